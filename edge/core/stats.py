"""Latency statistics and SLA accounting, defined once for everything that reports them: the engine host
(live statistics), the simulator (the same statistics of a simulated run), the serving dashboard and the
load-test reports.

* :func:`percentiles`: numpy's default (linear) interpolation, the reports' and the dashboard's p50 / p95 / p99;
* :func:`p95_ms`: nearest rank over a short window (the host's and the simulator's recent tail, what the
  control policies observe);
* :func:`due_time` / :func:`on_time`: token i of a request is due at arrival + TTFT + i x TPOT (the SLA
  slack's schedule); a token handed over later is late, and a request turns late (one violation) once;
* :func:`sla_met`: a finished request met its SLA when its first token came within TTFT and (more than
  one token) its mean time per later token within TPOT.
"""
from __future__ import annotations

import math
from typing import Iterable, Sequence

import numpy as np

QUANTILES = (50, 95, 99)
_SLACK_S = 1e-12  # a token handed over exactly at its due time is on time, float rounding included


def percentiles(values: Iterable[float | None], qs: Sequence[float] = QUANTILES) -> dict[str, float | None]:
    """``{"p50": ..., ...}`` by numpy's default (linear) interpolation; None for every q of no values."""
    arr = np.asarray([v for v in values if v is not None], dtype=np.float64)
    if arr.size == 0:
        return {f"p{q:g}": None for q in qs}
    return {f"p{q:g}": float(v) for q, v in zip(qs, np.percentile(arr, qs))}


def p95_ms(values: Iterable[float]) -> float | None:
    """The 95th percentile (nearest rank) of seconds, in ms; None for none."""
    s = sorted(values)
    if not s:
        return None
    return s[min(len(s) - 1, math.ceil(0.95 * len(s)) - 1)] * 1e3


def due_time(arrival_s: float, sla_ttft_s: float, sla_tpot_s: float, index: int) -> float:
    """When token ``index`` (0 = the first) of a request that arrived at ``arrival_s`` is due."""
    return arrival_s + sla_ttft_s + index * sla_tpot_s


def on_time(t: float, arrival_s: float, sla_ttft_s: float, sla_tpot_s: float, index: int) -> bool:
    """Token ``index`` handed over at ``t`` is on time."""
    return t <= due_time(arrival_s, sla_ttft_s, sla_tpot_s, index) + _SLACK_S


def sla_met(ttft_s: float, tpot_s: float | None, sla_ttft_s: float, sla_tpot_s: float) -> bool:
    """First token within ``sla_ttft_s`` and (``tpot_s`` not None: more than one token) the mean time per
    later token within ``sla_tpot_s``."""
    return ttft_s <= sla_ttft_s and (tpot_s is None or tpot_s <= sla_tpot_s)
