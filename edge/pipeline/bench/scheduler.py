"""``smartexit bench scheduler``: the stage. The work is :mod:`scheduler.loadtest.bench_scheduler`'s; this module reads the run, calls it and
records what it made."""
from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from edge.core.artifacts import Manifest
from scheduler.control.env import estimate_capacity
from scheduler.control.evaluate import cell_table, compare, evaluate_grid, spec_capacity
from scheduler.loadtest.bench_scheduler import _env_dict, capacity_policy, env_config, load_inputs, policy_factories, predictor_report, real_runs, render_headline, summary, workload_specs, write_outputs
from scheduler.loadtest.bench_scheduler_ablation import ablation_report, load_ablation
from scheduler.loadtest.bench_scheduler_config import BenchSchedulerConfig, LEARNED, STAGE


def main(cfg: BenchSchedulerConfig) -> int:
    t0 = time.perf_counter()
    latency, exits, learned, info = load_inputs(cfg)
    env = env_config(cfg, info)
    reference = capacity_policy(info, env)
    env.capacity_rps = estimate_capacity(latency, exits, env, reference)
    specs, trace_note = workload_specs(cfg)
    caps = {s.name: spec_capacity(latency, exits, env, s, reference, cfg.duration_s) for s in specs}
    ablated = load_ablation(cfg, learned)
    policies = policy_factories(cfg, learned, ablated)
    print(f"bench scheduler: capacity (fixed {reference.prefill_budget}, SLA {env.sim.sla_ttft_ms:g} / {env.sim.sla_tpot_ms:g} ms) "
          + ", ".join(f"{k} {v:.2f}" for k, v in caps.items()) + f" req/s; {len(specs)} workloads x {len(cfg.loads)} "
          f"loads x {len(policies)} policies x {len(cfg.sim_seeds)} seeds; {trace_note}", flush=True)
    rows = evaluate_grid(latency, exits, env, specs, cfg.loads, policies, cfg.duration_s, cfg.sim_seeds,
                         progress=lambda s: print(f"  sim {s}", flush=True), capacities=caps)
    cells = cell_table(rows)
    names = [s.name for s in specs]
    offered = {(r["workload"], r["load"]): r["rate_rps"] for r in rows}
    cmp = compare(cells, names, cfg.loads, LEARNED, offered)
    report: dict[str, Any] = {"config": asdict(cfg), "capacity_rps": env.capacity_rps, "capacities_rps": caps,
                              "env": _env_dict(env),
                              "workloads": trace_note, "policy": {k: info.get(k) for k in ("layout_id", "trained_at",
                                                                                            "selected", "sha256")},
                              "latency_fit": latency.fit, "exit_model": asdict(exits), "sim": {"rows": rows, **cmp}}
    collapsed = {(w, load) for w in names for load in cfg.loads if cmp["per_cell"][f"{w}@{load:g}"]["collapsed"]}
    report["sim"]["exit_features_ablation"] = (ablation_report(cells, names, cfg.loads, collapsed)
                                               if ablated is not None else None)
    report["predictor"] = predictor_report(Path(cfg.run_dir))
    real_w = "trace" if cfg.real_workload == "trace" and "trace" in names else \
        next((n for n in names if n.startswith(cfg.real_workload)), names[0])
    if cfg.real:
        report["real"] = real_runs(cfg, env, latency, exits, learned, specs[names.index(real_w)], cells,
                                   caps[real_w])
    report["summary"] = summary(report, cells, real_w)
    paths = write_outputs(cfg, report)
    print(render_headline(report["summary"]), flush=True)
    Manifest(cfg.run_dir).record(STAGE, inputs={}, config=report["config"], outputs=paths,
                                 metrics=report["summary"],
                                 seconds=time.perf_counter() - t0)
    return 0
