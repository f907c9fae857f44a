"""The small additions to the meter interface: a failed start or stop leaves the meter stopped, a
sampling thread's failure is raised by stop(), a meter may begin its window at its first reading,
and a window ends when stop() is called."""
from __future__ import annotations

import time

import pytest

from edge.core.errors import SmartExitError
from edge.energy.meter import PowerMeter, PowerSample, SampledMeter


class Flaky(SampledMeter):
    name = "flaky"

    def __init__(self, fail_after: int) -> None:
        super().__init__(0.005)
        self.reads, self.fail_after = 0, fail_after

    def _read(self) -> PowerSample:
        self.reads += 1
        if self.reads > self.fail_after:
            raise OSError("sensor gone")
        return PowerSample(self.clock(), 1.0)


def test_thread_failure_is_raised_and_the_meter_can_start_again():
    meter = Flaky(fail_after=3)
    meter.start()
    time.sleep(0.1)
    with pytest.raises(SmartExitError, match="flaky meter: a reading failed during the window: OSError: sensor gone"):
        meter.stop()
    meter.fail_after = 10**9
    meter.start()  # not "already started"
    m = meter.stop()
    assert m.joules == pytest.approx(m.samples[-1].t - m.samples[0].t)
    meter.close()


class Late(PowerMeter):
    """Its first reading comes at t = 5 on a hand-driven clock; stop() is called at t = 9."""

    name = "late"

    def __init__(self, fail_start: bool = False) -> None:
        ticks = iter([1.0, 5.0, 9.0, 11.0])
        super().__init__(0.1, clock=lambda: next(ticks))
        self.fail_start = fail_start

    def _start(self) -> float:
        if self.fail_start:
            raise RuntimeError("no first reading")
        self.clock()  # t = 1 was start(); the reading arrives at t = 5
        return 5.0

    def _stop(self):
        self.clock()  # t = 11: a reading taken after the stop call (t = 9)
        return 4.0, "samples", []


def test_window_from_first_reading_to_the_stop_call():
    meter = Late()
    meter.start()
    assert meter.stop().seconds == 4.0  # 9 - 5: neither the wait for the first reading nor the last one
    failing = Late(fail_start=True)
    with pytest.raises(RuntimeError, match="no first reading"):
        failing.start()
    with pytest.raises(RuntimeError, match="was not started"):
        failing.stop()
