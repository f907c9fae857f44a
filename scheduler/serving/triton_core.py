"""Triton's core in this process, through its C API: the ``smartexit`` model served without the gRPC hop.

tritonserver is a front end (HTTP, gRPC, metrics) over a core library, ``libtritonserver``, whose C API
(``tritonserver.h``) serves a model repository in the calling process: the model's python backend stub still
runs in a process of its own, and everything between a client and it that gRPC carried (the client's
stream, the server's gRPC front end, a process hop) is gone. Ray Serve's Triton guide does the same with
Triton's Python bindings (``tritonserver``), which no wheel installable here ships (PyPI's ``tritonserver``
is a 0.0.1.dev0 placeholder); nvidia-pytriton's wheel ships the core library itself, whose few functions this
needs are bound with ctypes in scheduler/serving/triton_capi.py.

- :class:`TritonCore` starts the core on a repository (``start``: until the model is ready) and stops it;
- :class:`TritonCoreClient` is :class:`scheduler.serving.triton_client.TritonClient`'s interface (``ready``,
  ``generate``, ``control``, ``cancel``, ``close``) over it, the same tensors in and the same
  :class:`~scheduler.serving.triton_client.Chunk` out; responses arrive on the core's threads and are handed
  to the caller's event loop.

Measured (docs/serving.md, stop 69): straight to the core this way, a 64-token prompt's first token came
2.8 ms sooner than over gRPC to a tritonserver on the same repository (paired medians, 40 sequential
requests, the 2-core Intel VM; 0.3-3.3 ms in four ``bench serve`` runs, which time it as the ``triton_core``
hop).
"""
from __future__ import annotations

import asyncio
import ctypes as C
import itertools
import logging
import os
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edge.core.errors import ConfigError
from scheduler.serving.triton_client import (MODEL, Chunk, TritonUnavailable, cancel_quietly, control_tensors,
                                             decode_chunk, decode_control, engine_checked, error_from_message,
                                             generation_tensors)
from scheduler.serving.triton_capi import (BYTES, CONTROL_NONE, DTYPES, FLAG_FINAL, MEMORY_CPU, NUMPY, RELEASE_ALL, P,
                                           AllocFn, CoreApi, FreeFn, RequestReleasedFn, ResponseFn, bytes_tensor,
                                           from_bytes)
from scheduler.serving.stamps import stamp
from scheduler.serving.tritonserver import TritonInstall, find_tritonserver, serving_dirs

log = logging.getLogger(__name__)
STOPPED = "the Triton core stopped before the request's end"  # the error of the requests a stop cut off


@dataclass
class _Result:
    """One response's outputs by name (``as_numpy``, what ``decode_chunk`` / ``decode_control`` read)."""

    outputs: dict[str, np.ndarray]

    def as_numpy(self, name: str) -> np.ndarray | None:
        return self.outputs.get(name)


@dataclass
class _Call:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    key: str = ""          # the request's id, for its stamps (scheduler/serving/stamps.py)
    answered: bool = False  # a response has come

    def put(self, item: tuple) -> None:
        """Hand ``item`` to the caller's queue from any thread."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed: nobody waits for it
            pass


@dataclass
class TritonCore:
    """Triton's core serving ``repo`` in this process (``start`` / ``stop``; a context manager).

    The python backend's stub is started by the core with this process's environment, so ``start`` adds the
    install's (``LD_LIBRARY_PATH``, ``SMARTEXIT_PYTHONPATH``: scheduler/serving/tritonserver.py) to it until
    ``stop``."""

    repo: Path
    work_dir: Path | None = None  # the log's folder; default: beside the repository
    exit_timeout_s: int = 10
    install: TritonInstall | None = None
    env: dict[str, str] = field(default_factory=dict)  # added to the stub's environment (as TritonProcess.env)
    _api: CoreApi | None = field(default=None, repr=False)
    _server: int | None = field(default=None, repr=False)
    _allocator: int | None = field(default=None, repr=False)
    _calls: dict[int, _Call] = field(default_factory=dict, repr=False)  # until the final response
    _inputs: dict[int, list] = field(default_factory=dict, repr=False)  # until the core releases the request
    _ids: Any = field(default_factory=lambda: itertools.count(1), repr=False)

    def __post_init__(self) -> None:
        self.repo, self.work_dir = serving_dirs(self.repo, self.work_dir)
        self.install = self.install or find_tritonserver(self.work_dir)
        # the callbacks the core calls, kept alive with the object (ctypes frees a collected one under the core)
        self._alloc, self._free = AllocFn(self._allocate), FreeFn(self._release_buffer)
        self._released, self._responded = RequestReleasedFn(self._request_released), ResponseFn(self._response)
        self._environ: dict[str, str | None] = {}  # what start changed in this process's environment

    @property
    def log_path(self) -> Path:
        return self.work_dir / "triton-core.log"

    @property
    def alive(self) -> bool:
        return self._server is not None

    def start(self, timeout_s: float = 180.0) -> "TritonCore":
        """Start the core and wait until the model is ready.

        Raises:
            SmartExitError: no core library; TritonUnavailable: the core refused to start, or the model was not
                ready within ``timeout_s`` (the log's tail in the message).
        """
        if self._server is not None:
            return self
        api = self._api = CoreApi.of(self.install)
        # what the model's stub, a child of this process, runs with (given back by stop, or if start fails)
        env = {**self.install.env, **self.env}
        self._environ = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            self._server = self._new_server(api)
            allocator = P()
            api.check(api.allocator_new(C.byref(allocator), self._alloc, self._free, None), "response allocator")
            self._allocator = allocator.value
            deadline, ready = time.monotonic() + timeout_s, C.c_bool(False)
            while not ready.value:
                api.check(api.model_ready(self._server, MODEL.encode(), -1, C.byref(ready)), "model readiness")
                if not ready.value:
                    if time.monotonic() > deadline:
                        raise TritonUnavailable(f"model {MODEL} not ready within {timeout_s:g} s{self._log_tail()}")
                    time.sleep(0.05)
        except BaseException:
            self.stop()
            raise
        return self

    def _new_server(self, api: CoreApi) -> int:
        """The core, started on the repository with this object's options (it loads the model before returning).

        Raises:
            TritonUnavailable: an option refused, or the core did not start (the log's tail in the message).
        """
        opts = P()
        api.check(api.options_new(C.byref(opts)), "options")
        try:
            for err, what in ((api.set_repository(opts, str(self.repo).encode()), "model repository"),
                              (api.set_backends(opts, str(self.install.backend_dir).encode()), "backend directory"),
                              (api.set_control(opts, CONTROL_NONE), "model control"),
                              (api.set_strict(opts, True), "strict readiness"),
                              (api.set_exit_on_error(opts, True), "exit on error"),
                              (api.set_exit_timeout(opts, int(self.exit_timeout_s)), "exit timeout"),
                              (api.set_metrics(opts, False), "metrics"),
                              (api.set_gpu_metrics(opts, False), "GPU metrics"),
                              (api.set_log_file(opts, str(self.log_path).encode()), "log file"),
                              (api.set_log_verbose(opts, 0), "log level")):
                api.check(err, what)
            server = P()
            msg = api.message(api.server_new(C.byref(server), opts))
            if msg is not None:
                raise TritonUnavailable(f"Triton core did not start on {self.repo}: {msg}{self._log_tail()}")
            return server.value
        finally:
            api.options_delete(opts)

    def stop(self) -> None:
        """Stop the core (its model's stub with it) and give back the environment ``start`` changed; idempotent.
        Requests in flight end with an error."""
        api = self._api
        server, self._server = self._server, None
        if server is not None:
            msg = api.message(api.server_stop(server))
            if msg is not None:
                log.warning("Triton core stop: %s", msg)
            api.message(api.server_delete(server))
        allocator, self._allocator = self._allocator, None
        if allocator is not None:
            api.message(api.allocator_delete(allocator))
        # requests the stopped core will answer no more (a model stub that died leaves them open): their callers
        # get an error instead of waiting for their timeouts
        calls, self._calls = self._calls, {}
        for call in calls.values():
            call.put((None, STOPPED, True))
        self._inputs.clear()
        for k, v in self._environ.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        self._environ = {}

    def restart(self, timeout_s: float = 180.0) -> "TritonCore":
        """Stop and start again (a supervisor's restart: a new core, a new stub)."""
        self.stop()
        return self.start(timeout_s)

    def kill(self) -> None:
        """A hung core's end: ``stop`` (the core waits ``exit_timeout_s`` at most for what runs; the stub goes
        with it). A process of its own would be SIGKILLed; this one is the caller's."""
        self.stop()

    def __enter__(self) -> "TritonCore":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _log_tail(self, lines: int = 20) -> str:
        try:
            tail = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return ""
        return "\n" + "\n".join(tail) if tail else ""

    # --- requests ---

    def submit(self, tensors: dict[str, np.ndarray], request_id: str | None = None) -> asyncio.Queue:
        """Send one request to the model; its responses arrive on the returned queue of the running event loop
        as ``(_Result | None, error message | None, final)``.

        Raises:
            TritonUnavailable: the core is not running, or refused the request before it reached the model.
        """
        if self._server is None:
            raise TritonUnavailable(f"the Triton core on {self.repo} is not running")
        api = self._api
        stamp("core_submit", request_id or "")
        req = P()
        api.check(api.request_new(C.byref(req), self._server, MODEL.encode(), -1), "request")
        key = next(self._ids)
        call, inputs = _Call(asyncio.get_running_loop(), asyncio.Queue(), request_id or ""), []
        try:
            if request_id:
                api.check(api.request_id(req, request_id.encode()), "request id")
            for name, arr in tensors.items():
                arr = np.asarray(arr)
                if arr.dtype == np.object_:
                    dtype, data = BYTES, bytes_tensor(arr)
                    base = C.cast(C.c_char_p(data), P)
                elif arr.dtype in DTYPES:
                    dtype = DTYPES[arr.dtype]
                    data = np.ascontiguousarray(arr)
                    base = P(data.ctypes.data)
                else:
                    raise ConfigError(f"input {name}: no Triton type for {arr.dtype}")
                inputs.append(data)
                shape = (C.c_int64 * arr.ndim)(*arr.shape)
                api.check(api.add_input(req, name.encode(), dtype, shape, arr.ndim), f"input {name}")
                size = len(data) if isinstance(data, bytes) else data.nbytes
                api.check(api.input_data(req, name.encode(), base, size, MEMORY_CPU, 0), f"input {name}")
            api.check(api.on_release(req, self._released, P(key)), "release callback")
            api.check(api.on_response(req, self._allocator, None, self._responded, P(key)), "response callback")
            self._calls[key], self._inputs[key] = call, inputs
            msg = api.message(api.infer(self._server, req, None))
            if msg is not None:  # the request is still ours
                self._calls.pop(key, None)
                self._inputs.pop(key, None)
                raise TritonUnavailable(f"Triton core refused the request: {msg}")
        except BaseException:
            if key not in self._calls:
                api.request_delete(req)
            raise
        return call.queue

    def _allocate(self, allocator, name, size, memory_type, memory_type_id, userp, buffer, buffer_userp,
                  actual_type, actual_id):
        buffer[0] = self._api.malloc(size) if size else None
        buffer_userp[0] = None
        actual_type[0], actual_id[0] = MEMORY_CPU, 0
        return None

    def _release_buffer(self, allocator, buffer, buffer_userp, size, memory_type, memory_type_id):
        if buffer:
            self._api.free(buffer)
        return None

    def _request_released(self, request, flags, userp) -> None:
        if flags & RELEASE_ALL:
            self._api.request_delete(request)
            self._inputs.pop(userp or 0, None)  # the core reads the inputs no more

    def _response(self, response, flags, userp) -> None:
        """A response (or NULL with the final flag alone) on one of the core's threads: read, deleted, handed over."""
        call = self._calls.get(userp or 0)
        if call is not None and not call.answered:
            call.answered = True
            stamp("core_response", call.key)
        result = error = None
        try:
            if response:
                try:
                    error = self._api.message(self._api.response_error(response), delete=False)
                    if error is None:
                        result = self._outputs(response)
                finally:
                    self._api.response_delete(response)
        except Exception as exc:  # noqa: BLE001 - nothing may escape into the core's thread
            error = f"malformed response: {exc}"
        final = bool(flags & FLAG_FINAL)
        if final:
            self._calls.pop(userp or 0, None)
        if call is not None:
            call.put((result, error, final))

    def _outputs(self, response) -> _Result:
        api, out = self._api, {}
        count = C.c_uint32()
        api.check(api.output_count(response, C.byref(count)), "output count")
        for i in range(count.value):
            name, dtype, shape, dims = C.c_char_p(), C.c_int(), C.POINTER(C.c_int64)(), C.c_uint64()
            base, size, mtype, mid, userp = P(), C.c_size_t(), C.c_int(), C.c_int64(), P()
            api.check(api.output(response, i, C.byref(name), C.byref(dtype), C.byref(shape), C.byref(dims),
                                 C.byref(base), C.byref(size), C.byref(mtype), C.byref(mid), C.byref(userp)), "output")
            dims_ = tuple(shape[j] for j in range(dims.value))
            raw = C.string_at(base, size.value) if size.value else b""
            if dtype.value == BYTES:
                out[name.value.decode()] = from_bytes(raw, dims_)
            elif dtype.value in NUMPY:
                out[name.value.decode()] = np.frombuffer(raw, NUMPY[dtype.value]).reshape(dims_).copy()
        return _Result(out)


class TritonCoreClient:
    """:class:`scheduler.serving.triton_client.TritonClient`'s interface over a :class:`TritonCore` of this
    process: the same requests and chunks, the same errors (``TritonUnavailable``: the core is down or broke
    the request; ``TritonRejected``: the model refused it)."""

    def __init__(self, core: TritonCore, timeout_s: float = 10.0) -> None:
        self.core, self.timeout_s = core, timeout_s
        self.url = f"core:{core.repo}"

    async def close(self) -> None:
        """Nothing to close: the core belongs to its owner."""

    async def ready(self) -> bool:
        return self.core.alive

    async def generate(self, request_id: str, prompt_ids: Sequence[int], max_tokens: int,
                       temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
                       stop_ids: Sequence[int] = (), mode: str | None = None,
                       sla_ttft_ms: float | None = None, sla_tpot_ms: float | None = None,
                       ) -> AsyncIterator[Chunk]:
        """Stream a generation, one :class:`Chunk` per engine step, the last with ``finish_reason``; closing
        the iterator early sends the ``cancel`` control op (as the gRPC client does)."""
        tensors = generation_tensors(prompt_ids, max_tokens, temperature, top_p, seed, stop_ids, mode,
                                     sla_ttft_ms, sla_tpot_ms)
        queue = self.core.submit(tensors, request_id)
        finished = broken = False
        try:
            while not finished:
                result, error, final = await queue.get()
                if error is not None:
                    finished = True
                    raise error_from_message(error)
                if result is None:
                    if final:
                        broken = True
                        raise TritonUnavailable("the Triton core ended the request without a final response")
                    continue
                chunk = decode_chunk(result)
                finished = bool(chunk.finish_reason)  # an engine's failure too is the request's final response
                yield engine_checked(chunk)
        finally:
            if not finished and not broken and self.core.alive:  # the consumer left early
                await cancel_quietly(self, request_id)

    async def control(self, op: dict[str, Any]) -> dict[str, Any]:
        """Send a control op (``stats``, ``set``, ``cancel``) and return its JSON answer.

        Raises:
            TritonUnavailable: the core is down or gave no answer within ``timeout_s``.
            TritonRejected: the model refused the op.
        """
        queue = self.core.submit(control_tensors(op))
        try:
            result, error, _ = await asyncio.wait_for(queue.get(), self.timeout_s)
        except asyncio.TimeoutError:
            raise TritonUnavailable(f"Triton core: no answer to {op.get('op')!r} within {self.timeout_s} s") from None
        if error is not None:
            raise error_from_message(error)
        if result is None:
            raise TritonUnavailable(f"Triton core: no answer to {op.get('op')!r}")
        return decode_control(result)

    async def cancel(self, request_id: str) -> bool:
        """Ask the model to stop ``request_id``; whether a running request was cancelled."""
        return bool((await self.control({"op": "cancel", "request_id": request_id})).get("cancelled"))
