"""``smartexit bench serve``'s price of serving: the closed-loop requests cut from the schedule, their runs
on every system at once (:func:`scheduler.loadtest.capacity.interleaved`) and ``serve.json``'s ``capacity``
section made of them (:func:`scheduler.loadtest.capacity.capacity_report`)."""
from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

from scheduler.loadtest.bench_serve_config import BenchServeConfig
from scheduler.loadtest.bench_serve_inputs import bundle_dir, stop_ids
from scheduler.loadtest.bench_serve_runs import served_sender
from scheduler.loadtest.capacity import INPROCESS as INPROCESS_SYSTEM
from scheduler.loadtest.capacity import SERVED as SERVED_SYSTEM
from scheduler.loadtest.capacity import TRITON as TRITON_SYSTEM
from scheduler.loadtest.capacity import TRITON_CORE as CORE_SYSTEM
from scheduler.loadtest.capacity import Run, capacity_report, interleaved, tokens_ratio
from scheduler.loadtest.hop_stamps import ENGINE, breakdown, read_stamps
from scheduler.loadtest.loadgen import ScheduledRequest
from scheduler.loadtest.senders import InProcessSender, TritonSender

EXACT_SYSTEM = "served_exact"  # the capacity runs' name for the stack in mode exact


def capacity_requests(cfg: BenchServeConfig, schedule: list[ScheduledRequest]) -> list[ScheduledRequest]:
    """The closed-loop requests: the schedule's prompts cut (or repeated) to ``capacity_prompt_tokens``,
    ``capacity_max_tokens`` each."""
    out = []
    for i in range(cfg.capacity_requests):
        ids = schedule[i % len(schedule)].prompt_ids
        ids = (ids * (cfg.capacity_prompt_tokens // len(ids) + 1))[:cfg.capacity_prompt_tokens]
        out.append(ScheduledRequest(0.0, ids, cfg.capacity_max_tokens, f"cap-{i}"))
    return out


def capacity_runs(cfg: BenchServeConfig, reqs: list[ScheduledRequest], url: str) -> dict[str, dict[int, list[Run]]]:
    """The closed-loop requests on every system at once, interleaved (:func:`scheduler.loadtest.capacity.interleaved`):
    the engine in this process (``inprocess``), a tritonserver of its own on the run's repository over
    gRPC (``triton_direct``, with ``hops`` and a stack of our own), Triton's core in this process on that
    repository (``triton_core``, with ``core_hop`` as well: the same model without gRPC), the stack at ``url``
    (``served``) and, with ``capacity_exact``, the stack in mode exact (``served_exact``)."""
    from scheduler.serving.bundle import open_bundle
    from scheduler.serving.stack import repository
    from scheduler.serving.triton_core import TritonCore, TritonCoreClient
    from scheduler.serving.tritonserver import TritonProcess

    with contextlib.ExitStack() as stack:
        host = None
        if cfg.inprocess:
            host = open_bundle(bundle_dir(cfg), threads=cfg.threads, **cfg.host)
            host.start()
            stack.callback(host.stop)
        tp = stack.enter_context(TritonProcess(repository(cfg.run_dir))) if cfg.hops and cfg.url is None else None
        core = (stack.enter_context(TritonCore(repository(cfg.run_dir), work_dir=tp.work_dir, install=tp.install))
                if tp is not None and cfg.core_hop else None)

        async def run() -> dict[str, dict[int, list[Run]]]:
            senders: dict[str, Any] = {}
            if host is not None:
                senders[INPROCESS_SYSTEM] = InProcessSender(host, cfg.mode, cfg.sla_ttft_ms, cfg.sla_tpot_ms,
                                                            cfg.request_timeout_s, stop_ids(cfg))
            if tp is not None:
                senders[TRITON_SYSTEM] = TritonSender(tp.grpc_url, cfg.mode, cfg.sla_ttft_ms, cfg.sla_tpot_ms,
                                                      stop_ids(cfg))
            if core is not None:
                senders[CORE_SYSTEM] = TritonSender(TritonCoreClient(core), cfg.mode, cfg.sla_ttft_ms, cfg.sla_tpot_ms,
                                                    stop_ids(cfg))
            senders[SERVED_SYSTEM] = await served_sender(url, cfg)
            if cfg.capacity_exact and cfg.mode != "exact":
                senders[EXACT_SYSTEM] = await served_sender(url, cfg, "exact")
            try:
                return await interleaved(senders, reqs, cfg.capacity_concurrency, cfg.capacity_repeats,
                                         cfg.warmup_requests)
            finally:
                for name, send in senders.items():
                    if name in (TRITON_SYSTEM, CORE_SYSTEM):
                        await send.close()
                    elif name in (SERVED_SYSTEM, EXACT_SYSTEM):
                        await send.__aexit__(None, None, None)
        return asyncio.run(run())


def tokens_path(cfg: BenchServeConfig) -> str:
    """How the bench's own stack brings the tokens to its ingress (the report's "tokens ..."): from Triton's core in
    the ingress replica (``serve.triton_host: ingress``), else the worker's tritonserver's ``stream_via``."""
    from scheduler.serving.config import ServeConfig

    if cfg.url is not None:
        return "as the server is configured"
    host = ServeConfig(triton_host=cfg.serve.get("triton_host"), triton_url=cfg.serve.get("triton_url"),
                       replicas=cfg.serve.get("replicas", 1))
    if host.engine_in_ingress:
        return "from Triton's core in the ingress replica"
    return cfg.serve.get("stream_via", ServeConfig.stream_via)


def stamps_dir(cfg: BenchServeConfig) -> Path:
    """Where the bench's own stack stamps its requests (scheduler/serving/stamps.py)."""
    return Path(cfg.run_dir) / "bench" / "stamps"


def capacity_section(cfg: BenchServeConfig, cap: dict[str, dict[int, list[Run]]]) -> dict[str, Any]:
    """``serve.json``'s ``capacity``: :func:`scheduler.loadtest.capacity.capacity_report` of the runs, with
    the requests' shape and, with mode exact, the exact / bounded tokens/s ratio at the lowest concurrency
    (``headline["exact_vs_bounded_tokens_ratio"]``, its spread beside the others); ``ttft_hops``: where the served
    requests' first tokens spent their time at the lowest concurrency, from the stack's stamps
    (:func:`scheduler.loadtest.hop_stamps.breakdown`; None without them)."""
    from scheduler.serving.config import ServeConfig

    own = cfg.url is None
    via = tokens_path(cfg)
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
    folder = stamps_dir(cfg)
    if SERVED_SYSTEM in cap and cap[SERVED_SYSTEM] and min(cap[SERVED_SYSTEM]) == 1 and folder.is_dir():
        spans = [run.span for run in cap[SERVED_SYSTEM][1] if run.span is not None]
        hops = rep["ttft_hops"] = breakdown(read_stamps(folder), spans)
        if hops is not None:  # the report's line: what the stack's hops took, and the engine's share, served
            engine = next(h for h in hops["hops"] if (h["from"], h["to"]) == ENGINE)
            rep["headline"]["ttft_serving_hops_ms"] = hops["serving_hops"]["median_ms"]
            rep["headline"]["ttft_engine_served_ms"] = engine["median_ms"]
            rep["headline"]["inprocess_ttft_p50_c1_ms"] = (rep["levels"]["1"].get(INPROCESS_SYSTEM) or {}).get(
                "ttft_p50_ms")
    return rep
