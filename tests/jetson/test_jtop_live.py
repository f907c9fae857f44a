"""On a Jetson with the jtop service: the live jtop meter reads the rails and measures a window."""
from __future__ import annotations

import time

import pytest

from edge.energy.meter import SensorUnavailable

pytestmark = pytest.mark.jetson


def test_jtop_live_window():
    pytest.importorskip("jtop", reason="jetson-stats is not installed (the 'jetson' extra)")
    from edge.energy.jtop import JtopMeter

    try:
        meter = JtopMeter(0.2)
    except SensorUnavailable as exc:  # e.g. the jtop service is not installed on this Jetson
        pytest.skip(str(exc))
    try:
        meter.start()
        time.sleep(1.5)
        m = meter.stop()
    finally:
        meter.close()
    assert m.available and m.rails and m.source == "samples" and len(m.samples) >= 3
    assert m.joules is not None and m.joules > 0
    assert 0.5 < m.mean_watts < 200, m.to_dict()  # a Jetson module draws from ~1 W idle to ~130 W (Thor)
    assert all(set(m.rails) <= set(s.rails) for s in m.samples)
