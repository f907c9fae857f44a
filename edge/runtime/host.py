"""EngineHost: the engine on a thread of its own, for servers (Triton's model.py, the in-process bench).

Callers on any thread ``submit`` requests, ``cancel`` them and send ``control`` ops; only the engine
thread touches the engine. ``submit`` validates at once (the engine's own checks read only its
configuration) and answers an overloaded queue with :class:`HostError` ``overloaded``; the rest goes
through an inbox the engine thread drains before every step, so nobody waits on a lock held for a
whole step. Each step's tokens reach the request's ``emit`` as one :class:`Chunk` (one token, or
several in mode exact), outside any lock; the last chunk carries the finish reason.

The host also keeps what a scheduler reads (queue, prefill backlog, running sequences, their recent
and predicted exit depth, SLA slack: docs/serving.md) and runs the online false-exit audit
(:mod:`edge.runtime.audit`). With deferral the engine judges every early exit of a greedy ``bounded``
request itself (``Verdict``: the full model's token, from the owed layers it computes anyway) and every
token of such a request is counted; otherwise a sampled token that exited early is re-decoded at full
depth as a one-token request over the same prefix (so is an exit the engine could not judge), submitted
only while the engine has spare capacity (nothing waiting, a free slot, one audit at a time), so it never
delays a request's admission. When the audit's bound crosses the certificate's epsilon (the threshold table's,
handed to the host), later ``bounded`` requests run at full depth.

The backend's largest chunk (``Backend.max_chunk``: a TensorRT profile's) bounds the prefill budget: a
``set`` above it is clamped, and ``stats`` reports it as ``max_chunk`` for the control policies.

Load shedding (``HostConfig.shed_late``, or ``{"op": "set", "shed_late": true}``): before every step, a
request still waiting for admission whose TTFT deadline (its arrival plus its TTFT target) has passed
can no longer meet it; it is refused there and then, its last chunk's finish reason ``shed`` with a
``retry_after_s`` (the front end answers 429 with Retry-After), counted in ``shed_total`` and as a
miss of its SLA, never dropped silently. A request already admitted runs to its end.
"""
from __future__ import annotations

import collections
import json
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from edge.core.errors import ConfigError, RequestError, SmartExitError
from edge.core.stats import due_time, on_time, p95_ms, sla_met
from edge.runtime.audit import AuditConfig, AuditEstimate, Trigger
from edge.runtime.backend import Backend
from edge.runtime.engine import NO_TOKEN, Engine, EngineConfig, KVMode, Mode, Request, TokenEvent, Verdict
from edge.runtime.rules import BatchExitRule
from edge.runtime.settings import EPSILON, SLA_TPOT_MS, SLA_TTFT_MS

log = logging.getLogger("smartexit.host")
EMA = 0.3  # weight of the newest exit layer in a request's predicted exit depth
RECENT = 32  # finished requests behind the recent tail latencies in ``stats``
RATE_WINDOW_S = 5.0  # arrivals counted for the recent arrival rate
FRONT_WINDOW_S = 2.0  # the step log's recent arrivals ("a"): the front end's work follows them (docs/scheduler.md)


@dataclass
class HostConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    max_waiting: int = 64  # requests queued for admission; one more is refused as overloaded
    default_sla_ttft_ms: float = SLA_TTFT_MS.default  # a request that names no SLA gets these
    default_sla_tpot_ms: float = SLA_TPOT_MS.default
    audit: AuditConfig = field(default_factory=AuditConfig)
    control_timeout_s: float = 10.0
    # a JSONL file the engine thread appends one line per step to (what the step did and how long it
    # took under the stack): `smartexit profile` fits the served engine's step time from it
    # (scheduler/loadtest/serving_path.py). None: no log (the default; it costs the engine thread ~20 us a step)
    step_log: str | None = None
    shed_late: bool = False  # refuse a waiting request once its TTFT deadline has passed (module doc)

    def __post_init__(self) -> None:
        if isinstance(self.engine, dict):
            self.engine = EngineConfig(**self.engine)
        if isinstance(self.audit, dict):
            self.audit = AuditConfig.from_dict(self.audit, "host.audit")
        if self.max_waiting < 1:
            raise ConfigError(f"host.max_waiting must be >= 1, got {self.max_waiting}")
        SLA_TTFT_MS.check(self.default_sla_ttft_ms, "host", "default_sla_ttft_ms")
        SLA_TPOT_MS.check(self.default_sla_tpot_ms, "host", "default_sla_tpot_ms")


@dataclass
class GenRequest:
    request_id: str
    prompt: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_ids: tuple[int, ...] = ()
    mode: str = "bounded"
    sla_ttft_ms: float | None = None
    sla_tpot_ms: float | None = None


@dataclass
class Chunk:
    request_id: str
    tokens: list[int]
    exit_layers: list[int]
    finish_reason: str | None = None  # set on the last chunk of a request
    retry_after_s: float | None = None  # with finish reason "shed": when to come back


def merge_chunks(chunks: list[Chunk]) -> list[Chunk]:
    """Chunks waiting to be sent, one per request in order of first appearance: each request's tokens
    concatenated in order, finished if any of them is (a transport that fell behind the engine sends
    fewer, larger responses instead of queueing one per step)."""
    merged: dict[str, Chunk] = {}
    for c in chunks:
        m = merged.get(c.request_id)
        if m is None:
            merged[c.request_id] = Chunk(c.request_id, list(c.tokens), list(c.exit_layers), c.finish_reason,
                                         c.retry_after_s)
        elif m.finish_reason is None:
            m.tokens += c.tokens
            m.exit_layers += c.exit_layers
            m.finish_reason, m.retry_after_s = c.finish_reason, c.retry_after_s
    return list(merged.values())


class HostError(SmartExitError):
    """A refused request: ``code`` is ``invalid_request`` (``field`` names the field), ``overloaded``
    (``retry_after_s`` says when to come back) or ``internal``."""

    def __init__(self, code: str, message: str, field: str | None = None, retry_after_s: float | None = None):
        super().__init__(message)
        self.code, self.message, self.field, self.retry_after_s = code, message, field, retry_after_s

    def as_dict(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "field": self.field, "retry_after_s": self.retry_after_s}


@dataclass
class _Live:
    req: GenRequest
    emit: Callable[[Chunk], None]
    arrival: float
    sla_ttft_s: float
    sla_tpot_s: float
    audited: bool  # eligible for the audit (greedy, bounded)
    # with the engine's verdicts, the request as a unit of the audit's per-request test: its exits, those judged
    # (by a verdict or a re-decode) or given up on (a re-decode dropped), and the false ones among them
    exits: int = 0
    resolved: int = 0
    false: int = 0
    incomplete: bool = False
    counted: bool = False  # its unit recorded
    engine_id: int = -1
    n_tokens: int = 0
    predicted: float | None = None  # EMA of its exit layers
    tokens: list[int] = field(default_factory=list)
    layers: list[int] = field(default_factory=list)
    finish: str | None = None
    history: list[int] = field(default_factory=list)  # prompt + output, for audit prefixes
    first: float | None = None  # when its first token was handed over
    late: bool = False  # a token was handed over after its due time
    shed: bool = False  # refused while waiting: its TTFT deadline passed (HostConfig.shed_late)
    retry_after_s: float | None = None


@dataclass
class _AuditItem:
    prefix: list[int]
    token: int
    exit_layer: int
    live: _Live | None = None  # the request it belongs to, where the request is a unit of the per-request test


class EngineHost:
    """The engine behind a thread-safe submit / cancel / control interface (module docstring)."""

    def __init__(self, backend: Backend, cfg: HostConfig, rule: BatchExitRule | None = None,
                 epsilon: float | None = None, expected_exit_layer: float | None = None) -> None:
        """``epsilon``: the certified false-exit rate of ``rule`` (the threshold table's
        :attr:`~calibration.table.ThresholdTable.epsilon`), the bound the audit tests; None: a rule
        without a certificate, which cannot be audited. ``expected_exit_layer``: the table's mean exit
        depth, the predicted depth before any token was served.

        Raises:
            ConfigError: an audit (``cfg.audit.fraction`` > 0) without ``epsilon``, or ``epsilon`` outside (0, 1).
        """
        a = cfg.audit
        if epsilon is not None:
            EPSILON.check(epsilon, "host")
        elif a.fraction > 0:
            raise ConfigError(f"host.audit.fraction={a.fraction}: the audit tests the certificate's epsilon, and "
                              f"none was given (EngineHost(epsilon=...): the threshold table's); set "
                              f"audit.fraction=0 for a rule without a certificate")
        self.cfg = cfg
        self.engine = Engine(backend, cfg.engine, rule)
        self.num_layers = backend.num_layers
        self.exit_layers = list(backend.exit_layers)
        self.expected_exit_layer = expected_exit_layer
        # the engine judges every greedy exit itself (deferral's verdicts): the audit counts every token
        self._verdicts = a.verdicts and epsilon is not None and cfg.engine.kv_mode is KVMode.DEFER
        trigger = a.trigger
        if trigger is Trigger.AUTO:  # requests as the units where requests are audited whole
            trigger = Trigger.REQUESTS if self._verdicts else Trigger.LOWER
        elif trigger is Trigger.REQUESTS and not self._verdicts and epsilon is not None:
            raise ConfigError("host.audit.trigger=requests needs requests audited whole (audit.verdicts with "
                              f"kv_mode defer; this host: verdicts={a.verdicts}, kv_mode "
                              f"{cfg.engine.kv_mode.value}): use trigger=lower or auto")
        self.audit = AuditEstimate(epsilon=epsilon, delta=a.delta, trigger=trigger, min_tokens=a.min_tokens)
        self._rng = np.random.default_rng(a.seed)
        self._audit_queue: collections.deque[_AuditItem] = collections.deque()
        self._audit_inflight = False
        self.audit_dropped = 0
        self._inbox: collections.deque[tuple[str, Any, Future | None]] = collections.deque()
        self._live: dict[str, _Live] = {}
        self._by_engine: dict[int, _Live] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._queued = 0  # submitted, not yet handed to the engine (read without a lock: an estimate)
        self.tokens_total = self.finished_total = self.rejected_total = self.steps_total = 0
        self.shed_total = self.start_failed_total = 0
        self.shed_late = cfg.shed_late
        # where the engine thread's time goes (the serving path's cost, scheduler/loadtest/serving_path.py)
        self.step_seconds_total = self.emit_seconds_total = 0.0
        self.chunks_total = 0
        self.error: BaseException | None = None
        self._finished_times: collections.deque[float] = collections.deque(maxlen=64)
        # what a scheduler's reward and its fallback guard read (docs/serving.md, stats)
        self.tokens_on_time_total = self.tokens_late_total = self.violations_total = 0
        self.sla_met_total = 0
        self._recent_ttft: collections.deque[float] = collections.deque(maxlen=RECENT)
        self._recent_tpot: collections.deque[float] = collections.deque(maxlen=RECENT)
        self._arrivals: collections.deque[float] = collections.deque()
        self._last_sla = (cfg.default_sla_ttft_ms, cfg.default_sla_tpot_ms)  # the newest request's, for scale

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "EngineHost":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="smartexit-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the engine thread; requests still active get a final ``cancelled`` chunk."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        for live in list(self._live.values()):
            self._finish(live, "cancelled")

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ------------------------------------------------------------------ callers' side (any thread)
    def submit(self, req: GenRequest, emit: Callable[[Chunk], None]) -> None:
        """Queue a generation; ``emit`` gets its chunks on the engine thread.

        Raises:
            HostError: ``invalid_request`` (naming the field), ``overloaded`` or ``internal`` (the
                engine thread has died).
        """
        if not self.alive:
            raise HostError("internal", f"the engine is not running ({self.error!r})" if self.error else
                            "the engine is not running")
        try:
            mode = Mode(req.mode)
        except ValueError:
            raise HostError("invalid_request", f"mode {req.mode!r} is not one of "
                            f"{', '.join(m.value for m in Mode)}", "mode") from None
        ereq = Request(list(req.prompt), int(req.max_tokens), float(req.temperature), float(req.top_p),
                       tuple(req.stop_ids), req.seed, mode=mode)
        try:
            self.engine.check(ereq)
        except RequestError as exc:
            raise HostError("invalid_request", str(exc), exc.field) from None
        for name in ("sla_ttft_ms", "sla_tpot_ms"):
            v = getattr(req, name)
            if v is not None and not v > 0:
                raise HostError("invalid_request", f"{name} must be > 0, got {v}", name)
        if not req.request_id or req.request_id in self._live:
            raise HostError("invalid_request", f"request id {req.request_id!r} is empty or already active",
                            "request_id")
        waiting = self._queued + len(self.engine.waiting)
        if waiting >= self.cfg.max_waiting:
            self.rejected_total += 1
            raise HostError("overloaded", f"{waiting} requests are waiting (limit {self.cfg.max_waiting})",
                            retry_after_s=self._retry_after(waiting))
        self._queued += 1
        self._arrivals.append(time.monotonic())  # deque appends are atomic; the engine thread trims
        self._inbox.append(("submit", (req, ereq, emit), None))
        self._wake.set()

    def cancel(self, request_id: str, wait: bool = True) -> bool:
        """Cancel a request (its final chunk says ``cancelled``); True if it was active. ``wait=False``
        (from an ``emit`` on the engine thread, which must not wait for itself) queues it and returns True."""
        if not wait:
            self._inbox.append(("cancel", request_id, None))
            self._wake.set()
            return True
        return bool(self._call("cancel", request_id))

    def control(self, op: dict[str, Any]) -> dict[str, Any]:
        """A control op (docs/serving.md): ``stats``, ``set``, ``cancel``, ``audit_reset``.

        Raises:
            HostError: ``invalid_request`` for an unknown op or a bad value.
        """
        name = op.get("op") if isinstance(op, dict) else None
        if name == "stats":
            return self._call("stats", None)
        if name == "set":
            values = {}
            for key in ("prefill_budget", "max_running"):
                if key in op:
                    v = op[key]
                    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                        raise HostError("invalid_request", f"{key} must be an integer >= 1, got {v!r}", key)
                    values[key] = v
            if "shed_late" in op:
                if not isinstance(op["shed_late"], bool):
                    raise HostError("invalid_request", f"shed_late must be true or false, got {op['shed_late']!r}",
                                    "shed_late")
                values["shed_late"] = op["shed_late"]
            return self._call("set", values)
        if name == "cancel":
            rid = op.get("request_id")
            if not isinstance(rid, str):
                raise HostError("invalid_request", "cancel needs a string request_id", "request_id")
            return {"cancelled": self.cancel(rid)}
        if name == "audit_reset":
            return self._call("audit_reset", None)
        raise HostError("invalid_request", f"unknown control op {name!r}; expected stats, set, cancel or "
                        "audit_reset", "op")

    def stats(self) -> dict[str, Any]:
        return self._call("stats", None)

    def _call(self, what: str, arg: Any) -> Any:
        if not self.alive:
            return self._apply(what, arg)  # nobody steps the engine: safe to answer here
        fut: Future = Future()
        self._inbox.append((what, arg, fut))
        self._wake.set()
        return fut.result(timeout=self.cfg.control_timeout_s)

    def _retry_after(self, waiting: int) -> float:
        """Seconds until the queue has room, from its length and the engine's recent rate of finishing."""
        rate = self._finish_rate()
        return float(max(1.0, min(60.0, np.ceil(waiting / rate)))) if rate > 0 else 1.0

    # ------------------------------------------------------------------ the engine thread
    def _run(self) -> None:
        log_file = open(self.cfg.step_log, "a", encoding="utf-8") if self.cfg.step_log else None
        try:
            while not self._stop.is_set():
                self._drain()
                if self.shed_late:
                    self._shed()
                busy = self.engine.has_work
                if busy:
                    before = self._before_step() if log_file is not None else None
                    t0 = time.perf_counter()
                    events = self.engine.step()
                    t1 = time.perf_counter()
                    self.steps_total += 1
                    chunks = self._flush()
                    t2 = time.perf_counter()
                    self.chunks_total += chunks
                    self.step_seconds_total += t1 - t0
                    self.emit_seconds_total += t2 - t1
                    if before is not None:
                        self._log_step(log_file, before, events, t1 - t0, t2 - t1, chunks)
                self._maybe_audit()
                if not busy and not self._inbox:
                    if log_file is not None:
                        log_file.flush()
                    self._wake.wait(0.05)
                    self._wake.clear()
        except BaseException as exc:  # noqa: BLE001 - the thread must report its death, not vanish
            self.error = exc
            log.exception("engine thread died")
            for live in list(self._live.values()):
                self._finish(live, "error")
            while self._inbox:
                _, _, fut = self._inbox.popleft()
                if fut is not None:
                    fut.set_exception(HostError("internal", f"engine thread died: {exc!r}"))
        finally:
            if log_file is not None:
                log_file.close()

    def _shed(self) -> None:
        """Refuse the waiting requests whose TTFT deadline has passed (module doc)."""
        now = time.monotonic()
        late = [live for seq in self.engine.waiting if (live := self._by_engine.get(seq.id)) is not None
                and not live.shed and live.n_tokens == 0 and now >= live.arrival + live.sla_ttft_s]
        if not late:
            return
        retry = self._retry_after(len(self.engine.waiting))
        for live in late:
            live.shed, live.retry_after_s = True, retry
            self.engine.cancel(live.engine_id)
            self.shed_total += 1
        self._flush()

    def _before_step(self) -> tuple[dict[int, int], list[tuple[Any, int]]]:
        """What the step log needs from before a step: the decoding sequences' cached positions and the
        waiting or prefilling sequences with their prefilled tokens."""
        e = self.engine
        return {s.id: s.length for s in e.decoding}, [(s, s.prefilled) for s in e.waiting + e.prefilling]

    def _log_step(self, f: Any, before: tuple[dict[int, int], list[tuple[Any, int]]], events: list[TokenEvent],
                  step_s: float, emit_s: float, chunks: int) -> None:
        """One line: step and emit seconds, chunks sent, decode rows ``[cached positions, exit layer]`` of the
        sequences that took a plain step, and per decoding sequence ``k`` = [tokens emitted, 1 if they came from
        a draft round (a verification call of its own) else 0] and ``i`` their request ids in the same order,
        prefill chunks ``[start, tokens]`` (a prefill's first token is not a decode row)."""
        ctx, pending = before
        decoded = [ev for ev in events if ev.request_id in ctx and ev.token != NO_TOKEN]
        rounds = self.engine.round_ids
        rows = [[ctx[ev.request_id], ev.exit_layer] for ev in decoded if ev.request_id not in rounds]
        per_seq = collections.Counter(ev.request_id for ev in decoded)
        pre = [[start, s.prefilled - start] for s, start in pending if s.prefilled > start]
        now = time.monotonic()
        arr = self._recent_arrivals(now)
        n = len(arr)  # other threads append while this one reads: indices below a length read once
        arrived = next((k for k in range(n) if arr[n - 1 - k] < now - FRONT_WINDOW_S), n)
        seqs = sorted((n, int(rid in rounds), rid) for rid, n in per_seq.items())
        f.write(json.dumps({"s": round(step_s, 7), "e": round(emit_s, 7), "c": chunks, "d": rows,
                            "k": [[n, r] for n, r, _ in seqs], "i": [rid for _, _, rid in seqs], "p": pre,
                            "n": len(self._live), "a": arrived},
                           separators=(",", ":")) + "\n")
        if self.steps_total % 64 == 0:
            f.flush()  # a stack stopped without a graceful shutdown loses at most 64 lines

    def _recent_arrivals(self, now: float) -> collections.deque[float]:
        """The arrivals of the last RATE_WINDOW_S seconds (older ones dropped: only the engine thread trims)."""
        while self._arrivals and self._arrivals[0] < now - RATE_WINDOW_S:
            self._arrivals.popleft()
        return self._arrivals

    def _drain(self) -> None:
        while self._inbox:
            what, arg, fut = self._inbox.popleft()
            try:
                result = self._apply(what, arg)
            except Exception as exc:  # noqa: BLE001 - handed to the caller waiting on the future
                if fut is None:
                    raise
                fut.set_exception(exc)
            else:
                if fut is not None:
                    fut.set_result(result)

    def _apply(self, what: str, arg: Any) -> Any:
        if what == "submit":
            try:
                self._start_request(*arg)
            except Exception:  # noqa: BLE001 - one request that cannot start must not stop the engine for all
                req, _, emit = arg
                log.exception("request %s could not start; ending it with an error", req.request_id)
                self.start_failed_total += 1
                try:
                    emit(Chunk(req.request_id, [], [], "error"))
                except Exception:  # noqa: BLE001 - a broken receiver too: nothing more to tell it
                    log.exception("emit failed for request %s", req.request_id)
            return None
        if what == "cancel":
            live = self._live.get(arg)
            if live is None or live.engine_id < 0:
                return False
            ok = self.engine.cancel(live.engine_id)
            self._flush()
            return ok
        if what == "set":
            if "prefill_budget" in arg:  # clamped to the backend's largest chunk; stats say what applies
                self.engine.set_prefill_budget(arg["prefill_budget"])
            if "max_running" in arg:
                self.engine.set_admission_limit(arg["max_running"])
            if "shed_late" in arg:
                self.shed_late = arg["shed_late"]
            return self._stats()
        if what == "stats":
            return self._stats()
        if what == "audit_reset":
            self.audit.reset()
            self._audit_queue.clear()
            return self._stats()
        raise ValueError(what)

    def _start_request(self, req: GenRequest, ereq: Request, emit: Callable[[Chunk], None]) -> None:
        self._queued -= 1
        if ereq.mode is Mode.BOUNDED and self.audit.fallback:
            ereq.mode = Mode.FULL  # the audit found the certificate broken: no early exits until reset
        live = _Live(req, emit, time.monotonic(),
                     (req.sla_ttft_ms or self.cfg.default_sla_ttft_ms) / 1e3,
                     (req.sla_tpot_ms or self.cfg.default_sla_tpot_ms) / 1e3,
                     audited=(ereq.mode is Mode.BOUNDED and ereq.temperature == 0
                              and (self.cfg.audit.fraction > 0 or self._verdicts)),
                     history=list(req.prompt))
        self._last_sla = (live.sla_ttft_s * 1e3, live.sla_tpot_s * 1e3)
        ereq.on_token = lambda ev, live=live: self._on_token(live, ev)
        if live.audited and self._verdicts:
            ereq.on_verdict = lambda v, live=live: self._on_verdict(live, v)
        live.engine_id = self.engine.submit(ereq)
        self._live[req.request_id] = live
        self._by_engine[live.engine_id] = live

    def _on_token(self, live: _Live, ev: TokenEvent) -> None:
        if ev.token >= 0:
            live.tokens.append(ev.token)
            live.layers.append(ev.exit_layer)
            if live.audited:
                if self._verdicts:  # every token counts: an exit when its verdict comes (_on_verdict)
                    if ev.exit_layer >= self.num_layers:
                        self._record(ev.exit_layer, False)
                    else:
                        live.exits += 1
                elif self._rng.random() < self.cfg.audit.fraction:
                    self._sample(live, ev)
            live.history.append(ev.token)
            live.n_tokens += 1
            live.predicted = (ev.exit_layer if live.predicted is None
                              else EMA * ev.exit_layer + (1 - EMA) * live.predicted)
        if ev.finished:
            live.finish = "shed" if live.shed else ev.finish_reason
            self._maybe_unit(live)

    def _flush(self) -> int:
        """Hand each request the tokens of this step (and its end); returns the chunks sent."""
        now = time.monotonic()
        ready = [v for v in self._live.values() if v.tokens or v.finish]
        for live in ready:
            chunk = Chunk(live.req.request_id, live.tokens, live.layers, live.finish,
                          live.retry_after_s if live.finish == "shed" else None)
            live.tokens, live.layers = [], []
            self.tokens_total += len(chunk.tokens)
            self._account(live, len(chunk.tokens), now)
            if live.finish is not None:
                self._forget(live)
            self._send(live, chunk)
        return len(ready)

    def _finish(self, live: _Live, reason: str) -> None:
        self._forget(live)
        self._send(live, Chunk(live.req.request_id, live.tokens, live.layers, reason))

    def _forget(self, live: _Live) -> None:
        self._live.pop(live.req.request_id, None)
        self._by_engine.pop(live.engine_id, None)
        self.finished_total += 1
        now = time.monotonic()
        self._finished_times.append(now)
        if live.first is None or live.finish not in ("length", "stop"):
            return
        ttft = live.first - live.arrival
        tpot = (now - live.first) / (live.n_tokens - 1) if live.n_tokens > 1 else None
        self._recent_ttft.append(ttft)
        if tpot is not None:
            self._recent_tpot.append(tpot)
        self.sla_met_total += sla_met(ttft, tpot, live.sla_ttft_s, live.sla_tpot_s)

    def _account(self, live: _Live, n: int, now: float) -> None:
        """Count ``n`` tokens handed over at ``now`` on time or late (token i is due at arrival + TTFT
        + i x TPOT, the SLA slack's schedule); a request turning late counts one violation."""
        if n and live.first is None:
            live.first = now
        for i in range(live.n_tokens - n, live.n_tokens):
            if on_time(now, live.arrival, live.sla_ttft_s, live.sla_tpot_s, i):
                self.tokens_on_time_total += 1
            else:
                self.tokens_late_total += 1
                if not live.late:
                    live.late = True
                    self.violations_total += 1

    def _send(self, live: _Live, chunk: Chunk) -> None:
        try:
            live.emit(chunk)
        except Exception:  # noqa: BLE001 - a broken receiver must not stop the engine for the others
            log.exception("emit failed for request %s; cancelling it", live.req.request_id)
            if chunk.finish_reason is None and live.engine_id >= 0:
                self.engine.cancel(live.engine_id)

    def _finish_rate(self) -> float:
        times = self._finished_times
        if len(times) < 2 or times[-1] <= times[0]:
            return 0.0
        return (len(times) - 1) / (times[-1] - times[0])

    # ------------------------------------------------------------------ audit
    def _sample(self, live: _Live, ev: TokenEvent) -> None:
        if ev.exit_layer >= self.num_layers:  # reached the last layer: cannot exit falsely
            self._record(ev.exit_layer, False)
        else:
            self._queue_audit(_AuditItem(list(live.history), ev.token, ev.exit_layer))

    def _on_verdict(self, live: _Live, v: Verdict) -> None:
        """The engine's verdict on one of ``live``'s exits; one it could not judge is re-decoded."""
        if v.false_exit is not None:
            self._record(v.exit_layer, v.false_exit)
            self._resolve(live, v.false_exit)
        else:  # its prefix: the prompt and the tokens before it (the host has them all by now)
            self._queue_audit(_AuditItem(live.history[:len(live.req.prompt) + v.index], v.token, v.exit_layer, live))

    def _queue_audit(self, item: _AuditItem) -> None:
        if len(self._audit_queue) < self.cfg.audit.max_pending:
            self._audit_queue.append(item)
        else:
            self.audit_dropped += 1
            if item.live is not None:
                self._resolve(item.live, None)

    def _resolve(self, live: _Live, false_exit: bool | None) -> None:
        """One of ``live``'s exits judged (None: given up on, the request is no longer a whole unit)."""
        live.resolved += 1
        live.false += bool(false_exit)
        live.incomplete |= false_exit is None
        self._maybe_unit(live)

    def _maybe_unit(self, live: _Live) -> None:
        """A finished request whose every exit is judged: its false-exit rate over its judged tokens (all but
        the first, which the prefill decides at full depth) is one unit of the audit's per-request test."""
        if (not (self._verdicts and live.audited and live.finish is not None and live.resolved == live.exits)
                or live.counted):
            return
        live.counted = True
        if live.incomplete:
            self.audit.incomplete_units += 1
        elif live.n_tokens >= 2 and self.audit.record_unit(live.false / (live.n_tokens - 1)):
            self._fired()

    def _record(self, exit_layer: int, false_exit: bool) -> None:
        if self.audit.record(exit_layer, false_exit):
            self._fired()

    def _fired(self) -> None:
        log.warning("false-exit audit: the rate exceeds epsilon=%.4g (%s); bounded requests now run at "
                    "full depth", self.audit.epsilon, self.audit.as_dict())

    def _maybe_audit(self) -> None:
        e = self.engine
        if (not self._audit_queue or self._audit_inflight or e.waiting or self._inbox
                or e.cache.free_slots == 0 or len(e.prefilling) + len(e.decoding) >= e.cfg.max_running):
            return
        item = self._audit_queue.popleft()
        self._audit_inflight = True

        def verdict(ev: TokenEvent, item: _AuditItem = item) -> None:
            if ev.finished:
                self._audit_inflight = False
            if ev.token >= 0:
                self._record(item.exit_layer, ev.token != item.token)
            if item.live is not None and ev.finished:  # its request's unit: judged, or (no token) given up on
                self._resolve(item.live, ev.token != item.token if ev.token >= 0 else None)

        e.submit(Request(item.prefix, 1, mode=Mode.FULL, on_token=verdict))

    # ------------------------------------------------------------------ statistics
    def _stats(self) -> dict[str, Any]:
        s = self.engine.stats()
        now = time.monotonic()
        reqs, slacks, preds, recent = [], [], [], []
        for live in self._live.values():
            due = due_time(live.arrival, live.sla_ttft_s, live.sla_tpot_s, live.n_tokens)
            slack = (due - now) * 1e3
            slacks.append(slack)
            layers = s.recent_exit_layers.get(live.engine_id, [])
            recent += layers
            if live.predicted is not None:
                preds.append(live.predicted)
            reqs.append({"id": live.req.request_id, "tokens": live.n_tokens, "recent_exit_layers": layers,
                         "predicted_exit_layer": live.predicted, "slack_ms": slack})
        self._recent_arrivals(now)
        waiting = [v for v in self._live.values() if v.n_tokens == 0]
        oldest = min((v.arrival + v.sla_ttft_s for v in waiting), default=None)
        fallback_pred = self.expected_exit_layer if self.expected_exit_layer is not None else float(self.num_layers)
        audit = self.audit.as_dict()
        audit.update(fraction=self.cfg.audit.fraction, pending=len(self._audit_queue), dropped=self.audit_dropped,
                     engine_verdicts=self._verdicts, verdict_counts=dict(self.engine.verdict_counts))
        return {
            "time": now, "engine_alive": self.alive,
            "waiting": s.waiting + self._queued, "prefill_backlog_tokens": s.prefill_backlog_tokens,
            "running": s.running, "free_slots": s.free_slots, "prefill_budget": s.prefill_budget,
            "max_chunk": s.max_chunk, "max_running": s.max_running, "max_seqs": self.cfg.engine.max_seqs,
            "max_waiting": self.cfg.max_waiting,
            "num_layers": self.num_layers, "exit_layers": self.exit_layers, "requests": reqs,
            "mean_recent_exit_layer": float(np.mean(recent)) if recent else None,
            "predicted_exit_layer": float(np.mean(preds)) if preds else fallback_pred,
            "min_slack_ms": min(slacks) if slacks else None,
            "oldest_waiting_slack_ms": None if oldest is None else (oldest - now) * 1e3,
            "recent_ttft_p95_ms": p95_ms(self._recent_ttft), "recent_tpot_p95_ms": p95_ms(self._recent_tpot),
            "arrival_rate_rps": len(self._arrivals) / RATE_WINDOW_S,
            "sla_ttft_ms": self._last_sla[0], "sla_tpot_ms": self._last_sla[1],
            "sla_met_total": self.sla_met_total, "violations_total": self.violations_total,
            "tokens_on_time_total": self.tokens_on_time_total, "tokens_late_total": self.tokens_late_total,
            "tokens_total": self.tokens_total, "finished_total": self.finished_total,
            "rejected_total": self.rejected_total, "steps_total": self.steps_total,
            "shed_late": self.shed_late, "shed_total": self.shed_total, "start_failed_total": self.start_failed_total,
            "step_seconds_total": self.step_seconds_total, "emit_seconds_total": self.emit_seconds_total,
            "chunks_total": self.chunks_total, "audit": audit,
        }

