"""``smartexit bench serve``: an open-loop load test of the serving stack, and of the engine in process.

One schedule (:mod:`scheduler.loadtest.loadgen`: the Azure code trace, or synthetic arrivals where it is absent,
mapped onto the model's context window; prompts cut from the held-out test split) is replayed

* against the OpenAI-compatible server, once per scheduling policy: a server at ``url``, or the
  stack this stage starts itself (``scheduler.serving.stack.serving_stack``) with the policy set per run;
* on an ``edge.runtime.host.EngineHost`` in this process, opened from the same bundle with the same
  host settings and ONNX Runtime threads as the served model (no HTTP, Ray or Triton, and no control
  loop: the bundle's initial prefill budget throughout), which prices the serving stack.

Writes ``<run_dir>/bench/serve.json`` (read by the report stage), ``serve.md``,
``serve_latency_cdf.png`` and ``serve_throughput.png``, and records stage ``bench_serve`` in the run
manifest. Definitions of the numbers: :mod:`scheduler.loadtest.bench_report`.

Here: the runs the stage makes (:func:`served_runs`, :func:`inprocess_run`). Its settings are in
``bench_serve_config.py``, the schedule and what it is made of in ``bench_serve_inputs.py``, one open-loop
run (warm-up, then the schedule; over HTTP) in ``bench_serve_runs.py``, the price of serving's closed-loop
runs and report section in ``bench_serve_capacity.py``, ``serve.json`` and the files written in
``bench_serve_report.py``; the stage itself (manifest record) is ``edge/pipeline/bench/serve.py``.
"""
from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

from scheduler.loadtest.bench_serve_capacity import capacity_runs, stamps_dir
from scheduler.loadtest.bench_serve_config import BenchServeConfig
from scheduler.loadtest.bench_serve_inputs import bundle_dir, stop_ids
from scheduler.loadtest.bench_serve_runs import http_run, warm_then_run
from scheduler.loadtest.capacity import Run
from scheduler.loadtest.loadgen import ScheduledRequest
from scheduler.control.outcomes import RequestResult
from scheduler.loadtest.senders import InProcessSender
from scheduler.serving.stamps import enable as enable_stamps


def served_runs(cfg: BenchServeConfig, schedule: list[ScheduledRequest],
                capacity: list[ScheduledRequest] | None = None
                ) -> tuple[dict[str, list[RequestResult]], dict[str, dict[int, list[Run]]], dict]:
    """(label -> results: ``served`` against ``url``, else one run per policy on a stack started for
    it; the capacity runs (:func:`capacity_runs`) on the first of them; the dashboard screenshot's record)."""
    if cfg.url is not None:
        res = asyncio.run(http_run(cfg.url, schedule, cfg))
        cap = capacity_runs(cfg, capacity, cfg.url) if capacity else {}
        shot = _screenshot(cfg.url, Path(cfg.run_dir) / "bench" / "dashboard.png", cfg.api_key) if cfg.screenshot else {}
        return {"served": res}, cap, shot
    from edge.core.configio import apply
    from scheduler.serving.config import ServeConfig
    from scheduler.serving.stack import free_port, serving_stack

    runs, cap, shot = {}, {}, {}
    # the dashboard draws the SLA every request of this run carries
    sla = {"default_sla_ttft_ms": cfg.sla_ttft_ms, "default_sla_tpot_ms": cfg.sla_tpot_ms}
    for k, policy in enumerate(cfg.policies):
        bundle = {"bundle_dir": cfg.bundle} if cfg.bundle is not None else {}  # else the stack's own
        # a port of its own unless the config names one (a stack right after another: free_port)
        serve_cfg = apply(ServeConfig(), {**bundle, **sla, "port": free_port(), **cfg.serve, "policy": policy})
        stamping = k == 0 and bool(capacity) and cfg.stamps
        if stamping:  # before the stack starts: its processes take the setting from their environment
            shutil.rmtree(stamps_dir(cfg), ignore_errors=True)
            enable_stamps(stamps_dir(cfg))
        try:
            with serving_stack(cfg.run_dir, serve_cfg, graceful=False) as url:
                runs[policy] = asyncio.run(http_run(url, schedule, cfg))
                if k == 0 and capacity:
                    cap = capacity_runs(cfg, capacity, url)
                if k == 0 and cfg.screenshot:
                    shot = _screenshot(url, Path(cfg.run_dir) / "bench" / "dashboard.png", serve_cfg.api_key)
        finally:
            if stamping:
                enable_stamps(None)
        print(f"bench serve: policy {policy}: {len(runs[policy])} requests sent", flush=True)
    return runs, cap, shot


def _screenshot(url: str, out: Path, api_key: str | None) -> dict[str, str]:
    """{"dashboard_png": path relative to the run} or {"dashboard_skipped": why} (no browser here)."""
    from edge.core.errors import MissingExtraError
    from scheduler.serving.screenshot import BrowserUnavailable, dashboard_screenshot

    try:
        dashboard_screenshot(url, out, seconds=1.0, api_key=api_key)
    except (BrowserUnavailable, MissingExtraError) as exc:
        print(f"bench serve: no dashboard screenshot: {exc}", flush=True)
        return {"dashboard_skipped": str(exc)}
    print(f"bench serve: dashboard screenshot {out}", flush=True)
    return {"dashboard_png": f"bench/{out.name}"}


def inprocess_run(cfg: BenchServeConfig, schedule: list[ScheduledRequest]) -> list[RequestResult]:
    """The same schedule on an EngineHost in this process, opened as the served model opens it."""
    from scheduler.serving.bundle import open_bundle

    host = open_bundle(bundle_dir(cfg), threads=cfg.threads, **cfg.host)
    host.start()
    try:
        send = InProcessSender(host, cfg.mode, cfg.sla_ttft_ms, cfg.sla_tpot_ms, cfg.request_timeout_s, stop_ids(cfg))
        return asyncio.run(warm_then_run(send, schedule, cfg.warmup_requests, "the in-process host"))
    finally:
        host.stop()
