"""``smartexit profile``'s fit, read off the recorded steps: the design matrix the latency model is fitted
on, the scenarios :func:`scheduler.control.latency.fit_latency` holds out, and the measured and predicted
step time per scenario."""
from __future__ import annotations

from dataclasses import asdict
from typing import Any, Sequence

import numpy as np

from scheduler.control.latency import FEATURES, LatencyModel, StepFeatures
from scheduler.loadtest.profile_config import Scenario


def design(steps: list[dict[str, Any]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """X [N, len(FEATURES)], y [N] seconds, groups [N] from recorded steps."""
    X = np.stack([StepFeatures(**{k: s[k] for k in StepFeatures.__dataclass_fields__}).vector() for s in steps]) \
        if steps else np.zeros((0, len(FEATURES)))
    return X, np.array([s["seconds"] for s in steps], np.float64), np.array([s["group"] for s in steps])


def held_out_groups(groups: np.ndarray, holdout: float, seed: int) -> set[int]:
    """The scenarios :func:`fit_latency` holds out (the same draw)."""
    uniq = np.unique(groups)
    rng = np.random.default_rng(seed)
    return {int(g) for g in rng.choice(uniq, size=max(1, int(round(holdout * len(uniq)))), replace=False)}


def per_scenario(model: LatencyModel, X: np.ndarray, y: np.ndarray, groups: np.ndarray, held: set[int] | None,
                 scenarios: Sequence[Scenario]) -> list[dict[str, Any]]:
    pred = model.predict(X)
    out = []
    for g, sc in enumerate(scenarios):
        m = groups == g
        if not m.any():
            continue
        meas, got = float(y[m].mean()), float(pred[m].mean())
        out.append({"group": g, **asdict(sc), "steps": int(m.sum()), "measured_ms": 1e3 * meas,
                    "predicted_ms": 1e3 * got, "mean_rel_err": abs(got - meas) / max(meas, 1e-9),
                    "held_out": None if held is None else g in held})
    return out
