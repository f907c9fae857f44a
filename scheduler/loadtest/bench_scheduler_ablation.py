"""The exit-depth ablation of ``smartexit bench scheduler`` (issue 30): the learned policy trained without the
exit-depth features, loaded and checked (:func:`load_ablation`), and the shipped policy's goodput over it per cell
of the simulator grid (:func:`ablation_report`)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from edge.core.errors import ConfigError
from scheduler.loadtest.bench_scheduler_config import ABLATED, LEARNED, BenchSchedulerConfig


def load_ablation(cfg: BenchSchedulerConfig, learned: Any) -> Any:
    """The learned policy trained without the exit-depth features (None where ``cfg.ablation_policy`` is "" or,
    left at None, nothing is shipped).

    Raises:
        ConfigError: the folder named does not hold a policy; the policy holds no exit-depth feature at 0;
            it was trained for another SLA than the shipped one (not the same comparison).
    """
    from scheduler.control.env import EXIT_FEATURES
    from scheduler.control.learned import DEFAULT_DIR, LearnedPolicy

    if cfg.ablation_policy == "":
        return None
    path = Path(cfg.ablation_policy) if cfg.ablation_policy else DEFAULT_DIR.parent / "ppo_noexit"
    if cfg.ablation_policy is None and not (path / "policy.json").is_file():
        return None
    ablated = LearnedPolicy.load(path)
    if not set(EXIT_FEATURES) <= set(ablated.masked):
        raise ConfigError(f"bench scheduler: the ablation policy {path} sees the exit-depth features "
                          f"{list(EXIT_FEATURES)}; train it with `make train-scheduler-ablation`")
    for key in ("sla_ttft_ms", "sla_tpot_ms"):
        a, b = ((p.meta.get("env") or {}).get("sim", {}).get(key) for p in (ablated, learned))
        if a != b:
            raise ConfigError(f"bench scheduler: the ablation policy {path} was trained for {key} {a}, the shipped "
                              f"policy for {b}: retrain both with `make train-scheduler train-scheduler-ablation`")
    return ablated


def ablation_report(cells: dict, workloads: list[str], loads: list[float],
                    collapsed: set[tuple[str, float]] = frozenset()) -> dict[str, Any] | None:
    """The shipped learned policy's goodput over the same policy trained without the exit-depth features, per
    (workload, load) cell of the grid (left out: cells where either has no goodput, and ``collapsed`` ones,
    where the best fixed budget no longer serves its share of the offered rate, as the comparison with the
    fixed budgets leaves them out): the ratios, their median and smallest, and the largest relative spread of
    either policy's goodput over the exit-depth draws (sim_seeds; 0 with one draw)."""
    ratios: dict[str, dict[str, float]] = {}
    spread = []
    for w in workloads:
        for load in loads:
            a, b = cells.get((w, load, LEARNED)), cells.get((w, load, ABLATED))
            if (w, load) in collapsed or a is None or b is None or not b["goodput_rps"] or not a["goodput_rps"]:
                continue
            ratios.setdefault(w, {})[f"{load:g}"] = a["goodput_rps"] / b["goodput_rps"]
            spread += [a["goodput_std"] / a["goodput_rps"], b["goodput_std"] / b["goodput_rps"]]
    flat = [r for v in ratios.values() for r in v.values()]
    if not flat:
        return None
    return {"ratios": ratios, "median": float(np.median(flat)), "min": float(min(flat)),
            "seed_spread_rel_max": float(max(spread)) if spread else None}

