"""Policies against each other in the simulator: held-out workloads x loads x policies, the best
fixed budget per cell (chosen in hindsight, the strongest form of Sarathi's offline choice), the
load where it just holds the SLA, and the learned policy's goodput relative to it.

Pure orchestration over :func:`scheduler.control.sim.simulate` and :func:`scheduler.loadtest.bench_report.summarize`
(one definition of attainment, goodput and percentiles for simulated and served runs).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from edge.core.errors import ConfigError
from scheduler.control.outcomes import summarize
from scheduler.control.env import CAPACITY_MIN_REQUESTS, EnvConfig, estimate_capacity, make_workload
from scheduler.control.exit_model import ExitModel
from scheduler.control.latency import LatencyModel
from scheduler.control.sim import simulate
from scheduler.control.sim_config import SimConfig
from scheduler.control.workload import Workload

FIXED_PREFIX = "fixed-"


@dataclass(frozen=True)
class WorkloadSpec:
    """A held-out workload family: ``pattern`` (poisson, bursty, diurnal) or ``trace`` (a file's
    arrivals and lengths, time-scaled to the load)."""
    name: str
    pattern: str
    seed: int
    trace: Workload | None = None


def trace_at_rate(trace: Workload, rate: float, duration_s: float, cfg: EnvConfig, start_s: float = 0.0) -> Workload:
    """The ``rate x duration_s`` requests of ``trace`` from ``start_s`` (trace time), time-scaled so
    that their own mean rate is ``rate`` (a trace's density varies along it: scaling by the whole
    trace's mean would miss the target); lengths clipped to the context (cfg.max_prompt / max_output).

    Raises:
        ConfigError: fewer than two requests from ``start_s``.
    """
    t = trace.arrival_s
    first = int(np.searchsorted(t, start_s))
    n = min(max(2, int(round(rate * duration_s))), len(t) - first)
    if n < 2:
        raise ConfigError(f"trace from {start_s} s holds {max(0, len(t) - first)} requests; need >= 2")
    idx = slice(first, first + n)
    span = float(t[idx][-1] - t[idx][0])
    scale = (n - 1) / rate / span if span > 0 else 0.0  # trace seconds -> run seconds
    arr = (t[idx] - t[idx][0]) * scale if span > 0 else np.arange(n) / rate
    return Workload(arr, np.minimum(trace.prompt_tokens[idx], cfg.max_prompt),
                    np.minimum(trace.output_tokens[idx], cfg.max_output), f"{trace.source} at {rate:.2f} req/s")


def workload_for(spec: WorkloadSpec, rate: float, duration_s: float, cfg: EnvConfig) -> Workload:
    if spec.trace is not None:
        return trace_at_rate(spec.trace, rate, duration_s, cfg)
    return make_workload(spec.pattern, rate, duration_s, spec.seed, cfg)


def holds_sla(s: dict[str, Any]) -> bool:
    """p95 TTFT and p95 time per output token within the SLA, and nothing refused."""
    sla = s["sla"]
    return (s["errors"] == 0 and s["ttft_p95_ms"] is not None and s["ttft_p95_ms"] <= sla["ttft_ms"]
            and (s["tpot_p95_ms"] is None or s["tpot_p95_ms"] <= sla["tpot_ms"]))


STATIONARY = ("poisson", "bursty")  # arrival patterns whose longer windows are more of the same workload


def spec_capacity(latency: LatencyModel, exits: ExitModel, cfg: EnvConfig, spec: WorkloadSpec, policy: Any,
                  duration_s: float, attainment: float = 0.95) -> float:
    """This workload family's own capacity (a trace's long prompts and same-instant bursts load the
    engine more per request than short synthetic ones): :func:`scheduler.control.env.estimate_capacity` on it.
    Stationary arrivals (Poisson, bursty) are judged on at least ``CAPACITY_MIN_REQUESTS`` requests per rate
    (the run lasts ``duration_s`` or longer: the demo's 20 s cells read Poisson capacity 1.97 req/s where
    30 s ones read 4.03 and 200 requests 3.32); a diurnal cycle or a trace keeps ``duration_s``, since a
    longer window is another workload (more of the cycle, other bursts of the trace)."""
    stationary = spec.trace is None and spec.pattern in STATIONARY

    def at(rate: float) -> Workload:
        return workload_for(spec, rate, max(duration_s, CAPACITY_MIN_REQUESTS / rate) if stationary else duration_s, cfg)
    return estimate_capacity(latency, exits, cfg, policy, attainment, workload_at=at)


def evaluate_grid(latency: LatencyModel, exits: ExitModel, cfg: EnvConfig, specs: Sequence[WorkloadSpec],
                  loads: Sequence[float], policies: dict[str, Callable[[], Any]], duration_s: float,
                  seeds: Sequence[int] = (0,), progress: Callable[[str], None] | None = None,
                  capacities: dict[str, float] | None = None) -> list[dict[str, Any]]:
    """One row per (workload, load, policy, seed): the run's summary plus its keys.

    ``loads``: multiples of each workload's capacity (``capacities[name]``, default
    ``cfg.capacity_rps``); ``policies``: name -> a factory (a fresh policy per run: the learned one
    carries LSTM state).
    """
    rows = []
    for spec in specs:
        for load in loads:
            rate = load * (capacities or {}).get(spec.name, cfg.capacity_rps)
            w = workload_for(spec, rate, duration_s, cfg)
            for seed in seeds:
                sim_cfg = SimConfig(**{**cfg.sim.__dict__, "seed": seed})
                for name, make in policies.items():
                    sim = simulate(latency, exits, sim_cfg, w, make(), cfg.tick_s)
                    s = summarize(sim.results(), sim_cfg.sla_ttft_ms, sim_cfg.sla_tpot_ms)
                    rows.append({"workload": spec.name, "load": load, "rate_rps": rate, "policy": name, "seed": seed,
                                 "holds_sla": holds_sla(s), **{k: s[k] for k in SUMMARY_KEYS}})
            if progress:
                progress(f"{spec.name} x{load:g}")
    return rows


SUMMARY_KEYS = ("requests", "errors", "sla_attainment", "goodput_rps", "tokens_per_s", "ttft_p50_ms", "ttft_p95_ms",
                "tpot_p50_ms", "tpot_p95_ms")


def _mean(rows: list[dict], key: str) -> float:
    vals = [r[key] for r in rows if r[key] is not None]
    return float(np.mean(vals)) if vals else math.nan


def cell_table(rows: list[dict[str, Any]]) -> dict[tuple[str, float, str], dict[str, Any]]:
    """(workload, load, policy) -> means over seeds (holds_sla: on every seed)."""
    cells: dict[tuple[str, float, str], list[dict]] = {}
    for r in rows:
        cells.setdefault((r["workload"], r["load"], r["policy"]), []).append(r)
    out = {}
    for key, rs in cells.items():
        d = {k: _mean(rs, k) for k in SUMMARY_KEYS}
        d["holds_sla"] = all(r["holds_sla"] for r in rs)
        d["goodput_std"] = float(np.std([r["goodput_rps"] for r in rs])) if len(rs) > 1 else 0.0
        out[key] = d
    return out


def best_fixed(cells: dict, workload: str, load: float) -> tuple[str, dict[str, Any]]:
    """The fixed budget with the highest goodput in this cell (ties: the one holding the SLA, then
    lower p95 TTFT)."""
    cands = [(p, c) for (w, l, p), c in cells.items() if w == workload and l == load and p.startswith(FIXED_PREFIX)]
    if not cands:
        raise ConfigError("evaluation: no fixed-budget policy in the grid")
    return max(cands, key=lambda pc: (round(pc[1]["goodput_rps"], 6), pc[1]["holds_sla"], -pc[1]["ttft_p95_ms"]))


def sla_edge(cells: dict, workload: str, loads: Sequence[float], policy: str | None = None) -> float | None:
    """The highest load at which ``policy`` (None: the best fixed budget of each load) holds the SLA,
    provided it holds at every lighter load too; None if it never holds."""
    edge = None
    for load in sorted(loads):
        c = best_fixed(cells, workload, load)[1] if policy is None else cells[(workload, load, policy)]
        if not c["holds_sla"]:
            break
        edge = load
    return edge


MIN_GOODPUT_SHARE = 0.1  # cells where the best fixed budget serves less than this share of the offered
# requests within the SLA (collapse past saturation) compare two near-zero numbers: reported, not ratioed


def compare(cells: dict, workloads: Sequence[str], loads: Sequence[float], learned: str,
            offered: dict[tuple[str, float], float] | None = None) -> dict[str, Any]:
    """The learned policy against the best fixed budget: goodput ratio per (workload, load), its
    smallest per workload and overall (over cells where the best fixed budget still serves
    ``MIN_GOODPUT_SHARE`` of the offered rate within the SLA), at each workload's SLA edge, and the
    SLA capacity ratio (the highest load each holds, learned / best fixed)."""
    per_cell, per_workload, at_edge, capacity = {}, {}, {}, {}
    for w in workloads:
        ratios = []
        for load in loads:
            name, bf = best_fixed(cells, w, load)
            le = cells[(w, load, learned)]
            ratio = le["goodput_rps"] / bf["goodput_rps"] if bf["goodput_rps"] > 0 else math.nan
            rate = (offered or {}).get((w, load))
            collapsed = rate is not None and bf["goodput_rps"] < MIN_GOODPUT_SHARE * rate
            per_cell[f"{w}@{load:g}"] = {"best_fixed": name, "ratio": ratio, "best_fixed_goodput": bf["goodput_rps"],
                                         "learned_goodput": le["goodput_rps"], "collapsed": collapsed,
                                         "noise": max(bf["goodput_std"], le["goodput_std"])}
            if not collapsed:
                ratios.append(ratio)
        per_workload[w] = float(np.nanmin(ratios)) if ratios else math.nan
        edge = sla_edge(cells, w, loads)
        if edge is not None:
            name, bf = best_fixed(cells, w, edge)
            at_edge[w] = {"load": edge, "best_fixed": name,
                          "ratio": cells[(w, edge, learned)]["goodput_rps"] / bf["goodput_rps"]}
        le_edge = sla_edge(cells, w, loads, learned)
        capacity[w] = {"best_fixed_edge_load": edge, "learned_edge_load": le_edge,
                       "ratio": (le_edge / edge) if edge and le_edge else None}
    return {"per_cell": per_cell, "goodput_ratio_vs_best_fixed": per_workload,
            "goodput_ratio_vs_best_fixed_min": float(np.nanmin(list(per_workload.values()))),
            "at_sla_edge": at_edge, "sla_capacity": capacity}
