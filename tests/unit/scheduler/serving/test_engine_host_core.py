"""The engine host with Triton's core in its own process (``serve.triton_host: ingress``,
scheduler/serving/engine_host.py), its core a stand-in (no Triton library): it pushes no gRPC route (the ingress
streams from its own core), its client is the core's own, and a restart after the engine's death keeps that client
(it is bound to the core object, which starts again), where a tritonserver's would be replaced by its new address."""
from __future__ import annotations

import asyncio
from pathlib import Path

from scheduler.serving.engine_host import EngineHost
from scheduler.serving.triton_core import TritonCore, TritonCoreClient
from tests.unit.scheduler.serving.test_triton_client import FakeHub, KeepPolicy


class FakeCore(TritonCore):
    """A core that is running until its engine is declared dead; ``restart`` counts."""

    def __init__(self) -> None:  # no library, no repository: the host only calls what is below
        self.repo, self.restarts, self.stops, self.running = Path("/nowhere/triton"), 0, 0, True

    @property
    def alive(self) -> bool:
        return self.running

    def restart(self, timeout_s: float = 180.0) -> "FakeCore":
        self.restarts += 1
        self.running = True
        return self

    def stop(self) -> None:
        self.stops += 1
        self.running = False


class DyingCoreClient(TritonCoreClient):
    """The core's client whose engine reports dead on the third stats call, until the core restarts."""

    def __init__(self, core: FakeCore) -> None:
        super().__init__(core)
        self.calls = 0

    async def control(self, op):
        self.calls += 1
        dead = self.core.restarts == 0 and self.calls >= 3
        return {"waiting": 0, "running": 0, "prefill_budget": 64, "max_running": 4, "engine_alive": not dead}


def host(core: FakeCore) -> EngineHost:
    from scheduler.serving.config import ServeConfig
    h = object.__new__(EngineHost)  # without __init__'s policy and meter
    h._cfg = ServeConfig(control_tick_s=0.01, restart_backoff_s=0.01, restart_backoff_max_s=0.04,
                         triton_host="ingress")
    h._hub, h._policy, h._observe, h._replica, h._node = FakeHub(), KeepPolicy(), (lambda s: s), "i0", "n0"
    h._proc, h._stats, h._ready, h._restarting, h._backoff_s = core, None, True, False, 0.01
    h._generation = h._acted = 0
    h._client = DyingCoreClient(core)
    return h


def test_a_core_host_pushes_no_route_and_keeps_its_client_across_a_restart():
    core = FakeCore()
    h = host(core)
    client = h.client
    assert h.in_process and isinstance(h._client_of(core), TritonCoreClient)

    async def main():
        h._loop = asyncio.create_task(h._run())
        for _ in range(300):
            if core.restarts and h._ready:
                break
            await asyncio.sleep(0.01)
        h.check_health()
        h._loop.cancel()

    asyncio.run(main())
    assert core.restarts == 1 and h._ready and h.client is client
    assert h._hub.routes and all(r is None for r in h._hub.routes)  # never a gRPC address to stream by
    assert False in h._hub.pushes  # not ready while its engine restarted
    h.close()
    h.close()
    assert core.stops == 1  # the core goes with its host, once


def test_a_host_that_cannot_open_leaves_nothing_running():
    """``open`` without a repository (and no ``triton_url``) is refused by name, and the host's meter is closed
    rather than left sampling in a replica that failed to start."""
    import pytest

    from edge.core.errors import ConfigError
    from scheduler.serving.config import ServeConfig

    class Meter:
        closed = 0

        def close(self):
            Meter.closed += 1

    h = EngineHost(ServeConfig(), hub=FakeHub(), replica="i0", node="n0")
    h._power = Meter()
    with pytest.raises(ConfigError, match="repo_dir"):
        asyncio.run(h.open(None, in_process=True))
    assert Meter.closed == 1 and h._power is None
