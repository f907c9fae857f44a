"""``smartexit bench serve``'s report: the workload as run (:func:`describe_workload`), ``serve.json``'s
per-run summaries, the served / in-process comparison and the ``serve_bench`` headline (:func:`build_report`),
and the files written (:func:`write_outputs`). The arithmetic and presentation are
:mod:`scheduler.loadtest.bench_report`'s."""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from edge.core.artifacts import atomic_write_json, atomic_write_text
from scheduler.loadtest.bench_report import compare, plot_latency_cdf, plot_throughput, render_markdown, same_lengths
from scheduler.loadtest.bench_serve_config import BenchServeConfig
from scheduler.loadtest.capacity import capacity_markdown
from scheduler.loadtest.loadgen import ScheduledRequest
from scheduler.control.outcomes import RequestResult, summarize
from scheduler.control.workload import Workload

STAGE = "bench_serve"
INPROCESS = "in-process"

LENGTH_MAPPING = ("outputs: the workload's, clipped to max_output; prompts: scaled so that the "
                  "p{q:g} prompt maps to context_window - max_output = {budget} tokens, clipped to [1, {budget}]")


def describe_workload(cfg: BenchServeConfig, w: Workload, schedule: list[ScheduledRequest], window: int) -> dict[str, Any]:
    p = np.array([len(r.prompt_ids) for r in schedule])
    o = np.array([r.max_tokens for r in schedule])
    stats = lambda a: {"mean": float(a.mean()), "p50": float(np.median(a)), "max": int(a.max())}  # noqa: E731
    return {
        "source": w.source,
        "synthetic": not w.source.startswith("trace "),
        "arrivals": cfg.arrivals,
        "requests": len(schedule),
        "span_s": schedule[-1].arrival_s - schedule[0].arrival_s,
        "start_s": cfg.start_s,
        "time_scale": cfg.time_scale,
        "seed": cfg.seed,
        "prompt_tokens": stats(p),
        "output_tokens": stats(o),
        "context_window": window,
        "length_mapping": LENGTH_MAPPING.format(q=cfg.prompt_percentile, budget=window - cfg.max_output),
        "prompts": "windows of the held-out test split (edge/assets/data/test.jsonl.xz), seeded",
    }


def build_report(cfg: BenchServeConfig, workload: dict[str, Any], runs: dict[str, list[RequestResult]]) -> dict[str, Any]:
    """``serve.json``: per-run summaries, served vs in-process, and the ``serve_bench`` headline
    (the first served run's numbers, every run under ``policies``)."""
    summaries = {label: summarize(res, cfg.sla_ttft_ms, cfg.sla_tpot_ms) for label, res in runs.items()}
    served = [label for label in runs if label != INPROCESS]
    comparison = ({label: {**compare(summaries[label], summaries[INPROCESS]),
                          "same_output_lengths": same_lengths(runs[label], runs[INPROCESS])} for label in served}
                  if INPROCESS in summaries else {})
    head = summaries[served[0]]
    keys = ("requests", "errors", "errors_by_kind", "ttft_p50_ms", "ttft_p95_ms", "tpot_p50_ms", "tpot_p95_ms",
            "e2e_p95_ms", "sla_attainment", "goodput_rps", "tokens_per_s", "offered_rps")
    headline: dict[str, Any] = {"policy": served[0], **{k: head[k] for k in keys}}
    headline["served_vs_inprocess_tokens_ratio"] = comparison.get(served[0], {}).get("served_vs_inprocess_tokens_ratio")
    headline["ttft_p50_overhead_ms"] = comparison.get(served[0], {}).get("ttft_p50_overhead_ms")
    headline["policies"] = {label: {k: summaries[label][k] for k in keys} for label in served}
    if INPROCESS in summaries:
        headline["inprocess"] = {k: summaries[INPROCESS][k] for k in keys}
    headline["workload_source"] = workload["source"]
    notes = []
    if workload["synthetic"]:
        notes.append(f"No trace was read: the arrivals are synthetic ({workload['source']}).")
    if INPROCESS in summaries:
        notes.append("In process: the same schedule on an EngineHost opened from the same bundle, with the same "
                     "threads and host settings, in the load generator's process (no HTTP, Ray Serve or Triton, no "
                     "control loop: the bundle's initial prefill budget and admission limit throughout); its "
                     "chunks are stamped on the engine thread as they are emitted.")
        notes.append("tokens/s counts generated tokens from the first request sent to the last response: at a load "
                     "both systems keep up with, it is the offered rate, and the served / in-process ratio moves "
                     "with the last requests' latency (two identical in-process runs on a 2-core machine differed "
                     "by 10%); the TTFT and TPOT percentiles are where the stack's cost shows.")
    config = asdict(cfg)
    config["api_key"] = "<set>" if cfg.api_key else None  # keys never reach the artifacts
    config["serve"] = {k: "<set>" if "key" in k and v else v for k, v in cfg.serve.items()}
    return {"stage": STAGE, "workload": workload, "sla": {"ttft_ms": cfg.sla_ttft_ms, "tpot_ms": cfg.sla_tpot_ms},
            "runs": summaries, "comparison": comparison, "serve_bench": headline, "notes": notes, "config": config}


def write_outputs(cfg: BenchServeConfig, report: dict[str, Any], runs: dict[str, list[RequestResult]]) -> dict[str, Path]:
    out = Path(cfg.run_dir) / "bench"
    paths = {"json": out / "serve.json", "md": out / "serve.md", "latency_cdf_png": out / "serve_latency_cdf.png",
             "throughput_png": out / "serve_throughput.png"}
    plot_latency_cdf(runs, paths["latency_cdf_png"], cfg.sla_ttft_ms, cfg.sla_tpot_ms)
    plot_throughput(runs, paths["throughput_png"])
    atomic_write_text(paths["md"], render_markdown(report) + capacity_markdown(report.get("capacity")))
    atomic_write_json(paths["json"], report)  # last: its presence means the set is complete
    return paths
