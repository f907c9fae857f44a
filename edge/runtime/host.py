"""EngineHost: the engine on a thread of its own, for servers (Triton's model.py, the in-process bench).

Callers on any thread ``submit`` requests, ``cancel`` them and send ``control`` ops; only the engine
thread touches the engine. ``submit`` validates at once (the engine's own checks read only its
configuration) and answers an overloaded queue with :class:`HostError` ``overloaded``; the rest goes
through an inbox the engine thread drains before every step, so nobody waits on a lock held for a
whole step. Each step's tokens reach the request's ``emit`` as one :class:`Chunk` (one token, or
several in mode exact), outside any lock; the last chunk carries the finish reason.

The host also keeps what a scheduler reads (queue, prefill backlog, running sequences, their recent
and predicted exit depth, SLA slack: docs/serving.md; the arithmetic in :mod:`edge.runtime.host_sla`) and
runs the online false-exit audit (:mod:`edge.runtime.audit`; the host's side in :mod:`edge.runtime.host_audit`:
the engine's verdicts, re-decodes while the engine has spare capacity, the fallback to full depth).

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
import logging
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

from edge.core.stats import p95_ms, sla_met
from edge.runtime.backend import Backend
from edge.runtime.engine import Engine
from edge.runtime.request import Mode, Request, TokenEvent
from edge.runtime.host_audit import HostAudit, check_epsilon
from edge.runtime.host_checks import check_request, parse_control
from edge.runtime.host_sla import finish_rate, late_tokens, outlook, predict_exit_layer, retry_after, ttft_tpot
from edge.runtime.host_steplog import Before, before_step, step_line
from edge.runtime.host_types import Chunk, GenRequest, HostConfig, HostError, LiveRequest
from edge.runtime.rules import BatchExitRule

log = logging.getLogger("smartexit.host")
RECENT = 32  # finished requests behind the recent tail latencies in ``stats``
RATE_WINDOW_S = 5.0  # arrivals counted for the recent arrival rate


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
        check_epsilon(cfg.audit, epsilon)
        self.cfg = cfg
        self.engine = Engine(backend, cfg.engine, rule)
        self.num_layers = backend.num_layers
        self.exit_layers = list(backend.exit_layers)
        self.expected_exit_layer = expected_exit_layer
        self._auditor = HostAudit(cfg.audit, epsilon, cfg.engine.kv_mode, self.num_layers)
        self.audit = self._auditor.estimate
        self._inbox: collections.deque[tuple[str, Any, Future | None]] = collections.deque()
        self._live: dict[str, LiveRequest] = {}
        self._by_engine: dict[int, LiveRequest] = {}
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

    @property
    def audit_dropped(self) -> int:
        """Audit re-decodes dropped for a full queue (``audit.max_pending``)."""
        return self._auditor.dropped

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
        ereq = check_request(req, self.engine)
        if not req.request_id or req.request_id in self._live:
            raise HostError("invalid_request", f"request id {req.request_id!r} is empty or already active",
                            "request_id")
        waiting = self._queued + len(self.engine.waiting)
        if waiting >= self.cfg.max_waiting:
            self.rejected_total += 1
            raise HostError("overloaded", f"{waiting} requests are waiting (limit {self.cfg.max_waiting})",
                            retry_after_s=retry_after(waiting, finish_rate(self._finished_times)))
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
        name, arg = parse_control(op)
        if name == "cancel":
            return {"cancelled": self.cancel(arg)}
        return self._call(name, arg)

    def stats(self) -> dict[str, Any]:
        return self._call("stats", None)

    def _call(self, what: str, arg: Any) -> Any:
        if not self.alive:
            return self._apply(what, arg)  # nobody steps the engine: safe to answer here
        fut: Future = Future()
        self._inbox.append((what, arg, fut))
        self._wake.set()
        return fut.result(timeout=self.cfg.control_timeout_s)

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
                    before = before_step(self.engine) if log_file is not None else None
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
                self._auditor.maybe_submit(self.engine, bool(self._inbox))
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
        retry = retry_after(len(self.engine.waiting), finish_rate(self._finished_times))
        for live in late:
            live.shed, live.retry_after_s = True, retry
            self.engine.cancel(live.engine_id)
            self.shed_total += 1
        self._flush()

    def _log_step(self, f: Any, before: Before, events: list[TokenEvent], step_s: float, emit_s: float,
                  chunks: int) -> None:
        """One line of the step log (:func:`edge.runtime.host_steplog.step_line`)."""
        now = time.monotonic()
        f.write(step_line(self.engine, before, events, step_s, emit_s, chunks, self._recent_arrivals(now), now,
                          len(self._live)))
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
            self._auditor.reset()
            return self._stats()
        raise ValueError(what)

    def _start_request(self, req: GenRequest, ereq: Request, emit: Callable[[Chunk], None]) -> None:
        self._queued -= 1
        if ereq.mode is Mode.BOUNDED and self.audit.fallback:
            ereq.mode = Mode.FULL  # the audit found the certificate broken: no early exits until reset
        live = LiveRequest(req, emit, time.monotonic(),
                           (req.sla_ttft_ms or self.cfg.default_sla_ttft_ms) / 1e3,
                           (req.sla_tpot_ms or self.cfg.default_sla_tpot_ms) / 1e3,
                           audited=self._auditor.eligible(ereq), history=list(req.prompt))
        self._last_sla = (live.sla_ttft_s * 1e3, live.sla_tpot_s * 1e3)
        ereq.on_token = lambda ev, live=live: self._on_token(live, ev)
        if live.audited and self._auditor.verdicts:
            ereq.on_verdict = lambda v, live=live: self._auditor.on_verdict(live, v)
        live.engine_id = self.engine.submit(ereq)
        self._live[req.request_id] = live
        self._by_engine[live.engine_id] = live

    def _on_token(self, live: LiveRequest, ev: TokenEvent) -> None:
        if ev.token >= 0:
            live.tokens.append(ev.token)
            live.layers.append(ev.exit_layer)
            if live.audited:
                self._auditor.on_token(live, ev)
            live.history.append(ev.token)
            live.n_tokens += 1
            live.predicted = predict_exit_layer(live.predicted, ev.exit_layer)
        if ev.finished:
            live.finish = "shed" if live.shed else ev.finish_reason
            self._auditor.maybe_unit(live)

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

    def _finish(self, live: LiveRequest, reason: str) -> None:
        self._forget(live)
        self._send(live, Chunk(live.req.request_id, live.tokens, live.layers, reason))

    def _forget(self, live: LiveRequest) -> None:
        self._live.pop(live.req.request_id, None)
        self._by_engine.pop(live.engine_id, None)
        self.finished_total += 1
        now = time.monotonic()
        self._finished_times.append(now)
        if live.first is None or live.finish not in ("length", "stop"):
            return
        ttft, tpot = ttft_tpot(live.arrival, live.first, now, live.n_tokens)
        self._recent_ttft.append(ttft)
        if tpot is not None:
            self._recent_tpot.append(tpot)
        self.sla_met_total += sla_met(ttft, tpot, live.sla_ttft_s, live.sla_tpot_s)

    def _account(self, live: LiveRequest, n: int, now: float) -> None:
        """Count ``n`` tokens handed over at ``now`` on time or late (token i is due at arrival + TTFT
        + i x TPOT, the SLA slack's schedule); a request turning late counts one violation."""
        if n and live.first is None:
            live.first = now
        late = late_tokens(live, n, now)
        self.tokens_on_time_total += n - late
        self.tokens_late_total += late
        if late and not live.late:
            live.late = True
            self.violations_total += 1

    def _send(self, live: LiveRequest, chunk: Chunk) -> None:
        try:
            live.emit(chunk)
        except Exception:  # noqa: BLE001 - a broken receiver must not stop the engine for the others
            log.exception("emit failed for request %s; cancelling it", live.req.request_id)
            if chunk.finish_reason is None and live.engine_id >= 0:
                self.engine.cancel(live.engine_id)

    # ------------------------------------------------------------------ statistics
    def _stats(self) -> dict[str, Any]:
        s = self.engine.stats()
        now = time.monotonic()
        view = outlook(self._live.values(), s.recent_exit_layers, now, self.expected_exit_layer, self.num_layers)
        self._recent_arrivals(now)
        audit = self._auditor.stats(self.engine.verdict_counts)
        return {
            "time": now, "engine_alive": self.alive,
            "waiting": s.waiting + self._queued, "prefill_backlog_tokens": s.prefill_backlog_tokens,
            "running": s.running, "free_slots": s.free_slots, "prefill_budget": s.prefill_budget,
            "max_chunk": s.max_chunk, "max_running": s.max_running, "max_seqs": self.cfg.engine.max_seqs,
            "max_waiting": self.cfg.max_waiting,
            "num_layers": self.num_layers, "exit_layers": self.exit_layers, **view,
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

