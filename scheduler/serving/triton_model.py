"""Triton python-backend model ``smartexit``: what tritonserver runs for every served request.

The repository's ``smartexit/1/model.py`` (written by ``smartexit repo``, exporters/triton.py ``MODEL_PY``)
makes the environment that holds this package importable inside the stub, then imports
:class:`TritonPythonModel` from here; so this is a module like any other, under the layer contract.

A thin adapter: it unpacks a request, calls :class:`edge.runtime.host.EngineHost`, packs its chunks
into responses. Decoupled: ``execute`` returns at once, and the engine thread sends one response per
engine step that decided tokens for the request, the last with the final flag. Wire protocol:
docs/serving.md. Runs only inside tritonserver (``triton_python_backend_utils`` exists there).
"""
import collections
import json
import os
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils  # only inside tritonserver's python stub

from edge.runtime.host_types import Chunk, GenRequest, HostError, merge_chunks
from scheduler.serving.bundle import open_bundle
from scheduler.serving.stamps import stamp

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
CANCEL_CHECK_S = 0.5  # how often a streaming request asks Triton whether its client cancelled (an IPC round trip)
INTERVAL_ENV = "SMARTEXIT_STREAM_INTERVAL_MS"  # ServeConfig.stream_interval_ms, for the tritonservers a worker starts


class Responder:
    """Sends the engine's chunks from a thread of its own, so the engine thread never waits on the
    python backend's IPC: whatever queued while it was sending goes out merged, one response per
    request (``merge_chunks``). The front end cancels with a control op; ``is_cancelled`` (a client
    that closed its gRPC stream) is asked at most every ``CANCEL_CHECK_S`` per request.

    ``interval_s`` (the bundle's ``stream_interval_ms``): a request's later tokens are held until that long
    after its previous response, then sent together; its first token and its end go at once. Every hop
    after this one (gRPC, the ingress, Ray Serve's proxy, HTTP, the client) costs CPU per response, not
    per token, on the cores the engine uses: fewer, larger responses leave it more (docs/serving.md).

    A request's first chunk hands this thread the GIL at once (the engine thread sleeps 0 s after queuing it):
    otherwise the woken thread waits for the engine thread's next release, its Python until the next ONNX Runtime
    call. Stamped on the 2-core VM (stop 71), the first chunk's way to its response sent went 0.42-0.48 -> 0.10 ms at
    the median; once per request, so the engine loses nothing measurable."""

    def __init__(self, host, interval_s: float = 0.0) -> None:
        self.host, self.queue, self.wake = host, collections.deque(), threading.Event()
        self.senders: dict[str, tuple[object, list[float]]] = {}
        self.interval_s = interval_s
        self.held: dict[str, Chunk] = {}      # request id -> its tokens waiting for their response
        self.last_sent: dict[str, float] = {}  # request id -> when its previous response went out
        self.started: set[str] = set()         # requests whose first chunk has come (until their last)
        self.stopped = False
        self.thread = threading.Thread(target=self._run, name="smartexit-responder", daemon=True)
        self.thread.start()

    def add(self, rid: str, sender) -> None:
        self.senders[rid] = (sender, [time.monotonic()])

    def put(self, chunk: Chunk) -> None:  # on the engine thread
        first = chunk.request_id not in self.started
        if first:  # marked before it is queued: its last chunk, which unmarks it, may be this one
            self.started.add(chunk.request_id)
            stamp("engine_first", chunk.request_id)  # scheduler/serving/stamps.py (off: one comparison)
        self.queue.append(chunk)
        self.wake.set()
        if first:
            time.sleep(0)  # the GIL to the sending thread now (class docstring)

    def stop(self) -> None:
        self.stopped = True
        self.wake.set()
        self.thread.join(5)

    def _run(self) -> None:
        while not self.stopped or self.queue or self.held:
            due = min(self.last_sent[rid] for rid in self.held) + self.interval_s if self.held else None
            self.wake.wait(0.1 if due is None else max(0.0, min(0.1, due - time.monotonic())))
            self.wake.clear()
            batch = []
            while self.queue:
                batch.append(self.queue.popleft())
            for chunk in merge_chunks(batch):
                held = self.held.pop(chunk.request_id, None)
                self.held[chunk.request_id] = merge_chunks([held, chunk])[0] if held is not None else chunk
            now = time.monotonic()
            for rid in list(self.held):
                chunk, last = self.held[rid], self.last_sent.get(rid)
                if (chunk.finish_reason is not None or last is None or now - last >= self.interval_s
                        or self.stopped):
                    del self.held[rid]
                    if last is None:
                        stamp("model_send", rid)
                    if chunk.finish_reason is None:
                        self.last_sent[rid] = now
                    else:
                        self.last_sent.pop(rid, None)
                    self._send(chunk)

    def _send(self, chunk: Chunk) -> None:
        entry = self.senders.get(chunk.request_id)
        if chunk.finish_reason is not None:
            self.started.discard(chunk.request_id)
        if entry is None:
            return
        sender, last_check = entry
        final = chunk.finish_reason is not None
        if not final and time.monotonic() - last_check[0] > CANCEL_CHECK_S:
            last_check[0] = time.monotonic()
            if sender.is_cancelled():
                self.host.cancel(chunk.request_id, wait=False)  # the client went away: free its slot
                return
        if final:
            self.senders.pop(chunk.request_id, None)
        if chunk.finish_reason == "shed":  # refused while it waited (the host's load shedding): a rejection
            err = HostError("overloaded", "shed: its TTFT deadline passed while it waited for admission",
                            retry_after_s=chunk.retry_after_s)
            try:
                sender.send(_error(err), flags=FINAL)
            except Exception:  # noqa: BLE001 - the client went away meanwhile: nothing to tell
                pass
            return
        try:
            sender.send(_chunk_response(chunk), flags=FINAL if final else 0)
        except Exception:  # noqa: BLE001 - a vanished client must not stop the others' responses
            if not final:
                self.host.cancel(chunk.request_id, wait=False)


def stream_interval_ms(bundle: Path) -> float:
    """The bundle's ``stream_interval_ms`` (RepoConfig's default where the bundle predates it)."""
    from exporters.triton import RepoConfig

    host = json.loads((bundle / "bundle.json").read_text()).get("host", {})
    return float(host.get("stream_interval_ms", RepoConfig.stream_interval_ms))


def _scalar(request, name, kind, default=None):
    t = pb_utils.get_input_tensor_by_name(request, name)
    if t is None:
        return default
    a = t.as_numpy().reshape(-1)
    if a.size != 1:
        raise HostError("invalid_request", f"{name} must hold one value, got {a.size}", name)
    v = a[0]
    if kind is not str:
        return kind(v)
    try:
        return v.decode("utf-8", errors="strict")
    except UnicodeDecodeError as exc:
        raise HostError("invalid_request", f"{name} is not UTF-8 ({exc.reason} at byte {exc.start})", name) from None


def _array(request, name):
    t = pb_utils.get_input_tensor_by_name(request, name)
    return [] if t is None else [int(x) for x in t.as_numpy().reshape(-1)]


def _error(exc: HostError):
    if exc.field == "prompt":  # the engine's name for what the wire calls input_ids
        exc.field = "input_ids"
    return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(json.dumps(exc.as_dict())))


def _chunk_response(chunk: Chunk):
    return pb_utils.InferenceResponse(output_tensors=[
        pb_utils.Tensor("token_ids", np.asarray(chunk.tokens, np.int64)),
        pb_utils.Tensor("exit_layers", np.asarray(chunk.exit_layers, np.int32)),
        pb_utils.Tensor("finish_reason", np.array([(chunk.finish_reason or "").encode()], np.object_)),
    ])


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise pb_utils.TritonModelException("model 'smartexit' must be decoupled (config.pbtxt)")
        bundle = Path(args["model_repository"]) / args["model_version"] / "bundle"
        self.host = open_bundle(bundle)
        # the serving path's measurement (scheduler/loadtest/serving_runs.py) asks for a step log through the
        # environment the worker starts tritonserver with (ServeConfig.step_log)
        self.host.cfg.step_log = os.environ.get("SMARTEXIT_STEP_LOG") or None
        self.host.start()
        interval_ms = os.environ.get(INTERVAL_ENV) or stream_interval_ms(bundle)
        self.responder = Responder(self.host, float(interval_ms) / 1e3)
        # the server's log names the backend (the Jetson's unit may choose TensorRT or torch_static)
        print(f"smartexit: serving {bundle} on the {self.host.engine.backend.name} backend", flush=True)

    def execute(self, requests):
        for request in requests:
            stamp("model_execute", request.request_id())
            sender = request.get_response_sender()
            try:
                control = _scalar(request, "control", str)
                if control is not None:
                    self._control(control, sender)
                else:
                    self._generate(request, sender)
            except HostError as exc:
                sender.send(_error(exc), flags=FINAL)
            except Exception as exc:  # noqa: BLE001 - the client must get an answer, whatever broke
                sender.send(_error(HostError("internal", repr(exc))), flags=FINAL)
        return None

    def _control(self, text, sender):
        try:
            op = json.loads(text)
        except json.JSONDecodeError as exc:
            raise HostError("invalid_request", f"control is not JSON: {exc}", "control") from None
        out = self.host.control(op)
        sender.send(pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("control_out", np.array([json.dumps(out).encode()], np.object_))]), flags=FINAL)

    def _generate(self, request, sender):
        rid = request.request_id() or uuid.uuid4().hex
        prompt = _array(request, "input_ids")
        max_tokens = _scalar(request, "max_tokens", int)
        if max_tokens is None:
            raise HostError("invalid_request", "max_tokens is required", "max_tokens")
        seed = _scalar(request, "seed", int)
        req = GenRequest(rid, prompt, max_tokens, temperature=_scalar(request, "temperature", float, 0.0),
                         top_p=_scalar(request, "top_p", float, 1.0), seed=seed,
                         stop_ids=tuple(_array(request, "stop_ids")), mode=_scalar(request, "mode", str, "bounded"),
                         sla_ttft_ms=_scalar(request, "sla_ttft_ms", float),
                         sla_tpot_ms=_scalar(request, "sla_tpot_ms", float))
        self.responder.add(rid, sender)
        try:
            self.host.submit(req, self.responder.put)
        except HostError:
            self.responder.senders.pop(rid, None)
            raise

    def finalize(self):
        self.host.stop()
        self.responder.stop()
