"""The ingress's routes to the workers' tritonservers (scheduler/serving/routes.py): which server a
request goes to, and which ones are never routes. The streams themselves run against a real
tritonserver in tests/integration/test_serving.py."""
from __future__ import annotations

import asyncio

from scheduler.serving.routes import Routes

NODE = "node-a"


def routes_of(**replicas):
    """replica -> (address, node) as the hub answers."""
    return dict(replicas)


def test_least_loaded_ready_server_on_our_node_is_picked():
    async def go():
        r = Routes(timeout_s=1.0, limit=2, node=NODE)
        assert not r.known and r.pick() is None
        await r.update(routes_of(w1=("127.0.0.1:9001", NODE), w2=("127.0.0.1:9002", NODE),
                                 w3=("127.0.0.1:9003", "node-b")))
        assert r.known
        picks = []
        for _ in range(4):
            url, client = r.pick()
            assert client.url == url
            r.acquire(url, client)
            picks.append(url)
        # alternating by load, never the other node's server (its loopback is not ours), two each
        assert sorted(picks) == ["127.0.0.1:9001"] * 2 + ["127.0.0.1:9002"] * 2
        assert r.pick() is None  # both at the limit: the ingress answers 429
        r.release("127.0.0.1:9002", r._clients["127.0.0.1:9002"])
        assert r.pick()[0] == "127.0.0.1:9002"
        return r
    asyncio.run(go())


def test_a_server_that_drops_out_is_no_route_and_gets_a_new_client_when_it_comes_back():
    """A server whose worker stops reporting it ready is no route; a request still on it keeps its client
    until it ends, then that client closes at the next update; when the server comes back (relaunched on the same address) it
    gets a new client, since the old channel may sit in gRPC's reconnect backoff (docs/serving.md)."""
    async def go():
        r = Routes(timeout_s=1.0, limit=4, node=NODE)
        await r.update(routes_of(w1=("127.0.0.1:9001", NODE), w2=("127.0.0.1:9002", NODE)))
        a, client_a = r.pick()
        r.acquire(a, client_a)
        b, client_b = r.pick()
        assert {a, b} == {"127.0.0.1:9001", "127.0.0.1:9002"}
        keep_b = routes_of(**{("w2" if b.endswith("9002") else "w1"): (b, NODE)})
        # a's worker restarts (not ready): the request still on it keeps its client until it ends
        await r.update(keep_b)
        assert all(r.pick()[0] == b for _ in range(3)) and r.retiring == 1
        closed = []
        client_a.close = lambda: asyncio.sleep(0, closed.append(client_a))
        r.release(a, client_a)
        assert closed == [] and r.retiring == 1  # closed at the next update, off the request's path
        await r.update(keep_b)
        assert closed == [client_a] and r.retiring == 0
        assert a not in r.inflight and r.pick()[1] is client_b  # b's client is kept, not reopened
        await r.update(routes_of(w1=("127.0.0.1:9001", NODE), w2=("127.0.0.1:9002", NODE)))
        picked = {}
        for _ in range(2):
            url, client = r.pick()
            r.acquire(url, client)
            picked[url] = client
        # a came back: a new client (a new channel), b's the same
        assert picked[a] is not client_a and picked[a].url == a and picked[b] is client_b
        await r.update({})
        assert not r.known and r.pick() is None  # nothing ready here: the ingress goes through a worker
    asyncio.run(go())


def test_an_idle_client_of_a_server_that_drops_out_closes_at_once():
    async def go():
        r = Routes(timeout_s=1.0, limit=4, node=NODE)
        await r.update(routes_of(w1=("127.0.0.1:9001", NODE)))
        url, client = r.pick()
        r.acquire(url, client)
        r.release(url, client)
        closed = []
        client.close = lambda: asyncio.sleep(0, closed.append(client))
        await r.update({})
        assert closed == [client] and r.retiring == 0 and url not in r.inflight
    asyncio.run(go())
