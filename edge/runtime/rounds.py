"""The engine's speculative rounds (mode exact, and mode bounded with ``bounded_drafts``): which rows draft
in a decode iteration and from which source, the rounds that verify their drafts, and the emitted tokens.

The algorithm and its settings are in edge/runtime/speculative.py; the measured costs, draft lengths and stop
rules, gates and acceptance rules these rounds use are in spec_costs.py, spec_length.py, spec_gates.py and
spec_accept.py beside it. :class:`SpeculativeRounds` is a mixin of :class:`edge.runtime.engine.Engine`:
its methods run on the engine's state (``backend``, ``cfg``, ``rule``, ``round_ids``) and emit through the
engine (``_emit``); rows that do not draft take the engine's plain step (``_step``).
"""
from __future__ import annotations

import time

import numpy as np

from edge.model.lookup import MAX_N as LOOKUP_MAX_N
from edge.model.ngram import MAX_N as NGRAM_MAX_N
from edge.runtime.backend import Backend
from edge.runtime.engine_config import EngineConfig
from edge.runtime.request import Mode, _Seq
from edge.runtime.rules import TOP1, BatchExitRule
from edge.runtime.sampling import token_distribution
from edge.runtime.spec_accept import accept_greedy, accept_sampled
from edge.runtime.spec_costs import CallCosts, DraftCosts
from edge.runtime.spec_gates import ExitDraftGate, SpeculationGate
from edge.runtime.spec_length import LookupAcceptance, include_next, lookup_length
from edge.runtime.speculative import MAX_VERIFY_ROWS, Source, SpecStats, StopRule
from edge.core.errors import ConfigError


class SpeculativeRounds:
    """Speculative decoding's half of the engine (a mixin of ``Engine``; see the module docstring)."""

    # the engine's, which the rounds read (and ``round_ids``, ``plain_steps`` they write)
    backend: Backend
    cfg: EngineConfig
    rule: BatchExitRule
    round_ids: set[int]

    def _init_speculation(self) -> None:
        """The drafting state: the draft exit, the measured costs and acceptance the backend keeps, the stats."""
        backend = self.backend
        # self-speculative decoding (mode exact): the draft exit's segment, its stop rule's inputs
        spec = self.cfg.speculative
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
        self.spec_stats = SpecStats()  # every speculative round
        self.source_stats = {src.value: SpecStats() for src in Source}  # the rounds of each draft source
        self.plain_steps = 0  # decode steps of exact requests that drafted nothing

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

