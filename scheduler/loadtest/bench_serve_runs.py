"""One open-loop run of ``smartexit bench serve``'s schedule: warm-up requests one at a time, then the
schedule at its arrival times (:func:`warm_then_run`, whatever the sender), and such a run against a server
over HTTP (:func:`http_run`, its sender from :func:`served_sender`)."""
from __future__ import annotations

from typing import Any

from edge.core.errors import SmartExitError
from scheduler.control.outcomes import RequestResult
from scheduler.loadtest.bench_serve_config import BenchServeConfig
from scheduler.loadtest.loadgen import ScheduledRequest, run_open_loop
from scheduler.loadtest.senders import HttpSender


async def warm_then_run(send: Any, schedule: list[ScheduledRequest], warmup: int, where: str) -> list[RequestResult]:
    """Warm-up requests one at a time (unmeasured), then the open-loop run. An idle system that fails
    a warm-up request is misconfigured (unreachable, wrong model or key): stop rather than record a run
    of errors."""
    for i, req in enumerate(schedule[:warmup]):
        r = await send(ScheduledRequest(0.0, req.prompt_ids, req.max_tokens, f"warmup-{i}"))
        if not r.ok:
            raise SmartExitError(f"bench serve: warm-up request to {where} failed ({r.error_kind}): {r.error}")
    return await run_open_loop(schedule, send)


async def served_sender(url: str, cfg: BenchServeConfig, mode: str | None = None) -> HttpSender:
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
    send = await served_sender(url, cfg)
    try:
        return await warm_then_run(send, schedule, cfg.warmup_requests, url)
    finally:
        await send.__aexit__(None, None, None)
