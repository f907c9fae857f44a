"""The ONNX Runtime backend's bindings (edge/runtime/ort_backend.py): :class:`Plan`, one graph call's I/O
binding and buffers, and :class:`PlanBinder`, which makes the plans of segment, ``full`` and ``verify_{B}``
calls and owns what they bind: the buffers consecutive segments' decode plans share, views of the
engine's cache, and the exit rule's weights (bound once, updated in place).

Only plan building lives here (one-time work per call shape); the calls that run a plan are the
backend's.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edge.runtime.backend import Backend, SegmentOut
from edge.runtime.cache import KVCache


def _col(a: np.ndarray) -> np.ndarray:
    """[N] -> a [N, 1] view of the same memory (a binding of it writes into the [N] buffer)."""
    return a.reshape(-1, 1)


def has_stats(sess) -> bool:
    """Whether a head session outputs the decision statistics (exporters/ort_fused.py head_has_stats)."""
    return "exit_stats" in {o.name for o in sess.get_outputs()}


@dataclass
class Plan:
    """A reusable binding of one segment graph to buffers (one decode shape)."""

    io: object
    head_io: object | None  # the head graph bound to this segment's exit hidden (None: a gated decision exit)
    head_sess: object  # the session head_io belongs to (the exact head, or the draft head)
    x: np.ndarray  # [B, T] ids or [B, T, D] hidden (input)
    seqlens: np.ndarray  # [B] int32
    total: np.ndarray  # [] int32
    exit_index: np.ndarray  # [] int64
    out: SegmentOut
    prev: dict[str, np.ndarray]  # the previous decision exit's outputs these graphs read, by input name
    lookup: tuple[np.ndarray, np.ndarray] | None = None  # the context lookup's token, length (shortlist checks)


def bind_cache(io, layers: list[int], values: list[tuple]) -> None:
    for j, (k, v) in zip(layers, values):
        io.bind_ortvalue_input(f"past_key_{j}", k)
        io.bind_ortvalue_input(f"past_value_{j}", v)
        io.bind_ortvalue_output(f"present_key_{j}", k)
        io.bind_ortvalue_output(f"present_value_{j}", v)


class PlanBinder:
    """Makes a backend's plans: binds its graphs to buffers, cache views and the exit rule's weights."""

    def __init__(self, ort, backend: Backend, head_sess, head_stats: bool) -> None:
        """``backend``: the model's shape and the exit rule's arrays (bound here, updated in place by
        ``set_rule``); ``head_sess``: the exact LM head; ``head_stats``: whether it outputs statistics."""
        self.ort = ort
        self.spec = backend.spec
        self.segments = backend.segments
        self.layers = backend.suffix_layers(0)  # every layer (the ``full`` graph's)
        self.num_layers, self.vocab_size = backend.num_layers, backend.vocab_size
        self.head_stats = head_stats
        self.head_decides = "rule_w" in {x.name for x in head_sess.get_inputs()}
        self.cache: KVCache | None = None
        self.bufs: dict[tuple[str, int, int, int], np.ndarray] = {}
        self.views: dict[tuple[int, int, int], tuple] = {}
        ov = ort.OrtValue.ortvalue_from_numpy
        # bound once, updated in place
        self.rule_values = [(ov(w), ov(b)) for w, b in zip(backend.rule_w, backend.rule_b)]
        # the last exit's head computes a score nobody reads: a rule of zeros, and has_prev per exit
        self.rule_values.append((ov(np.zeros(self.spec.num_features, np.float32)), ov(np.full((), -1, np.float32))))
        self.has_prev = [ov(np.array(i > 0)) for i in range(len(self.segments))]
        self.mlp_values = [tuple(ov(a) for a in form) for form in backend.rule_mlp]  # shortlist checks' rule

    def attach(self, cache: KVCache) -> None:
        """Bind ``cache`` from now on: the buffers and views made so far are dropped."""
        self.cache = cache
        self.bufs.clear()
        self.views.clear()

    # ---------------------------------------------------------------- cache views
    def cache_values(self, j: int, s0: int, b: int) -> tuple:
        """OrtValues over the cache rows [s0, s0 + b) of layer j (views: no copy)."""
        key = (j, s0, b)
        if key not in self.views:
            c, ov = self.cache, self.ort.OrtValue.ortvalue_from_numpy
            self.views[key] = (ov(c.keys[j][s0:s0 + b]), ov(c.values[j][s0:s0 + b]))
        return self.views[key]

    # ---------------------------------------------------------------- plans
    def buf(self, name: str, i: int, s0: int | None, b: int, shape: tuple, dtype) -> np.ndarray:
        """A buffer that segment i-1 writes and segment i reads, shared by their decode plans over the
        same cache block (s0, b); a fresh array for any other call (s0 None)."""
        if s0 is None:
            return np.zeros(shape, dtype)
        key = (name, i, s0, b)
        if key not in self.bufs:
            self.bufs[key] = np.zeros(shape, dtype)
        return self.bufs[key]

    def segment_plan(self, sess, head_sess, i: int, s0: int | None, b: int, t: int, values: list[tuple] | None,
                     rows: int = 1, draft: bool = False, full: bool = False) -> Plan:
        """Bind segment i's graph (``sess``), and the head graph after it (``head_sess``: the draft head when
        ``draft``), to buffers for B = ``b`` sequences of ``t`` rows each, the exit on the last ``rows`` of them.
        Decode plans (s0 given, t == 1) chain through shared buffers: segment i's hidden and
        exit hidden and its exit's token, run and gate are the arrays segment i+1 and its head read, so a
        step over one cache block copies nothing. ``full``: the graph of every layer instead (``i`` is then
        the last segment's index: its exit, its buffers)."""
        ov = self.ort.OrtValue.ortvalue_from_numpy
        d, v, f32 = self.spec.hidden_size, self.vocab_size, np.float32
        last = i == len(self.segments) - 1
        gated_exit = self.spec.gated and not last  # decides from its gate; no head in the plan
        check = self.spec.candidates and not last  # checks its candidates in the segment; no head in the plan
        headless = gated_exit or check
        chain = s0 if t == 1 else None  # consecutive segments share their buffers
        first = i == 0 or full
        stats = not headless and (has_stats(head_sess) if draft else self.head_stats)
        x = np.zeros((b, t), np.int64) if first else self.buf("hidden", i, chain, b, (b, t, d), f32)
        r = b * rows  # rows the exit runs on
        out = SegmentOut(
            hidden=None if last else self.buf("hidden", i + 1, chain, b, (b, t, d), f32),
            exit_hidden=self.buf("exit_hidden", i + 1, chain, b, (r, d), f32),
            logits=None if headless else np.zeros((r, v), f32),
            stats=np.zeros((r, 3), f32) if stats else None,
            token=None if gated_exit or check else self.buf("token", i + 1, chain, b, (r,), np.int64),
            gate=self.buf("gate", i + 1, chain, b, (r,), f32) if gated_exit else None)
        if check:  # the two best candidates and their logits, which the next check reads
            out.cand_tokens = self.buf("cand_tokens", i + 1, chain, b, (r, 2), np.int64)
            out.cand_logits = self.buf("cand_logits", i + 1, chain, b, (r, 2), f32)
            out.token = out.cand_tokens[:, 0]  # a view: the check's token
        if not last:  # a decision exit: the rule's features and score (exporters/ort_exits.py)
            out.features = np.zeros((r, self.spec.num_features), f32)
            out.score = np.zeros(r, f32)
            if not self.spec.gated and not check:
                out.run = self.buf("run", i + 1, chain, b, (r,), f32)
        # what the previous decision exit gave these rows: the segment reads it (gates) or the head (softmax)
        seg_prev, head_prev = {}, {}
        if gated_exit and i > 0:
            seg_prev = {"prev_exit_hidden": self.buf("exit_hidden", i, chain, b, (r, d), f32),
                        "prev_gate": self.buf("gate", i, chain, b, (r,), f32)}
        if check:  # the first check reads a pair of "no previous check" buffers (-1 tokens, zero probabilities)
            seg_prev = {"prev_tokens": self.buf("cand_tokens", i, chain, b, (r, 2), np.int64),
                        "prev_logits": self.buf("cand_logits", i, chain, b, (r, 2), f32)}
            if i == 0:
                seg_prev["prev_tokens"][...] = -1
        if not headless and self.head_decides:
            head_prev = {"prev_exit_hidden": self.buf("exit_hidden", i, chain, b, (r, d), f32),
                         "prev_token": self.buf("token", i, chain, b, (r,), np.int64),
                         "prev_run": self.buf("run", i, chain, b, (r,), f32)}
        io = sess.io_binding()
        head_io = None if headless else head_sess.io_binding()
        lookup = None
        if check:  # one pair of buffers for every check of a step over this block
            lookup = (self.buf("lookup_token", 0, chain, b, (r,), np.int64), self.buf("lookup_len", 0, chain, b, (r,), f32))
        # the rows' cache lengths, the longest and the first exit row: one set per block, written once a step
        plan = Plan(io, head_io, head_sess, x, self.buf("seqlens", 0, chain, b, (b,), np.int32),
                    self.buf("total", 0, chain, b, (), np.int32), self.buf("exit_index", 0, chain, b, (), np.int64),
                    out, {**seg_prev, **head_prev}, lookup)
        io.bind_ortvalue_input("input_ids" if first else "hidden", ov(x))
        io.bind_ortvalue_input("seqlens_k", ov(plan.seqlens))
        io.bind_ortvalue_input("total_len", ov(plan.total))
        io.bind_ortvalue_input("exit_index", ov(plan.exit_index))
        seg_outs = {"exit_hidden": out.exit_hidden, "hidden_out": out.hidden}
        if check:  # per-row values are [B, 1] in these graphs: bind column views of the [B] buffers
            seg_outs.update(exit_tokens=out.cand_tokens, exit_logits=out.cand_logits, exit_features=out.features,
                            exit_score=_col(out.score))
            self.bind(io, {**seg_prev, "lookup_token": _col(lookup[0]), "lookup_len": _col(lookup[1])}, seg_outs, None)
            for name, value in zip(("rule_w1", "rule_b1", "rule_w2", "rule_b2"), self.mlp_values[i]):
                io.bind_ortvalue_input(name, value)
        elif gated_exit:
            seg_outs.update(exit_gate=out.gate, exit_features=out.features, exit_score=out.score)
            self.bind(io, seg_prev, seg_outs, i)
        else:
            self.bind(io, {}, seg_outs, None)
            self.bind_head(head_io, out, head_prev, i, self.has_prev[i])
        if values is not None:
            bind_cache(io, self.layers if full else self.segments[i], values)
        return plan

    def verify_plan(self, sess, head_sess, b: int, t: int, slots: np.ndarray) -> Plan:
        """Bind a ``verify_{B}`` graph (``sess``) to the cache rows of ``slots`` and buffers for B = ``b``
        sequences of ``t`` rows, and the exact LM head (``head_sess``) to its B * T rows."""
        ov = self.ort.OrtValue.ortvalue_from_numpy
        d, v, f32, r = self.spec.hidden_size, self.vocab_size, np.float32, b * t
        last = len(self.segments) - 1
        out = SegmentOut(hidden=None, exit_hidden=np.zeros((r, d), f32), logits=np.zeros((r, v), f32),
                         stats=np.zeros((r, 3), f32) if self.head_stats else None, token=np.zeros(r, np.int64))
        io = sess.io_binding()
        plan = Plan(io, head_sess.io_binding(), head_sess, np.zeros((b, t), np.int64),
                    np.zeros(b, np.int32), np.zeros((), np.int32), np.zeros((), np.int64), out, {})
        io.bind_ortvalue_input("input_ids", ov(plan.x))
        io.bind_ortvalue_input("seqlens_k", ov(plan.seqlens))
        io.bind_ortvalue_output("exit_hidden", ov(out.exit_hidden))
        for j in range(self.num_layers):
            for q, slot in enumerate(map(int, slots)):
                for kind, value in zip(("key", "value"), self.cache_values(j, slot, 1)):
                    io.bind_ortvalue_input(f"past_{kind}_{j}_{q}", value)
                    io.bind_ortvalue_output(f"present_{kind}_{j}_{q}", value)
        head_in = {}
        if self.head_decides:  # the last exit's score: nobody reads it (a rule of zeros, no previous exit)
            out.features, out.score, out.run = np.zeros((r, self.spec.num_features), f32), np.zeros(r, f32), np.zeros(r, f32)
            head_in = {"prev_exit_hidden": np.zeros((r, d), f32), "prev_token": np.zeros(r, np.int64),
                       "prev_run": np.zeros(r, f32)}
        self.bind_head(plan.head_io, out, head_in, last, self.has_prev[0])
        return plan

    def bind_head(self, head_io, out: SegmentOut, prev: dict[str, np.ndarray], i: int, has_prev) -> None:
        """Bind the head graph to ``out``'s exit hidden (input) and logits, statistics and token (and, where the
        head decides, exit i's rule, ``prev`` and ``has_prev``, and the features, score and run)."""
        outs = {"logits": out.logits, "exit_stats": out.stats, "exit_token": out.token}
        if self.head_decides:
            outs.update(exit_features=out.features, exit_score=out.score, exit_run=out.run)
            head_io.bind_ortvalue_input("has_prev", has_prev)
        head_io.bind_ortvalue_input("exit_hidden", self.ort.OrtValue.ortvalue_from_numpy(out.exit_hidden))
        self.bind(head_io, prev, outs, i if self.head_decides else None)

    def bind(self, io, inputs: dict[str, np.ndarray], outputs: dict[str, np.ndarray | None], rule: int | None) -> None:
        """Bind ``inputs``, the ``outputs`` that are not None, and exit ``rule``'s weights (None: none)."""
        ov = self.ort.OrtValue.ortvalue_from_numpy
        for name, arr in inputs.items():
            io.bind_ortvalue_input(name, ov(arr))
        for name, arr in outputs.items():
            if arr is not None:
                io.bind_ortvalue_output(name, ov(arr))
        if rule is not None:
            io.bind_ortvalue_input("rule_w", self.rule_values[rule][0])
            io.bind_ortvalue_input("rule_b", self.rule_values[rule][1])
