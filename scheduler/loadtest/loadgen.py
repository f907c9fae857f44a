"""Load generation for ``smartexit bench serve``: a request schedule and the drivers (the senders
that talk to a server or an engine are in :mod:`scheduler.loadtest.senders`).

Schedule (:func:`build_schedule`): a :class:`~scheduler.control.workload.Workload` (the Azure code trace or
synthetic arrivals) becomes requests with real prompt token ids and output lengths that fit the model:

* **outputs** keep the trace's ``GeneratedTokens``, clipped to ``max_output``: code-completion outputs
  are already short (Azure code trace: median 13 tokens, 8% above 64), and shrinking them further
  would leave most requests with one token and no time per output token to measure;
* **prompts** are scaled proportionally so that the ``prompt_percentile``-th percentile of the
  workload's ``ContextTokens`` maps to the prompt budget ``context_window - max_output``, rounded,
  and clipped to ``[1, budget]`` (Azure code trace, 512-token model, 64 output tokens: the p99, 7,436
  tokens, maps to 448, so a median 1,469-token context becomes 88 tokens). The scale is computed on
  the whole workload, before the time window is cut, so a window does not change it. Every request
  then has ``prompt + max_tokens <= context_window``;
* **arrivals**: trace time ``t`` becomes ``(t - start_s) * time_scale`` seconds after the run starts
  (``time_scale`` 0.5 offers the window's requests twice as fast); requests scheduled before
  ``duration_s`` and at most ``max_requests`` of them are kept;
* **prompt ids** are windows of held-out token streams (``prompts_pool``, e.g. the test split
  tokenized): a stream long enough and an offset within it, both drawn from ``seed``.

Driver (:func:`run_open_loop`): each request is sent at its arrival time whether or not earlier ones
have finished (an open system; Schroeder et al., "Open versus closed: a cautionary tale", NSDI 2006),
so a server that falls behind faces a growing queue instead of a client that politely waits.

:func:`run_closed_loop`: a fixed number of clients, each sending its next request when its last one
finished (the capacity at that concurrency).
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Sequence

import numpy as np

from edge.core.errors import ConfigError
from scheduler.control.outcomes import RequestResult
from scheduler.control.workload import Workload

@dataclass(frozen=True)
class ScheduledRequest:
    arrival_s: float          # seconds after the run starts
    prompt_ids: list[int]
    max_tokens: int
    request_id: str = ""


# --------------------------------------------------------------------------- schedule (pure)

def map_lengths(prompt_tokens: np.ndarray, output_tokens: np.ndarray, context_window: int, max_output: int,
                prompt_percentile: float = 99.0) -> tuple[np.ndarray, np.ndarray]:
    """Trace lengths -> lengths that fit the model (module docstring): ``([N] prompts, [N] outputs)``.

    Raises:
        ConfigError: ``max_output < 1``, no room for a prompt, or a percentile outside (0, 100].
    """
    if max_output < 1 or context_window < max_output + 1:
        raise ConfigError(f"bench serve: need max_output >= 1 and context_window > max_output, got "
                          f"context_window={context_window}, max_output={max_output}")
    if not 0 < prompt_percentile <= 100:
        raise ConfigError(f"bench serve: prompt_percentile must be in (0, 100], got {prompt_percentile}")
    budget = context_window - max_output
    ref = float(np.percentile(prompt_tokens, prompt_percentile))
    prompts = np.clip(np.rint(np.asarray(prompt_tokens, np.float64) * (budget / ref)), 1, budget).astype(np.int64)
    outputs = np.clip(np.asarray(output_tokens, np.int64), 1, max_output)
    return prompts, outputs


def window(arrival_s: np.ndarray, time_scale: float, start_s: float = 0.0, duration_s: float | None = None,
           max_requests: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Indices of the requests in the run and their scaled arrival times ``(t - start_s) * time_scale``."""
    if time_scale <= 0:
        raise ConfigError(f"bench serve: time_scale must be > 0, got {time_scale}")
    t = (np.asarray(arrival_s, np.float64) - start_s) * time_scale
    keep = t >= 0
    if duration_s is not None:
        keep &= t < duration_s
    idx = np.flatnonzero(keep)
    if max_requests is not None:
        idx = idx[:max_requests]
    return idx, t[idx]


def cut_prompts(pool: Sequence[Sequence[int]], lengths: np.ndarray, seed: int) -> list[list[int]]:
    """One window of ``lengths[i]`` tokens per request: a stream at least that long and an offset in it,
    both uniform and drawn from ``seed``.

    Raises:
        ConfigError: no stream of the pool is long enough for some request.
    """
    sizes = np.array([len(s) for s in pool], dtype=np.int64)
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        ok = np.flatnonzero(sizes >= n)
        if ok.size == 0:
            raise ConfigError(f"bench serve: no held-out stream has {int(n)} tokens "
                              f"(the longest has {int(sizes.max(initial=0))}); lower context_window")
        d = int(ok[rng.integers(0, ok.size)])
        o = int(rng.integers(0, sizes[d] - n + 1))
        out.append([int(x) for x in pool[d][o:o + int(n)]])
    return out


def requests_of(workload: Workload, pool: Sequence[Sequence[int]], seed: int, prefix: str = "r") -> list[ScheduledRequest]:
    """The workload's requests as they are (arrivals, prompt and output lengths), prompts cut from
    ``pool`` (:func:`cut_prompts`).

    Raises:
        ConfigError: as :func:`cut_prompts`.
    """
    prompts = cut_prompts(pool, workload.prompt_tokens, seed)
    return [ScheduledRequest(float(a), p, int(o), f"{prefix}{i:05d}")
            for i, (a, p, o) in enumerate(zip(workload.arrival_s, prompts, workload.output_tokens))]


def build_schedule(workload: Workload, prompts_pool: Sequence[Sequence[int]], context_window: int, max_output: int,
                   time_scale: float, seed: int, *, start_s: float = 0.0, duration_s: float | None = None,
                   max_requests: int | None = None, prompt_percentile: float = 99.0) -> list[ScheduledRequest]:
    """The requests of one run, in arrival order (mapping in the module docstring).

    Raises:
        ConfigError: bad lengths or scale, an empty window, or a pool without long enough streams.
    """
    prompts, outputs = map_lengths(workload.prompt_tokens, workload.output_tokens, context_window, max_output,
                                   prompt_percentile)
    idx, arrivals = window(workload.arrival_s, time_scale, start_s, duration_s, max_requests)
    if idx.size == 0:
        raise ConfigError(f"bench serve: no request of {workload.source} arrives in the window "
                          f"(start_s={start_s}, duration_s={duration_s}, time_scale={time_scale})")
    ids = cut_prompts(prompts_pool, prompts[idx], seed)
    return [ScheduledRequest(float(a), p, int(o), f"r{i:05d}")
            for i, (a, p, o) in enumerate(zip(arrivals, ids, outputs[idx]))]


# --------------------------------------------------------------------------- open-loop driver

Send = Callable[[ScheduledRequest], Awaitable[RequestResult]]


async def run_open_loop(schedule: Sequence[ScheduledRequest], send: Send,
                        clock: Callable[[], float] = time.perf_counter) -> list[RequestResult]:
    """Send each request at its arrival time, never waiting for earlier ones; results in schedule order.

    ``send`` stamps its result with ``clock()`` times (``time.perf_counter`` by default); they come back
    as seconds after the run started. A send that raises is recorded as a ``client`` error.
    """
    t0 = clock()
    tasks = []
    for req in schedule:
        delay = t0 + req.arrival_s - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(_guarded(send, req, clock)))
    results = list(await asyncio.gather(*tasks))
    for r in results:
        r._shift(t0)
    return results


async def run_closed_loop(requests: Sequence[ScheduledRequest], send: Send, concurrency: int,
                          clock: Callable[[], float] = time.perf_counter) -> list[RequestResult]:
    """``concurrency`` clients, each sending its next request as soon as its last one finished (the
    capacity at that concurrency, not latency under an arrival process); results in request order,
    ``arrival_s`` set to when each was sent."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    t0 = clock()
    queue = list(enumerate(requests))[::-1]
    results: list[RequestResult | None] = [None] * len(requests)

    async def client() -> None:
        while queue:
            i, req = queue.pop()
            sent = ScheduledRequest(clock() - t0, req.prompt_ids, req.max_tokens, req.request_id)
            results[i] = await _guarded(send, sent, clock)

    await asyncio.gather(*(client() for _ in range(concurrency)))
    for r in results:
        r._shift(t0)
    return results  # type: ignore[return-value]


async def _guarded(send: Send, req: ScheduledRequest, clock: Callable[[], float]) -> RequestResult:
    fired = clock()
    try:
        return await send(req)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # one request's failure is a result, not the end of the run
        r = _result(req)
        r.t_submit, r.t_end = fired, clock()
        r.error_kind, r.error = "client", f"{type(exc).__name__}: {exc}"
        return r


def _result(req: ScheduledRequest) -> RequestResult:
    return RequestResult(req.request_id, req.arrival_s, len(req.prompt_ids), req.max_tokens)
