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
from scheduler.loadtest.loadgen import ScheduledRequest, build_schedule, run_closed_loop, run_open_loop
from scheduler.control.outcomes import RequestResult
from scheduler.loadtest.senders import HttpSender, InProcessSender
from scheduler.control.workload import SHARED_TRACE, Arrivals, Workload, load_workload, synthetic

STAGE = "bench_serve"
INPROCESS = "in-process"
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
    # first policy's stack and in process; tokens/s ratio at the highest, TTFT overhead at the lowest
    capacity_concurrency: list[int] = field(default_factory=lambda: [1, 8])
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
        from edge.runtime.engine import Mode

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
                or self.capacity_prompt_tokens < 1 or self.capacity_max_tokens < 1:
            raise ConfigError("bench serve: capacity_concurrency values, capacity_requests, capacity_prompt_tokens "
                              "and capacity_max_tokens must be >= 1")
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


async def _capacity(send: Any, cfg: BenchServeConfig, reqs: list[ScheduledRequest]) -> dict[int, list[RequestResult]]:
    return {c: await run_closed_loop([ScheduledRequest(0.0, r.prompt_ids, r.max_tokens, f"{r.request_id}-c{c}")
                                      for r in reqs], send, c) for c in cfg.capacity_concurrency}


async def http_run(url: str, schedule: list[ScheduledRequest], cfg: BenchServeConfig,
                capacity: list[ScheduledRequest] | None = None) -> tuple[list[RequestResult], dict]:
    async with HttpSender(url, cfg.model or "", cfg.mode, cfg.sla_ttft_ms, cfg.sla_tpot_ms, cfg.api_key,
                          cfg.request_timeout_s) as send:
        if cfg.model is None:
            models = await send.models()
            if not models:
                raise SmartExitError(f"bench serve: {url}/v1/models lists no model")
            send.model = models[0]
        results = await _warm_then_run(send, schedule, cfg.warmup_requests, url)
        cap = await _capacity(send, cfg, capacity) if capacity else {}
        if capacity and cfg.capacity_exact and send.mode != "exact":
            mode, send.mode = send.mode, "exact"
            try:
                cap["exact"] = await _capacity(send, cfg, capacity)
            finally:
                send.mode = mode
        return results, cap


def served_runs(cfg: BenchServeConfig, schedule: list[ScheduledRequest],
                capacity: list[ScheduledRequest] | None = None) -> tuple[dict[str, list[RequestResult]], dict, dict]:
    """(label -> results: ``served`` against ``url``, else one run per policy on a stack started for
    it; concurrency -> closed-loop results on the first of them; the dashboard screenshot's record)."""
    if cfg.url is not None:
        res, cap = asyncio.run(http_run(cfg.url, schedule, cfg, capacity))
        shot = _screenshot(cfg.url, Path(cfg.run_dir) / "bench" / "dashboard.png", cfg.api_key) if cfg.screenshot else {}
        return {"served": res}, cap, shot
    from edge.core.configio import apply
    from scheduler.serving.config import ServeConfig
    from scheduler.serving.stack import serving_stack

    runs, cap, shot = {}, {}, {}
    # the dashboard draws the SLA every request of this run carries
    sla = {"default_sla_ttft_ms": cfg.sla_ttft_ms, "default_sla_tpot_ms": cfg.sla_tpot_ms}
    for k, policy in enumerate(cfg.policies):
        bundle = {"bundle_dir": cfg.bundle} if cfg.bundle is not None else {}  # else the stack's own
        serve_cfg = apply(ServeConfig(), {**bundle, **sla, **cfg.serve, "policy": policy})
        with serving_stack(cfg.run_dir, serve_cfg, graceful=False) as url:
            runs[policy], c = asyncio.run(http_run(url, schedule, cfg, capacity if k == 0 else None))
            cap = cap or c
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


def inprocess_run(cfg: BenchServeConfig, schedule: list[ScheduledRequest],
                  capacity: list[ScheduledRequest] | None = None) -> tuple[list[RequestResult], dict]:
    """The same schedule (and closed-loop requests) on an EngineHost in this process, opened as the
    served model opens it."""
    from scheduler.serving.bundle import open_bundle

    host = open_bundle(bundle_dir(cfg), threads=cfg.threads, **cfg.host)
    host.start()
    try:
        send = InProcessSender(host, cfg.mode, cfg.sla_ttft_ms, cfg.sla_tpot_ms, cfg.request_timeout_s, stop_ids(cfg))

        async def both():
            res = await _warm_then_run(send, schedule, cfg.warmup_requests, "the in-process host")
            return res, (await _capacity(send, cfg, capacity) if capacity else {})
        return asyncio.run(both())
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


def triton_direct_run(cfg: BenchServeConfig, reqs: list[ScheduledRequest]) -> dict[int, list[RequestResult]]:
    """The closed-loop requests over gRPC to a tritonserver of its own on the run's repository."""
    from scheduler.serving.tritonserver import TritonProcess
    from scheduler.loadtest.senders import TritonSender
    from scheduler.serving.stack import repository

    with TritonProcess(repository(cfg.run_dir)) as tp:
        async def run():
            send = TritonSender(tp.grpc_url, cfg.mode, cfg.sla_ttft_ms, cfg.sla_tpot_ms, stop_ids(cfg))
            try:
                for i, req in enumerate(reqs[:cfg.warmup_requests]):
                    await send(ScheduledRequest(0.0, req.prompt_ids, req.max_tokens, f"warmup-triton-{i}"))
                return await _capacity(send, cfg, reqs)
            finally:
                await send.close()
        return asyncio.run(run())


def capacity_report(cfg: BenchServeConfig, served: dict[int, list[RequestResult]],
                    local: dict[int, list[RequestResult]],
                    triton: dict[int, list[RequestResult]] | None = None) -> dict[str, Any]:
    """Closed-loop runs side by side: per concurrency, served and in-process tokens/s and TTFT / TPOT
    p50, their ratio and differences. The headline takes the tokens/s ratio at the highest concurrency
    (the stack's capacity cost) and the TTFT p50 overhead at the lowest (its latency cost per request)."""
    levels = {}
    for c in sorted(served):
        s, l = (summarize(x[c], cfg.sla_ttft_ms, cfg.sla_tpot_ms) for x in (served, local))
        keys = ("requests", "errors", "tokens", "tokens_per_s", "ttft_p50_ms", "ttft_p95_ms", "tpot_p50_ms",
                "tpot_p95_ms", "e2e_p50_ms")
        t = summarize(triton[c], cfg.sla_ttft_ms, cfg.sla_tpot_ms) if triton and c in triton else None
        levels[str(c)] = {"served": {k: s[k] for k in keys}, "inprocess": {k: l[k] for k in keys},
                          "triton_direct": {k: t[k] for k in keys} if t else None,
                          **compare(s, l), "same_output_lengths": same_lengths(served[c], local[c]),
                          "tpot_p50_overhead_ms": (s["tpot_p50_ms"] - l["tpot_p50_ms"]
                                                   if s["tpot_p50_ms"] is not None and l["tpot_p50_ms"] is not None
                                                   else None)}
    hi, lo = str(max(served)), str(min(served))
    return {"requests_per_level": cfg.capacity_requests, "prompt_tokens": cfg.capacity_prompt_tokens,
            "max_tokens": cfg.capacity_max_tokens, "policy": cfg.policies[0] if cfg.url is None else "served",
            "mode": cfg.mode,
            "levels": levels,
            "headline": {"served_vs_inprocess_tokens_ratio": levels[hi]["served_vs_inprocess_tokens_ratio"],
                         "served_vs_inprocess_concurrency": int(hi),
                         "ttft_p50_overhead_ms": levels[lo]["ttft_p50_overhead_ms"],
                         "ttft_overhead_concurrency": int(lo),
                         "tpot_p50_overhead_ms": levels[lo]["tpot_p50_overhead_ms"]}}


def exact_report(cfg: BenchServeConfig, exact: dict[int, list[RequestResult]],
                 bounded: dict[int, list[RequestResult]]) -> dict[str, Any]:
    """The closed loop in mode exact through the stack beside the same requests in the bench's mode: per
    concurrency tokens/s, TTFT and TPOT p50, and the tokens/s ratio (headline: at the lowest concurrency)."""
    levels = {}
    for c in sorted(exact):
        e, b = (summarize(x[c], cfg.sla_ttft_ms, cfg.sla_tpot_ms) for x in (exact, bounded))
        levels[str(c)] = {"exact": {k: e[k] for k in ("requests", "errors", "tokens_per_s", "ttft_p50_ms", "tpot_p50_ms")},
                          "tokens_ratio": e["tokens_per_s"] / b["tokens_per_s"] if b["tokens_per_s"] else None}
    return {"levels": levels, "headline": levels[str(min(exact))]["tokens_ratio"]}


def capacity_markdown(cap: dict[str, Any] | None) -> str:
    if not cap:
        return ""
    f = lambda v, spec=".1f": "n/a" if v is None else format(v, spec)  # noqa: E731
    lines = ["", "## The price of serving (closed loop, side by side)", "",
             f"{cap['requests_per_level']} requests per concurrency, {cap['prompt_tokens']} prompt tokens, "
             f"{cap['max_tokens']} new tokens each (greedy, stop at end of text), through the stack (policy "
             f"{cap['policy']}) and on the engine in process.", "",
             "| concurrency | served tokens/s | in-process tokens/s | ratio | TTFT p50 served / in-process ms | "
             "overhead ms | TPOT p50 overhead ms | same lengths |", "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for c, lv in cap["levels"].items():
        s, l = lv["served"], lv["inprocess"]
        lines.append(f"| {c} | {f(s['tokens_per_s'])} | {f(l['tokens_per_s'])} | "
                     f"{f(lv['served_vs_inprocess_tokens_ratio'], '.3f')} | {f(s['ttft_p50_ms'])} / "
                     f"{f(l['ttft_p50_ms'])} | {f(lv['ttft_p50_overhead_ms'])} | {f(lv['tpot_p50_overhead_ms'])} | "
                     f"{f(lv['same_output_lengths'], '.2f')} |")
    if cap.get("exact"):
        lines += ["", f"The same closed loop through the stack in mode exact (lossless speculative decoding) against "
                  f"mode {cap.get('mode', 'bounded')}:", "",
                  "| concurrency | exact tokens/s | ratio to the served row above | TTFT p50 ms | TPOT p50 ms |",
                  "| ---: | ---: | ---: | ---: | ---: |"]
        for c, lv in cap["exact"]["levels"].items():
            e = lv["exact"]
            lines.append(f"| {c} | {f(e['tokens_per_s'])} | {f(lv['tokens_ratio'], '.3f')} | {f(e['ttft_p50_ms'])} | "
                         f"{f(e['tpot_p50_ms'])} |")
    hops = [(c, lv) for c, lv in cap["levels"].items() if lv.get("triton_direct")]
    if hops:
        lines += ["", "Where the time goes: the same requests in process, straight to a tritonserver over gRPC "
                  "(+ the python backend's IPC), and through Ray Serve (+ HTTP, the ingress, the worker).", "",
                  "| concurrency | TTFT p50 ms: in process / Triton / stack | TPOT p50 ms: in process / Triton / "
                  "stack | tokens/s: in process / Triton / stack |", "| ---: | ---: | ---: | ---: |"]
        for c, lv in hops:
            t3 = [lv["inprocess"], lv["triton_direct"], lv["served"]]
            lines.append(f"| {c} | " + " / ".join(f(x["ttft_p50_ms"]) for x in t3) + " | "
                         + " / ".join(f(x["tpot_p50_ms"]) for x in t3) + " | "
                         + " / ".join(f(x["tokens_per_s"]) for x in t3) + " |")
    return "\n".join(lines) + "\n"


def write_outputs(cfg: BenchServeConfig, report: dict[str, Any], runs: dict[str, list[RequestResult]]) -> dict[str, Path]:
    out = Path(cfg.run_dir) / "bench"
    paths = {"json": out / "serve.json", "md": out / "serve.md", "latency_cdf_png": out / "serve_latency_cdf.png",
             "throughput_png": out / "serve_throughput.png"}
    plot_latency_cdf(runs, paths["latency_cdf_png"], cfg.sla_ttft_ms, cfg.sla_tpot_ms)
    plot_throughput(runs, paths["throughput_png"])
    atomic_write_text(paths["md"], render_markdown(report) + capacity_markdown(report.get("capacity")))
    atomic_write_json(paths["json"], report)  # last: its presence means the set is complete
    return paths
