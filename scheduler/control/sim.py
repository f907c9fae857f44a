"""A discrete-event simulator of the engine behind the server: chunked prefill, decode with
per-sequence exit depths, admission, driven by a fitted latency model (scheduler/control/latency.py).

It follows ``Engine.step`` (edge/runtime/engine.py): each iteration admits waiting requests FCFS
while a slot is free and fewer than ``max_running`` hold one, decodes one token for every decoding
sequence (each leaves at an exit layer drawn from its request's exit distribution), or several at full
depth where the served engine's draft rounds did at that batch size (``SimConfig.decode_rounds``), then spends the
prefill budget on prompt chunks FCFS, one sequence per call; a prompt that completes yields its
first token (full depth). The step lasts what the latency model says for what it did, and its
tokens are delivered at its end (the host sends a step's tokens after the step). A request that
arrives to ``max_waiting`` queued ones is refused (the host's ``overloaded``).

Exit depths: each request draws its own exit distribution from a Dirichlet centred on the calibrated
marginal (``ExitModel``): requests differ in how easy their text is (some exit early often, some
rarely), which is what makes a per-request predicted exit depth worth having. The concentration is
fitted from measured per-request exit traces where they exist (``ExitModel.fit``).

``observe()`` answers with the same keys as the engine host's ``stats`` control op, so one
``observation_from_stats`` serves the simulator, the gym environment and the live server. Like the
host, the simulator clamps the budget to the backend's largest chunk (``SimConfig.max_chunk``).
"""
from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from edge.core.errors import ConfigError
from edge.core.stats import due_time, on_time, p95_ms, sla_met  # the host's own statistics: one definition live and simulated
from edge.runtime.host_steplog import FRONT_WINDOW_S
from edge.runtime.host_types import HostConfig
from edge.runtime.settings import MAX_RUNNING, MAX_SEQS, PREFILL_BUDGET, SLA_TPOT_MS, SLA_TTFT_MS, clamp_budget
from scheduler.control.latency import LatencyModel
from scheduler.control.outcomes import RequestResult
from scheduler.control.workload import Workload

EMA = 0.3           # the host's weight of the newest exit layer in a request's predicted depth (edge/runtime/host_sla.py)
RECENT = 32         # finished requests behind the recent tail latencies (the host keeps as many)
RATE_WINDOW_S = 5.0  # arrivals counted for the recent arrival rate
# decode batch sizes whose plain steps and draft rounds are counted apart (SimConfig.decode_rounds): a round of
# drafts pays by batch size (the engine's cost model and speculation gate decide it per batch)
BATCH_BUCKETS = ((1, 1), (2, 2), (3, 4), (5, 8), (9, None))
MAX_ROUND_TOKENS = 8  # the most tokens one sequence emits in a step (a verified round: drafts + 1)


def round_summary(probs: Sequence[float]) -> tuple[float, float]:
    """(the share of draft rounds, the mean tokens per step) of one batch bucket's SimConfig.decode_rounds."""
    return float(sum(probs[1:])), float(probs[0] + sum(j * p for j, p in enumerate(probs) if j))


def batch_bucket(b: int) -> str:
    """The BATCH_BUCKETS key of a decode batch of ``b`` sequences ("1", "2", "3-4", "5-8", "9+")."""
    for lo, hi in BATCH_BUCKETS:
        if b >= lo and (hi is None or b <= hi):
            return f"{lo}+" if hi is None else str(lo) if lo == hi else f"{lo}-{hi}"
    raise ConfigError(f"sim: a decode batch of {b} sequences")


BUCKET_KEYS = tuple(batch_bucket(lo) for lo, _ in BATCH_BUCKETS)  # "1", "2", "3-4", "5-8", "9+"


@dataclass
class ExitModel:
    """Exit layers (ascending, the last = full depth) and their marginal token fractions; per request,
    a distribution ~ Dirichlet(concentration x marginal)."""

    layers: list[int]
    fractions: list[float]
    concentration: float = 4.0

    def __post_init__(self) -> None:
        if len(self.layers) != len(self.fractions) or not self.layers:
            raise ConfigError(f"exit model: {len(self.layers)} layers but {len(self.fractions)} fractions")
        if list(self.layers) != sorted(self.layers):
            raise ConfigError(f"exit model: layers must ascend, got {self.layers}")
        f = np.asarray(self.fractions, np.float64)
        if (f < 0).any() or f.sum() <= 0 or self.concentration <= 0:
            raise ConfigError("exit model: fractions must be >= 0 with a positive sum, concentration > 0")
        self.fractions = list(f / f.sum())

    @property
    def mean_layer(self) -> float:
        return float(np.dot(self.layers, self.fractions))

    def request_probs(self, rng: np.random.Generator) -> np.ndarray:
        """[len(layers)] one request's exit distribution."""
        alpha = np.maximum(np.asarray(self.fractions) * self.concentration, 1e-3)
        return rng.dirichlet(alpha)

    @classmethod
    def from_certificate(cls, exit_layers: Sequence[int], fractions: dict[str, float] | None,
                         concentration: float = 4.0) -> ExitModel:
        """From a threshold table's ``expected_exit_fraction`` ({layer: share}); full depth without one."""
        if not fractions:
            return cls(list(exit_layers), [0.0] * (len(exit_layers) - 1) + [1.0], concentration)
        return cls(list(exit_layers), [float(fractions.get(str(k), 0.0)) for k in exit_layers], concentration)

    @classmethod
    def fit(cls, exit_layers: Sequence[int], traces: Sequence[Sequence[int]], min_tokens: int = 8) -> ExitModel:
        """Marginal and concentration from per-request exit-layer sequences (method of moments on
        the requests' share of full-depth tokens: for a Dirichlet-multinomial, the variance of a
        request's share p is m (1 - m) / (c + 1) plus the binomial noise m (1 - m) / n).

        Raises:
            ConfigError: fewer than 4 requests with ``min_tokens`` tokens.
        """
        layers = list(exit_layers)
        seqs = [list(t) for t in traces if len(t) >= min_tokens]
        if len(seqs) < 4:
            raise ConfigError(f"exit model: {len(seqs)} requests with >= {min_tokens} tokens; at least 4 needed")
        counts = np.array([[s.count(k) for k in layers] for s in seqs], np.float64)  # [R, E]
        marginal = counts.sum(0) / counts.sum()
        full = counts[:, -1] / counts.sum(1)
        m = float(marginal[-1])
        noise = float(np.mean(m * (1 - m) / counts.sum(1)))
        between = max(float(np.var(full)) - noise, 1e-6)
        c = m * (1 - m) / between - 1 if 0 < m < 1 else 4.0
        return cls(layers, list(marginal), float(np.clip(c, 0.5, 1e3)))


@dataclass
class SimConfig:
    """The simulated server: the engine host's limits, the SLA, the serving path's own latency."""

    max_seqs: int = MAX_SEQS.default
    max_waiting: int = 64
    prefill_budget: int = PREFILL_BUDGET.default  # initial knob values (the bundle's)
    max_running: int = MAX_RUNNING.default
    # the served SLA; a preset that trains or evaluates under tighter targets sets them in its YAML
    sla_ttft_ms: float = SLA_TTFT_MS.default
    sla_tpot_ms: float = SLA_TPOT_MS.default
    max_chunk: int | None = None    # the backend's largest chunk (Backend.max_chunk): the budget never exceeds it
    ttft_overhead_ms: float = 0.0   # the serving path's added latency to the first token (HTTP, Ray, Triton)
    token_overhead_ms: float = 0.0  # and to each later token
    # the front end's time per request before the engine sees it (HTTP, Ray Serve's proxy and ingress,
    # the hop to Triton), one request at a time: a FIFO queue in front of the engine's, whose delay
    # grows with load (a burst waits there too); fitted with the overheads by `smartexit profile`
    ingress_ms: float = 0.0
    # engine time lost per delivered chunk (one request's tokens of one step) when served, and per
    # chunk squared: Triton's python backend packs and sends each chunk on a responder thread of the
    # engine's own process, under the GIL the engine thread needs, and the stack's processes (Ray
    # Serve's proxy and ingress streaming each request, the client) share the 2 cores: the more streams
    # a step feeds, the more each costs (measured in the served engine's step log: scheduler/loadtest/serving_path.py)
    serve_chunk_ms: float = 0.0
    serve_chunk_sq_ms: float = 0.0
    # the served engine's decode step time / the profiled one (> 0): the stack's processes and threads
    # share the CPU and the GIL with the engine thread; measured by `smartexit profile`
    engine_slowdown: float = 1.0
    # the same for the prefill part of a step (None: engine_slowdown); measured apart because long
    # prompt chunks are one large ONNX Runtime call that holds no GIL, while decode is many short calls
    # with Python between them, each taking the GIL back from the stack's threads
    prefill_slowdown: float | None = None
    # added to the decode (prefill) slowdown per request that reached the engine in the last FRONT_WINDOW_S
    # seconds: the front end's work for each new request (HTTP, Ray Serve's proxy and ingress, the hop to
    # Triton, the stub's intake) shares the 2 cores with the engine, so the served step slows with the traffic
    # (measured in the served engine's step log, whose "a" is that count: scheduler/loadtest/serving_path.py)
    front_decode_per_arrival: float = 0.0
    front_prefill_per_arrival: float = 0.0
    # rows exit only while the decode batch holds at most this many sequences (None: any batch): the
    # engine's defer_exit_max_batch (edge/runtime/engine_config.py; 1 in the shipped defer mode on CPU)
    exit_max_batch: int | None = 1
    # what a decoding sequence does in a step, by decode batch (batch_bucket): the probability of a plain step
    # (one token, at its exit layer) and of a draft round emitting 1, 2, ... MAX_ROUND_TOKENS tokens at full depth
    # ([plain, round of 1, ..., round of MAX_ROUND_TOKENS]). The served engine drafts from the context and the corpus
    # where a round pays (mode exact, and mode bounded with repo.bounded_drafts): a round is a verification call
    # of its own (round_ms), outside the batched step. Counted in the served engine's step log (`smartexit
    # profile`); None: plain steps only
    decode_rounds: dict[str, list[float]] | None = None
    round_ms: float = 0.0  # engine time per draft round (fitted from the step log with the slowdowns)
    # the same per decode batch bucket where the step log measured rounds (round_ms elsewhere): at batch 2 the
    # ONNX backend verifies both sequences' drafts in one call (its verify graph), above it one call per round,
    # and each call's cost grows with its batch's context; one price for all batches put two rounds at batch 2
    # at 1.35x the served step (2026-12-05)
    round_ms_by_batch: dict[str, float] | None = None
    # the host's online false-exit audit (edge/runtime/host_audit.py): each early-exited token is sampled with
    # this probability and re-decoded at full depth as a one-token request over its whole prefix, one at
    # a time, admitted only when nothing waits and a slot is free; at most audit_max_pending queued
    audit_fraction: float = 0.0
    audit_max_pending: int = 64
    # the host's load shedding (edge/runtime/host.py, HostConfig.shed_late): a request still waiting when
    # its TTFT deadline passes is refused then (a 429: a miss, never dropped silently)
    shed_late: bool = HostConfig.shed_late
    seed: int = 0

    def __post_init__(self) -> None:
        for setting in (MAX_SEQS, PREFILL_BUDGET, MAX_RUNNING):
            setting.check(getattr(self, setting.name), "sim")
        if self.max_waiting < 1:
            raise ConfigError(f"sim.max_waiting must be >= 1, got {self.max_waiting}")
        if self.max_chunk is not None:
            PREFILL_BUDGET.check(self.max_chunk, "sim", "max_chunk")
        SLA_TTFT_MS.check(self.sla_ttft_ms, "sim")
        SLA_TPOT_MS.check(self.sla_tpot_ms, "sim")
        if not self.engine_slowdown > 0 or (self.prefill_slowdown is not None and not self.prefill_slowdown > 0):
            raise ConfigError(f"sim: engine_slowdown and prefill_slowdown must be > 0, got "
                              f"{self.engine_slowdown} and {self.prefill_slowdown}")
        if min(self.ttft_overhead_ms, self.token_overhead_ms, self.ingress_ms, self.serve_chunk_ms,
               self.serve_chunk_sq_ms, self.front_decode_per_arrival, self.front_prefill_per_arrival) < 0:
            raise ConfigError("sim: overheads, ingress_ms, serve_chunk_ms, serve_chunk_sq_ms and the per-arrival "
                              "slowdowns must be >= 0")
        if not 0.0 <= self.audit_fraction <= 1.0 or self.audit_max_pending < 0:
            raise ConfigError(f"sim: audit_fraction must be in [0, 1] and audit_max_pending >= 0, got "
                              f"{self.audit_fraction}, {self.audit_max_pending}")
        if self.exit_max_batch is not None and self.exit_max_batch < 1:
            raise ConfigError(f"sim: exit_max_batch must be >= 1 or None, got {self.exit_max_batch}")
        for key, probs in (self.decode_rounds or {}).items():
            p = np.asarray(probs, np.float64)
            if (key not in BUCKET_KEYS or p.ndim != 1
                    or not 1 <= p.size <= MAX_ROUND_TOKENS + 1 or (p < 0).any() or abs(p.sum() - 1) > 1e-6):
                raise ConfigError(f"sim: decode_rounds[{key!r}] must be the probabilities of a plain step and of rounds "
                                  f"of 1..{MAX_ROUND_TOKENS} tokens, summing to 1, for a batch bucket of "
                                  f"{list(BUCKET_KEYS)}; got {probs!r}")
        by = self.round_ms_by_batch or {}
        if self.round_ms < 0 or any(v < 0 for v in by.values()) \
                or not set(by) <= set(BUCKET_KEYS):
            raise ConfigError(f"sim: round_ms and round_ms_by_batch's values must be >= 0, the latter's keys batch "
                              f"buckets of {list(BUCKET_KEYS)}; got {self.round_ms}, {by}")


@dataclass(eq=False)
class _Req:
    i: int
    arrival: float
    prompt: int
    out: int
    exits: np.ndarray           # [out] the exit layer of each generated token (index 0: prefill, full depth)
    ready: float = 0.0          # when it leaves the front end's queue and reaches the engine (SimConfig.ingress_ms)
    prefilled: int = 0
    generated: int = 0
    first: float | None = None
    last: float | None = None   # when its latest token reached the client
    end: float | None = None
    predicted: float | None = None
    late: bool = False          # a token was delivered after its due time
    rejected: bool = False
    shed: bool = False          # refused while waiting: its TTFT deadline passed (SimConfig.shed_late)
    audit: bool = False         # the host's own audit request: no client, no SLA


@dataclass
class TickCounts:
    """What happened since the last ``take_counts`` (the reward's ingredients)."""
    tokens_on_time: int = 0
    tokens_late: int = 0
    violations: int = 0         # requests that turned late (counted once each), refusals included
    finished: int = 0
    finished_met: int = 0
    rejected: int = 0
    busy_s: float = 0.0         # engine time spent stepping (energy proxy)


@dataclass
class Simulator:
    """Step-wise simulation of one workload; ``advance`` moves the clock, ``set`` turns the knobs."""

    latency: LatencyModel
    exits: ExitModel
    cfg: SimConfig
    workload: Workload
    t: float = 0.0
    counts: TickCounts = field(default_factory=TickCounts)

    def __post_init__(self) -> None:
        w = self.workload
        if len(w) == 0:
            raise ConfigError("sim: the workload has no requests")
        if self.exits.layers[-1] != self.latency.num_layers:
            raise ConfigError(f"sim: exit model ends at layer {self.exits.layers[-1]}, the latency model's "
                              f"engine has {self.latency.num_layers}")
        rng = np.random.default_rng(self.cfg.seed)
        layers = np.asarray(self.exits.layers)
        self._reqs = []
        for i in range(len(w)):
            n = int(w.output_tokens[i])
            ex = rng.choice(layers, size=n, p=self.exits.request_probs(rng))
            ex[0] = layers[-1]
            self._reqs.append(_Req(i, float(w.arrival_s[i]), int(w.prompt_tokens[i]), n, ex))
        ingress, free = self.cfg.ingress_ms / 1e3, -np.inf
        for r in self._reqs:  # the front end serves one request at a time, in arrival order
            r.ready = free = max(r.arrival, free) + ingress
        self._audit_rng = np.random.default_rng([self.cfg.seed, 1])
        self._round_rng = np.random.default_rng([self.cfg.seed, 2])
        self._rounds = {k: np.cumsum(v) for k, v in (self.cfg.decode_rounds or {}).items()}
        self._round_s = self.cfg.round_ms / 1e3
        self._round_s_by = {k: v / 1e3 for k, v in (self.cfg.round_ms_by_batch or {}).items()}
        self._audits: collections.deque[int] = collections.deque()  # queued audit prefixes' lengths
        self._audit_inflight = False
        self.audits_total = 0
        self._next = 0                          # the next arrival's index
        self.waiting: collections.deque[_Req] = collections.deque()
        self.prefilling: list[_Req] = []
        self.decoding: list[_Req] = []
        self.budget, self.limit = clamp_budget(self.cfg.prefill_budget, self.cfg.max_chunk), self.cfg.max_running
        self._ttft = self.cfg.sla_ttft_ms / 1e3
        self._tpot = self.cfg.sla_tpot_ms / 1e3
        self._oh_first = self.cfg.ttft_overhead_ms / 1e3
        self._oh_tok = self.cfg.token_overhead_ms / 1e3
        self._chunk = self.cfg.serve_chunk_ms / 1e3
        self._chunk_sq = self.cfg.serve_chunk_sq_ms / 1e3
        kp = self.cfg.prefill_slowdown
        self._kp = self.cfg.engine_slowdown if kp is None else kp
        self._recent_ttft: collections.deque[float] = collections.deque(maxlen=RECENT)
        self._recent_tpot: collections.deque[float] = collections.deque(maxlen=RECENT)
        self._arrivals: collections.deque[float] = collections.deque()
        self._front: collections.deque[float] = collections.deque()  # reached the engine in the last FRONT_WINDOW_S
        self._fd, self._fp = self.cfg.front_decode_per_arrival, self.cfg.front_prefill_per_arrival
        self._w = {f: self.latency.coef[f] for f in self.latency.coef}
        self._ends = list(self.latency.exit_layers)
        self._L = self.latency.num_layers
        self.tokens_total = self.finished_total = self.rejected_total = self.steps_total = 0
        self.sla_met_total = self.chunks_total = self.shed_total = 0
        self.step_seconds_total = self.emit_seconds_total = 0.0

    # ---------------------------------------------------------------- control
    def set(self, prefill_budget: int | None = None, max_running: int | None = None) -> None:
        if prefill_budget is not None:  # as the engine does: within the backend's largest chunk
            self.budget = clamp_budget(prefill_budget, self.cfg.max_chunk)
        if max_running is not None:
            self.limit = max(1, min(int(max_running), self.cfg.max_seqs))

    @property
    def done(self) -> bool:
        return self._next >= len(self._reqs) and not (self.waiting or self.prefilling or self.decoding)

    def take_counts(self) -> TickCounts:
        c, self.counts = self.counts, TickCounts()
        return c

    # ---------------------------------------------------------------- the clock
    def advance(self, until: float) -> None:
        """Run engine steps (and jump over idle time) until the clock reaches ``until`` or the
        workload is done; a step in progress at ``until`` finishes (the clock may pass it)."""
        while self.t < until:
            self._arrive()
            if self.waiting or self.prefilling or self.decoding:
                self._step()
            elif self._next < len(self._reqs):
                self.t = min(until, max(self.t, self._reqs[self._next].ready))
            else:
                self.t = until
                return

    def run_to_end(self, horizon_s: float = 1e6) -> None:
        self.advance(horizon_s)

    def _arrive(self) -> None:
        reqs, c = self._reqs, self.counts
        while self._next < len(reqs) and reqs[self._next].ready <= self.t:
            r = reqs[self._next]
            self._next += 1
            self._arrivals.append(r.arrival)
            self._front.append(r.ready)
            if len(self.waiting) >= self.cfg.max_waiting:
                r.rejected, r.end = True, r.arrival
                self.rejected_total += 1
                c.rejected += 1
                c.violations += 1
            else:
                self.waiting.append(r)

    def _maybe_audit(self) -> None:
        """As the host: one audit at a time, only when nothing waits and a slot is free."""
        running = len(self.prefilling) + len(self.decoding)
        if (self._audits and not self._audit_inflight and not self.waiting
                and running < min(self.limit, self.cfg.max_seqs)):
            n = self._audits.popleft()
            self.prefilling.append(_Req(-1, self.t, n, 1, np.array([self._L]), audit=True))
            self._audit_inflight = True
            self.audits_total += 1

    def _shed(self) -> None:
        """As the host: refuse the waiting requests whose TTFT deadline has passed."""
        late = [r for r in self.waiting if self.t >= r.arrival + self._ttft]
        for r in late:
            self.waiting.remove(r)
            r.shed, r.end = True, self.t
            self.shed_total += 1
            self.counts.rejected += 1
            self.counts.violations += 1

    def _step(self) -> None:
        w, ends, L = self._w, self._ends, self._L
        if self.cfg.shed_late:
            self._shed()
        while self.waiting and len(self.prefilling) + len(self.decoding) < min(self.limit, self.cfg.max_seqs):
            self.prefilling.append(self.waiting.popleft())
        if self.cfg.audit_fraction > 0:
            self._maybe_audit()
        # decode: one token each, at its exit layer, in the batched step; or a draft round, a call of its own,
        # emitting several tokens at full depth (SimConfig.decode_rounds)
        dec = self.decoding
        cost = 0.0
        limit = self.cfg.exit_max_batch
        exits = limit is None or len(dec) <= limit
        bucket = batch_bucket(len(dec)) if dec else None
        rounds = self._rounds.get(bucket) if dec else None
        emitted, n_rounds = [], 0
        if dec:
            deepest, layer_rows, attn, rows = 0, 0, 0.0, 0
            for r in dec:
                j = 0  # 0: a plain step; j > 0: a round emitting j tokens
                if rounds is not None:  # what the served engine's sequences did at this batch size
                    j = min(int(np.searchsorted(rounds, self._round_rng.random() * rounds[-1], side="right")),
                            r.out - r.generated)
                if j:
                    emitted.append((j, L))  # a round's tokens are the full model's
                    n_rounds += 1
                    continue
                e = int(r.exits[r.generated]) if exits else L
                emitted.append((1, e))
                rows += 1
                layer_rows += e
                attn += (r.prompt + r.generated - 1) * e
                if e > deepest:
                    deepest = e
            if rows:
                calls = next(i for i, e in enumerate(ends) if e >= deepest) + 1
                cost += (w["decode_calls"] * calls + w["decode_rows"] * rows
                         + w["decode_layer_rows"] * layer_rows + w["decode_attn"] * attn / 1e3)
        # prefill: the budget over prompt chunks, FCFS
        budget, done_prefill, chunks, tokens, pattn = self.budget, [], 0, 0, 0.0
        for r in self.prefilling:
            n = min(r.prompt - r.prefilled, budget)
            if n <= 0:
                break
            budget -= n
            chunks += 1
            tokens += n
            pattn += n * (r.prefilled + n / 2) * L
            r.prefilled += n
            if r.prefilled == r.prompt:
                done_prefill.append(r)
        pcost = 0.0
        if chunks:
            pcost = w["prefill_calls"] * chunks + w["prefill_tokens"] * tokens + w["prefill_attn"] * pattn / 1e3
        # one chunk per sequence (all its tokens of the step); the host emits none for an audit
        sent = len(dec) + sum(not r.audit for r in done_prefill)
        front = self._front
        while front and front[0] < self.t - FRONT_WINDOW_S:
            front.popleft()
        a = len(front)  # as the host's step log counts them, at the step's start
        engine = ((cost + w["one"]) * (self.cfg.engine_slowdown + self._fd * a) + pcost * (self._kp + self._fp * a)
                  + self._round_s_by.get(bucket, self._round_s) * n_rounds)
        cost = engine + self._chunk * sent + self._chunk_sq * sent * sent
        self.t += cost
        self.steps_total += 1
        self.chunks_total += sent
        self.step_seconds_total += engine
        self.emit_seconds_total += cost - engine
        self.counts.busy_s += cost
        t_deliver = self.t
        finished = []
        af = self.cfg.audit_fraction
        for r, (k, e) in zip(dec, emitted):
            for _ in range(k):
                r.predicted = e if r.predicted is None else (1 - EMA) * r.predicted + EMA * e
                if af > 0 and e < L and self._audit_rng.random() < af and len(self._audits) < self.cfg.audit_max_pending:
                    self._audits.append(r.prompt + r.generated)
                self._deliver(r, t_deliver + self._oh_tok)
            if r.generated >= r.out:
                finished.append(r)
        for r in done_prefill:
            self.prefilling.remove(r)
            r.first = t_deliver + self._oh_first
            self._deliver(r, r.first)
            if r.generated >= r.out:
                finished.append(r)
            else:
                self.decoding.append(r)
        for r in finished:
            if r in self.decoding:
                self.decoding.remove(r)
            self._finish(r)

    def _deliver(self, r: _Req, t: float) -> None:
        r.last = t
        if r.audit:  # its token goes to the audit, not to a client
            r.generated += 1
            return
        index = r.generated
        r.generated += 1
        self.tokens_total += 1
        c = self.counts
        if on_time(t, r.arrival, self._ttft, self._tpot, index):
            c.tokens_on_time += 1
        else:
            c.tokens_late += 1
            if not r.late:
                r.late = True
                c.violations += 1

    def _finish(self, r: _Req) -> None:
        r.end = r.last
        if r.audit:
            self._audit_inflight = False
            return
        ttft = r.first - r.arrival
        tpot = (r.end - r.first) / (r.out - 1) if r.out > 1 else None
        self._recent_ttft.append(ttft)
        if tpot is not None:
            self._recent_tpot.append(tpot)
        met = sla_met(ttft, tpot, self._ttft, self._tpot)
        self.finished_total += 1
        self.sla_met_total += met
        self.counts.finished += 1
        self.counts.finished_met += met

    # ---------------------------------------------------------------- what a policy sees
    def observe(self) -> dict[str, Any]:
        """The engine host's ``stats`` keys (docs/serving.md) at the current time."""
        now = self.t
        slacks = [(due_time(r.arrival, self._ttft, self._tpot, r.generated) - now) * 1e3
                  for r in (*self.waiting, *self.prefilling, *self.decoding) if not r.audit]
        preds = [r.predicted for r in self.decoding if r.predicted is not None]
        while self._arrivals and self._arrivals[0] < now - RATE_WINDOW_S:
            self._arrivals.popleft()
        pre = [r for r in self.prefilling if not r.audit]
        oldest = self.waiting[0] if self.waiting else (pre[0] if pre else None)
        return {
            "time": now, "waiting": len(self.waiting),
            "prefill_backlog_tokens": sum(r.prompt - r.prefilled for r in (*self.waiting, *self.prefilling)),
            "audits_total": self.audits_total, "audit_pending": len(self._audits),
            "running": len(self.prefilling) + len(self.decoding),
            "free_slots": self.cfg.max_seqs - len(self.prefilling) - len(self.decoding),
            "prefill_budget": self.budget, "max_chunk": self.cfg.max_chunk, "max_running": self.limit,
            "max_seqs": self.cfg.max_seqs, "max_waiting": self.cfg.max_waiting, "num_layers": self._L, "exit_layers": list(self._ends),
            "predicted_exit_layer": float(np.mean(preds)) if preds else self.exits.mean_layer,
            "min_slack_ms": min(slacks) if slacks else None,
            "oldest_waiting_slack_ms": None if oldest is None else (oldest.arrival + self._ttft - now) * 1e3,
            "recent_ttft_p95_ms": p95_ms(self._recent_ttft), "recent_tpot_p95_ms": p95_ms(self._recent_tpot),
            "arrival_rate_rps": len(self._arrivals) / RATE_WINDOW_S,
            "sla_ttft_ms": self.cfg.sla_ttft_ms, "sla_tpot_ms": self.cfg.sla_tpot_ms,
            "tokens_total": self.tokens_total, "finished_total": self.finished_total,
            "sla_met_total": self.sla_met_total, "rejected_total": self.rejected_total,
            "shed_late": self.cfg.shed_late, "shed_total": self.shed_total,
            "steps_total": self.steps_total, "step_seconds_total": self.step_seconds_total,
            "emit_seconds_total": self.emit_seconds_total, "chunks_total": self.chunks_total,
        }

    # ---------------------------------------------------------------- results
    def results(self) -> list[RequestResult]:
        """Every request as a client would have seen it (outcomes.RequestResult: summarize() applies)."""
        out = []
        for r in self._reqs:
            res = RequestResult(f"sim-{r.i}", r.arrival, r.prompt, r.out, t_submit=r.arrival)
            if r.rejected:
                res.t_end, res.error_kind, res.error = r.arrival, "overloaded", "refused: queue full"
            elif r.shed:
                res.t_end, res.error_kind, res.error = r.end, "shed", "refused: its TTFT deadline passed while it waited"
            elif r.end is not None:
                res.t_first_token, res.t_end, res.tokens, res.finish_reason = r.first, r.end, r.out, "length"
            else:
                res.error_kind, res.error = "unfinished", "the simulation ended first"
            out.append(res)
        return out


def simulate(latency: LatencyModel, exits: ExitModel, cfg: SimConfig, workload: Workload, policy: Any,
             tick_s: float = 0.25, horizon_s: float | None = None) -> Simulator:
    """Run ``workload`` to the end (or ``horizon_s``) with ``policy`` acting every ``tick_s`` as the
    serving worker does (``policy.act(observation_from_stats(stats))``); returns the simulator
    (``results()``, totals).

    Raises:
        ConfigError: tick_s <= 0.
    """
    from scheduler.control.policies import observation_from_stats

    if tick_s <= 0:
        raise ConfigError(f"sim: tick_s must be > 0, got {tick_s}")
    sim = Simulator(latency, exits, cfg, workload)
    end = horizon_s if horizon_s is not None else math.inf
    reset = getattr(policy, "reset", None)
    if reset is not None:
        reset()
    while not sim.done and sim.t < end:
        a = policy.act(observation_from_stats(sim.observe()))
        sim.set(a.prefill_budget, a.max_running)
        sim.advance(min(end, sim.t + tick_s))
    return sim
