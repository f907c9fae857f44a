"""The ingress's own way to the tritonservers (``serve.stream_via: triton``, the default).

Through the worker (``stream_via: worker``) every engine step's chunk crosses two Ray actor boundaries
on its way out (tritonserver -> worker -> ingress -> HTTP proxy), each a serialised object and a hop
of the event loops that share the device's cores with the engine. Here the ingress opens its own gRPC
stream to the tritonserver of the worker it picks, and the worker keeps what only it can do: launch,
supervise and relaunch its tritonserver, run the control loop, push stats. Each worker tells the hub
its server's gRPC address and its Ray node with its stats; the ingress reads the routes from the hub,
picks the ready one with the fewest of its own requests in flight (the least-loaded rule Serve's
router also applies), and streams. The chunks are the dicts ``Worker.generate`` yields, so
``generation.Generation`` serves both.

tritonserver listens on its machine's loopback, so only the workers on the ingress's own node are
routes; with none of those ready (a Ray cluster whose other devices serve, or a server restarting) a
request goes through a worker as with ``stream_via: worker`` (docs/serving.md, Scale-out).
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from scheduler.serving.triton_client import TritonClient, TritonError, error_to_dict

log = logging.getLogger(__name__)


class TritonStream:
    """One request's chunks from a tritonserver, as ``Worker.generate`` yields them: ``{"token_ids",
    "exit_layers", "finish_reason"}`` per engine step, or one ``{"error": ...}``. ``cancel()`` closes
    the gRPC stream, which sends the model the ``cancel`` op (``TritonClient.generate``)."""

    def __init__(self, client: TritonClient, payload: dict[str, Any]) -> None:
        self._chunks = self._run(client, payload)
        self._closing: asyncio.Task | None = None

    async def _run(self, client: TritonClient, payload: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        try:
            async with aclosing(client.generate(**payload)) as chunks:
                async for c in chunks:
                    yield {"token_ids": c.token_ids, "exit_layers": c.exit_layers, "finish_reason": c.finish_reason}
        except TritonError as exc:
            yield {"error": error_to_dict(exc)}

    def __aiter__(self) -> AsyncIterator[dict[str, Any]]:
        return self._chunks

    def cancel(self) -> None:
        """Stop the request (the client left, or a stop string ended its text): close the stream."""
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._chunks.aclose())


class Routes:
    """The ingress's gRPC clients, one per worker's tritonserver, and its requests in flight on each.

    A server that drops out of the routes (its worker's control op failed: it died, hung or restarts) gets a
    new client when it comes back: the old one's channel may sit in gRPC's reconnect backoff, failing every
    call at once for seconds after the relaunched server (same address) answers again. The old client closes
    at the first update after the last request on it ended."""

    def __init__(self, timeout_s: float, limit: int, node: str) -> None:
        self._timeout_s, self._limit, self._node = timeout_s, limit, node
        self._clients: dict[str, TritonClient] = {}
        self._ready: dict[str, str] = {}      # replica -> the gRPC address of its ready tritonserver
        self.inflight: dict[str, int] = {}    # address -> this ingress's requests on it
        self._users: dict[TritonClient, int] = {}  # client -> this ingress's requests on it
        self._retiring: list[TritonClient] = []    # clients of servers that dropped out, in use when they did

    @property
    def known(self) -> bool:
        return bool(self._ready)

    async def update(self, routes: dict[str, tuple[str, str]]) -> None:
        """The hub's current routes (replica -> (address of a ready server, its Ray node)), those on our
        node kept; the clients of addresses no route names any more are retired, and closed once nothing of
        ours runs on them."""
        self._ready = {replica: url for replica, (url, node) in routes.items() if node == self._node}
        live = set(self._ready.values())
        self._retiring += [self._clients.pop(u) for u in list(self._clients) if u not in live]
        for client in [c for c in self._retiring if not self._users.get(c)]:
            self._retiring.remove(client)
            try:
                await client.close()
            except Exception as exc:  # noqa: BLE001 - a dead channel: nothing left to close
                log.debug("closing the client of %s: %r", client.url, exc)
        for url in [u for u in self.inflight if u not in live and not self.inflight[u]]:
            self.inflight.pop(url)

    def pick(self) -> tuple[str, TritonClient] | None:
        """The ready server with the fewest of our requests in flight, below ``limit``; None if none."""
        open_ = [u for u in set(self._ready.values()) if self.inflight.get(u, 0) < self._limit]
        if not open_:
            return None
        url = min(open_, key=lambda u: (self.inflight.get(u, 0), u))
        if url not in self._clients:
            self._clients[url] = TritonClient(url, timeout_s=self._timeout_s)
        return url, self._clients[url]

    def acquire(self, url: str, client: TritonClient) -> None:
        self.inflight[url] = self.inflight.get(url, 0) + 1
        self._users[client] = self._users.get(client, 0) + 1

    def release(self, url: str, client: TritonClient) -> None:
        self.inflight[url] = max(0, self.inflight.get(url, 0) - 1)
        left = self._users.get(client, 0) - 1
        if left > 0:
            self._users[client] = left
        else:
            self._users.pop(client, None)

    @property
    def retiring(self) -> int:
        """Clients of servers that dropped out, kept until the first update after their last request ended."""
        return len(self._retiring)
