"""The worker restarts a tritonserver whose model's engine thread has died (scheduler/serving/worker.py): the
server still answers its control requests, so only the stats' ``engine_alive`` tells; before, /health stayed
ready and every request got a 500 until someone restarted the server by hand."""
from __future__ import annotations

import asyncio

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
