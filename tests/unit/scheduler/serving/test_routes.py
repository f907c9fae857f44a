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
            r.acquire(url)
            picks.append(url)
        # alternating by load, never the other node's server (its loopback is not ours), two each
        assert sorted(picks) == ["127.0.0.1:9001"] * 2 + ["127.0.0.1:9002"] * 2
        assert r.pick() is None  # both at the limit: the ingress answers 429
        r.release("127.0.0.1:9002")
        assert r.pick()[0] == "127.0.0.1:9002"
        return r
    asyncio.run(go())


def test_a_server_that_drops_out_is_no_route_and_its_client_closes_when_idle():
    async def go():
        r = Routes(timeout_s=1.0, limit=4, node=NODE)
        await r.update(routes_of(w1=("127.0.0.1:9001", NODE), w2=("127.0.0.1:9002", NODE)))
        a, _ = r.pick()
        r.acquire(a)
        b, client_b = r.pick()
        assert {a, b} == {"127.0.0.1:9001", "127.0.0.1:9002"}
        # a's worker restarts (not ready): a request still on it keeps its client until it ends
        await r.update(routes_of(**{("w2" if b.endswith("9002") else "w1"): (b, NODE)}))
        assert all(r.pick()[0] == b for _ in range(3))
        r.release(a)
        await r.update(routes_of(**{("w2" if b.endswith("9002") else "w1"): (b, NODE)}))
        assert a not in r.inflight and r.pick()[1] is client_b  # b's client is kept, not reopened
        await r.update({})
        assert not r.known and r.pick() is None  # nothing ready here: the ingress goes through a worker
    asyncio.run(go())
