"""``smartexit bench serve``: the stage. The work is :mod:`scheduler.loadtest.bench_serve`'s (and its
``bench_serve_*`` modules'); this module reads the run, calls it and records what it made."""
from __future__ import annotations

import time
from pathlib import Path

from edge.core.artifacts import Manifest
from scheduler.loadtest.bench_serve import inprocess_run, served_runs
from scheduler.loadtest.bench_serve_capacity import capacity_requests, capacity_section
from scheduler.loadtest.bench_serve_config import BenchServeConfig
from scheduler.loadtest.bench_serve_inputs import context_window, make_schedule
from scheduler.loadtest.bench_serve_report import INPROCESS, STAGE, build_report, describe_workload, write_outputs


def main(cfg: BenchServeConfig) -> int:
    """Served run(s), the in-process run, outputs and manifest record; 0 on success.

    Raises:
        SmartExitError: a bad config, no tokenizer, an unreachable server, or a stack that fails to start.
    """
    t0 = time.perf_counter()
    schedule, w = make_schedule(cfg)
    workload = describe_workload(cfg, w, schedule, context_window(cfg))
    print(f"bench serve: {len(schedule)} requests over {workload['span_s']:.1f} s from {w.source}", flush=True)
    cap_reqs = capacity_requests(cfg, schedule) if cfg.capacity_concurrency else None
    runs, cap, shot = served_runs(cfg, schedule, cap_reqs)
    if cfg.inprocess:
        runs[INPROCESS] = inprocess_run(cfg, schedule)
    report = build_report(cfg, workload, runs)
    report["serve_bench"].update(shot)
    if cap:
        report["capacity"] = capacity_section(cfg, cap)
        report["serve_bench"].update(report["capacity"]["headline"])
    paths = write_outputs(cfg, report, runs)
    if "dashboard_png" in shot:
        paths["dashboard_png"] = Path(cfg.run_dir) / shot["dashboard_png"]
    for label, s in report["runs"].items():
        ttft = "n/a" if s["ttft_p95_ms"] is None else f"{s['ttft_p95_ms']:.1f}"
        print(f"  {label}: {s['requests']} requests, {s['errors']} errors, TTFT p95 {ttft} ms, "
              f"SLA attainment {s['sla_attainment']:.3f}, goodput {s['goodput_rps']:.2f} req/s, "
              f"{s['tokens_per_s']:.1f} tokens/s", flush=True)
    inputs = {"trace": w.source[len("trace "):]} if not workload["synthetic"] else {}
    Manifest(cfg.run_dir).record(STAGE, inputs=inputs, config=report["config"], outputs=paths,
                                 metrics=report["serve_bench"], seconds=time.perf_counter() - t0)
    return 0
