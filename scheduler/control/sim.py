"""A discrete-event simulator of the engine behind the server: chunked prefill, decode with
per-sequence exit depths, admission, driven by a fitted latency model (scheduler/control/latency.py).

It follows ``Engine.step`` (edge/runtime/engine.py): each iteration admits waiting requests FCFS
while a slot is free and fewer than ``max_running`` hold one, decodes one token for every decoding
sequence (each leaves at an exit layer drawn from its request's exit distribution), or several at full
depth where the served engine's draft rounds did at that batch size (``SimConfig.decode_rounds``), then spends the
prefill budget on prompt chunks FCFS, one sequence per call; a prompt that completes yields its
first token (full depth). The step lasts what the latency model says for what it did, slowed as the
served engine is (step_cost.py ``StepCost``), and its tokens are delivered at its end (the host sends
a step's tokens after the step). A request that arrives to ``max_waiting`` queued ones is refused (the
host's ``overloaded``).

Exit depths: each request draws its own exit distribution from a Dirichlet centred on the calibrated
marginal (exit_model.py ``ExitModel``): requests differ in how easy their text is (some exit early
often, some rarely), which is what makes a per-request predicted exit depth worth having. The concentration is
fitted from measured per-request exit traces where they exist (``ExitModel.fit``).

``observe()`` answers with the same keys as the engine host's ``stats`` control op, so one
``observation_from_stats`` serves the simulator, the gym environment and the live server. Like the
host, the simulator clamps the budget to the backend's largest chunk (``SimConfig.max_chunk``; the
settings are sim_config.py's, a request's state sim_request.py's).
"""
from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edge.core.errors import ConfigError
from edge.core.stats import due_time, on_time, p95_ms, sla_met  # the host's own statistics: one definition live and simulated
from edge.runtime.host_steplog import FRONT_WINDOW_S
from edge.runtime.settings import clamp_budget
from scheduler.control.exit_model import ExitModel
from scheduler.control.latency import LatencyModel
from scheduler.control.outcomes import RequestResult
from scheduler.control.sim_config import SimConfig, batch_bucket
from scheduler.control.sim_request import Req, draw_requests
from scheduler.control.step_cost import StepCost
from scheduler.control.workload import Workload

EMA = 0.3           # the host's weight of the newest exit layer in a request's predicted depth (edge/runtime/host_sla.py)
RECENT = 32         # finished requests behind the recent tail latencies (the host keeps as many)
RATE_WINDOW_S = 5.0  # arrivals counted for the recent arrival rate


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
        self._reqs = draw_requests(w, self.exits, self.cfg.seed, self.cfg.ingress_ms)
        self._audit_rng = np.random.default_rng([self.cfg.seed, 1])
        self._round_rng = np.random.default_rng([self.cfg.seed, 2])
        self._rounds = {k: np.cumsum(v) for k, v in (self.cfg.decode_rounds or {}).items()}
        self._audits: collections.deque[int] = collections.deque()  # queued audit prefixes' lengths
        self._audit_inflight = False
        self.audits_total = 0
        self._next = 0                          # the next arrival's index
        self.waiting: collections.deque[Req] = collections.deque()
        self.prefilling: list[Req] = []
        self.decoding: list[Req] = []
        self.budget, self.limit = clamp_budget(self.cfg.prefill_budget, self.cfg.max_chunk), self.cfg.max_running
        self._ttft = self.cfg.sla_ttft_ms / 1e3
        self._tpot = self.cfg.sla_tpot_ms / 1e3
        self._oh_first = self.cfg.ttft_overhead_ms / 1e3
        self._oh_tok = self.cfg.token_overhead_ms / 1e3
        self._recent_ttft: collections.deque[float] = collections.deque(maxlen=RECENT)
        self._recent_tpot: collections.deque[float] = collections.deque(maxlen=RECENT)
        self._arrivals: collections.deque[float] = collections.deque()
        self._front: collections.deque[float] = collections.deque()  # reached the engine in the last FRONT_WINDOW_S
        self._cost = StepCost(self.latency, self.cfg)
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
            self.prefilling.append(Req(-1, self.t, n, 1, np.array([self._L]), audit=True))
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
        L = self._L
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
                cost = self._cost.decode(deepest, rows, layer_rows, attn)
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
            pcost = self._cost.prefill(chunks, tokens, pattn)
        # one chunk per sequence (all its tokens of the step); the host emits none for an audit
        sent = len(dec) + sum(not r.audit for r in done_prefill)
        front = self._front
        while front and front[0] < self.t - FRONT_WINDOW_S:
            front.popleft()
        a = len(front)  # as the host's step log counts them, at the step's start
        engine = self._cost.engine(cost, pcost, a, bucket, n_rounds)
        cost = self._cost.served(engine, sent)
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

    def _deliver(self, r: Req, t: float) -> None:
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

    def _finish(self, r: Req) -> None:
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
