"""The engine: continuous batching, chunked prefill, batched hierarchical exits.

Each ``step()``:
1. admits waiting requests while the admission limit and free cache slots allow;
2. runs one decode step for every sequence past its prompt: segment by segment,
   after each exit the rule picks the rows that stop there, their tokens are
   decided, and the batch is compacted to the rows still running
   (edge/runtime/exit_step.py, ``_step``);
3. spends the prefill budget (tokens per iteration, the scheduler's knob) on
   prompt chunks, full depth (Sarathi-Serve's chunked prefill).
Before admitting, it ends the requests whose deadline has passed.

Events reach the request's ``on_token`` callback as they happen and are returned by
``step()``. A callback may cancel any request, its own included: the engine
never iterates a list a cancel changes, and a token decided in the same step for
a request cancelled that way is dropped.

Skipped layers still need keys / values for later tokens: ``propagate`` or ``defer``
(edge/runtime/skipped_kv.py).

Whether a decode iteration drafts, and the speculative rounds of requests in mode exact,
are in edge/runtime/rounds.py (``_decode``).
"""
from __future__ import annotations

import itertools
import logging
import time
import weakref
from dataclasses import dataclass
from typing import Callable

import numpy as np

from edge.runtime.backend import Backend
from edge.runtime.cache import KVCache
from edge.runtime.engine_config import EngineConfig, KVMode
from edge.runtime.exit_step import ExitStep
from edge.runtime.gate import StepGate
from edge.model.lookup import Lookup
from edge.runtime.request import NO_TOKEN, Mode, Request, TokenEvent, _Seq, check_request
from edge.runtime.rounds import SpeculativeRounds
from edge.runtime.rules import BatchExitRule, NeverExit
from edge.runtime.sampling import choose_token
from edge.runtime.settings import clamp_budget
from edge.runtime.speculative import StopRule
from edge.core.errors import ConfigError, RequestError

log = logging.getLogger("smartexit.engine")


@dataclass
class EngineStats:
    waiting: int
    prefill_backlog_tokens: int
    running: int
    recent_exit_layers: dict[int, list[int]]  # request id -> last exit layers
    deadlines: dict[int, float | None]
    prefill_budget: int
    max_running: int
    free_slots: int
    max_chunk: int | None  # the backend's largest chunk (None: no limit); the budget never exceeds it


class Engine(ExitStep, SpeculativeRounds):
    def __init__(self, backend: Backend, cfg: EngineConfig, rule: BatchExitRule | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``clock``: the time base of ``Request.deadline`` (seconds)."""
        self.backend, self.cfg, self.clock = backend, cfg, clock
        self.rule = rule or NeverExit()
        if cfg.max_len > backend.spec.max_positions:
            raise ConfigError(f"engine.max_len {cfg.max_len} exceeds the model's {backend.spec.max_positions} positions")
        self.max_chunk = backend.max_chunk
        if clamp_budget(cfg.prefill_budget, self.max_chunk) != cfg.prefill_budget:
            log.warning("engine.prefill_budget %d exceeds the %s backend's largest chunk %d: clamped to it",
                        cfg.prefill_budget, backend.name, self.max_chunk)
            cfg.prefill_budget = clamp_budget(cfg.prefill_budget, self.max_chunk)
        # an idle cache of this shape that the backend computes on already (an earlier engine's, every slot
        # free) is taken over with the backend's bindings over it: an engine per request or per run does not
        # rebuild them (on ONNX Runtime, a binding per call shape, ~0.4 ms each and a slower first call)
        prev = backend.cache
        if (prev is not None and prev.shape == (cfg.max_seqs, backend.num_kv_heads, cfg.max_len, backend.head_dim)
                and prev.num_layers == backend.num_layers and prev.free_slots == prev.slots
                and bool(prev.keys) == backend.host_cache):
            self.cache = prev
        else:
            self.cache = KVCache(backend.num_layers, backend.num_kv_heads, backend.head_dim, cfg.max_seqs,
                                 cfg.max_len, allocate=backend.host_cache)
            backend.attach(self.cache)
        self._init_exits()  # where the exit rule is decided (edge/runtime/exit_step.py)
        self._init_speculation()  # mode exact's drafts (edge/runtime/rounds.py)
        self.step_gate = self._step_gate() if cfg.exit_gate else None
        # the full model's verdicts on greedy early exits, free with deferral (Verdict), of requests that ask
        # for them: judged, false among them, and unjudged (the request ended before the exit's layers ran)
        self.verdict_counts = {"judged": 0, "false": 0, "unjudged": 0}
        self.round_ids: set[int] = set()  # the requests whose tokens of the last step came from a draft round
        self.waiting: list[_Seq] = []
        self.prefilling: list[_Seq] = []
        self.decoding: list[_Seq] = []
        self._events: list[TokenEvent] = []  # delivered to callbacks, not yet returned by step()
        self._ids = itertools.count()

    def _step_gate(self) -> StepGate:
        """The step gate of this backend, K/V mode and rule: kept by the backend like the draft costs, so an
        engine per request or per benchmark run starts from what earlier ones measured (a checking step's
        cost depends on the rule and the K/V mode, so each pair has its own)."""
        held = held_step_gate(self.backend, self.cfg.kv_mode, self.rule)
        if held is not None:
            return held
        gates = self.backend.draft_costs.setdefault("step_gates", {})
        key = (self.cfg.kv_mode, id(self.rule))
        gate = StepGate()
        try:
            gates[key] = (weakref.ref(self.rule), gate)
        except TypeError:  # a rule without weak references: this engine's own gate
            pass
        return gate

    # ---------------------------------------------------------------- control
    def submit(self, req: Request) -> int:
        """Queue a request; raises :class:`RequestError` as :meth:`check` does."""
        self.check(req)
        seq = _Seq(next(self._ids), req, submitted=self.clock())
        seq.rng = np.random.default_rng(req.seed) if req.temperature > 0 else None
        self.waiting.append(seq)
        return seq.id

    def check(self, req: Request) -> None:
        """Raise :class:`RequestError` (naming the field) for a request :meth:`submit` would refuse: an
        empty or oversize prompt, out-of-vocabulary ids, bad sampling values, an unknown or unavailable
        mode. Reads only the configuration, so another thread may call it while the engine steps.
        Normalises ``req.mode`` to :class:`Mode`."""
        check_request(req, self.cfg.max_len, self.backend.vocab_size)
        if req.mode is Mode.EXACT and self.cfg.speculative.exit_only:
            if self._draft_seg is None:
                raise RequestError("mode 'exact' drafts from an early exit, and this model has none; use 'full'",
                                   "mode")
            if self.cfg.speculative.stop is StopRule.CALIBRATED and self._agreement is None:
                raise RequestError("mode 'exact' with the calibrated draft-length rule needs the threshold "
                                   "table's calibrators (run the engine with the calibrated rule), or set "
                                   "speculative.stop to 'fixed' or 'top1'", "mode")

    def cancel(self, request_id: int) -> bool:
        """Stop a request (waiting, in prefill or decoding) and free its cache slot; True if it was
        still active. Its callback gets a "cancelled" event at once, which the current step (when
        called from a callback) or the next one also returns."""
        for seq in self.waiting + self.prefilling + self.decoding:
            if seq.id == request_id:
                self._end(seq, "cancelled")
                return True
        return False

    def set_prefill_budget(self, tokens: int) -> int:
        """Prompt tokens per step from now on, clamped to the backend's largest chunk; returns the
        budget applied.

        Raises:
            ConfigError: ``tokens`` < 1.
        """
        if tokens < 1:
            raise ConfigError(f"prefill budget must be >= 1 token, got {tokens}")
        self.cfg.prefill_budget = clamp_budget(tokens, self.max_chunk)
        return self.cfg.prefill_budget

    def set_admission_limit(self, n: int) -> None:
        if n < 1:
            raise ConfigError(f"admission limit must be >= 1, got {n}")
        self.cfg.max_running = int(n)

    @property
    def has_work(self) -> bool:
        """Requests are active, or events are not yet returned by ``step()``."""
        return bool(self.waiting or self.prefilling or self.decoding or self._events)

    def stats(self) -> EngineStats:
        backlog = sum(len(s.req.prompt) - s.prefilled for s in self.waiting + self.prefilling)
        active = self.prefilling + self.decoding
        return EngineStats(
            waiting=len(self.waiting), prefill_backlog_tokens=backlog, running=len(active),
            recent_exit_layers={s.id: s.exit_layers[-8:] for s in self.decoding},
            deadlines={s.id: s.req.deadline for s in self.waiting + active},
            prefill_budget=self.cfg.prefill_budget, max_running=self.cfg.max_running,
            free_slots=self.cache.free_slots, max_chunk=self.max_chunk,
        )

    def run_until_idle(self) -> None:
        """Step until every submitted request has finished."""
        while self.has_work:
            self.step()

    # ---------------------------------------------------------------- the loop
    def step(self) -> list[TokenEvent]:
        """One iteration; returns its events (and those of cancels since the last step) in the order
        the callbacks saw them."""
        self._expire()
        self._admit()
        self.round_ids = set()
        if self.decoding:
            self._decode(list(self.decoding))  # drafts or plain steps (edge/runtime/rounds.py)
        if self.prefilling:
            self._prefill()
        events, self._events = self._events, []
        return events

    def _expire(self) -> None:
        """End the requests whose deadline has passed, before they take a slot or a step."""
        now = self.clock()
        for seq in self.waiting + self.prefilling + self.decoding:
            # not finished: an earlier deadline event's callback may have cancelled it
            if not seq.finished and seq.req.deadline is not None and now >= seq.req.deadline:
                self._end(seq, "deadline")

    def _admit(self) -> None:
        while (self.waiting and self.cache.free_slots
               and len(self.prefilling) + len(self.decoding) < self.cfg.max_running):
            seq = self.waiting.pop(0)
            seq.slot = seq.admitted_slot = self.cache.alloc()
            self.prefilling.append(seq)
        # a decode batch in slot order is one block of the cache when its slots are consecutive
        self.decoding.sort(key=lambda s: s.slot)

    def _prefill(self) -> None:
        """Spend the prefill budget on prompt chunks, one sequence per call, full depth; no call longer
        than the backend's largest chunk (the budget is clamped to it, and so is each chunk: a caller may
        have written ``cfg.prefill_budget`` directly)."""
        if self.cfg.prefill_together and self.backend.prefills_together:
            return self._prefill_together()
        budget = self.cfg.prefill_budget
        for seq in list(self.prefilling):
            if seq.finished:  # cancelled by a callback earlier in this loop
                continue
            n = self._chunk(seq, budget)
            if n <= 0:
                break
            budget -= n
            x = np.array([seq.req.prompt[seq.prefilled:seq.prefilled + n]], np.int64)  # [1, n]
            out = self.backend.full(x, np.array([seq.slot]), np.array([seq.prefilled]))  # full depth, last head only
            self._prefilled(seq, n, out.logits, 0)

    def _prefill_together(self) -> None:
        """:meth:`_prefill` with the first chunks of prompts in consecutive cache slots and of one length in one
        call of ``[k, n]`` rows (``cfg.prefill_together``, a backend that takes them: ``prefills_together``; at
        most its ``max_batch`` sequences): the same budget, the same chunks, fewer calls. A chunk after a
        prompt's first has a past, and runs alone."""
        budget, todo = self.cfg.prefill_budget, []
        for seq in self.prefilling:
            n = self._chunk(seq, budget)
            if n <= 0:
                break
            budget -= n
            todo.append((seq, n))
        most = self.backend.max_batch or len(todo)
        while todo:
            todo = [(s, n) for s, n in todo if not s.finished]  # a callback may have cancelled one
            if not todo:
                break
            (first, n), k = todo[0], 1
            while (first.prefilled == 0 and k < min(len(todo), most) and todo[k][1] == n
                   and todo[k][0].slot == first.slot + k and todo[k][0].prefilled == 0):
                k += 1
            group, todo = [s for s, _ in todo[:k]], todo[k:]
            x = np.array([s.req.prompt[s.prefilled:s.prefilled + n] for s in group], np.int64)  # [k, n]
            out = self.backend.full(x, np.array([s.slot for s in group]), np.array([s.prefilled for s in group]))
            for r, seq in enumerate(group):
                if not seq.finished:
                    self._prefilled(seq, n, out.logits, r)

    def _chunk(self, seq: _Seq, budget: int) -> int:
        """Prompt tokens of ``seq`` its next chunk takes: the rest of its prompt, within ``budget`` and the
        backend's largest chunk."""
        return min(len(seq.req.prompt) - seq.prefilled, budget, self.max_chunk or budget)

    def _prefilled(self, seq: _Seq, n: int, logits, row: int) -> None:
        """``n`` more prompt tokens of ``seq`` are in its cache slot, row ``row`` of the call's ``logits`` of
        the last: at the prompt's end the sequence decodes, its first token from them (read only then: a
        backend may hold them on its device until read)."""
        seq.prefilled += n
        if seq.prefilled == len(seq.req.prompt):
            self.prefilling.remove(seq)
            self.decoding.append(seq)
            # checks and lookup drafts read it; a request in mode full neither checks nor drafts (its index cost
            # mode full on the exits graphs 2% at batch 8, and an audit's one-token verdict its whole prefix)
            if (self._candidates and seq.req.mode is Mode.BOUNDED) or self._drafts(seq):
                seq.lookup = Lookup(seq.req.prompt, self._lookup_table)
            token = choose_token(logits[row], seq.req.temperature, seq.req.top_p, seq.rng)
            self._emit(seq, token, self.backend.num_layers)

    def _emit(self, seq: _Seq, token: int, exit_layer: int) -> None:
        seq.tokens.append(token)
        if seq.lookup is not None:
            seq.lookup.push(token)
        seq.exit_layers.append(exit_layer)
        reason = None
        if token in seq.req.stop_ids:
            reason = "stop"
        elif len(seq.tokens) >= seq.req.max_tokens:
            reason = "length"
        if reason is not None:  # before the callback: a cancel from it finds nothing left to stop
            self._release(seq, reason)
        self._deliver(seq, TokenEvent(seq.id, token, exit_layer, len(seq.tokens) - 1, reason is not None, reason))

    def _end(self, seq: _Seq, reason: str) -> None:
        """End an active request without a token (cancelled, deadline)."""
        self._release(seq, reason)
        self._deliver(seq, TokenEvent(seq.id, NO_TOKEN, NO_TOKEN, len(seq.tokens), True, reason))

    def _deliver(self, seq: _Seq, ev: TokenEvent) -> None:
        self._events.append(ev)
        if seq.req.on_token is not None:
            seq.req.on_token(ev)

    def _release(self, seq: _Seq, reason: str) -> None:
        """Take a finished request out of its queue and free its cache slot."""
        for group in (self.waiting, self.prefilling, self.decoding):
            if seq in group:
                group.remove(seq)
        if seq.slot >= 0:
            self.cache.release(seq.slot)
            seq.slot = -1
        owed, seq.pending = seq.pending, []
        for p in owed:  # exits whose skipped layers will never run: not judged by the engine
            self._judge(seq, p, None)
        seq.finished = reason


def held_step_gate(backend: Backend, kv_mode: KVMode, rule: object) -> StepGate | None:
    """The step gate ``backend`` keeps for engines in ``kv_mode`` with ``rule`` (None: none made yet)."""
    held = backend.draft_costs.get("step_gates", {}).get((KVMode(kv_mode), id(rule)))
    return held[1] if held is not None and held[0]() is rule else None
