"""A running estimate of a measured time (pure): an exponential moving average whose observation counts
at most ``outlier`` times the current estimate, so a GC pause or a context switch moves it by a bounded
step. The step gate (``gate.py``) and the speculative call costs (``spec_costs.py``) keep theirs with it."""
from __future__ import annotations


def capped_ema(estimate: float | None, value: float, alpha: float, outlier: float) -> float:
    """The estimate after observing ``value``: ``value`` itself where there is none yet, else
    ``estimate + alpha * (min(value, outlier * estimate) - estimate)``."""
    if estimate is None:
        return float(value)
    return estimate + alpha * (min(value, outlier * estimate) - estimate)
