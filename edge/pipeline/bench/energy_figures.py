"""What ``smartexit bench energy`` (:mod:`edge.pipeline.bench.energy`) reads off its measured windows, pure: a
window's per-token figures, their median and min-max across repeats, each system's ratios against full depth paired
by repeat, and the exact interval of a false-exit rate."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from edge.pipeline.bench.energy_config import FULL


@dataclass
class Window:
    """One measured decode window of one system."""

    tokens: int
    seconds: float  # the whole window: the decode and its threads' spin-down (edge/pipeline/bench/quiesce.py)
    cpu_seconds: float
    joules: float | None
    idle_watts: float | None  # mean power of the idle window before this repeat
    decode_seconds: float | None = None  # the decode alone (tokens/s); None: the whole window

    @property
    def joules_above_idle(self) -> float | None:
        if self.joules is None or self.idle_watts is None:
            return None
        return self.joules - self.idle_watts * self.seconds



def _stat(values: list[float | None]) -> dict[str, float] | None:
    """Median and min-max of ``values``; None if there are none or any is None."""
    if not values or any(v is None for v in values):
        return None
    a = np.asarray(values, np.float64)
    return {"median": float(np.median(a)), "min": float(a.min()), "max": float(a.max())}


# the per-token figures a system is compared by, from one window
FIGURES: dict[str, Any] = {
    "joules_per_token": lambda w: w.joules / w.tokens if w.joules is not None else None,
    "joules_per_token_above_idle": lambda w: w.joules_above_idle / w.tokens if w.joules_above_idle is not None
    else None,
    "cpu_seconds_per_token": lambda w: w.cpu_seconds / w.tokens,
    "tokens_per_s": lambda w: w.tokens / (w.decode_seconds or w.seconds),
}


def per_token(windows: list[Window]) -> dict[str, Any]:
    """Median and min-max across repeats of each per-token figure (None where a figure is None)."""
    return {
        **{key: _stat([f(w) for w in windows]) for key, f in FIGURES.items()},
        # how busy the process's threads were over the window: near the thread count, a spinning pool (docs/energy.md)
        "cpu_per_second": _stat([w.cpu_seconds / w.seconds for w in windows]),
        "watts": _stat([w.joules / w.seconds if w.joules is not None else None for w in windows]),
        "tokens": int(sum(w.tokens for w in windows)),
    }


def clopper_pearson(k: int, n: int, level: float = 0.95) -> list[float]:
    """Exact two-sided binomial interval [lo, hi] of a rate of ``k`` in ``n`` (Clopper and Pearson, 1934).
    Tokens of one prompt are correlated, so this is optimistic; calibration's certificate counts prompts."""
    from scipy.stats import beta

    a = (1.0 - level) / 2.0
    lo = 0.0 if k == 0 else float(beta.ppf(a, k, n - k + 1))
    hi = 1.0 if k == n else float(beta.ppf(1.0 - a, k + 1, n - k))
    return [lo, hi]


def paired_ratios(windows: dict[str, list[Window]], base: str = FULL) -> dict[str, dict[str, dict[str, float] | None]]:
    """Each system's figures (:data:`FIGURES`) over ``base``'s, repeat by repeat (window i of every system is
    repeat i's, and a repeat runs the systems back to back), as median and min-max over the repeats; None
    for a figure that is None in any window or zero in ``base``'s.

    Raises:
        ValueError: systems with different numbers of windows (the repeats cannot be paired).
    """
    n = len(windows[base])
    if any(len(ws) != n for ws in windows.values()):
        raise ValueError(f"paired ratios need one window per repeat for every system, got "
                         f"{ {k: len(v) for k, v in windows.items()} }")
    out: dict[str, dict[str, dict[str, float] | None]] = {}
    for name, ws in windows.items():
        out[name] = {}
        for key, f in FIGURES.items():
            pairs = [(f(a), f(b)) for a, b in zip(ws, windows[base])]
            ok = pairs and all(a is not None and b for a, b in pairs)
            out[name][key] = _stat([a / b for a, b in pairs]) if ok else None
    return out


def medians(spread: dict[str, dict[str, dict[str, float] | None]]) -> dict[str, dict[str, float | None]]:
    """The medians of :func:`paired_ratios`'s answer."""
    return {name: {key: None if d is None else d["median"] for key, d in r.items()} for name, r in spread.items()}


def ratios(windows: dict[str, list[Window]], base: str = FULL) -> dict[str, dict[str, float | None]]:
    """The medians of :func:`paired_ratios`: joules, CPU-seconds per token, tokens/s against ``base``."""
    return medians(paired_ratios(windows, base))
