"""Senders for the load drivers (:mod:`scheduler.loadtest.loadgen`): each turns a
:class:`~scheduler.loadtest.loadgen.ScheduledRequest` into a :class:`~scheduler.loadtest.loadgen.RequestResult`.

:class:`HttpSender` streams ``POST /v1/completions`` from the OpenAI-compatible ingress
(docs/serving.md), reading server-sent events; :class:`InProcessSender` submits the same requests to
an ``edge.runtime.host.EngineHost`` running in this process; :class:`TritonSender` goes straight to
a tritonserver's ``smartexit`` model over gRPC.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from edge.core.errors import SmartExitError
from scheduler.loadtest.loadgen import ScheduledRequest, _result
from scheduler.control.outcomes import NORMAL_FINISH, RequestResult
from scheduler.serving.stamps import stamp


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
        stamp("client_send", req.request_id)
        try:
            async with self._session.post(self.url, json=body, headers=self.headers) as resp:
                r.http_status = resp.status
                if resp.status != 200:
                    r.error_kind, r.error = error_from_body(resp.status, await resp.read())
                    r.t_end = time.perf_counter()
                    return r
                reader = StreamReader(r)
                async for chunk in resp.content.iter_any():
                    first = r.t_first_token is None
                    if reader.feed(time.perf_counter(), chunk):
                        break
                    if first and r.t_first_token is not None:
                        stamp("client_first", req.request_id)
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
        from edge.runtime.host_types import GenRequest, HostError

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
    """``send`` straight to a tritonserver's ``smartexit`` model over gRPC (no Ray Serve), or to any client of
    that interface (``TritonCoreClient``: Triton's core in this process, no gRPC): the middle points of the
    hop profile (in process -> + Triton's core -> + gRPC -> + Ray Serve and HTTP)."""

    def __init__(self, url: "str | Any", mode: str = "bounded", sla_ttft_ms: float | None = None,
                 sla_tpot_ms: float | None = None, stop_ids: Sequence[int] = ()) -> None:
        from scheduler.serving.triton_client import TritonClient

        self.client = TritonClient(url) if isinstance(url, str) else url
        self.mode, self.sla, self.stop_ids = mode, (sla_ttft_ms, sla_tpot_ms), tuple(stop_ids)

    async def __call__(self, req: ScheduledRequest) -> RequestResult:
        from scheduler.serving.triton_client import TritonError

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
