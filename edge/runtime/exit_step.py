"""The engine's decode step with early exits: how the exit rule decides (a score computed in the segment
graphs, whose sign the engine reads, or a rule asked on the host), and one token for every decoding
sequence, segment by segment, the batch compacted to the rows still running after each exit; full depth in
one call when no row may leave. With deferral, the full model's verdicts on greedy exits are delivered here.

:class:`ExitStep` is a mixin of :class:`edge.runtime.engine.Engine`: its methods run on the engine's state
(``backend``, ``cfg``, ``rule``, ``step_gate``, ``verdict_counts``, and the rounds' ``call_costs``) and emit
through the engine (``_emit``); the K/V of skipped layers is edge/runtime/skipped_kv.py's.
"""
from __future__ import annotations

import time

import numpy as np

from edge.model.candidates import lookup_feature
from edge.model.lookup import NONE as LOOKUP_NONE
from edge.model.ngram import checked_table
from edge.runtime.backend import Backend, SegmentOut
from edge.runtime.engine_config import EngineConfig, KVMode
from edge.runtime.gate import StepGate
from edge.runtime.request import Mode, Verdict, _Pending, _Seq
from edge.runtime.rules import BatchExitRule, score_form
from edge.runtime.sampling import choose_token
from edge.runtime.skipped_kv import catch_up, fill_skipped, with_deferred
from edge.runtime.spec_costs import CallCosts
from edge.core.errors import ConfigError


class ExitStep:
    """The decode step with exits, half of the engine (a mixin of ``Engine``; see the module docstring)."""

    # the engine's, which the step reads (and ``verdict_counts``, ``call_costs`` it updates)
    backend: Backend
    cfg: EngineConfig
    rule: BatchExitRule
    step_gate: StepGate | None
    verdict_counts: dict[str, int]
    call_costs: CallCosts

    def _init_exits(self) -> None:
        """Where the exit rule is decided (in the graphs or on the host), and a shortlist rule's routing."""
        backend = self.backend
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
                    out = with_deferred(backend, i, act[0], x, slots, start, prev, lookup, self._judge)
                else:
                    x = catch_up(backend, i, act, x, slots, start, self._judge)
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
                fill_skipped(backend, self.cfg.kv_mode, [act[r] for r in rows], i, out.hidden[rows, 0], slots[rows],
                             start[rows], decided[-len(rows):])
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



def _rows(a: np.ndarray | None, keep: np.ndarray) -> np.ndarray | None:
    return None if a is None else a[keep]
