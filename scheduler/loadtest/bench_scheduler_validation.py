"""The simulator against the served stack in ``smartexit bench scheduler``: a served run replayed in the simulator
(:func:`validate`), the simulator's error against the served repeats' own spread (:func:`noise_check`,
:func:`repeat_spread`), and whether the served runs below the edge held the SLA (:func:`sla_check`)."""
from __future__ import annotations

from typing import Any

import numpy as np

from scheduler.control.env import EnvConfig
from scheduler.control.exit_model import ExitModel
from scheduler.control.latency import LatencyModel
from scheduler.control.outcomes import summarize
from scheduler.control.sim import simulate
from scheduler.control.sim_config import SimConfig
from scheduler.control.workload import Workload

VALIDATED = ("ttft_p50_ms", "ttft_p95_ms", "tpot_p50_ms", "tpot_p95_ms")


def validate(latency: LatencyModel, exits: ExitModel, env: EnvConfig, results: list, policy: Any,
             seeds: list[int]) -> dict[str, Any]:
    """The served run replayed in the simulator (arrivals, prompt lengths, realized output lengths) with
    the serving path ``smartexit profile`` measured on its own requests: measured vs simulated
    percentiles and their relative errors."""
    ok = [r for r in results if r.ok and r.tokens >= 1]
    w = Workload(np.array([r.arrival_s for r in ok]), np.array([r.prompt_tokens for r in ok], np.int64),
                 np.array([r.tokens for r in ok], np.int64), "the served run")
    sla = (env.sim.sla_ttft_ms, env.sim.sla_tpot_ms)
    real = summarize(results, *sla)
    sims = []
    for seed in seeds:
        scfg = SimConfig(**{**env.sim.__dict__, "seed": seed})
        sims.append(summarize(simulate(latency, exits, scfg, w, policy, env.tick_s).results(), *sla))
    sim = {k: float(np.mean([s[k] for s in sims if s[k] is not None])) for k in VALIDATED}
    rel = {k: abs(sim[k] - real[k]) / real[k] for k in VALIDATED if real[k]}
    return {"measured": {k: real[k] for k in VALIDATED}, "simulated": sim, "rel_err": rel,
            "max_rel_err": max(rel.values()) if rel else None, "requests": len(ok)}


def _rel_diff(a: float | None, b: float | None) -> float | None:
    """|a - b| / their mean (symmetric: neither side is the truth); None where either is missing."""
    return None if a is None or b is None or a + b <= 0 else abs(a - b) / ((a + b) / 2)


def _median(xs: list[float | None]) -> float | None:
    v = [x for x in xs if x is not None]
    return float(np.median(v)) if v else None


def noise_check(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The simulator judged against the served stack's own noise, per validation load and metric: the
    served runs' spread (median over pairs of runs of one schedule of |a - b| / mean(a, b)) and the
    simulator's error (median over the runs of the same statistic between a run and its replay), and
    their ratio: 1 means the simulator lands as close to a served run as another served run does.
    Runs carry the stack start they ran on (``stack``; 0 where absent): the spread is over pairs of runs on
    different starts where there are such pairs (the simulator was fitted on another start: the profile's),
    else over pairs on one; both are reported (``served_spread_across_starts``, ``served_spread_one_stack``)
    with the ratio against the one-stack spread beside it. ``max_ratio`` is the largest over loads and
    metrics (None without two runs at some load, or where a spread is 0). ``runs``: :func:`validate`'s
    results with ``share_of_edge``."""
    by_load: dict[float, list[dict[str, Any]]] = {}
    for v in runs:
        by_load.setdefault(v["share_of_edge"], []).append(v)
    levels, ratios = [], []
    for share, vs in sorted(by_load.items()):
        pairs = [(i, j) for i in range(len(vs)) for j in range(i + 1, len(vs))]
        across = [(i, j) for i, j in pairs if vs[i].get("stack", 0) != vs[j].get("stack", 0)]
        within = [(i, j) for i, j in pairs if vs[i].get("stack", 0) == vs[j].get("stack", 0)]

        def spread_of(ps: list[tuple[int, int]]) -> dict[str, float | None]:
            return {k: _median([_rel_diff(vs[i]["measured"][k], vs[j]["measured"][k]) for i, j in ps])
                    for k in VALIDATED}

        spread_across, spread_within = spread_of(across), spread_of(within)
        spread = spread_across if across else spread_within
        err = {k: _median([_rel_diff(v["simulated"][k], v["measured"][k]) for v in vs]) for k in VALIDATED}
        ratio = {k: err[k] / spread[k] if err[k] is not None and spread[k] else None for k in VALIDATED}
        ratio_within = {k: err[k] / spread_within[k] if err[k] is not None and spread_within[k] else None
                        for k in VALIDATED}
        levels.append({"share_of_edge": share, "runs": len(vs), "starts": len({v.get("stack", 0) for v in vs}),
                       "served_spread": spread, "served_spread_across_starts": spread_across if across else None,
                       "served_spread_one_stack": spread_within if within else None, "sim_error": err,
                       "ratio": ratio, "ratio_one_stack": ratio_within,
                       "max_ratio": max((r for r in ratio.values() if r is not None), default=None)})
        ratios += [ratio[k] for k in VALIDATED if err[k] is not None]
    if not levels:
        return None
    complete = ratios and all(r is not None for r in ratios)
    one = [r for lv in levels for r in lv["ratio_one_stack"].values()]
    return {"levels": levels, "max_ratio": max(ratios) if complete else None,
            "max_ratio_one_stack": max(one) if one and all(r is not None for r in one) else None,
            "spread": "across starts" if any(lv["served_spread_across_starts"] for lv in levels) else "one stack"}


def sla_check(summaries: list[dict[str, Any]], share: float, policy: str) -> dict[str, Any] | None:
    """Whether every served run at ``share`` of the SLA edge held p95 TTFT and p95 time per output token
    within the SLA with nothing refused (:func:`scheduler.control.evaluate.holds_sla`), with their p95s."""
    from scheduler.control.evaluate import holds_sla

    if not summaries:
        return None
    return {"share_of_edge": share, "policy": policy, "held": all(holds_sla(s) for s in summaries),
            "runs": [{k: s[k] for k in ("ttft_p95_ms", "tpot_p95_ms", "errors", "sla_attainment")} for s in summaries],
            "sla": summaries[0]["sla"]}


def repeat_spread(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """How far served runs of one schedule land from each other: per validated metric, the largest
    |a - b| / mean(a, b) over pairs of runs at one load (None without a repeat)."""
    by_load: dict[float, list[dict[str, float]]] = {}
    for v in runs:
        by_load.setdefault(v["share_of_edge"], []).append(v["measured"])
    diffs: dict[str, float] = {}
    for ms in by_load.values():
        for i in range(len(ms)):
            for j in range(i + 1, len(ms)):
                for k in VALIDATED:
                    a, b = ms[i][k], ms[j][k]
                    if a and b:
                        diffs[k] = max(diffs.get(k, 0.0), abs(a - b) / ((a + b) / 2))
    return {"rel_diff": diffs, "max_rel_diff": max(diffs.values())} if diffs else None
