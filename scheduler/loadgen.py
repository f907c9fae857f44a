"""Open-loop load generation for ``smartexit bench serve``: a request schedule, the driver, two senders.

Schedule (:func:`build_schedule`): a :class:`~scheduler.workload.Workload` (the Azure code trace or
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

Senders: :class:`HttpSender` streams ``POST /v1/completions`` from the OpenAI-compatible ingress
(docs/serving.md); :class:`InProcessSender` submits the same requests to an
``edge.runtime.host.EngineHost`` running in this process. Both return :class:`RequestResult`.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Sequence

import numpy as np

from edge.core.errors import ConfigError, SmartExitError
from scheduler.workload import Workload

# finish reasons that end a request normally; the engine's others (cancelled, deadline) are errors
NORMAL_FINISH = ("length", "stop")


@dataclass(frozen=True)
class ScheduledRequest:
    arrival_s: float          # seconds after the run starts
    prompt_ids: list[int]
    max_tokens: int
    request_id: str = ""


@dataclass
class RequestResult:
    """One request as the client saw it. Times are seconds after the run started (the driver's t0)."""
    request_id: str
    arrival_s: float                     # when it was scheduled
    prompt_tokens: int
    max_tokens: int
    t_submit: float | None = None        # when it was sent
    t_first_token: float | None = None   # when the first generated token arrived
    t_end: float | None = None           # when the last response (or the error) arrived
    tokens: int = 0                      # generated tokens (the server's usage count where it sends one)
    token_times: list[float] = field(default_factory=list)  # arrival time of each token received
    exit_layers: list[int] = field(default_factory=list)    # the layer each token left at, where reported
    finish_reason: str | None = None
    http_status: int | None = None       # None in process
    error_kind: str | None = None        # None = success; e.g. http_429, http_503, overloaded, timeout
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error_kind is None and self.t_end is not None

    @property
    def ttft_s(self) -> float | None:
        if self.t_first_token is None or self.t_submit is None:
            return None
        return self.t_first_token - self.t_submit

    @property
    def e2e_s(self) -> float | None:
        if self.t_end is None or self.t_submit is None:
            return None
        return self.t_end - self.t_submit

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first: (e2e - ttft) / (n - 1); None for n <= 1."""
        if not self.ok or self.tokens <= 1 or self.ttft_s is None:
            return None
        return (self.e2e_s - self.ttft_s) / (self.tokens - 1)

    def sla_met(self, ttft_ms: float, tpot_ms: float) -> bool:
        """Succeeded, first token within ``ttft_ms``, and (n > 1) mean later-token time within ``tpot_ms``."""
        if not self.ok or self.ttft_s is None or self.ttft_s * 1e3 > ttft_ms:
            return False
        return self.tpot_s is None or self.tpot_s * 1e3 <= tpot_ms

    def _shift(self, t0: float) -> None:
        for name in ("t_submit", "t_first_token", "t_end"):
            v = getattr(self, name)
            if v is not None:
                setattr(self, name, v - t0)
        self.token_times = [t - t0 for t in self.token_times]


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


# --------------------------------------------------------------------------- server-sent events (pure)

@dataclass(frozen=True)
class SSEEvent:
    event: str   # "message" unless the server names it
    data: str


class SSEDecoder:
    """Bytes in, events out (the WHATWG server-sent events format: ``field: value`` lines, blank line ends
    an event, ``:`` starts a comment). Chunks may split lines and events anywhere."""

    def __init__(self) -> None:
        self._buf = b""
        self._data: list[str] = []
        self._event = ""

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        self._buf += chunk
        out = []
        *lines, self._buf = self._buf.split(b"\n")
        for raw in lines:
            line = raw.rstrip(b"\r").decode("utf-8", errors="replace")
            if not line:
                if self._data:
                    out.append(SSEEvent(self._event or "message", "\n".join(self._data)))
                self._data, self._event = [], ""
                continue
            if line.startswith(":"):
                continue
            name, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if name == "data":
                self._data.append(value)
            elif name == "event":
                self._event = value
        return out


@dataclass
class StreamDelta:
    """What one completion chunk says."""
    done: bool = False                      # the ``[DONE]`` sentinel
    tokens: int = 0                         # tokens the chunk carries
    exit_layers: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int | None = None    # from the usage chunk
    error: str | None = None
    error_code: str | None = None


def parse_chunk(data: str) -> StreamDelta:
    """One SSE ``data`` payload of ``/v1/completions`` streaming -> :class:`StreamDelta`.

    A choice's token count is the length of its ``exit_layers`` (SmartExit's extension: one layer per
    token), else 1 when it carries text. The finish reason is the engine's own where the server adds it
    (``smartexit_finish_reason``: ``deadline`` and ``cancelled`` travel as OpenAI's ``length``). An
    ``{"error": ...}`` object or a malformed payload is an error.
    """
    if data.strip() == "[DONE]":
        return StreamDelta(done=True)
    try:
        obj = json.loads(data)
    except json.JSONDecodeError as exc:
        return StreamDelta(error=f"malformed stream chunk ({exc}): {data[:200]!r}")
    if not isinstance(obj, dict):
        return StreamDelta(error=f"stream chunk is not an object: {data[:200]!r}")
    if "error" in obj:
        err = obj["error"]
        code = err.get("code") if isinstance(err, dict) else None
        return StreamDelta(error=_error_text(err), error_code=None if code is None else str(code))
    d = StreamDelta()
    for choice in obj.get("choices") or []:
        layers = [int(x) for x in choice.get("exit_layers") or []]
        d.exit_layers.extend(layers)
        d.tokens += len(layers) if layers else int(bool(choice.get("text")))
        reason = choice.get("smartexit_finish_reason") or choice.get("finish_reason")
        if reason:
            d.finish_reason = str(reason)
    usage = obj.get("usage")
    if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
        d.completion_tokens = int(usage["completion_tokens"])
    return d


def _error_text(err: Any) -> str:
    if isinstance(err, dict):
        msg = err.get("message") or json.dumps(err)
        code = err.get("code") or err.get("type")
        return f"{code}: {msg}" if code else str(msg)
    return str(err)


def error_from_body(status: int, body: bytes) -> tuple[str, str]:
    """A non-200 response -> ``(kind, message)``; kind is ``http_<status>`` (429 / 503: overloaded)."""
    text = body.decode("utf-8", errors="replace")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return f"http_{status}", text[:500] or f"HTTP {status}"
    if isinstance(obj, dict) and "error" in obj:
        return f"http_{status}", _error_text(obj["error"])
    if isinstance(obj, dict) and "detail" in obj:  # FastAPI's default error body
        return f"http_{status}", str(obj["detail"])[:500]
    return f"http_{status}", text[:500]


class StreamReader:
    """Folds a streamed response into a :class:`RequestResult`: ``feed(now, bytes)`` as bytes arrive,
    ``close(now)`` when the body ends."""

    def __init__(self, result: RequestResult) -> None:
        self.result = result
        self._sse = SSEDecoder()
        self._counted = 0
        self._usage: int | None = None
        self.done = False

    def feed(self, now: float, chunk: bytes) -> bool:
        """Returns True once the stream has ended (``[DONE]`` or an error event)."""
        r = self.result
        for ev in self._sse.feed(chunk):
            d = parse_chunk(ev.data)
            if d.error is None and ev.event == "error":
                d.error = ev.data[:500]
            if d.error is not None:
                kind = f"stream_{d.error_code}" if d.error_code else "stream_error"
                r.error_kind, r.error, r.t_end, self.done = kind, d.error, now, True
                return True
            if d.tokens and r.t_first_token is None:
                r.t_first_token = now
            self._counted += d.tokens
            r.token_times.extend([now] * d.tokens)
            r.exit_layers.extend(d.exit_layers)
            r.finish_reason = d.finish_reason or r.finish_reason
            self._usage = d.completion_tokens if d.completion_tokens is not None else self._usage
            if d.done:
                self.done = True
                return True
        return False

    def close(self, now: float) -> RequestResult:
        r = self.result
        if r.t_end is None:
            r.t_end = now
        r.tokens = self._usage if self._usage is not None else self._counted
        if r.error_kind is None:
            if not self.done and r.finish_reason is None:
                r.error_kind, r.error = "stream_truncated", "the stream ended without [DONE] or a finish_reason"
            elif r.finish_reason is not None and r.finish_reason not in NORMAL_FINISH:
                r.error_kind, r.error = r.finish_reason, f"finish_reason {r.finish_reason}"
        return r


# --------------------------------------------------------------------------- senders

def completion_body(req: ScheduledRequest, model: str, mode: str, sla_ttft_ms: float | None,
                    sla_tpot_ms: float | None) -> dict[str, Any]:
    """The JSON body of one streamed ``POST /v1/completions`` (prompt as token ids, greedy)."""
    body: dict[str, Any] = {"model": model, "prompt": list(req.prompt_ids), "max_tokens": req.max_tokens,
                            "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
                            "mode": mode}
    if sla_ttft_ms is not None or sla_tpot_ms is not None:
        body["sla"] = {k: v for k, v in (("ttft_ms", sla_ttft_ms), ("tpot_ms", sla_tpot_ms)) if v is not None}
    return body


class HttpSender:
    """``send`` for the OpenAI-compatible server. Use as ``async with HttpSender(...) as send``.

    The connection pool is unlimited (aiohttp's default of 100 would turn a backlog of more than 100
    requests into a closed loop).
    """

    def __init__(self, base_url: str, model: str, mode: str = "bounded",
                 sla_ttft_ms: float | None = None, sla_tpot_ms: float | None = None, api_key: str | None = None,
                 timeout_s: float = 300.0) -> None:
        self.url = base_url.rstrip("/") + "/v1/completions"
        self.model, self.mode, self.sla = model, mode, (sla_ttft_ms, sla_tpot_ms)
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout_s = timeout_s
        self._session = None

    async def __aenter__(self) -> "HttpSender":
        import aiohttp

        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                              timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._session.close()

    async def models(self) -> list[str]:
        """The ids ``GET /v1/models`` lists.

        Raises:
            SmartExitError: the server is unreachable or answers with an error.
        """
        import aiohttp

        url = self.url.removesuffix("/completions") + "/models"
        try:
            async with self._session.get(url, headers=self.headers) as resp:
                body = await resp.read()
                if resp.status != 200:
                    raise SmartExitError(f"GET {url}: {' '.join(error_from_body(resp.status, body))}")
                return [m["id"] for m in json.loads(body)["data"]]
        except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise SmartExitError(f"GET {url}: {type(exc).__name__}: {exc}") from exc

    async def __call__(self, req: ScheduledRequest) -> RequestResult:
        import aiohttp

        r = _result(req)
        body = completion_body(req, self.model, self.mode, *self.sla)
        r.t_submit = time.perf_counter()
        try:
            async with self._session.post(self.url, json=body, headers=self.headers) as resp:
                r.http_status = resp.status
                if resp.status != 200:
                    r.error_kind, r.error = error_from_body(resp.status, await resp.read())
                    r.t_end = time.perf_counter()
                    return r
                reader = StreamReader(r)
                async for chunk in resp.content.iter_any():
                    if reader.feed(time.perf_counter(), chunk):
                        break
                return reader.close(time.perf_counter())
        except asyncio.TimeoutError:
            r.error_kind, r.error = "timeout", f"no complete response within {self.timeout_s} s"
        except aiohttp.ClientError as exc:
            r.error_kind, r.error = "connection", f"{type(exc).__name__}: {exc}"
        r.t_end = time.perf_counter()
        return r


class InProcessSender:
    """``send`` for an ``edge.runtime.host.EngineHost`` running in this process (started by the caller).

    The host calls ``emit`` from its engine thread; each chunk is stamped there (the engine's own
    latency, without this event loop's delay) and handed to the loop with ``call_soon_threadsafe``.
    """

    def __init__(self, host: Any, mode: str = "bounded", sla_ttft_ms: float | None = None,
                 sla_tpot_ms: float | None = None, timeout_s: float = 300.0, stop_ids: Sequence[int] = ()) -> None:
        """``stop_ids``: tokens that end a request (the server adds the tokenizer's end-of-text)."""
        self.host, self.mode, self.sla, self.timeout_s = host, mode, (sla_ttft_ms, sla_tpot_ms), timeout_s
        self.stop_ids = tuple(stop_ids)

    async def __call__(self, req: ScheduledRequest) -> RequestResult:
        from edge.runtime.host import GenRequest, HostError

        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def emit(chunk: Any) -> None:  # engine thread
            loop.call_soon_threadsafe(queue.put_nowait, (time.perf_counter(), chunk))

        r = _result(req)
        gen = GenRequest(request_id=req.request_id, prompt=list(req.prompt_ids), max_tokens=req.max_tokens,
                         temperature=0.0, stop_ids=self.stop_ids, mode=self.mode, sla_ttft_ms=self.sla[0],
                         sla_tpot_ms=self.sla[1])
        r.t_submit = time.perf_counter()
        try:
            self.host.submit(gen, emit)
        except HostError as exc:
            r.error_kind, r.error, r.t_end = str(exc.code), str(exc.message), time.perf_counter()
            return r
        deadline = r.t_submit + self.timeout_s
        while True:
            try:
                now, chunk = await asyncio.wait_for(queue.get(), max(0.0, deadline - time.perf_counter()))
            except asyncio.TimeoutError:
                self.host.cancel(req.request_id)
                r.error_kind, r.error = "timeout", f"no complete response within {self.timeout_s} s"
                r.t_end = time.perf_counter()
                return r
            if chunk.tokens and r.t_first_token is None:
                r.t_first_token = now
            r.tokens += len(chunk.tokens)
            r.token_times.extend([now] * len(chunk.tokens))
            r.exit_layers.extend(int(x) for x in chunk.exit_layers)
            if chunk.finish_reason is not None:
                r.finish_reason, r.t_end = chunk.finish_reason, now
                if chunk.finish_reason not in NORMAL_FINISH:
                    r.error_kind, r.error = chunk.finish_reason, f"finish_reason {chunk.finish_reason}"
                return r


class TritonSender:
    """``send`` straight to a tritonserver's ``smartexit`` model over gRPC (no Ray Serve): the middle
    point of the hop profile (in process -> + Triton -> + Ray Serve and HTTP)."""

    def __init__(self, url: str, mode: str = "bounded", sla_ttft_ms: float | None = None,
                 sla_tpot_ms: float | None = None, stop_ids: Sequence[int] = ()) -> None:
        from scheduler.serve.triton_client import TritonClient

        self.client = TritonClient(url)
        self.mode, self.sla, self.stop_ids = mode, (sla_ttft_ms, sla_tpot_ms), tuple(stop_ids)

    async def __call__(self, req: ScheduledRequest) -> RequestResult:
        from scheduler.serve.triton_client import TritonError

        r = _result(req)
        r.t_submit = time.perf_counter()
        try:
            async for chunk in self.client.generate(req.request_id, list(req.prompt_ids), req.max_tokens,
                                                    stop_ids=self.stop_ids, mode=self.mode,
                                                    sla_ttft_ms=self.sla[0], sla_tpot_ms=self.sla[1]):
                now = time.perf_counter()
                if chunk.token_ids and r.t_first_token is None:
                    r.t_first_token = now
                r.tokens += len(chunk.token_ids)
                r.token_times.extend([now] * len(chunk.token_ids))
                r.exit_layers.extend(int(x) for x in chunk.exit_layers)
                if chunk.finish_reason:
                    r.finish_reason = chunk.finish_reason
        except TritonError as exc:
            r.error_kind, r.error = type(exc).__name__, str(exc)
        r.t_end = time.perf_counter()
        if r.finish_reason is None and r.error_kind is None:
            r.error_kind, r.error = "unfinished", "the stream ended without a finish reason"
        return r

    async def close(self) -> None:
        await self.client.close()
