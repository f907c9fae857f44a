"""The engine: continuous batching, chunked prefill, batched hierarchical exits.

Each ``step()``:
1. admits waiting requests while the admission limit and free cache slots allow;
2. runs one decode step for every sequence past its prompt: segment by segment,
   after each exit the rule picks the rows that stop there, their tokens are
   decided, and the batch is compacted to the rows still running;
3. spends the prefill budget (tokens per iteration, the scheduler's knob) on
   prompt chunks, full depth (Sarathi-Serve's chunked prefill).
Before admitting, it ends the requests whose deadline has passed.

Events reach the request's ``on_token`` callback as they happen and are returned by
``step()``. A callback may cancel any request, its own included: the engine
never iterates a list a cancel changes, and a token decided in the same step for
a request cancelled that way is dropped.

Skipped layers still need keys / values for later tokens. ``propagate`` (CALM):
the exit's residual goes through each skipped layer's K/V projections at once.
``defer`` (EE-LLM style recomputation): the exited row is kept pending and run
through the skipped layers, for real, together with the sequence's next token
when that token reaches them. Pending rows of a sequence always form a suffix
whose next segment does not increase with position, so at each segment the
rows that must run are a contiguous suffix plus the new token.
"""
from __future__ import annotations

import enum
import itertools
import logging
import math
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from edge.runtime.backend import Backend, SegmentOut
from edge.runtime.cache import KVCache
from edge.runtime.gate import StepGate
from edge.model.candidates import lookup_feature
from edge.model.lookup import MAX_N as LOOKUP_MAX_N, NONE as LOOKUP_NONE, Lookup
from edge.model.ngram import MAX_N as NGRAM_MAX_N, checked_table
from edge.runtime.rules import TOP1, BatchExitRule, NeverExit, score_form
from edge.runtime.sampling import choose_token, token_distribution
from edge.runtime.settings import MAX_RUNNING, MAX_SEQS, PREFILL_BUDGET, clamp_budget
from edge.runtime.speculative import (MAX_VERIFY_ROWS, CallCosts, DraftCosts, ExitDraftGate, LookupAcceptance, Source,
                                      SpecConfig, SpecStats, SpeculationGate, StopRule, accept_greedy, accept_sampled,
                                      include_next, lookup_length)
from edge.core.errors import ConfigError, RequestError

log = logging.getLogger("smartexit.engine")


class Mode(str, enum.Enum):
    """What a request accepts. ``bounded``: calibrated exits, false exits within the certified eps;
    ``full``: every token from the full model (this request never exits early); ``exact``: the full
    model's output, sped up by speculative decoding from context lookups and a draft exit
    (edge/runtime/speculative.py)."""

    BOUNDED = "bounded"
    FULL = "full"
    EXACT = "exact"


class KVMode(str, enum.Enum):
    PROPAGATE = "propagate"
    DEFER = "defer"


@dataclass
class EngineConfig:
    max_seqs: int = MAX_SEQS.default  # cache slots
    max_len: int = 512  # tokens per sequence (prompt + output), <= the model's context window
    # prompt tokens per iteration; clamped to the backend's largest chunk (Backend.max_chunk)
    prefill_budget: int = PREFILL_BUDGET.default
    max_running: int = MAX_RUNNING.default  # admission limit (sequences holding a slot)
    kv_mode: KVMode = KVMode.PROPAGATE
    # With deferral, rows exit only while the decode batch holds at most this many sequences (None: any
    # batch). At batch 1 a sequence's deferred rows ride along with its next token in one call; at
    # batch > 1 they need a pass of their own over every later segment (ONNX Runtime's CPU attention
    # takes several rows with a past only at batch 1) and the rows still running sit in scattered
    # cache slots, so exits cost more than they skip (measured: 0.47x full depth at batch 16). Above
    # the limit every row runs to full depth: the K/V stays exact and no token exits falsely.
    defer_exit_max_batch: int | None = 1
    # With deferral, compute a leaving row's skipped layers in the same step instead of with its next token:
    # the row keeps running through the remaining segments (its later checks ignored) and emits its exit's
    # token. The K/V and the tokens are deferral's (every layer of every token computed exactly), without
    # deferral's extra calls over scattered slots at batch > 1; it saves nothing, so it is for free-running
    # calibration and evaluation only (calibration.freerun), never for serving.
    defer_inline: bool = False
    # Measure, per batch size, what a decode step that checks exits costs against one call of every layer,
    # and run the cheaper (edge/runtime/gate.py): exits never make a step dearer than full depth. The served
    # engine runs with it (exporters/triton.py, repo.exit_gate); off here, so that an engine does what its
    # rule says (calibration, the benches' exit systems, the tests).
    exit_gate: bool = False
    speculative: SpecConfig = field(default_factory=SpecConfig)  # mode exact: draft exit, stop rule
    # Requests in mode bounded also take mode exact's context-lookup and corpus drafts wherever a round is
    # expected to pay (never exit drafts, never while deferred rows are owed): a verified round emits the
    # full model's tokens, as a full-depth step does, so what the certificate bounds stays the rule's
    # decisions on the steps that check (the step gate's argument, edge/runtime/gate.py). A bounded request
    # is then never slower than an exact one for want of drafts. The served engine runs with it
    # (exporters/triton.py, repo.bounded_drafts); off here, so that an engine does what its rule says.
    bounded_drafts: bool = False
    # Requests in mode exact speculate while the decode batch holds at most this many sequences (None: any
    # batch); above it they decode at full depth, which is lossless too. ONNX Runtime's CPU attention
    # verifies several rows of a sequence only at batch 1, so a batch verifies sequence by sequence.
    speculate_max_batch: int | None = 1

    def __post_init__(self) -> None:
        self.kv_mode = KVMode(self.kv_mode)
        if isinstance(self.speculative, dict):
            self.speculative = SpecConfig(**self.speculative)
        if self.speculate_max_batch is not None and self.speculate_max_batch < 1:
            raise ConfigError(f"engine.speculate_max_batch must be >= 1 or None, got {self.speculate_max_batch}")
        for setting in (MAX_SEQS, PREFILL_BUDGET, MAX_RUNNING):
            setting.check(getattr(self, setting.name), "engine")
        if self.max_len < 2:
            raise ConfigError(f"engine.max_len must be >= 2, got {self.max_len}")
        if self.defer_exit_max_batch is not None and self.defer_exit_max_batch < 1:
            raise ConfigError(f"engine.defer_exit_max_batch must be >= 1 or None, got {self.defer_exit_max_batch}")


NO_TOKEN = -1  # token and exit layer of an event that ends a request without a token


@dataclass
class TokenEvent:
    """One output token, or the end of a request without one.

    ``finish_reason`` is set on a request's last event: "length" (``max_tokens`` reached), "stop" (a
    stop id was emitted), "cancelled" (:meth:`Engine.cancel`), "deadline" (``Request.deadline``
    passed). The last two carry no token: ``token`` and ``exit_layer`` are :data:`NO_TOKEN` and
    ``index`` is the number of tokens emitted before.
    """

    request_id: int
    token: int
    exit_layer: int
    index: int  # position in the output
    finished: bool
    finish_reason: str | None = None


@dataclass
class Request:
    prompt: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    stop_ids: tuple[int, ...] = ()
    seed: int | None = None
    # absolute time on the engine's clock (time.monotonic by default): a request still active at the
    # start of a later step is ended there, finish_reason "deadline", and its cache slot freed
    deadline: float | None = None
    on_token: Callable[[TokenEvent], None] | None = None
    mode: Mode = Mode.BOUNDED
    # with deferral, the full model's verdict on each greedy token this request emitted from an early exit
    # (:class:`Verdict`), once the exit's skipped layers have been computed (with the next token); the
    # engine runs the one more head row this takes only for requests that set it
    on_verdict: Callable[["Verdict"], None] | None = None


@dataclass
class Verdict:
    """The full model's judgement of a token that left early, free with deferral.

    A row that exits with deferral owes its skipped layers; the engine computes them with the sequence's
    next token (or the batch's catch-up call) and there runs the last layer's head on that row too: its
    argmax is the full model's token on exactly the prefix the exit decided on (the row's K/V and every
    earlier one are exact under deferral). ``full_token`` is None when the request ended (its last token,
    a stop id, a cancel) before the owed layers ran: that exit is not judged by the engine."""

    request_id: int
    index: int  # the token's position in the output
    exit_layer: int
    token: int  # what the exit emitted
    full_token: int | None

    @property
    def false_exit(self) -> bool | None:
        return None if self.full_token is None else self.full_token != self.token


@dataclass
class _Pending:
    pos: int
    hidden: np.ndarray  # [D] residual at the depth reached so far
    next_seg: int
    # the token the exit emitted, its output index and layer, for the verdict (token -1: not judged, e.g.
    # a sampled token, whose exit is not an argmax the full model's argmax can judge)
    token: int = -1
    index: int = -1
    layer: int = -1


@dataclass(eq=False)  # identity: lists of sequences are searched by object
class _Seq:
    id: int
    req: Request
    slot: int = -1
    admitted_slot: int = -1  # the slot it held, kept after release (a batch run reads what it left there)
    prefilled: int = 0  # prompt tokens in the cache
    tokens: list[int] = field(default_factory=list)
    exit_layers: list[int] = field(default_factory=list)
    pending: list[_Pending] = field(default_factory=list)
    rng: np.random.Generator | None = None
    submitted: float = 0.0
    finished: str | None = None  # the finish reason, once ended
    lookup: Lookup | None = None  # the context lookup over prompt + output (a shortlist model's checks read it)

    @property
    def length(self) -> int:
        """Tokens whose position is in the cache (the newest output token is not yet)."""
        return self.prefilled + max(0, len(self.tokens) - 1)


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


class Engine:
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
        # a rule that is a linear score of the exit's features is computed in the segment graphs, and
        # the engine only reads its sign; any other rule is asked on the host (decide / decide_gated)
        linear = getattr(self.rule, "linear", None)
        f = backend.spec.num_features
        self._candidates = backend.spec.candidates  # checks over the shortlist, decided in the graph
        if self._candidates:
            if linear is None and getattr(self.rule, "score_form", None) is None:
                raise ConfigError("a model with a candidate shortlist decides in its graphs: the exit rule must be a "
                                  "score of the check's features (linear or score_form), e.g. a threshold table's")
            backend.set_rule({layer: score_form(self.rule, layer, f) for layer in backend.exit_layers[:-1]})
        elif linear is not None:
            backend.set_rule({layer: linear(layer, f) for layer in backend.exit_layers[:-1]})
        self._score_in_graph = self._candidates or linear is not None
        # a shortlist rule's routing: rows whose lookup feature is below this run every layer with no check
        self._route = float(getattr(self.rule, "route_min_lookup", 0.0)) if self._candidates else 0.0
        # ... and the corpus table its context lookup falls back to, the one it was calibrated with (or none)
        self._lookup_table = (checked_table(getattr(self.rule, "lookup_table_sha256", None),
                                            getattr(backend, "ngram_table", None), f"the {backend.name} backend")
                              if self._candidates else None)
        # self-speculative decoding (mode exact): the draft exit's segment, its stop rule's inputs
        spec = cfg.speculative
        self._agreement = getattr(self.rule, "agreement", None)
        decision = backend.exit_layers[:-1]
        draft = spec.draft_exit if spec.draft_exit is not None else (decision[0] if decision else None)
        if draft is not None and draft not in decision:
            raise ConfigError(f"speculative.draft_exit {draft} is not a decision exit of this model "
                              f"(exits {backend.exit_layers})")
        self.draft_exit = draft  # exit layer that drafts (None: the model has no decision exit)
        self._draft_seg = decision.index(draft) if draft is not None else None
        # the measured costs belong to the backend: an engine per request (or per benchmark run) starts from
        # what earlier engines measured instead of the prior
        key = draft or 0
        if key not in backend.draft_costs:
            backend.draft_costs[key] = DraftCosts(key, backend.num_layers, MAX_VERIFY_ROWS)
        self.spec_costs = backend.draft_costs[key]
        # lookup drafts: the graph of every layer's measured call costs and the drafts' acceptance, kept by
        # the backend like the draft costs
        if "calls" not in backend.draft_costs:
            backend.draft_costs["calls"] = CallCosts()
            backend.draft_costs["lookup"] = LookupAcceptance(LOOKUP_MAX_N, MAX_VERIFY_ROWS - 1)
            backend.draft_costs["corpus"] = LookupAcceptance(NGRAM_MAX_N, MAX_VERIFY_ROWS - 1)
        self.call_costs: CallCosts = backend.draft_costs["calls"]
        self._acceptance: dict[Source, LookupAcceptance] = {Source.LOOKUP: backend.draft_costs["lookup"],
                                                             Source.CORPUS: backend.draft_costs["corpus"]}
        # the corpus n-gram table the backend's export carries (edge/model/ngram.py), if any
        self._ngram = getattr(backend, "ngram_table", None) if Source.CORPUS in spec.sources else None
        if "exit_gate" not in backend.draft_costs:
            backend.draft_costs["exit_gate"] = ExitDraftGate()
        self._exit_gate: ExitDraftGate = backend.draft_costs["exit_gate"]
        # above batch 1, whether looking for drafts has paid: whole iterations' seconds per token, by batch size
        self._spec_gate: SpeculationGate = backend.draft_costs.setdefault("speculation_gate", SpeculationGate())
        # exit drafts need an exit, and the calibrated stop rule its calibrators
        self._exit_drafts = (Source.EXIT in spec.sources and self._draft_seg is not None
                             and not (spec.stop is StopRule.CALIBRATED and self._agreement is None))
        self.step_gate = self._step_gate() if cfg.exit_gate else None
        self.spec_stats = SpecStats()  # every speculative round
        self.source_stats = {src.value: SpecStats() for src in Source}  # the rounds of each draft source
        self.plain_steps = 0  # decode steps of exact requests that drafted nothing
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
        if not req.prompt:
            raise RequestError("empty prompt: at least one token is needed", "prompt")
        if req.max_tokens < 1:
            raise RequestError(f"max_tokens must be >= 1, got {req.max_tokens}", "max_tokens")
        if len(req.prompt) + req.max_tokens > self.cfg.max_len:
            raise RequestError(f"prompt of {len(req.prompt)} tokens + max_tokens {req.max_tokens} exceeds the "
                               f"context window of {self.cfg.max_len} tokens", "prompt")
        bad = [t for t in req.prompt if not 0 <= t < self.backend.vocab_size]
        if bad:
            raise RequestError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.backend.vocab_size})",
                               "prompt")
        if not (math.isfinite(req.temperature) and req.temperature >= 0):
            raise RequestError(f"temperature must be finite and >= 0, got {req.temperature}", "temperature")
        if not 0.0 < req.top_p <= 1.0:
            raise RequestError(f"top_p must be in (0, 1], got {req.top_p}", "top_p")
        # numpy's generator takes non-negative integers only; a negative seed used to kill the engine thread
        if req.seed is not None and (isinstance(req.seed, bool) or not isinstance(req.seed, (int, np.integer))
                                     or req.seed < 0):
            raise RequestError(f"seed must be a non-negative integer, got {req.seed!r}", "seed")
        try:
            req.mode = Mode(req.mode)
        except ValueError:
            raise RequestError(f"mode {req.mode!r} is not one of {', '.join(m.value for m in Mode)}",
                               "mode") from None
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
            self._decode(list(self.decoding))
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
        budget = self.cfg.prefill_budget
        for seq in list(self.prefilling):
            if seq.finished:  # cancelled by a callback earlier in this loop
                continue
            n = min(len(seq.req.prompt) - seq.prefilled, budget, self.max_chunk or budget)
            if n <= 0:
                break
            budget -= n
            x = np.array([seq.req.prompt[seq.prefilled:seq.prefilled + n]], np.int64)  # [1, n]
            out = self.backend.full(x, np.array([seq.slot]), np.array([seq.prefilled]))  # full depth, last head only
            seq.prefilled += n
            if seq.prefilled == len(seq.req.prompt):
                self.prefilling.remove(seq)
                self.decoding.append(seq)
                # checks and lookup drafts read it; a request in mode full neither checks nor drafts (its index cost
                # mode full on the exits graphs 2% at batch 8, and an audit's one-token verdict its whole prefix)
                if (self._candidates and seq.req.mode is Mode.BOUNDED) or self._drafts(seq):
                    seq.lookup = Lookup(seq.req.prompt, self._lookup_table)
                token = choose_token(out.logits[0], seq.req.temperature, seq.req.top_p, seq.rng)
                self._emit(seq, token, self.backend.num_layers)

    def _decode(self, seqs: list[_Seq]) -> None:
        """One decode iteration. Requests in mode exact (and in mode bounded with ``bounded_drafts``, lookup
        and corpus drafts only) draft where a draft is expected to pay
        (edge/runtime/speculative.py): at a batch size with a verify graph, the whole batch in one call;
        else a lookup draft is verified in a call of its own; exit drafts run as a batched round (at
        batches up to ``speculate_max_batch``, while they measure cheaper per token than plain steps);
        every other row takes one plain step, batched. Above batch 1 the iteration drafts only while
        iterations that did have measured cheaper per token than plain ones (SpeculationGate)."""
        drafters = [s for s in seqs if self._drafts(s) and not s.pending]  # rows that may draft (none owing K/V)
        if not drafters:
            self._step(seqs)
            return
        b = len(seqs)
        if b == 1 or self.cfg.speculative.exit_only:
            # a batch of one: every choice below is priced by the call it makes; exit drafts alone: configured
            self._speculate_or_step(seqs, drafters)
            return
        # above batch 1, whether looking for drafts pays is measured on whole iterations (SpeculationGate)
        speculate = self._spec_gate.speculate(b)
        t0, before, setups = time.perf_counter(), sum(len(s.tokens) for s in seqs), self.backend.setup_events
        if speculate:
            self._speculate_or_step(seqs, drafters)
        else:
            self.plain_steps += sum(s.req.mode is Mode.EXACT for s in drafters)
            self._step(seqs)
        if self.backend.setup_events == setups:  # one-time work (a graph opened, a binding built) is not the cost
            self._spec_gate.observe(b, speculate, time.perf_counter() - t0, sum(len(s.tokens) for s in seqs) - before)

    def _drafts(self, s: _Seq) -> bool:
        """Whether sequence ``s`` may draft: mode exact, or mode bounded with ``bounded_drafts`` (lookup and
        corpus drafts only: a configuration of exit drafts alone leaves bounded requests to their checks)."""
        if s.req.mode is Mode.EXACT:
            return True
        return (self.cfg.bounded_drafts and s.req.mode is Mode.BOUNDED
                and not self.cfg.speculative.exit_only)

    def _speculate_or_step(self, seqs: list[_Seq], drafters: list[_Seq]) -> None:
        """The drafting half of :meth:`_decode`: one call for the batch where it verifies together, else
        each row of ``drafters`` drafts where its round is expected to pay and the rest step together."""
        if len(drafters) == len(seqs) and self._verify_together(seqs):
            return
        spec, b = self.cfg.speculative, len(seqs)
        per_token = self.call_costs.cost(b, 1) / b  # a row's seconds per token on a plain batched step
        plain = 1.0 / per_token
        lookups: dict[_Seq, tuple[list[int], int, float, Source]] = {}
        # a round of k drafts, every one accepted, emits k + 1 tokens: when no k can beat a plain step that
        # way (large batches), no row's drafts are looked at
        ceiling = max((k + 1) / self.call_costs.cost(1, k + 1) for k in range(1, spec.max_draft + 1))
        if not spec.exit_only and ceiling > plain:
            for s in drafters:
                best = self._best_draft(s, plain)
                if best is not None:
                    lookups[s] = best
        limit = self.cfg.speculate_max_batch
        drafting: list[_Seq] = []
        if self._exit_drafts and (limit is None or b <= limit):
            others = [s for s in drafters if s not in lookups and s.req.mode is Mode.EXACT]  # bounded rows check
            # beside other sources, exit rounds must measure cheaper per token than plain steps; exit drafts
            # alone always draft (the configuration asked for them)
            if others and (spec.exit_only or self._exit_gate.pays(per_token)):
                drafting = others
        busy = set(map(id, drafting)) | set(map(id, lookups))
        rest = [s for s in seqs if id(s) not in busy]
        self.plain_steps += sum(s.req.mode is Mode.EXACT for s in rest)
        if rest:
            self._step(rest)
        for s, (drafts, n, predicted, src) in lookups.items():
            if not s.finished:  # a callback of this iteration may have cancelled it
                self._verify_drafts(s, drafts, n, predicted, src)
        drafting = [s for s in drafting if not s.finished]
        if drafting:
            emitted = sum(len(s.tokens) for s in drafting)
            t0 = time.perf_counter()
            self._speculate(drafting)
            self._exit_gate.observe(time.perf_counter() - t0, sum(len(s.tokens) for s in drafting) - emitted)

    def _verify_together(self, seqs: list[_Seq]) -> bool:
        """Mode exact at a batch size the backend verifies in one call (``Backend.verify_batches``): each
        sequence's best lookup or corpus drafts, all padded to one length T, go to one call of the graph of
        every layer, when that is expected to return more tokens per second than a plain batched step
        (E = sum over rows of 1 + the drafts' expected accepted run, against C(B, T) measured as the engine
        runs); a row without drafts gets its plain step's token from its first row. False: nothing was
        done (no drafts, or none expected to pay), the caller steps."""
        b, spec = len(seqs), self.cfg.speculative
        if b not in self.backend.verify_batches or spec.exit_only:
            return False
        # the padded rows of every sequence are written to its cache slot: all of them must fit
        most = min([spec.fixed if spec.stop is StopRule.FIXED else spec.max_draft]
                   + [self.cfg.max_len - s.length - 1 for s in seqs])
        if most < 1:
            return False
        rows: list[tuple[list[int], int, np.ndarray, Source] | None] = []
        for s in seqs:
            best = None
            for drafts, n, probs, src in self._source_drafts(s, min(most, self._draft_cap(s))):
                if best is None or np.cumprod(probs).sum() > np.cumprod(best[2]).sum():
                    best = (drafts, n, probs, src)
            rows.append(best)
        drafted = [np.cumprod(r[2]) for r in rows if r is not None]
        if not drafted:
            return False
        t, value = 1, b / self.call_costs.cost(b, 1)  # a plain step: b tokens
        for k in range(1, max(map(len, drafted)) + 1):
            v = (b + sum(float(p[:k].sum()) for p in drafted)) / self.call_costs.cost(b, k + 1)
            if v > value:
                t, value = k + 1, v
        if t == 1:
            return False
        x = np.empty((b, t), np.int64)
        for q, (s, r) in enumerate(zip(seqs, rows)):
            x[q] = s.tokens[-1]  # a row's padding: its outputs are never read, its cache rows are overwritten later
            if r is not None:
                d = r[0][:t - 1]
                x[q, 1:len(d) + 1] = d
        t0 = time.perf_counter()
        out = self.backend.verify(x, np.array([s.slot for s in seqs]), np.array([s.length for s in seqs]))
        self.call_costs.observe(b, t, time.perf_counter() - t0)
        for q, (s, r) in enumerate(zip(seqs, rows)):
            if s.finished:  # a callback of this round cancelled it
                continue
            drafts = [] if r is None else r[0][:t - 1]
            at = q * t
            if s.req.temperature > 0:  # a lookup draft is a point mass: q(x) = 1
                full = [token_distribution(out.logits[at + j], s.req.temperature, s.req.top_p)
                        for j in range(len(drafts) + 1)]
                point = [np.eye(1, full[0].shape[0], d, dtype=np.float64)[0] for d in drafts]
                accepted, token = accept_sampled(drafts, point, full, s.rng)
            else:
                accepted, token = accept_greedy(drafts, out.token[at:at + len(drafts) + 1])
            if r is None:
                self.plain_steps += 1
            else:
                self.round_ids.add(s.id)
                _, n, probs, src = r
                self._acceptance[src].record(n, len(drafts), accepted)
                for stats in (self.spec_stats, self.source_stats[src.value]):
                    stats.record(len(drafts), accepted, float(probs[:len(drafts)].sum()))
            for tok in drafts[:accepted] + [token]:
                if s.finished:  # a stop id, max_tokens, or a callback's cancel ended it: the rest is dropped
                    break
                self._emit(s, tok, self.backend.num_layers)
        return True

    def _best_draft(self, s: _Seq, plain: float) -> tuple[list[int], int, float, Source] | None:
        """Sequence ``s``'s lookup or corpus drafts whose round is expected to return the most tokens per
        second, above ``plain`` (a plain step's): (drafts, match length, their summed acceptance, source),
        or None."""
        best, value = None, plain
        for drafts, n, probs, src in self._source_drafts(s, self._draft_cap(s)):
            k, v = lookup_length(probs, self.call_costs, plain)
            if k and v > value:
                best, value = (drafts[:k], n, float(probs[:k].sum()), src), v
        return best

    def _source_drafts(self, s: _Seq, cap: int):
        """Sequence ``s``'s drafts from each lookup or corpus source that has some, at most ``cap``:
        (drafts, match length n, their counted acceptance [len(drafts)], source)."""
        if cap < 1:
            return
        for src in self.cfg.speculative.sources:
            if src is Source.LOOKUP:
                drafts, n = s.lookup.draft(cap)
            elif src is Source.CORPUS and self._ngram is not None:
                drafts, n = self._ngram.draft(s.tokens, cap)
            else:
                continue
            if drafts:
                yield drafts, n, self._acceptance[src].probs(n, len(drafts)), src

    def _draft_cap(self, s: _Seq) -> int:
        """The most drafts a round of ``s`` may verify: it emits drafts + 1 tokens, within max_tokens,
        and writes positions length .. length + drafts, within the cache."""
        spec = self.cfg.speculative
        most = spec.fixed if spec.stop is StopRule.FIXED else spec.max_draft
        return max(0, min(most, s.req.max_tokens - len(s.tokens) - 1, self.cfg.max_len - s.length - 1))

    def _verify_drafts(self, s: _Seq, drafts: list[int], n: int, predicted: float, src: Source) -> None:
        """A lookup or corpus round of one sequence: its newest token and ``drafts`` (after a match of
        length ``n``) in one call of the graph of every layer; emit the accepted drafts and the full
        model's next token. Rejected rows' cache entries sit past the sequence's new length (overwritten
        later)."""
        rows = len(drafts) + 1
        x = np.array([[s.tokens[-1], *drafts]], np.int64)
        self.round_ids.add(s.id)
        t0 = time.perf_counter()
        out = self.backend.full(x, np.array([s.slot]), np.array([s.length]), rows=rows)
        self.call_costs.observe(1, rows, time.perf_counter() - t0)
        if s.req.temperature > 0:  # a lookup draft is a point mass: q(x) = 1
            full = [token_distribution(out.logits[r], s.req.temperature, s.req.top_p) for r in range(rows)]
            q = [np.eye(1, full[0].shape[0], t, dtype=np.float64)[0] for t in drafts]
            accepted, token = accept_sampled(drafts, q, full, s.rng)
        else:
            accepted, token = accept_greedy(drafts, out.token)
        self._acceptance[src].record(n, len(drafts), accepted)
        for stats in (self.spec_stats, self.source_stats[src.value]):
            stats.record(len(drafts), accepted, predicted)
        for t in drafts[:accepted] + [token]:
            if s.finished:  # a stop id, max_tokens, or a callback's cancel ended it: the rest is dropped
                break
            self._emit(s, t, self.backend.num_layers)

    def _step(self, seqs: list[_Seq]) -> None:
        """One token for every sequence: segment by segment, the rule picks the rows that stop after
        each exit, and the batch shrinks to the rows still running."""
        t_step = time.perf_counter()
        backend, nseg = self.backend, len(self.backend.segments)
        x = np.array([[s.tokens[-1]] for s in seqs], np.int64)  # [B, 1]
        slots = np.array([s.slot for s in seqs])
        start = np.array([s.length for s in seqs])
        act = seqs  # the sequences still running, in batch order
        # what the rule sees, per exit reached so far, for the rows still running
        stats: dict[int, np.ndarray] = {}  # [B, 3]
        tokens: dict[int, np.ndarray] = {}  # [B]
        hidden: dict[int, np.ndarray] = {}  # [B, D]
        decided: list[tuple[_Seq, int, int]] = []
        deferred = self.cfg.kv_mode is KVMode.DEFER
        inline = deferred and self.cfg.defer_inline
        limit = self.cfg.defer_exit_max_batch
        # the rows that may leave early (requests in mode full never do; with a candidate shortlist, nor do
        # sampled ones: a check has no distribution over the vocabulary to sample from), compacted with the batch
        bounded = np.fromiter((s.req.mode is Mode.BOUNDED and not (self._candidates and s.req.temperature > 0)
                               for s in seqs), bool, len(seqs))
        exits = bool(bounded.any()) and not (deferred and limit is not None and len(seqs) > limit)
        step_gate = None if inline else self.step_gate  # defer_inline steps price nothing a served step does
        if exits and step_gate is not None and not step_gate.checks(len(seqs)):
            exits = False  # checking measured dearer than full depth at this batch size
        lookup = self._lookups(seqs) if self._candidates and exits else None
        if lookup is not None and self._route > 0:  # rows the rule does not check run every layer, no check paid
            bounded &= lookup[1] >= self._route - 1e-6
            exits = bool(bounded.any())
        if not exits and not (deferred and any(s.pending for s in seqs)):
            t0 = time.perf_counter()
            self._step_full(seqs, x, slots, start)  # no row may leave: every layer in one call, no check paid
            if step_gate is not None:
                step_gate.observe(len(seqs), False, time.perf_counter() - t0)
            return
        gated = backend.spec.gated
        gone = np.zeros(len(seqs), bool)  # defer_inline: rows whose token is decided, running on for their K/V
        gates: dict[int, np.ndarray] = {}  # [B] gate logits (gated exits)
        prev = None  # the previous decision exit's outputs for the rows still running
        first, fast = 0, None
        if self._score_in_graph and exits and not (deferred and any(s.pending for s in seqs)):
            # the segments run back to back until the first where a row leaves (no host work between them)
            first, fast = backend.decode_until_exit(x, slots, start, lookup, bounded)
        for i in range(first, nseg):
            if fast is not None:
                out, fast = fast, None
            elif deferred and i > 0 and any(s.pending for s in act):
                if len(act) == 1:  # one call: the deferred rows, then the new token (reads the weights once)
                    out = self._with_deferred(i, act[0], x, slots, start, prev, lookup)
                else:
                    x = self._catch_up(i, act, x, slots, start)
                    out = backend.segment(i, x, slots, start, prev, decide=exits, lookup=lookup)
            else:  # decide=False: no row may exit here, so the exit's LM head need not run
                out = backend.segment(i, x, slots, start, prev, decide=exits, lookup=lookup)
            layer = self.backend.exit_layers[i]
            logits, tok = out.logits, out.token
            if i == nseg - 1:
                stop = ~gone if inline else np.ones(len(act), bool)
            elif not exits:
                stop = np.zeros(len(act), bool)
            elif self._score_in_graph:
                stop = out.score >= 0.0
            elif gated:  # decide from the gates; the LM head runs for the rows that exit
                gates[layer], hidden[layer] = out.gate, out.exit_hidden
                stop = np.asarray(self.rule.decide_gated(layer, gates, hidden), bool)
            else:
                stats[layer], tokens[layer], hidden[layer] = out.stats, out.token, out.exit_hidden
                stop = np.asarray(self.rule.decide(layer, stats, tokens, hidden), bool)
            if i < nseg - 1:
                stop = stop & bounded  # a new array: the rule's own may be returned above
            if stop.any():
                rows = np.flatnonzero(stop)
                if gated and i < nseg - 1:
                    head = backend.head(i, out.exit_hidden[rows])
                    logits, tok = np.zeros((len(act), head.logits.shape[1]), np.float32), np.zeros(len(act), np.int64)
                    logits[rows], tok[rows] = head.logits, head.token
                for r in rows:
                    s = act[r]
                    token = (choose_token(logits[r], s.req.temperature, s.req.top_p, s.rng)
                             if s.req.temperature > 0 else int(tok[r]))
                    decided.append((s, token, layer))
                if inline and i < nseg - 1:  # every row runs on: the leaving ones for their K/V only
                    gone |= stop
                    bounded = bounded & ~stop
                    x, prev = out.hidden, out
                    continue
                if i == nseg - 1:
                    break  # every row still running has its token (with defer_inline, the rows gone before too)
                self._fill_skipped([act[r] for r in rows], i, out.hidden[rows, 0], slots[rows], start[rows],
                                   decided[-len(rows):])
                keep = ~stop
                if not keep.any():
                    break
                act = [s for s, k in zip(act, keep) if k]
                slots, start, bounded = slots[keep], start[keep], bounded[keep]
                x = out.hidden[keep]
                prev = SegmentOut(None, out.exit_hidden[keep], None, None, _rows(out.token, keep),
                                  _rows(out.gate, keep), run=_rows(out.run, keep),
                                  cand_tokens=_rows(out.cand_tokens, keep), cand_logits=_rows(out.cand_logits, keep))
                if lookup is not None:
                    lookup = (lookup[0][keep], lookup[1][keep])
                for trace in (stats, tokens, hidden, gates):
                    for k in trace:
                        trace[k] = trace[k][keep]
            else:
                x, prev = out.hidden, out
        decided.sort(key=lambda d: d[0].slot)
        for s, token, layer in decided:
            if not s.finished:  # else a callback of this step cancelled it: its token is dropped
                self._emit(s, token, layer)
        if step_gate is not None:  # checks, or the catch-up of rows that left before: what exits cost
            step_gate.observe(len(seqs), True, time.perf_counter() - t_step)

    def _step_full(self, seqs: list[_Seq], x: np.ndarray, slots: np.ndarray, start: np.ndarray) -> None:
        """One token for every sequence at full depth, through the backend's graph of every layer."""
        t0 = time.perf_counter()
        out = self.backend.full(x, slots, start)
        self.call_costs.observe(len(seqs), 1, time.perf_counter() - t0)
        last = self.backend.num_layers
        decided = []
        for r, s in enumerate(seqs):
            token = (choose_token(out.logits[r], s.req.temperature, s.req.top_p, s.rng)
                     if s.req.temperature > 0 else int(out.token[r]))
            decided.append((s, token))
        for s, token in decided:
            if not s.finished:  # else a callback of this step cancelled it: its token is dropped
                self._emit(s, token, last)

    @staticmethod
    def _lookups(seqs: list[_Seq]) -> tuple[np.ndarray, np.ndarray]:
        """The context lookup's (token [B], match length [B]) of each sequence (edge/model/lookup.py)."""
        b = len(seqs)
        toks, lens = np.empty(b, np.int64), np.empty(b, np.float32)
        for r, s in enumerate(seqs):  # a row in mode full keeps no lookup: it is never checked
            toks[r], lens[r] = s.lookup.predict() if s.lookup is not None else (LOOKUP_NONE, 0)
        return toks, lookup_feature(lens)

    def _speculate(self, seqs: list[_Seq]) -> None:
        """One self-speculative round for every sequence in mode exact (edge/runtime/speculative.py):
        draft with the segments up to the draft exit, batched, each sequence until its stop rule ends
        its drafts; then verify each sequence's rows with the remaining segments, one call per segment,
        and emit its accepted drafts and the full model's next token."""
        backend, spec, d = self.backend, self.cfg.speculative, self._draft_seg
        layer, nseg = backend.exit_layers[d], len(backend.segments)
        calibrated = spec.stop is StopRule.CALIBRATED
        self.round_ids.update(s.id for s in seqs)
        base = [s.length for s in seqs]  # position of each sequence's newest token (not yet cached)
        # the most drafts a sequence may have verified: a round emits drafts + 1 tokens, within max_tokens,
        # and writes positions base .. base + drafts, within the cache
        cap = [self._draft_cap(s) for s in seqs]
        resid: list[list[np.ndarray]] = [[] for _ in seqs]  # residual after the draft exit, per row drafted from
        drafts: list[list[int]] = [[] for _ in seqs]
        dists: list[list[np.ndarray | None]] = [[] for _ in seqs]  # what each draft was sampled from
        probs: list[list[float]] = [[] for _ in seqs]  # calibrated agreement of each draft
        cur = [s.tokens[-1] for s in seqs]
        act, j = list(range(len(seqs))), 0  # the sequences still drafting; the draft step
        while act:
            heads = any(j < cap[b] for b in act)  # some row may draft another token: the exit's head runs
            x = np.array([[cur[b]] for b in act], np.int64)
            slots = np.array([seqs[b].slot for b in act])
            start = np.array([base[b] + j for b in act])
            t0 = time.perf_counter()
            out = prev = None
            for i in range(d + 1):
                out = backend.segment(i, x, slots, start, prev, decide=heads, draft=True)  # heads only draft
                x, prev = out.hidden, out
            logits, tok, stats = out.logits, out.token, out.stats
            if heads and (backend.spec.gated or backend.spec.candidates):  # drafts read the exit's whole head
                head = backend.head(d, out.exit_hidden)
                logits, tok, stats = head.logits, head.token, head.stats
            agree = self._agreement(layer, out.features) if heads and calibrated else None
            going = []
            for r, b in enumerate(act):
                resid[b].append(out.hidden[r, 0].copy())
                if j >= cap[b]:
                    continue
                s = seqs[b]
                dist = None
                if s.req.temperature > 0:
                    dist = token_distribution(logits[r], s.req.temperature, s.req.top_p)
                    token = int(s.rng.choice(dist.shape[0], p=dist))
                else:
                    token = int(tok[r])
                self.spec_stats.draft_steps += 1
                if agree is not None:
                    probs[b].append(float(agree[r]))
                if include_next(spec, len(drafts[b]), probs[b], float(stats[r, TOP1]), self.spec_costs):
                    drafts[b].append(token)
                    dists[b].append(dist)
                    cur[b] = token
                    going.append(b)
            if len(act) == 1:  # the stop rule weighs one sequence's costs
                self.spec_costs.observe_step(time.perf_counter() - t0)
            act, j = going, j + 1
        decided = []
        for b, s in enumerate(seqs):
            rows = len(drafts[b]) + 1
            h = np.stack(resid[b])[None]  # [1, rows, D]
            slots, start = np.array([s.slot]), np.array([base[b]])
            t0 = time.perf_counter()
            for i in range(d + 1, nseg):
                out = backend.segment(i, h, slots, start, decide=False, rows=rows if i == nseg - 1 else 1)
                h = out.hidden
            if len(seqs) == 1:
                self.spec_costs.observe_verify(rows, time.perf_counter() - t0)
            if s.req.temperature > 0:
                full = [token_distribution(out.logits[r], s.req.temperature, s.req.top_p) for r in range(rows)]
                n, token = accept_sampled(drafts[b], dists[b], full, s.rng)
            else:
                n, token = accept_greedy(drafts[b], out.token)
            for stats in (self.spec_stats, self.source_stats[Source.EXIT.value]):
                stats.record(rows - 1, n, sum(probs[b][:rows - 1]))
            decided.append((s, drafts[b][:n] + [token]))
        decided.sort(key=lambda e: e[0].slot)
        for s, tokens in decided:
            for token in tokens:
                if s.finished:  # a stop id, max_tokens, or a callback's cancel ended it: the rest is dropped
                    break
                self._emit(s, token, backend.num_layers)

    def _with_deferred(self, i: int, s: _Seq, x: np.ndarray, slots: np.ndarray, start: np.ndarray,
                       prev: SegmentOut | None, lookup: tuple[np.ndarray, np.ndarray] | None = None) -> SegmentOut:
        """Segment i for one sequence: its deferred rows that segment i must see (the newest ones, at the
        positions just before the new token's) and the new token, in one call of T rows."""
        rows = [p for p in s.pending if p.next_seg <= i]
        if not rows:
            return self.backend.segment(i, x, slots, start, prev, lookup=lookup)
        h = np.concatenate([np.stack([p.hidden for p in rows])[None], x], axis=1)  # [1, k + 1, D]
        last = i == len(self.backend.segments) - 1
        # at the last segment the head runs on the deferred rows too (their verdicts: one more head row)
        judge = last and any(p.token >= 0 for p in rows)
        n = len(rows) + 1 if judge else 1
        out = self.backend.segment(i, h, slots, start - len(rows), prev, lookup=lookup, rows=n)
        for q, p in enumerate(rows):
            p.next_seg = i + 1
            if out.hidden is not None:
                p.hidden = out.hidden[0, q].copy()
            if judge:
                self._judge(s, p, int(out.token[q]))
        if last:
            s.pending = [p for p in s.pending if p.next_seg < i + 1]
        hidden = None if out.hidden is None else out.hidden[:, -1:]
        if n == 1:
            return SegmentOut(hidden, out.exit_hidden, out.logits, out.stats, out.token, out.gate, out.features,
                              out.score, out.run, out.cand_tokens, out.cand_logits)
        return SegmentOut(hidden, out.exit_hidden[-1:], out.logits[-1:], _rows(out.stats, slice(-1, None)),
                          out.token[-1:])  # the last segment: no decision outputs

    def _catch_up(self, i: int, act: list[_Seq], x: np.ndarray, slots: np.ndarray, start: np.ndarray) -> np.ndarray:
        """Deferred rows that segment i must see before the new tokens: run them first, oldest first,
        in batched one-row calls (phase k holds every sequence's k-th such row). Returns the new
        tokens' input, copied if a phase call could reuse its buffer."""
        rows = [[p for p in s.pending if p.next_seg <= i] for s in act]
        depth = max(len(r) for r in rows)
        if depth == 0:
            return x
        x = x.copy()
        nseg = len(self.backend.segments)
        for k in range(depth):
            sel = [b for b, r in enumerate(rows) if len(r) > k]
            ps = [rows[b][k] for b in sel]
            h = np.stack([p.hidden for p in ps])[:, None]  # [B_k, 1, D]
            # the last segment's head runs where a row is to be judged (its verdict); no decision is read
            judge = i == nseg - 1 and any(p.token >= 0 for p in ps)
            out = self.backend.segment(i, h, slots[sel], np.array([p.pos for p in ps]), decide=judge)
            for q, (b, p) in enumerate(zip(sel, ps)):
                p.next_seg = i + 1
                if out.hidden is not None:
                    p.hidden = out.hidden[q, 0].copy()
                if judge:
                    self._judge(act[b], p, int(out.token[q]))
        if i == nseg - 1:
            for s in act:
                s.pending = [p for p in s.pending if p.next_seg < nseg]
        return x

    def _fill_skipped(self, exited: list[_Seq], i: int, h: np.ndarray, slots: np.ndarray, pos: np.ndarray,
                      decided: list[tuple[_Seq, int, int]]) -> None:
        """K/V of segments i+1.. for rows that exited after segment i (h [B, D]: their residual; ``decided``:
        their (sequence, token, layer), for the verdict deferral gives on greedy tokens)."""
        if self.cfg.kv_mode is KVMode.DEFER:
            for s, row, (_, token, layer) in zip(exited, h, decided):
                judged = s.req.temperature == 0 and s.req.on_verdict is not None  # the head row only if asked
                s.pending.append(_Pending(s.length, row.copy(), i + 1, token if judged else -1, len(s.tokens), layer))
            return
        self.backend.kvfill(i + 1, h, slots, pos)

    def _judge(self, s: _Seq, p: _Pending, full_token: int | None) -> None:
        """Deliver the full model's verdict on pending row ``p`` of ``s`` (None: it will never be computed)."""
        if p.token < 0:
            return
        if full_token is None:
            self.verdict_counts["unjudged"] += 1
        else:
            self.verdict_counts["judged"] += 1
            self.verdict_counts["false"] += int(full_token != p.token)
        if s.req.on_verdict is not None:
            s.req.on_verdict(Verdict(s.id, p.index, p.layer, p.token, full_token))

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


def _rows(a: np.ndarray | None, keep: np.ndarray) -> np.ndarray | None:
    return None if a is None else a[keep]
