"""One request's answer at the ingress (scheduler/serving/app.py): its stream of chunks from a worker or a
tritonserver (``routes.TritonStream``) turned into text deltas, timing and token counts (``Generation``), then into
the non-streaming body (``complete``) or the SSE events (``sse_events``); the request's metrics are recorded once,
when it ends. Errors become ``api.ApiError``: before the first event the caller answers with its status, after it
the error travels in the stream."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from ray.exceptions import RayError
from ray.serve.exceptions import BackPressureError, RayServeException

from scheduler.serving import api, api_responses
from scheduler.serving.metrics import ServeMetrics
from scheduler.serving.text_stream import TextStream


class Generation:
    """One request's stream from a worker: text deltas, timing, token counts, metrics once at the end."""

    def __init__(self, stream: Any, req: api.GenerationRequest, text: TextStream, metrics: ServeMetrics,
                 t0: float, on_done: Callable[[], None]) -> None:
        self._stream, self.req, self.text, self._metrics, self.t0 = stream, req, text, metrics, t0
        self._on_done = on_done
        self.t_first: float | None = None
        self.t_last: float | None = None
        self.tokens, self.exit_layers, self.finish_reason, self._finished = 0, [], "length", False

    async def _chunks(self) -> AsyncIterator[dict[str, Any]]:
        done = False
        try:
            async for chunk in self._stream:
                if "error" in chunk:
                    done = True
                    raise api.backend_error(chunk["error"])
                done = bool(chunk["finish_reason"])
                yield chunk
                if done:
                    return
            raise api.ApiError(503, "the worker ended the stream before its last chunk", code="unavailable",
                               retry_after_s=1.0)
        except BackPressureError as exc:
            done = True
            raise api.ApiError(429, f"the workers' queues are full: {exc}", code="overloaded", retry_after_s=1.0) \
                from None
        except (RayError, RayServeException) as exc:
            done = True
            raise api.ApiError(503, f"the worker failed: {exc}", code="unavailable", retry_after_s=1.0) from None
        finally:
            if not done:  # the client left, or a stop string ended the text early: stop the worker
                self._stream.cancel()

    async def deltas(self) -> AsyncIterator[tuple[str, list[int], str | None]]:
        """``(text, exit_layers, finish_reason)``: each non-empty delta, and the last one with its reason.

        Raises:
            ApiError: the worker's error chunk, or the worker failing.
        """
        pending: list[int] = []
        async with aclosing(self._chunks()) as chunks:
            async for chunk in chunks:
                ids, layers = chunk["token_ids"], chunk["exit_layers"]
                self.t_last = time.monotonic()
                if ids and self.t_first is None:
                    self.t_first = self.t_last
                self.tokens += len(ids)
                self.exit_layers += layers
                pending += layers
                self._metrics.record_tokens(layers)
                delta = self.text.push(ids)
                reason = "stop" if self.text.stopped else (chunk["finish_reason"] or None)
                if reason is not None:
                    delta += self.text.flush()
                    self.finish_reason = reason
                if delta or reason is not None:
                    yield delta, pending, reason
                    pending = []
                if reason is not None:
                    return

    def finish(self, status: int) -> None:
        """Record the request's metrics and release its in-flight slot (once)."""
        if self._finished:
            return
        self._finished = True
        self._on_done()
        ttft = None if self.t_first is None else self.t_first - self.t0
        e2e = None if self.t_last is None or ttft is None else self.t_last - self.t0
        self._metrics.record_request(status, ttft, e2e if status == 200 else None, self.tokens,
                                     self.req.sla_ttft_ms, self.req.sla_tpot_ms)

    def usage(self) -> dict[str, int]:
        return api_responses.usage(len(self.req.prompt_ids), self.tokens)


async def complete(gen: Generation, rid: str) -> dict[str, Any]:
    """The non-streaming answer: the whole completion (or chat completion) with usage.

    Raises:
        ApiError: the worker's error or failure.
    """
    async with aclosing(gen.deltas()) as deltas:
        async for _ in deltas:
            pass
    build = api_responses.chat_response if gen.req.kind == "chat" else api_responses.completion_response
    return build(rid, int(time.time()), gen.req.model, gen.text.text, gen.finish_reason, gen.exit_layers, gen.usage())


async def sse_events(gen: Generation, rid: str) -> AsyncIterator[bytes]:
    """The SSE body of a streaming answer; records the request when it ends (``gen.finish``).

    Raises:
        ApiError: only before the first event (nothing sent yet: the caller answers with its status);
            later errors travel in the stream as an error event.
    """
    req, created, status, sent = gen.req, int(time.time()), 499, False
    try:
        async with aclosing(gen.deltas()) as deltas:
            async for delta, layers, reason in deltas:
                if req.kind == "chat":
                    out = b"" if sent else api_responses.sse(api_responses.chat_chunk(
                        rid, created, req.model, {"role": "assistant", "content": ""}))
                    out += api_responses.sse(api_responses.chat_chunk(
                        rid, created, req.model, {"content": delta} if delta else {}, reason, layers))
                else:
                    out = api_responses.sse(api_responses.completion_chunk(rid, created, req.model, delta, reason,
                                                                           layers))
                sent = True
                yield out
        if req.include_usage:
            yield api_responses.sse(api_responses.usage_chunk(req.kind, rid, created, req.model, gen.usage()))
        status = 200
        yield api_responses.SSE_DONE
    except api.ApiError as err:
        status = err.status
        if not sent:
            raise
        # the headers are gone: the error travels in the stream
        yield api_responses.sse(err.body()) + api_responses.SSE_DONE
    finally:
        gen.finish(status)


async def prepend(first: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """``first``, then what ``rest`` yields (closed at the end): an SSE body whose first event was awaited before the
    response's status was chosen."""
    try:
        yield first
        async for item in rest:
            yield item
    finally:
        await rest.aclose()
