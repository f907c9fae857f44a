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
"""
from __future__ import annotations

import asyncio
import contextlib
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edge.core.artifacts import atomic_write_json, atomic_write_text
from edge.core.errors import ConfigError, SmartExitError
from edge.runtime.settings import SLA_TPOT_MS, SLA_TTFT_MS
from scheduler.loadtest.bench_report import compare, plot_latency_cdf, plot_throughput, render_markdown, same_lengths
from scheduler.control.outcomes import summarize
from scheduler.loadtest.capacity import INPROCESS as INPROCESS_SYSTEM
from scheduler.loadtest.capacity import SERVED as SERVED_SYSTEM
from scheduler.loadtest.capacity import TRITON as TRITON_SYSTEM
from scheduler.loadtest.capacity import Run, capacity_markdown, capacity_report, interleaved, tokens_ratio
from scheduler.loadtest.loadgen import ScheduledRequest, build_schedule, run_open_loop
from scheduler.control.outcomes import RequestResult
from scheduler.loadtest.senders import HttpSender, InProcessSender, TritonSender
from scheduler.control.workload import SHARED_TRACE, Arrivals, Workload, load_workload, synthetic

STAGE = "bench_serve"
INPROCESS = "in-process"
EXACT_SYSTEM = "served_exact"  # the capacity runs' name for the stack in mode exact
ARRIVALS = ("trace", "poisson", "bursty")
MAX_TRACE_ROWS = 10_000_000  # read a whole trace; the window is cut afterwards


@dataclass
class BenchServeConfig:
    run_dir: str = "artifacts/demo"
    url: str | None = None            # a running server; None: start the stack for each policy
    api_key: str | None = None        # bearer key for ``url`` (never written to the artifacts)
    model: str | None = None          # the ``model`` field of each request; None: the server's (/v1/models)
    # the bundle `smartexit repo` wrote (exporters/triton.py): the in-process engine, the tokenizer and the
    # context window come from it; None: <run_dir>/triton/smartexit/1/bundle
    bundle: str | None = None
    tokenizer: str | None = None      # tokenizer.json for the prompts; None: the bundle's
    # workload: arrivals "trace" (``trace``, else the shared Azure trace, else synthetic Poisson at
    # rate_rps, reported as such), "poisson" or "bursty" (synthetic at rate_rps)
    trace: str | None = None
    arrivals: str = "trace"
    rate_rps: float = 2.0
    start_s: float = 0.0              # where the window opens, in trace (unscaled) seconds
    duration_s: float | None = 30.0   # seconds of arrivals after scaling
    max_requests: int | None = None
    time_scale: float = 1.0           # arrival (t - start_s) * time_scale
    context_window: int | None = None  # prompt + output tokens per request; None: the bundle's max positions
    max_output: int = 64
    prompt_percentile: float = 99.0   # this percentile of the trace's prompts maps to the prompt budget
    seed: int = 0
    # the SLA every request carries, and that attainment / goodput are counted against (default: the
    # server's; configs/bench_serve.yaml tightens it)
    sla_ttft_ms: float = SLA_TTFT_MS.default
    sla_tpot_ms: float = SLA_TPOT_MS.default
    mode: str = "bounded"
    policies: list[str] = field(default_factory=lambda: ["fixed", "aimd"])  # one served run each; the first heads the summary
    serve: dict[str, Any] = field(default_factory=dict)  # other keys for the stack's ServeConfig
    inprocess: bool = True
    threads: int | None = None        # in-process ONNX Runtime threads; None: the bundle's, as served
    host: dict[str, Any] = field(default_factory=dict)  # bundle host overrides (RepoConfig fields), in process
    warmup_requests: int = 2          # sent one by one before each run, not measured
    # the price of serving: closed-loop runs at these concurrencies (same requests, fixed lengths) on the
    # first policy's stack, straight to a tritonserver (hops) and in process, interleaved, capacity_repeats
    # times (scheduler/loadtest/capacity.py); tokens/s ratio at the highest and lowest, TTFT overhead at the lowest
    capacity_concurrency: list[int] = field(default_factory=lambda: [1, 8])
    capacity_repeats: int = 3
    capacity_requests: int = 16       # per concurrency level
    capacity_prompt_tokens: int = 64
    capacity_max_tokens: int = 32
    # the closed-loop runs once more with every request in mode exact (lossless speculative decoding),
    # through the stack: exact-mode tokens/s beside the bounded mode's
    capacity_exact: bool = True
    hops: bool = True                 # the closed-loop requests also straight to a tritonserver (no Ray Serve)
    # after the first policy's run, a PNG of the live dashboard (/dashboard) of that stack in headless
    # Chromium -> bench/dashboard.png, embedded in the report (skipped, saying why, without a browser)
    screenshot: bool = True
    request_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        from edge.runtime.request import Mode

        if self.arrivals not in ARRIVALS:
            raise ConfigError(f"bench serve: arrivals must be one of {', '.join(ARRIVALS)}, got {self.arrivals!r}")
        try:
            self.mode = Mode(self.mode).value
        except ValueError:
            raise ConfigError(f"bench serve: mode must be one of {', '.join(m.value for m in Mode)}, "
                              f"got {self.mode!r}") from None
        if self.duration_s is None and self.max_requests is None:
            raise ConfigError("bench serve: set duration_s or max_requests (or both)")
        if (self.duration_s is not None and self.duration_s <= 0) or (self.max_requests is not None
                                                                       and self.max_requests < 1):
            raise ConfigError("bench serve: duration_s must be > 0 and max_requests >= 1")
        if self.rate_rps <= 0 or self.time_scale <= 0 or self.start_s < 0:
            raise ConfigError("bench serve: rate_rps > 0, time_scale > 0 and start_s >= 0 are required")
        SLA_TTFT_MS.check(self.sla_ttft_ms, "bench serve")
        SLA_TPOT_MS.check(self.sla_tpot_ms, "bench serve")
        if not self.policies and self.url is None:
            raise ConfigError("bench serve: policies is empty; name at least one (fixed, aimd)")
        if (self.threads is not None and self.threads < 1) or self.warmup_requests < 0 or self.request_timeout_s <= 0:
            raise ConfigError("bench serve: threads >= 1, warmup_requests >= 0 and request_timeout_s > 0")
        if any(c < 1 for c in self.capacity_concurrency) or self.capacity_requests < 1 \
                or self.capacity_prompt_tokens < 1 or self.capacity_max_tokens < 1 or self.capacity_repeats < 1:
            raise ConfigError("bench serve: capacity_concurrency values, capacity_requests, capacity_prompt_tokens, "
                              "capacity_max_tokens and capacity_repeats must be >= 1")
        if self.context_window is not None and self.context_window < 2:
            raise ConfigError(f"bench serve: context_window must be >= 2, got {self.context_window}")


# --------------------------------------------------------------------------- inputs

def load_arrivals(cfg: BenchServeConfig) -> Workload:
    """The workload the window is cut from; its ``source`` says which it is."""
    window_s = cfg.start_s + (cfg.duration_s / cfg.time_scale if cfg.duration_s is not None else 0.0)
    # enough synthetic requests to cover the window (1.5x the expected count, plus a margin)
    n = math.ceil(1.5 * cfg.rate_rps * window_s) + 10 + (cfg.max_requests or 0)
    if cfg.arrivals != "trace":
        return synthetic(n, cfg.rate_rps, Arrivals(cfg.arrivals), cfg.seed)
    has_trace = cfg.trace is not None or SHARED_TRACE.is_file()
    return load_workload(cfg.trace, n=MAX_TRACE_ROWS if has_trace else n, rate=cfg.rate_rps,
                         kind=Arrivals.POISSON, seed=cfg.seed)


def bundle_dir(cfg: BenchServeConfig) -> Path:
    # the layout exporters/triton.py writes: <out>/<model name>/<version>/bundle
    from scheduler.serving.config import REPO_BUNDLE

    return Path(cfg.bundle) if cfg.bundle is not None else Path(cfg.run_dir) / "triton" / REPO_BUNDLE


def context_window(cfg: BenchServeConfig) -> int:
    """``cfg.context_window``, else the bundle's model positions (what the server accepts by default)."""
    if cfg.context_window is not None:
        return cfg.context_window
    from scheduler.serving.config import BundleInfo

    try:
        return BundleInfo.load(bundle_dir(cfg)).max_positions
    except ConfigError as exc:
        raise ConfigError(f"bench serve: {exc}; run `smartexit repo`, name the bundle (bundle=DIR) or set "
                          f"context_window") from exc


def _tokenizer_path(cfg: BenchServeConfig) -> Path:
    path = Path(cfg.tokenizer) if cfg.tokenizer is not None else bundle_dir(cfg) / "tokenizer.json"
    if not path.is_file():
        raise SmartExitError(f"bench serve: tokenizer {path} is missing; run `smartexit repo`, name the bundle "
                             f"(bundle=DIR) or the tokenizer (tokenizer=PATH)")
    return path


def prompt_pool(cfg: BenchServeConfig) -> list[list[int]]:
    """The held-out test split, one token stream per document."""
    from edge.core.data import Split, load_split
    from edge.model.tokenizer import load_tokenizer

    tok = load_tokenizer(_tokenizer_path(cfg))
    return [e.ids for e in tok.encode_batch([d.text for d in load_split(Split.TEST)])]


def stop_ids(cfg: BenchServeConfig) -> tuple[int, ...]:
    """The end-of-text token, which the server adds to every request's stop ids (scheduler/serving/app.py)."""
    from edge.model.tokenizer import EOS, load_tokenizer

    eos = load_tokenizer(_tokenizer_path(cfg)).token_to_id(EOS)
    return () if eos is None else (eos,)


def make_schedule(cfg: BenchServeConfig) -> tuple[list[ScheduledRequest], Workload]:
    w = load_arrivals(cfg)
    sched = build_schedule(w, prompt_pool(cfg), context_window(cfg), cfg.max_output, cfg.time_scale, cfg.seed,
                           start_s=cfg.start_s, duration_s=cfg.duration_s, max_requests=cfg.max_requests,
                           prompt_percentile=cfg.prompt_percentile)
    return sched, w


# --------------------------------------------------------------------------- runs

async def _warm_then_run(send: Any, schedule: list[ScheduledRequest], warmup: int, where: str) -> list[RequestResult]:
    """Warm-up requests one at a time (unmeasured), then the open-loop run. An idle system that fails
    a warm-up request is misconfigured (unreachable, wrong model or key): stop rather than record a run
    of errors."""
    for i, req in enumerate(schedule[:warmup]):
        r = await send(ScheduledRequest(0.0, req.prompt_ids, req.max_tokens, f"warmup-{i}"))
        if not r.ok:
            raise SmartExitError(f"bench serve: warm-up request to {where} failed ({r.error_kind}): {r.error}")
    return await run_open_loop(schedule, send)


def capacity_requests(cfg: BenchServeConfig, schedule: list[ScheduledRequest]) -> list[ScheduledRequest]:
    """The closed-loop requests: the schedule's prompts cut (or repeated) to ``capacity_prompt_tokens``,
    ``capacity_max_tokens`` each."""
    out = []
    for i in range(cfg.capacity_requests):
        ids = schedule[i % len(schedule)].prompt_ids
        ids = (ids * (cfg.capacity_prompt_tokens // len(ids) + 1))[:cfg.capacity_prompt_tokens]
        out.append(ScheduledRequest(0.0, ids, cfg.capacity_max_tokens, f"cap-{i}"))
    return out


async def _served_sender(url: str, cfg: BenchServeConfig, mode: str | None = None) -> HttpSender:
    """An entered :class:`HttpSender` for ``url`` in ``mode`` (default: the bench's), its model resolved
    from ``/v1/models`` unless configured. The caller exits it."""
    send = HttpSender(url, cfg.model or "", mode or cfg.mode, cfg.sla_ttft_ms, cfg.sla_tpot_ms, cfg.api_key,
                      cfg.request_timeout_s)
    await send.__aenter__()
    if cfg.model is None:
        models = await send.models()
        if not models:
            await send.__aexit__(None, None, None)
            raise SmartExitError(f"bench serve: {url}/v1/models lists no model")
        send.model = models[0]
    return send


async def http_run(url: str, schedule: list[ScheduledRequest], cfg: BenchServeConfig) -> list[RequestResult]:
    send = await _served_sender(url, cfg)
    try:
        return await _warm_then_run(send, schedule, cfg.warmup_requests, url)
    finally:
        await send.__aexit__(None, None, None)


def capacity_runs(cfg: BenchServeConfig, reqs: list[ScheduledRequest], url: str) -> dict[str, dict[int, list[Run]]]:
    """The closed-loop requests on every system at once, interleaved (:func:`scheduler.loadtest.capacity.interleaved`):
    the engine in this process (``inprocess``), a tritonserver of its own on the run's repository over
    gRPC (``triton_direct``, with ``hops`` and a stack of our own), the stack at ``url`` (``served``) and,
    with ``capacity_exact``, the stack in mode exact (``served_exact``)."""
    from scheduler.serving.bundle import open_bundle
    from scheduler.serving.stack import repository
    from scheduler.serving.tritonserver import TritonProcess

    with contextlib.ExitStack() as stack:
        host = None
        if cfg.inprocess:
            host = open_bundle(bundle_dir(cfg), threads=cfg.threads, **cfg.host)
            host.start()
            stack.callback(host.stop)
        tp = stack.enter_context(TritonProcess(repository(cfg.run_dir))) if cfg.hops and cfg.url is None else None

        async def run() -> dict[str, dict[int, list[Run]]]:
            senders: dict[str, Any] = {}
            if host is not None:
                senders[INPROCESS_SYSTEM] = InProcessSender(host, cfg.mode, cfg.sla_ttft_ms, cfg.sla_tpot_ms,
                                                            cfg.request_timeout_s, stop_ids(cfg))
            if tp is not None:
                senders[TRITON_SYSTEM] = TritonSender(tp.grpc_url, cfg.mode, cfg.sla_ttft_ms, cfg.sla_tpot_ms,
                                                      stop_ids(cfg))
            senders[SERVED_SYSTEM] = await _served_sender(url, cfg)
            if cfg.capacity_exact and cfg.mode != "exact":
                senders[EXACT_SYSTEM] = await _served_sender(url, cfg, "exact")
            try:
                return await interleaved(senders, reqs, cfg.capacity_concurrency, cfg.capacity_repeats,
                                         cfg.warmup_requests)
            finally:
                for name, send in senders.items():
                    if name == TRITON_SYSTEM:
                        await send.close()
                    elif name in (SERVED_SYSTEM, EXACT_SYSTEM):
                        await send.__aexit__(None, None, None)
        return asyncio.run(run())


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
        with serving_stack(cfg.run_dir, serve_cfg, graceful=False) as url:
            runs[policy] = asyncio.run(http_run(url, schedule, cfg))
            if k == 0 and capacity:
                cap = capacity_runs(cfg, capacity, url)
            if k == 0 and cfg.screenshot:
                shot = _screenshot(url, Path(cfg.run_dir) / "bench" / "dashboard.png", serve_cfg.api_key)
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
        return asyncio.run(_warm_then_run(send, schedule, cfg.warmup_requests, "the in-process host"))
    finally:
        host.stop()


# --------------------------------------------------------------------------- report

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


def capacity_section(cfg: BenchServeConfig, cap: dict[str, dict[int, list[Run]]]) -> dict[str, Any]:
    """``serve.json``'s ``capacity``: :func:`scheduler.loadtest.capacity.capacity_report` of the runs, with
    the requests' shape and, with mode exact, the exact / bounded tokens/s ratio at the lowest concurrency
    (``headline["exact_vs_bounded_tokens_ratio"]``, its spread beside the others)."""
    from scheduler.serving.config import ServeConfig

    own = cfg.url is None
    via = cfg.serve.get("stream_via", ServeConfig.stream_via) if own else "as the server is configured"
    ingress = cfg.serve.get("ingress", ServeConfig.ingress) if own else "as the server is configured"
    meta = {"requests_per_level": cfg.capacity_requests, "prompt_tokens": cfg.capacity_prompt_tokens,
            "max_tokens": cfg.capacity_max_tokens, "policy": cfg.policies[0] if own else "served",
            "mode": cfg.mode, "stream_via": via, "ingress": ingress}
    rep = capacity_report(cap, cfg.sla_ttft_ms, cfg.sla_tpot_ms, meta)
    if EXACT_SYSTEM in cap and SERVED_SYSTEM in cap:
        lo = min(cap[SERVED_SYSTEM])
        spread = tokens_ratio(cap[EXACT_SYSTEM][lo], cap[SERVED_SYSTEM][lo], cfg.sla_ttft_ms, cfg.sla_tpot_ms)
        rep["headline"]["exact_vs_bounded_tokens_ratio"] = spread["median"]
        rep["headline"]["spread"]["exact_vs_bounded_tokens_ratio"] = spread
    return rep


def write_outputs(cfg: BenchServeConfig, report: dict[str, Any], runs: dict[str, list[RequestResult]]) -> dict[str, Path]:
    out = Path(cfg.run_dir) / "bench"
    paths = {"json": out / "serve.json", "md": out / "serve.md", "latency_cdf_png": out / "serve_latency_cdf.png",
             "throughput_png": out / "serve_throughput.png"}
    plot_latency_cdf(runs, paths["latency_cdf_png"], cfg.sla_ttft_ms, cfg.sla_tpot_ms)
    plot_throughput(runs, paths["throughput_png"])
    atomic_write_text(paths["md"], render_markdown(report) + capacity_markdown(report.get("capacity")))
    atomic_write_json(paths["json"], report)  # last: its presence means the set is complete
    return paths
