"""The worker restarts a tritonserver whose model's engine thread has died (scheduler/serving/worker.py): the
server still answers its control requests, so only the stats' ``engine_alive`` tells; before, /health stayed
ready and every request got a 500 until someone restarted the server by hand. And one that hangs (running, but
answering nothing: ``kill -STOP``, a deadlock): before, the requests sent to it waited for their clients' timeouts."""
from __future__ import annotations

import asyncio
import time
from dataclasses import replace

from scheduler.serving.triton_client import TritonUnavailable
from tests.unit.scheduler.serving.test_triton_client import FakeProc, worker


class DyingEngineClient:
    """A tritonserver whose engine dies on the ``dead_from``-th stats call, until the server restarts."""

    url = "127.0.0.1:1"

    def __init__(self, proc: FakeProc, dead_from: int) -> None:
        self.proc, self.dead_from, self.calls, self.seen_dead = proc, dead_from, 0, 0

    async def control(self, op):
        self.calls += 1
        dead = self.proc.restarts == 0 and self.calls >= self.dead_from
        self.seen_dead += dead
        return {"waiting": 0, "running": 0, "prefill_budget": 64, "max_running": 4, "engine_alive": not dead}


def test_a_server_whose_engine_died_is_restarted():
    proc = FakeProc(fail=0)
    proc.alive = True  # a running server
    w = worker(proc)
    w._client = client = DyingEngineClient(proc, dead_from=3)

    async def main():
        w._loop = asyncio.create_task(w._run())
        for _ in range(300):
            if proc.restarts and w._ready:
                break
            await asyncio.sleep(0.01)
        w.check_health()  # the loop is alive
        w._loop.cancel()

    asyncio.run(main())
    assert client.seen_dead == 1 and proc.restarts == 1 and w._ready
    assert w._stats["engine_alive"] is True  # the restarted server's engine
    assert False in w._hub.pushes  # not ready while it restarted


def test_a_live_engine_is_left_alone():
    proc = FakeProc(fail=0)
    proc.alive = True  # a running server
    w = worker(proc)
    w._client = DyingEngineClient(proc, dead_from=10 ** 9)

    async def main():
        w._loop = asyncio.create_task(w._run())
        await asyncio.sleep(0.1)
        w.check_health()
        w._loop.cancel()

    asyncio.run(main())
    assert proc.restarts == 0 and w._ready


class KillableProc(FakeProc):
    """A running server that only SIGKILL stops (a stopped or deadlocked process ignores SIGTERM)."""

    def __init__(self) -> None:
        super().__init__(fail=0)
        self.alive, self.kills = True, 0

    def kill(self) -> None:
        self.kills += 1
        self.alive = False


class HungClient:
    """Control ops time out while the server is hung (from the ``hung_from``-th call until a restart)."""

    url = "127.0.0.1:1"

    def __init__(self, proc: KillableProc, hung_from: int) -> None:
        self.proc, self.hung_from, self.calls, self.failed = proc, hung_from, 0, 0

    async def control(self, op):
        self.calls += 1
        if self.proc.restarts == 0 and self.calls >= self.hung_from:
            self.failed += 1
            raise TritonUnavailable("control op timed out", 1.0)
        return {"waiting": 0, "running": 0, "prefill_budget": 64, "max_running": 4, "engine_alive": True}


def _run_hung(hang_restart_s: float | None, seconds: float) -> tuple[KillableProc, HungClient, object]:
    proc = KillableProc()
    w = worker(proc)
    w._cfg = replace(w._cfg, hang_restart_s=hang_restart_s)
    w._client = client = HungClient(proc, hung_from=3)

    async def main():
        w._answered = time.monotonic()
        w._loop = asyncio.create_task(w._run())
        deadline = asyncio.get_running_loop().time() + seconds
        while asyncio.get_running_loop().time() < deadline and not (proc.restarts and w._ready):
            await asyncio.sleep(0.01)
        w.check_health()
        w._loop.cancel()

    asyncio.run(main())
    return proc, client, w


def test_a_hung_server_is_killed_and_restarted_once_silent_for_hang_restart_s():
    proc, client, w = _run_hung(0.2, 5.0)
    assert proc.kills == 1 and proc.restarts == 1 and w._ready
    # it was silent for at least 0.2 s: ticks every 0.01 s failed ~20 times before the kill, not one
    assert client.failed >= 10
    assert False in w._hub.pushes  # not ready while it was silent and while it restarted


def test_a_silent_server_is_left_running_below_the_limit_or_without_one():
    for limit in (60.0, None):
        proc, client, w = _run_hung(limit, 0.3)
        assert client.failed > 5 and proc.kills == 0 and proc.restarts == 0 and not w._ready
