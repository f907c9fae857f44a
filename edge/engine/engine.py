"""The engine: continuous batching, chunked prefill, batched hierarchical exits.

Each ``step()``:
1. admits waiting requests while the admission limit and free cache slots allow;
2. runs one decode step for every sequence past its prompt: segment by segment,
   after each exit the rule picks the rows that stop there, their tokens are
   decided, and the batch is compacted to the rows still running;
3. spends the prefill budget (tokens per iteration, the scheduler's knob) on
   prompt chunks, full depth (Sarathi-Serve's chunked prefill).

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
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from edge.engine.backend import Backend
from edge.engine.cache import KVCache
from edge.engine.rules import BatchExitRule, NeverExit
from edge.engine.sampling import choose_token
from edge.errors import ConfigError, SmartExitError

NEG = np.finfo(np.float32).min


class KVMode(str, enum.Enum):
    PROPAGATE = "propagate"
    DEFER = "defer"


@dataclass
class EngineConfig:
    max_seqs: int = 16  # cache slots
    max_len: int = 512  # tokens per sequence (prompt + output), <= the model's context window
    prefill_budget: int = 256  # prompt tokens per iteration
    max_running: int = 16  # admission limit (sequences holding a slot)
    kv_mode: KVMode = KVMode.PROPAGATE

    def __post_init__(self) -> None:
        self.kv_mode = KVMode(self.kv_mode)
        if self.max_seqs < 1 or self.max_len < 2 or self.prefill_budget < 1 or self.max_running < 1:
            raise ConfigError("engine: max_seqs, prefill_budget, max_running >= 1 and max_len >= 2 are required")


@dataclass
class TokenEvent:
    request_id: int
    token: int
    exit_layer: int
    index: int  # position in the output
    finished: bool
    finish_reason: str | None = None  # "length", "stop", "cancelled"


@dataclass
class Request:
    prompt: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    stop_ids: tuple[int, ...] = ()
    seed: int | None = None
    deadline: float | None = None  # absolute time.monotonic() by which the request should finish
    on_token: Callable[[TokenEvent], None] | None = None


@dataclass
class _Pending:
    pos: int
    hidden: np.ndarray  # [D] residual at the depth reached so far
    next_seg: int


@dataclass
class _Seq:
    id: int
    req: Request
    slot: int = -1
    prefilled: int = 0  # prompt tokens in the cache
    tokens: list[int] = field(default_factory=list)
    exit_layers: list[int] = field(default_factory=list)
    pending: list[_Pending] = field(default_factory=list)
    rng: np.random.Generator | None = None
    submitted: float = 0.0

    @property
    def length(self) -> int:
        """Tokens whose position is in the cache (the newest output token is not yet)."""
        return self.prefilled + max(0, len(self.tokens) - 1)


@dataclass
class _DecodeOut:
    """One segment's results for the decode rows, in row order."""

    hidden: list[np.ndarray]  # per row [T_b, D]: residual after the segment (deferred rows, then the new token)
    stats: np.ndarray  # [B, 3] the new token's exit statistics
    token: np.ndarray  # [B] its exit argmax
    exit_hidden: np.ndarray  # [B, D] its normalised exit hidden
    logits: list[np.ndarray]  # per row [V]


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


def build_mask(q_pos: np.ndarray, past_len: np.ndarray, P: int, q_valid: np.ndarray,
               window: int | None) -> np.ndarray:
    """Additive mask [B, 1, T, P+T]: a query at q_pos [B, T] sees cached keys 0..past_len-1 and new
    valid rows at positions <= its own (and within ``window`` if set)."""
    b = q_pos.shape[0]
    k_pos = np.concatenate([np.broadcast_to(np.arange(P), (b, P)), q_pos], axis=1)  # [B, S]
    k_valid = np.concatenate([np.arange(P)[None, :] < past_len[:, None], q_valid], axis=1)  # [B, S]
    allowed = (k_pos[:, None, :] <= q_pos[:, :, None]) & k_valid[:, None, :]  # [B, T, S]
    if window is not None:
        allowed &= k_pos[:, None, :] > q_pos[:, :, None] - window
    return np.where(allowed, 0.0, NEG).astype(np.float32)[:, None]


class Engine:
    def __init__(self, backend: Backend, cfg: EngineConfig, rule: BatchExitRule | None = None) -> None:
        self.backend, self.cfg = backend, cfg
        self.rule = rule or NeverExit()
        self.cache = KVCache(backend.num_layers, backend.num_kv_heads, backend.head_dim, cfg.max_seqs, cfg.max_len)
        self.layer_seg = {j: i for i, seg in enumerate(backend.segments) for j in seg}
        self.waiting: list[_Seq] = []
        self.prefilling: list[_Seq] = []
        self.decoding: list[_Seq] = []
        self._ids = itertools.count()
        self._cancelled: set[int] = set()

    # ---------------------------------------------------------------- control
    def submit(self, req: Request) -> int:
        """Queue a request; raises for an empty or oversize prompt or out-of-vocabulary ids."""
        if not req.prompt:
            raise SmartExitError("empty prompt: at least one token is needed")
        if req.max_tokens < 1:
            raise SmartExitError(f"max_tokens must be >= 1, got {req.max_tokens}")
        if len(req.prompt) + req.max_tokens > self.cfg.max_len:
            raise SmartExitError(f"prompt of {len(req.prompt)} tokens + max_tokens {req.max_tokens} exceeds the "
                                 f"context window of {self.cfg.max_len} tokens")
        bad = [t for t in req.prompt if not 0 <= t < self.backend.vocab_size]
        if bad:
            raise SmartExitError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.backend.vocab_size})")
        if not 0.0 < req.top_p <= 1.0 or req.temperature < 0:
            raise SmartExitError("temperature must be >= 0 and top_p in (0, 1]")
        seq = _Seq(next(self._ids), req, submitted=time.monotonic())
        seq.rng = np.random.default_rng(req.seed) if req.temperature > 0 else None
        self.waiting.append(seq)
        return seq.id

    def cancel(self, request_id: int) -> bool:
        """Stop a request and free its cache slot; True if it was still active."""
        for group in (self.waiting, self.prefilling, self.decoding):
            for seq in group:
                if seq.id == request_id:
                    group.remove(seq)
                    self._release(seq)
                    return True
        return False

    def set_prefill_budget(self, tokens: int) -> None:
        if tokens < 1:
            raise ConfigError(f"prefill budget must be >= 1 token, got {tokens}")
        self.cfg.prefill_budget = int(tokens)

    def set_admission_limit(self, n: int) -> None:
        if n < 1:
            raise ConfigError(f"admission limit must be >= 1, got {n}")
        self.cfg.max_running = int(n)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.decoding)

    def stats(self) -> EngineStats:
        backlog = sum(len(s.req.prompt) - s.prefilled for s in self.waiting + self.prefilling)
        active = self.prefilling + self.decoding
        return EngineStats(
            waiting=len(self.waiting), prefill_backlog_tokens=backlog, running=len(active),
            recent_exit_layers={s.id: s.exit_layers[-8:] for s in self.decoding},
            deadlines={s.id: s.req.deadline for s in self.waiting + active},
            prefill_budget=self.cfg.prefill_budget, max_running=self.cfg.max_running,
            free_slots=self.cache.free_slots,
        )

    def run(self) -> None:
        while self.has_work:
            self.step()

    # ---------------------------------------------------------------- the loop
    def step(self) -> list[TokenEvent]:
        events: list[TokenEvent] = []
        self._admit()
        if self.decoding:
            events += self._decode(list(self.decoding))
        if self.prefilling:
            events += self._prefill()
        return events

    def _admit(self) -> None:
        while (self.waiting and self.cache.free_slots
               and len(self.prefilling) + len(self.decoding) < self.cfg.max_running):
            seq = self.waiting.pop(0)
            seq.slot = self.cache.alloc()
            self.prefilling.append(seq)

    def _segment_rows(self, i: int, seqs: list[_Seq], rows: list[tuple[list[int], np.ndarray]]):
        """Run segment i; rows[b] = (positions, hidden [T_b, D]) for seqs[b]; writes their K/V."""
        b = len(seqs)
        t = max(len(p) for p, _ in rows)
        if t == 1:  # decode without deferred rows: one new token per sequence
            positions = np.array([p for p, _ in rows], np.int64)  # [B, 1]
            return self._segment(i, seqs, np.stack([h for _, h in rows]).reshape(b, 1, -1), positions, None,
                                 np.zeros(b, np.int64))
        d = rows[0][1].shape[-1]
        hidden = np.zeros((b, t, d), np.float32)
        positions = np.zeros((b, t), np.int64)
        valid = np.zeros((b, t), bool)
        for r, (pos, h) in enumerate(rows):
            n = len(pos)
            hidden[r, :n] = h
            positions[r, :n] = pos
            positions[r, n:] = pos[-1]
            valid[r, :n] = True
        last = np.array([len(pos) - 1 for pos, _ in rows], np.int64)  # each sequence's newest row
        return self._segment(i, seqs, hidden, positions, valid, last)

    def _segment(self, i: int, seqs: list[_Seq], hidden: np.ndarray, positions: np.ndarray,
                 valid: np.ndarray | None, exit_index: np.ndarray):
        """Run segment i on hidden [B, T, D] at positions [B, T] (``valid`` [B, T], None = all rows
        valid; the exit head runs on row ``exit_index[b]``); reads the past from the cache and writes
        the new rows' K/V into it."""
        past_len = positions[:, 0].copy()
        P = int(past_len.max())
        slots = np.array([s.slot for s in seqs])
        seg_layers = self.backend.segments[i]
        pk, pv = zip(*(self.cache.gather(j, slots, P) for j in seg_layers))
        if valid is None and positions.shape[1] == 1 and self.backend.sliding_window is None:
            # the decode mask: its own past, then itself
            mask = np.zeros((len(seqs), 1, 1, P + 1), np.float32)
            mask[:, 0, 0, :P][np.arange(P)[None, :] >= past_len[:, None]] = NEG
        else:
            ok = np.ones(positions.shape, bool) if valid is None else valid
            mask = build_mask(positions, past_len, P, ok, self.backend.sliding_window)
        out = self.backend.segment(i, hidden, positions, mask, list(pk), list(pv), exit_index)
        for j, k, v in zip(seg_layers, out.keys, out.values):
            self.cache.write(j, slots, positions, valid, k, v)
        return out

    def _prefill(self) -> list[TokenEvent]:
        budget = self.cfg.prefill_budget
        chunk: list[tuple[_Seq, int]] = []
        for seq in self.prefilling:
            n = min(len(seq.req.prompt) - seq.prefilled, budget)
            if n <= 0:
                break
            chunk.append((seq, n))
            budget -= n
        if not chunk:
            return []
        seqs = [s for s, _ in chunk]
        ids = [s.req.prompt[s.prefilled:s.prefilled + n] for s, n in chunk]
        rows = [(list(range(s.prefilled, s.prefilled + n)), self.backend.embed(np.array([x]))[0])
                for (s, n), x in zip(chunk, ids)]
        out = None
        for i in range(len(self.backend.segments)):
            out = self._segment_rows(i, seqs, rows)
            rows = [(pos, out.hidden[r, :len(pos)]) for r, (pos, _) in enumerate(rows)]
        events = []
        for r, (seq, n) in enumerate(chunk):
            seq.prefilled += n
            if seq.prefilled == len(seq.req.prompt):
                self.prefilling.remove(seq)
                self.decoding.append(seq)
                token = choose_token(out.logits[r], seq.req.temperature, seq.req.top_p, seq.rng)
                events.append(self._emit(seq, token, self.backend.num_layers))
        return events

    def _decode(self, seqs: list[_Seq]) -> list[TokenEvent]:
        nseg = len(self.backend.segments)
        last = np.array([[s.tokens[-1]] for s in seqs], np.int64)
        new_h = {s.id: h for s, h in zip(seqs, self.backend.embed(last)[:, 0])}  # [D] per seq
        # what the rule sees, per exit reached so far, for the rows still running
        stats: dict[int, np.ndarray] = {}  # [B, 3]
        tokens: dict[int, np.ndarray] = {}  # [B]
        hidden: dict[int, np.ndarray] = {}  # [B, D]
        active = list(range(len(seqs)))  # indices into seqs of rows still running
        decided: dict[int, tuple[int, int]] = {}  # seq index -> (token, exit layer)
        for i in range(nseg):
            act = [seqs[a] for a in active]
            pend = [[p for p in s.pending if p.next_seg <= i] for s in act]  # rows that run this segment
            rows = [([p.pos for p in ps] + [s.length], np.stack([p.hidden for p in ps] + [new_h[s.id]]))
                    if ps else ([s.length], new_h[s.id][None]) for s, ps in zip(act, pend)]
            out = self._decode_segment(i, act, rows)
            for r, s in enumerate(act):
                for q, p in enumerate(pend[r]):
                    p.hidden, p.next_seg = out.hidden[r][q], i + 1
                new_h[s.id] = out.hidden[r][-1]
                if pend[r]:
                    s.pending = [p for p in s.pending if p.next_seg < nseg]
            layer = self.backend.exit_layers[i]
            stats[layer], tokens[layer] = out.stats, out.token
            if i == nseg - 1:
                stop = np.ones(len(act), bool)
            else:
                hidden[layer] = out.exit_hidden
                stop = np.asarray(self.rule.decide(layer, stats, tokens, hidden), bool)
            for r in np.flatnonzero(stop):
                s = act[r]
                if s.req.temperature > 0:
                    token = choose_token(out.logits[r], s.req.temperature, s.req.top_p, s.rng)
                else:
                    token = int(out.token[r])
                decided[active[r]] = (token, layer)
            if i < nseg - 1 and stop.any():
                self._fill_skipped([act[r] for r in np.flatnonzero(stop)], i, new_h)
            keep = ~stop
            if not keep.any():
                break
            if not keep.all():
                active = [a for a, k in zip(active, keep) if k]
                for trace in (stats, tokens, hidden):
                    for k in trace:
                        trace[k] = trace[k][keep]
        return [self._emit(seqs[a], tok, layer) for a, (tok, layer) in sorted(decided.items())]

    def _decode_segment(self, i: int, act: list[_Seq], rows: list[tuple[list[int], np.ndarray]]) -> _DecodeOut:
        """Segment i for the decode rows. Sequences carrying deferred rows (T > 1) run in a call of
        their own, so that one pending row does not pad every sequence of the batch to T = 2."""
        multi = [r for r, (pos, _) in enumerate(rows) if len(pos) > 1]
        if multi and len(multi) < len(rows):
            single = [r for r, (pos, _) in enumerate(rows) if len(pos) == 1]
            groups = [single, multi]
        else:
            groups = [list(range(len(rows)))]
        b, d = len(rows), rows[0][1].shape[-1]
        res = _DecodeOut([None] * b, np.empty((b, 3), np.float32), np.empty(b, np.int64),
                         np.empty((b, d), np.float32), [None] * b)
        for g in groups:
            out = self._segment_rows(i, [act[r] for r in g], [rows[r] for r in g])
            res.stats[g], res.token[g], res.exit_hidden[g] = out.stats, out.token, out.exit_hidden
            for q, r in enumerate(g):
                res.hidden[r] = out.hidden[q, :len(rows[r][0])]
                res.logits[r] = out.logits[q]
        return res

    def _fill_skipped(self, exited: list[_Seq], i: int, new_h: dict[int, np.ndarray]) -> None:
        """K/V of segments i+1.. for rows that exited after segment i."""
        if self.cfg.kv_mode is KVMode.DEFER:
            for s in exited:
                s.pending.append(_Pending(s.length, new_h[s.id].copy(), i + 1))
            return
        slots = np.array([s.slot for s in exited])
        pos = np.array([[s.length] for s in exited], np.int64)
        h = np.stack([new_h[s.id] for s in exited])[:, None]  # [B, 1, D]
        ones = np.ones((len(exited), 1), bool)
        keys, values = self.backend.kvfill(i + 1, h, pos)
        for layer, k, v in zip(self.backend.suffix_layers(i + 1), keys, values):
            self.cache.write(layer, slots, pos, ones, k, v)

    def _emit(self, seq: _Seq, token: int, exit_layer: int) -> TokenEvent:
        seq.tokens.append(token)
        seq.exit_layers.append(exit_layer)
        reason = None
        if token in seq.req.stop_ids:
            reason = "stop"
        elif len(seq.tokens) >= seq.req.max_tokens:
            reason = "length"
        ev = TokenEvent(seq.id, token, exit_layer, len(seq.tokens) - 1, reason is not None, reason)
        if seq.req.on_token is not None:
            seq.req.on_token(ev)
        if reason is not None:
            self.decoding.remove(seq)
            self._release(seq)
        return ev

    def _release(self, seq: _Seq) -> None:
        if seq.slot >= 0:
            self.cache.release(seq.slot)
            seq.slot = -1
        seq.pending.clear()


def generate_batch(backend: Backend, rule: BatchExitRule | None, prompts: list[list[int]], max_tokens: int,
                   kv_mode: KVMode = KVMode.PROPAGATE) -> list[tuple[list[int], list[int]]]:
    """Greedy-generate all prompts together; returns (tokens, exit layers) per prompt, in order."""
    cfg = EngineConfig(max_seqs=len(prompts), max_running=len(prompts),
                       max_len=max(len(p) for p in prompts) + max_tokens,
                       prefill_budget=sum(len(p) for p in prompts), kv_mode=kv_mode)
    engine = Engine(backend, cfg, rule)
    ids = [engine.submit(Request(list(p), max_tokens)) for p in prompts]
    out: dict[int, tuple[list[int], list[int]]] = {i: ([], []) for i in ids}
    while engine.has_work:
        for ev in engine.step():
            out[ev.request_id][0].append(ev.token)
            out[ev.request_id][1].append(ev.exit_layer)
    return [out[i] for i in ids]
