"""The worker's power wiring (scheduler/serving/worker.py): each control tick's stats carry its device's
meter reading; the meter's window rolls off the event loop; a failing meter costs the readings, not
the control loop."""
from __future__ import annotations

import asyncio

from scheduler.serving.dashboard import LivePower
from tests.unit.scheduler.serving.test_serve_dashboard import FakeSensor
from tests.unit.scheduler.serving.test_triton_client import KeepPolicy, StatsClient


class Hub:
    def __init__(self):
        self.stats = []
        self.push = self

    def remote(self, replica, ready, stats, route=None):
        self.stats.append(None if stats is None else dict(stats))

        async def done():
            return None
        return done()


class BrokenSensor(FakeSensor):
    def _read(self):
        if self.reads >= 1:
            raise OSError("sensor unplugged")
        return super()._read()


def worker(power: LivePower | None):
    from scheduler.serving import worker as worker_module
    from scheduler.serving.config import ServeConfig
    w = object.__new__(worker_module.Worker.func_or_class)  # the class Serve runs, without its constructor
    w._cfg = ServeConfig(control_tick_s=0.01)
    w._hub, w._policy, w._observe, w._replica, w._node = Hub(), KeepPolicy(), (lambda s: s), "w0", "n0"
    w._proc, w._client, w._stats, w._ready, w._restarting = None, StatsClient(), None, True, False
    w._generation = w._acted = 0
    w._backoff_s, w._power = 0.01, power
    return w


def run_ticks(w, seconds: float = 0.1) -> None:
    async def main():
        w._loop = asyncio.create_task(w._run())
        await asyncio.sleep(seconds)
        w.check_health()  # the loop is alive
        w._loop.cancel()
    asyncio.run(main())


def test_each_ticks_stats_carry_the_power_reading():
    power = LivePower(FakeSensor(interval_s=3600.0))
    w = worker(power)
    try:
        run_ticks(w)
    finally:
        power.close()
    pushed = [s for s in w._hub.stats if s]
    assert pushed and all(s["power"]["meter"] == "fake-ina3221" and s["power"]["watts"] == 5.0 for s in pushed)


def test_no_meter_no_power_key():
    w = worker(None)
    run_ticks(w)
    assert w._hub.stats and all("power" not in s for s in w._hub.stats if s)


def test_a_meter_failing_at_its_roll_is_dropped_and_the_loop_goes_on():
    power = LivePower(BrokenSensor(interval_s=3600.0), roll_s=0.0)  # due at once; its stop() reading fails
    w = worker(power)
    run_ticks(w)
    assert w._power is None
    assert "power" in w._hub.stats[0] and "power" not in w._hub.stats[-1]
