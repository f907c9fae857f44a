"""Past the SLA edge in ``smartexit bench scheduler``: the learned policy against the best constant action of its
own grid in the simulator (:func:`constant_actions`), what the real stack serves there and in which order
(:func:`overload_setup`, :func:`overload_plan`), the served runs' goodput ratios (:func:`overload_report`), and the
most any policy's goodput can be against the best fixed budget's run (:func:`goodput_ceiling`)."""
from __future__ import annotations

from typing import Any

import numpy as np

from scheduler.control.env import EnvConfig
from scheduler.control.evaluate import FIXED_PREFIX, WorkloadSpec, best_fixed, workload_for
from scheduler.control.exit_model import ExitModel
from scheduler.control.latency import LatencyModel
from scheduler.control.policies import FixedBudget
from scheduler.loadtest.bench_scheduler_config import LEARNED, BenchSchedulerConfig
from scheduler.loadtest.bench_scheduler_served import real_schedule


def constant_actions(latency: LatencyModel, exits: ExitModel, env: EnvConfig, spec: WorkloadSpec, loads: list[float],
                     capacity: float, duration_s: float, seeds: list[int], learned: Any) -> dict[str, dict[str, Any]]:
    """In the simulator, every constant action of the learned policy's own action grid (``ACTIONS``: prefill budget x
    admission limit; the fixed budgets of the grid above keep the limit at every slot) on ``spec`` at each of
    ``loads`` (multiples of ``capacity``): the best one by goodput (mean over ``seeds``) and the learned policy's
    goodput beside it, and the best of those with the widest admission limit (``best_all_slots``: the fixed budgets
    of the grid, for a load the grid does not hold). A policy that only learned a better constant is no
    better than that constant."""
    from scheduler.control.env import ACTIONS
    from scheduler.control.evaluate import cell_table, evaluate_grid

    pols: dict[str, Any] = {constant_name(b, m): (lambda b=b, m=m: FixedBudget(b, min(m, env.sim.max_seqs)))
                            for b, m in ACTIONS}
    pols[LEARNED] = lambda: learned
    widest = max(m for _, m in ACTIONS)  # the grid's fixed budgets admit this many (FixedBudget's default limit)
    cells = cell_table(evaluate_grid(latency, exits, env, [spec], loads, pols, duration_s, seeds,
                                     capacities={spec.name: capacity}))
    out = {}
    for load in loads:
        g, best = max((c["goodput_rps"], p) for (_, lv, p), c in cells.items() if lv == load and p != LEARNED)
        mine = cells[(spec.name, load, LEARNED)]["goodput_rps"]
        _, slots = max((c["goodput_rps"], p) for (_, lv, p), c in cells.items() if lv == load and p != LEARNED
                       and constant_kwargs(p)["max_running"] == widest)
        out[f"x{load:g}"] = {"load": load, "best": best, "goodput_rps": g, "learned_goodput_rps": mine,
                             "ratio": mine / g if g else None,
                             "best_all_slots": f"{FIXED_PREFIX}{constant_kwargs(slots)['prefill_budget']}"}
    return out


CONSTANT_PREFIX = "const-"


def constant_name(budget: int, limit: int) -> str:
    return f"{CONSTANT_PREFIX}{budget}x{limit}"


def constant_kwargs(name: str) -> dict[str, int]:
    """The fixed policy's settings of a :func:`constant_name`."""
    b, m = name[len(CONSTANT_PREFIX):].split("x")
    return {"prefill_budget": int(b), "max_running": int(m)}


def overload_plan(policies: list[str], repeats: int) -> list[tuple[int, str]]:
    """(repeat, policy) in run order: every repeat runs every policy, the order rotated by the repeat, so a slow
    minute of the machine lands on each policy in turn."""
    n = len(policies)
    return [(r, policies[(r + i) % n]) for r in range(repeats) for i in range(n)]


def overload_setup(cfg: BenchSchedulerConfig, env: EnvConfig, spec: WorkloadSpec, cells: dict, load: float,
                   capacity: float, consts: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """What runs past the edge: the schedule at ``cfg.overload`` x the edge's rate, the policies (the learned one,
    the best fixed budget of that load in the simulator's grid, else in the constant actions' run (their budgets at
    every slot), the best constant action of the learned policy's own grid there (``consts``,
    :func:`constant_actions`; where it is not that fixed budget), and
    ``cfg.overload_heuristics``), their serving settings and the interleaved plan."""
    over = load * cfg.overload
    grid = sorted({lv for (w, lv, _) in cells if w == spec.name and np.isclose(lv, over)})
    fixed = best_fixed(cells, spec.name, grid[0])[0] if grid else consts[f"x{over:g}"]["best_all_slots"]
    fixed_kw = {"prefill_budget": int(fixed[len(FIXED_PREFIX):]), "max_running": env.sim.max_seqs}
    best_const = consts[f"x{over:g}"]["best"]
    const_kw = constant_kwargs(best_const)
    settings = {LEARNED: (LEARNED, {"path": cfg.policy}), fixed: ("fixed", fixed_kw)}
    if const_kw != fixed_kw:
        settings[best_const] = ("fixed", const_kw)
    settings.update({h: (h, {}) for h in cfg.overload_heuristics})
    policies = list(settings)
    schedule = real_schedule(cfg, workload_for(spec, over * capacity, cfg.overload_duration_s, env))
    return {"policies": policies, "settings": settings, "schedule": schedule, "best_fixed": fixed,
            "best_fixed_from": f"the simulator at x{over:g}" + ("" if grid else " (the constant actions' run)"),
            "best_constant": best_const if const_kw != fixed_kw else fixed,
            "plan": overload_plan(policies, cfg.overload_repeats)}


def by_policy(plan: list[tuple[int, str]], summaries: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Served runs' summaries by policy, in repeat order."""
    out: dict[str, list[dict[str, Any]]] = {}
    for (_, p), s in sorted(zip(plan, summaries), key=lambda x: x[0][0]):
        out.setdefault(p, []).append(s)
    return out


def _spread(xs: list[float | None]) -> dict[str, Any]:
    v = [x for x in xs if x is not None]
    return {"median": float(np.median(v)) if v else None, "min": min(v) if v else None,
            "max": max(v) if v else None, "per_repeat": xs}


def overload_report(runs: dict[str, list[dict[str, Any]]], learned: str, fixed: str, factor: float, rate: float,
                    fixed_from: str, constant: str | None = None, where: str = "") -> dict[str, Any]:
    """The policies past the edge: per policy its goodput and SLA attainment over the repeats (median, range), and
    the learned policy's goodput over each other policy's, taken within a repeat (the runs of one repeat sit side by
    side in time), then their median and range. A repeat where the other policy met no request has no ratio (None);
    ``ceiling_vs_best_fixed`` is 1 / the best fixed budget's attainment (every request within the SLA), per repeat.
    ``runs``: :func:`scheduler.control.outcomes.summarize` results by policy, in repeat order; ``constant``: the best
    constant action of the learned policy's grid in the simulator (the fixed budget's name where they coincide)."""
    keys = ("requests", "errors", "sla_attainment", "goodput_rps", "ttft_p50_ms", "ttft_p95_ms", "tpot_p50_ms",
            "tpot_p95_ms")
    mine = [s["goodput_rps"] for s in runs[learned]]
    ratios = {}
    for p, ss in runs.items():
        if p != learned:
            ratios[p] = _spread([a / s["goodput_rps"] if s["goodput_rps"] else None for a, s in zip(mine, ss)])
    return {"factor": factor, "rate_rps": rate, "learned": learned, "best_fixed": fixed, "best_fixed_from": fixed_from,
            "best_constant": constant, "stack": where, "repeats": len(mine),
            "runs": {p: [{k: s.get(k) for k in keys} for s in ss] for p, ss in runs.items()},
            "goodput_rps": {p: _spread([s["goodput_rps"] for s in ss]) for p, ss in runs.items()},
            "sla_attainment": {p: _spread([s["sla_attainment"] for s in ss]) for p, ss in runs.items()},
            "ratio_vs": ratios,
            "ceiling_vs_best_fixed": _spread([goodput_ceiling(s) for s in runs[fixed]])}


def goodput_ceiling(best: dict[str, Any]) -> float | None:
    """The most any policy's goodput can be against ``best`` (a run's ``summarize``) on the same schedule: every
    request within the SLA, 1 / its attainment (goodput = requests met / the run's length; the length, first
    send to last token, moves by the last requests' latencies only). The edge is where the best fixed budget meets
    95% in the simulator, so there the ceiling is ~1.05 plus what the served stack falls short of the simulator.
    None: it met none."""
    attained = best["sla_attainment"]
    return 1.0 / attained if attained else None
