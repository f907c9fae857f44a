"""Asyncio client for the decoupled Triton model ``smartexit`` (wire protocol: docs/serving.md).

Every call opens one gRPC bidirectional stream (``tritonclient.grpc.aio.InferenceServerClient
.stream_infer``): a decoupled model answers only on the streaming RPC, and one stream per request
keeps a broken or cancelled request from touching the others (HTTP/2 multiplexes them on one
channel). The request iterator stays open until the final response arrives, so the client never
half-closes a stream the server is still answering.

Errors are typed: :class:`TritonUnavailable` (no server, server died, stream broken, an answer
outside the protocol: the front end answers 503) and :class:`TritonRejected` (the model's JSON
error: ``overloaded`` -> 429, ``invalid_request`` -> 400, ``internal`` -> 500).
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from edge.core.errors import require

log = logging.getLogger(__name__)

MODEL = "smartexit"
REJECTION_CODES = ("invalid_request", "overloaded", "internal")
FINISH_REASONS = ("length", "stop", "cancelled", "deadline")
# EngineHost ends a request with "error" when its engine thread dies (edge/runtime/host.py), beyond
# the reasons docs/serving.md lists: the client raises it as an ``internal`` rejection
ENGINE_ERROR = "error"
DEFAULT_RETRY_AFTER_S = 1.0
# the python backend's answer once the model's stub process has died ("Stub process 'smartexit_0_0' is not healthy.")
STUB_LOST = ("Stub process", "is not healthy")
RECONNECT_BACKOFF_MS = (100, 500)  # first and longest wait between a channel's connection attempts


class TritonError(Exception):
    """A request the Triton model did not serve."""


class TritonUnavailable(TritonError):
    """The server cannot be reached, died, or broke the stream (HTTP 503)."""

    def __init__(self, message: str, retry_after_s: float = DEFAULT_RETRY_AFTER_S) -> None:
        super().__init__(message, retry_after_s)
        self.message = message
        self.retry_after_s = retry_after_s

    def __str__(self) -> str:
        return self.message


class TritonRejected(TritonError):
    """The model refused the request with a JSON error (``code``: invalid_request | overloaded | internal)."""

    def __init__(self, code: str, message: str, field: str | None = None,
                 retry_after_s: float | None = None) -> None:
        super().__init__(code, message, field, retry_after_s)  # all args: the exception pickles across Ray
        self.code, self.message, self.field, self.retry_after_s = code, message, field, retry_after_s

    def __str__(self) -> str:
        return f"{self.code}: {self.message}" + (f" (field {self.field})" if self.field else "")


@dataclass(frozen=True)
class Chunk:
    """One streamed response: the tokens one engine step decided, the layer each left at, and
    ``finish_reason`` ("" until the last response)."""
    token_ids: list[int]
    exit_layers: list[int]
    finish_reason: str


def error_from_message(message: str) -> TritonError:
    """The typed error for a response's error message.

    The model's rejections are JSON (``{"code", "message", "field", "retry_after_s"}``), possibly
    behind a prefix the server adds; anything else (unknown model, crashed backend stub) means the
    model is not serving: :class:`TritonUnavailable`.
    """
    start, end = message.find("{"), message.rfind("}")
    body: Any = None
    if 0 <= start < end:
        try:
            body = json.loads(message[start:end + 1])
        except json.JSONDecodeError:
            body = None
    if not isinstance(body, dict) or body.get("code") not in REJECTION_CODES:
        return TritonUnavailable(f"tritonserver answered outside the protocol: {message}")
    retry = body.get("retry_after_s")
    retry = float(retry) if isinstance(retry, (int, float)) and not isinstance(retry, bool) and retry >= 0 else None
    if body["code"] == "overloaded" and retry is None:
        retry = DEFAULT_RETRY_AFTER_S
    field = body.get("field") if isinstance(body.get("field"), str) else None
    return TritonRejected(body["code"], str(body.get("message", "")), field, retry)


def stub_lost(exc: TritonError) -> bool:
    """Whether ``exc`` says the model's python-backend stub is gone (killed, crashed): Triton answers every
    request with this until the model is loaded again, so only a restart serves again."""
    text = str(exc)
    return STUB_LOST[0] in text and STUB_LOST[1] in text


def error_to_dict(exc: TritonError) -> dict[str, Any]:
    """A plain dict for ``exc`` (what a Ray Serve worker yields instead of raising across actors)."""
    if isinstance(exc, TritonRejected):
        return {"kind": "rejected", "code": exc.code, "message": exc.message, "field": exc.field,
                "retry_after_s": exc.retry_after_s}
    retry = getattr(exc, "retry_after_s", DEFAULT_RETRY_AFTER_S)
    return {"kind": "unavailable", "code": "unavailable", "message": str(exc), "field": None,
            "retry_after_s": retry}


def generation_tensors(prompt_ids: Sequence[int], max_tokens: int, temperature: float = 0.0,
                       top_p: float = 1.0, seed: int | None = None, stop_ids: Sequence[int] = (),
                       mode: str | None = None, sla_ttft_ms: float | None = None,
                       sla_tpot_ms: float | None = None) -> dict[str, np.ndarray]:
    """The model's inputs for a generation, by name (optional ones left out when unset)."""
    out = {"input_ids": np.asarray(prompt_ids, dtype=np.int64).reshape(-1),     # [T]
           "max_tokens": np.asarray([max_tokens], dtype=np.int32),
           "temperature": np.asarray([temperature], dtype=np.float32),
           "top_p": np.asarray([top_p], dtype=np.float32)}
    if seed is not None:
        out["seed"] = np.asarray([seed], dtype=np.int64)
    if len(stop_ids):
        out["stop_ids"] = np.asarray(stop_ids, dtype=np.int64).reshape(-1)     # [S]
    if mode is not None:
        out["mode"] = np.asarray([mode.encode()], dtype=np.object_)
    if sla_ttft_ms is not None:
        out["sla_ttft_ms"] = np.asarray([sla_ttft_ms], dtype=np.float32)
    if sla_tpot_ms is not None:
        out["sla_tpot_ms"] = np.asarray([sla_tpot_ms], dtype=np.float32)
    return out


def control_tensors(op: dict[str, Any]) -> dict[str, np.ndarray]:
    """The model's input for a control op."""
    return {"control": np.asarray([json.dumps(op).encode()], dtype=np.object_)}


def _string(arr: np.ndarray | None) -> str:
    if arr is None or arr.size == 0:
        return ""
    value = arr.reshape(-1)[0]
    return value.decode() if isinstance(value, bytes) else str(value)


def decode_chunk(result: Any) -> Chunk:
    """A :class:`Chunk` from an ``InferResult`` (anything with ``as_numpy(name)``).

    Raises:
        TritonUnavailable: the response lacks the outputs the protocol names, or they disagree.
    """
    ids, layers = result.as_numpy("token_ids"), result.as_numpy("exit_layers")
    reason = _string(result.as_numpy("finish_reason"))
    ids = [] if ids is None else [int(x) for x in ids.reshape(-1)]
    layers = [] if layers is None else [int(x) for x in layers.reshape(-1)]
    if len(ids) != len(layers):
        raise TritonUnavailable(f"malformed response: {len(ids)} token_ids but {len(layers)} exit_layers")
    if reason and reason not in FINISH_REASONS and reason != ENGINE_ERROR:
        raise TritonUnavailable(f"malformed response: finish_reason {reason!r}")
    return Chunk(ids, layers, reason)


def engine_checked(chunk: Chunk) -> Chunk:
    """``chunk``, unless it says the engine failed.

    Raises:
        TritonRejected: the engine stopped while serving the request (finish reason ``ENGINE_ERROR``).
    """
    if chunk.finish_reason == ENGINE_ERROR:
        raise TritonRejected("internal", "the engine stopped while serving the request")
    return chunk


async def cancel_quietly(client: Any, request_id: str) -> None:
    """``client.cancel(request_id)``, shielded (it runs while the caller is being cancelled, and must still reach
    the server) and logged, not raised, when the server is gone: nothing is left to cancel then."""
    task = asyncio.ensure_future(client.cancel(request_id))
    try:
        await asyncio.shield(task)
    except TritonError as exc:
        log.info("cancel %s not delivered: %s", request_id, exc)


def decode_control(result: Any) -> dict[str, Any]:
    """The JSON answer of a control response.

    Raises:
        TritonUnavailable: ``control_out`` is missing or not a JSON object.
    """
    text = _string(result.as_numpy("control_out"))
    try:
        out = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TritonUnavailable(f"malformed control_out {text[:200]!r}: {exc}") from exc
    if not isinstance(out, dict):
        raise TritonUnavailable(f"malformed control_out {text[:200]!r}: not a JSON object")
    return out


def channel_args(grpc_aio: Any) -> list[tuple[str, int]]:
    """tritonclient's own channel arguments, and a reconnect backoff for a server on this machine.

    gRPC's default backoff (1 s, growing 1.6x to 120 s) keeps a channel failing every call at once for
    seconds after a relaunched tritonserver listens again on the same port: measured 2.8 s after 6 s down
    (docs/serving.md, Errors). A loopback connection attempt costs well under a millisecond, so the
    channel retries every 100 ms, at most every 500 ms."""
    keep = grpc_aio.KeepAliveOptions()
    return [("grpc.max_send_message_length", grpc_aio.MAX_GRPC_MESSAGE_SIZE),
            ("grpc.max_receive_message_length", grpc_aio.MAX_GRPC_MESSAGE_SIZE),
            ("grpc.keepalive_time_ms", keep.keepalive_time_ms),
            ("grpc.keepalive_timeout_ms", keep.keepalive_timeout_ms),
            ("grpc.keepalive_permit_without_calls", keep.keepalive_permit_without_calls),
            ("grpc.http2.max_pings_without_data", keep.http2_max_pings_without_data),
            ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[0]),
            ("grpc.min_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[0]),
            ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[1])]


class TritonClient:
    """The ``smartexit`` model over ``tritonclient.grpc.aio`` (create it inside the event loop
    that uses it: the gRPC channel binds to that loop)."""

    def __init__(self, url: str, model: str = MODEL, timeout_s: float = 10.0) -> None:
        self._grpc = require("tritonclient.grpc.aio", "serve")
        self.url, self.model, self.timeout_s = url, model, timeout_s
        self._client = self._grpc.InferenceServerClient(url, channel_args=channel_args(self._grpc))

    async def close(self) -> None:
        await self._client.close()

    async def ready(self) -> bool:
        """Whether the server is up and the model loaded (False on any transport error)."""
        from tritonclient.utils import InferenceServerException
        try:
            return bool(await self._client.is_server_ready(client_timeout=self.timeout_s)
                        and await self._client.is_model_ready(self.model, client_timeout=self.timeout_s))
        except InferenceServerException as exc:
            log.debug("triton %s not ready: %s", self.url, exc)
            return False

    def _inputs(self, tensors: dict[str, np.ndarray]) -> list:
        from tritonclient.utils import np_to_triton_dtype
        out = []
        for name, arr in tensors.items():
            x = self._grpc.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype))
            x.set_data_from_numpy(arr)
            out.append(x)
        return out

    def _open(self, request: dict[str, Any], done: asyncio.Event):
        """Open a stream carrying one request; the stream's response iterator (``cancel()``-able)."""
        async def requests():
            yield request
            await done.wait()  # keep our side open until the final response (see the module doc)
        return self._client.stream_infer(requests())

    async def _next(self, call) -> tuple[Any, Any]:
        """The next (result, error) of a stream, transport failures as :class:`TritonUnavailable`."""
        import grpc
        from tritonclient.utils import InferenceServerException
        try:
            return await call.__anext__()
        except StopAsyncIteration:
            raise TritonUnavailable("tritonserver closed the stream before the final response") from None
        except grpc.RpcError as exc:
            raise TritonUnavailable(f"tritonserver at {self.url}: {exc.code().name} {exc.details()}") from exc
        except InferenceServerException as exc:
            raise TritonUnavailable(f"tritonserver at {self.url}: {exc}") from exc

    async def generate(self, request_id: str, prompt_ids: Sequence[int], max_tokens: int,
                       temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
                       stop_ids: Sequence[int] = (), mode: str | None = None,
                       sla_ttft_ms: float | None = None, sla_tpot_ms: float | None = None,
                       ) -> AsyncIterator[Chunk]:
        """Stream a generation: one :class:`Chunk` per engine step, the last with ``finish_reason``.

        Closing the iterator before the last chunk (the HTTP client went away) cancels the stream
        and sends the ``cancel`` control op for ``request_id``.

        Raises:
            TritonUnavailable: no server, the server died, or the stream broke.
            TritonRejected: the model refused the request (its JSON error).
        """
        tensors = generation_tensors(prompt_ids, max_tokens, temperature, top_p, seed, stop_ids, mode,
                                     sla_ttft_ms, sla_tpot_ms)
        done = asyncio.Event()
        finished = broken = False
        call = self._open({"model_name": self.model, "inputs": self._inputs(tensors),
                           "request_id": request_id}, done)
        try:
            while not finished:
                try:
                    result, error = await self._next(call)
                except TritonUnavailable:
                    broken = True  # the server lost the request with the stream: nothing to cancel
                    raise
                if error is not None:
                    finished = True  # a rejection is the request's only (final) response
                    raise error_from_message(error.message() or str(error))
                chunk = decode_chunk(result)
                finished = bool(chunk.finish_reason)  # an engine's failure too is the request's final response
                yield engine_checked(chunk)
        finally:
            done.set()
            if not finished:
                call.cancel()
                if not broken:  # the consumer left early: stop the engine working for nobody
                    await cancel_quietly(self, request_id)

    async def control(self, op: dict[str, Any]) -> dict[str, Any]:
        """Send a control op (``stats``, ``set``, ``cancel``) and return its JSON answer.

        Raises:
            TritonUnavailable: transport failure or no answer within ``timeout_s``.
            TritonRejected: the model refused the op.
        """
        done = asyncio.Event()
        call = self._open({"model_name": self.model, "inputs": self._inputs(control_tensors(op))}, done)
        try:
            result, error = await asyncio.wait_for(self._next(call), self.timeout_s)
        except asyncio.TimeoutError:
            call.cancel()
            raise TritonUnavailable(f"tritonserver at {self.url}: no answer to {op.get('op')!r} "
                                    f"within {self.timeout_s} s") from None
        finally:
            done.set()
        if error is not None:
            raise error_from_message(error.message() or str(error))
        return decode_control(result)

    async def cancel(self, request_id: str) -> bool:
        """Ask the model to stop ``request_id``; whether a running request was cancelled."""
        return bool((await self.control({"op": "cancel", "request_id": request_id})).get("cancelled"))
