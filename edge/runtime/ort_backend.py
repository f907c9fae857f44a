"""ONNX Runtime backend over the fused graphs written by ``smartexit export`` (exporters/ort_fused.py).

It needs only the export folder: the model's shape comes from ``graphs.json``, the graphs' hashes
(and the checkpoint's, when given) are checked at load. The KV cache is the engine's, bound in
place: GroupQueryAttention reads a sequence's past from its slot and appends the new rows there.

A decode batch over consecutive cache slots runs on views of the cache (nothing is copied); its
I/O binding, input and output buffers are made once per (segment, first slot, batch) and reused,
and the hidden-state output of segment i is the input buffer of segment i+1. A batch over scattered
slots (after some rows exited) gathers its rows' past into scratch buffers and writes the new rows
back; ``gathered_rows`` counts those copies.

The LM head is one graph, ``head``, for every exit (its weight is loaded once per process, not once
per exit: docs/runtime.md). A segment's plan binds it too: its input is the segment's
``exit_hidden`` output buffer, its outputs the plan's logits / stats / token (and, without gates, the
exit rule's features, score and run), so a segment call is two session calls and no copy. With exit
gates a decision segment decides from its gate and the head runs only for the rows that exit
(:meth:`Backend.head`).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edge.core.artifacts import sha256_path
from edge.runtime.backend import Backend, HeadOut, ModelSpec, SegmentOut
from edge.runtime.graphs import load_graphs_json, load_ngram_table, verify_graphs
from edge.runtime.cache import contiguous_start
from edge.core.errors import ConfigError, require
from edge.runtime.ortsession import open_session, pool_threads

FULL = "full"  # the fused graph of every layer (exporters/ort_fused.py)
VERIFY = "verify_"  # + B: the fused graph of every layer for B sequences of several rows (exporters/ort_fused.py)

PREFERRED_PROVIDERS = ("CUDAExecutionProvider", "CPUExecutionProvider")
_PREV_FIELD = {"prev_exit_hidden": "exit_hidden", "prev_token": "token", "prev_run": "run", "prev_gate": "gate",
               "prev_tokens": "cand_tokens", "prev_logits": "cand_logits"}
MAX_PLAN_ROWS = 8  # calls of up to this many rows per sequence keep their binding (a prompt chunk does not)
MAX_VERIFY_PLANS = 64  # verify bindings kept (per rows and slots); more are dropped and rebuilt as needed


def _col(a: np.ndarray) -> np.ndarray:
    """[N] -> a [N, 1] view of the same memory (a binding of it writes into the [N] buffer)."""
    return a.reshape(-1, 1)


def _has_stats(sess) -> bool:
    """Whether a head session outputs the decision statistics (exporters/ort_fused.py head_has_stats)."""
    return "exit_stats" in {o.name for o in sess.get_outputs()}


def pick_providers(available: list[str], requested: list[str] | None = None) -> list[str]:
    """Providers to use, in preference order, among those this build offers."""
    if requested:
        missing = [p for p in requested if p not in available]
        if missing:
            raise ConfigError(f"onnxruntime providers {missing} are not available; this build has {available}")
        return list(requested)
    return [p for p in PREFERRED_PROVIDERS if p in available]


@dataclass
class _Plan:
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


class OrtBackend(Backend):
    name = "onnxruntime"

    def __init__(self, graphs_dir: str | Path | None = None, checkpoint: str | Path | None = None,
                 threads: int = 0, providers: list[str] | None = None, cache: bool = True) -> None:
        """``cache``: open graphs through the optimised-graph cache (edge/runtime/ortsession.py)."""
        self.ort = ort = require("onnxruntime", "onnxruntime")
        if graphs_dir is None:
            raise ConfigError("the onnxruntime backend needs graphs_dir (run `smartexit export`)")
        graphs_dir = Path(graphs_dir)
        meta = (verify_graphs(graphs_dir, sha256_path(checkpoint)) if checkpoint is not None
                else load_graphs_json(graphs_dir))
        fused = meta.get("fused")
        # corpus drafts for mode exact: the table the export built from the training split (absent: none)
        self.ngram_table = load_ngram_table(graphs_dir)
        if not fused:
            raise ConfigError(f"{graphs_dir}: the export has no fused ONNX Runtime graphs "
                              f"({meta.get('fused_skipped', 'not written')}); re-run `smartexit export`")
        m = meta["model"]
        super().__init__(ModelSpec(m["num_layers"], tuple(meta["exit_layers"]), m["hidden_size"], m["num_kv_heads"],
                                   m["head_dim"], m["vocab_size"], m["max_positions"], m.get("sliding_window"),
                                   m["gated"], tuple(m.get("shortlist", ()))))
        self.providers = pick_providers(ort.get_available_providers(), providers)

        def session(name: str):
            g = fused["graphs"][name]
            return open_session(ort, graphs_dir / g["file"], threads, self.providers, source_sha256=g["sha256"],
                                cache=cache)

        self._seg = [session(f"segment_{i}") for i in range(len(self.segments))]
        # every layer in one graph (calls in which no row may leave early); absent with one segment
        self._full = session(FULL) if FULL in fused["graphs"] else None
        def opened_later(name: str):  # a graph opened on first use: a one-time cost of the call that needs it
            self.setup_events += 1
            return session(name)

        self._session = opened_later
        # K/V fill graphs (state propagation) are opened on first use: deferral never loads their weights
        self._fill: list = [None] * len(self.segments)
        # graphs that verify several sequences' drafts in one call (mode exact above batch 1), opened on first use
        self.verify_batches = tuple(sorted(int(n[len(VERIFY):]) for n in fused["graphs"] if n.startswith(VERIFY)))
        self._verify_sess: dict[int, object] = {}
        self._head_sess = session("head")  # one LM head for every exit
        # self-speculative drafts' head (int8 weights), opened on first use; the exact head if not exported
        self._draft_head_sess = None if "draft_head" in fused["graphs"] else self._head_sess
        self._head_decides = "rule_w" in {x.name for x in self._head_sess.get_inputs()}
        # the head of a model with one exit or a candidate shortlist has no decision statistics (nothing reads them:
        # exporters/ort_fused.py head_has_stats); a candidate model's draft exit reads the draft head's
        self.head_stats = _has_stats(self._head_sess)
        self.pool_threads = pool_threads()
        self.gathered_rows = 0  # past rows copied for batches over scattered slots
        self._plans: dict[tuple, _Plan] = {}  # (segment, first slot, B, T, rows, draft)
        self._bufs: dict[tuple[str, int, int, int], np.ndarray] = {}
        ov = ort.OrtValue.ortvalue_from_numpy
        self._rule_values = [(ov(w), ov(b)) for w, b in zip(self.rule_w, self.rule_b)]  # bound once, updated in place
        # the last exit's head computes a score nobody reads: a rule of zeros, and has_prev per exit
        self._rule_values.append((ov(np.zeros(self.spec.num_features, np.float32)), ov(np.full((), -1, np.float32))))
        self._has_prev = [ov(np.array(i > 0)) for i in range(len(self.segments))]
        self._mlp_values = [tuple(ov(a) for a in form) for form in self.rule_mlp]  # shortlist checks' rule

    def _attached(self) -> None:
        self._plans.clear()
        self._verify_plans: dict[tuple, _Plan] = {}
        self._bufs.clear()
        self._step_plans: dict[tuple[int, int], list[_Plan]] = {}
        self._views: dict[tuple[int, int, int], tuple] = {}

    # ---------------------------------------------------------------- cache views
    def _cache_values(self, j: int, s0: int, b: int) -> tuple:
        """OrtValues over the cache rows [s0, s0 + b) of layer j (views: no copy)."""
        key = (j, s0, b)
        if key not in self._views:
            c, ov = self.cache, self.ort.OrtValue.ortvalue_from_numpy
            self._views[key] = (ov(c.keys[j][s0:s0 + b]), ov(c.values[j][s0:s0 + b]))
        return self._views[key]

    def _bind_cache(self, io, layers: list[int], values: list[tuple]) -> None:
        for j, (k, v) in zip(layers, values):
            io.bind_ortvalue_input(f"past_key_{j}", k)
            io.bind_ortvalue_input(f"past_value_{j}", v)
            io.bind_ortvalue_output(f"present_key_{j}", k)
            io.bind_ortvalue_output(f"present_value_{j}", v)

    # ---------------------------------------------------------------- plans
    def _buf(self, name: str, i: int, s0: int | None, b: int, shape: tuple, dtype) -> np.ndarray:
        """A buffer that segment i-1 writes and segment i reads, shared by their decode plans over the
        same cache block (s0, b); a fresh array for any other call (s0 None)."""
        if s0 is None:
            return np.zeros(shape, dtype)
        key = (name, i, s0, b)
        if key not in self._bufs:
            self._bufs[key] = np.zeros(shape, dtype)
        return self._bufs[key]

    def _make_plan(self, i: int, s0: int | None, b: int, t: int, values: list[tuple] | None, rows: int = 1,
                   draft: bool = False, full: bool = False) -> _Plan:
        """Bind segment i's graph, and the head graph after it, to buffers for B = ``b`` sequences of ``t``
        rows each, the exit on the last ``rows`` of them. Decode plans (s0 given, t == 1) chain through shared buffers: segment i's hidden and
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
        head_sess = self._draft_head() if draft else self._head_sess
        stats = not headless and (_has_stats(head_sess) if draft else self.head_stats)
        x = np.zeros((b, t), np.int64) if first else self._buf("hidden", i, chain, b, (b, t, d), f32)
        r = b * rows  # rows the exit runs on
        out = SegmentOut(
            hidden=None if last else self._buf("hidden", i + 1, chain, b, (b, t, d), f32),
            exit_hidden=self._buf("exit_hidden", i + 1, chain, b, (r, d), f32),
            logits=None if headless else np.zeros((r, v), f32),
            stats=np.zeros((r, 3), f32) if stats else None,
            token=None if gated_exit or check else self._buf("token", i + 1, chain, b, (r,), np.int64),
            gate=self._buf("gate", i + 1, chain, b, (r,), f32) if gated_exit else None)
        if check:  # the two best candidates and their logits, which the next check reads
            out.cand_tokens = self._buf("cand_tokens", i + 1, chain, b, (r, 2), np.int64)
            out.cand_logits = self._buf("cand_logits", i + 1, chain, b, (r, 2), f32)
            out.token = out.cand_tokens[:, 0]  # a view: the check's token
        if not last:  # a decision exit: the rule's features and score (exporters/ort_exits.py)
            out.features = np.zeros((r, self.spec.num_features), f32)
            out.score = np.zeros(r, f32)
            if not self.spec.gated and not check:
                out.run = self._buf("run", i + 1, chain, b, (r,), f32)
        # what the previous decision exit gave these rows: the segment reads it (gates) or the head (softmax)
        seg_prev, head_prev = {}, {}
        if gated_exit and i > 0:
            seg_prev = {"prev_exit_hidden": self._buf("exit_hidden", i, chain, b, (r, d), f32),
                        "prev_gate": self._buf("gate", i, chain, b, (r,), f32)}
        if check:  # the first check reads a pair of "no previous check" buffers (-1 tokens, zero probabilities)
            seg_prev = {"prev_tokens": self._buf("cand_tokens", i, chain, b, (r, 2), np.int64),
                        "prev_logits": self._buf("cand_logits", i, chain, b, (r, 2), f32)}
            if i == 0:
                seg_prev["prev_tokens"][...] = -1
        if not headless and self._head_decides:
            head_prev = {"prev_exit_hidden": self._buf("exit_hidden", i, chain, b, (r, d), f32),
                         "prev_token": self._buf("token", i, chain, b, (r,), np.int64),
                         "prev_run": self._buf("run", i, chain, b, (r,), f32)}
        io = (self._full if full else self._seg[i]).io_binding()
        head_io = None if headless else head_sess.io_binding()
        lookup = None
        if check:  # one pair of buffers for every check of a step over this block
            lookup = (self._buf("lookup_token", 0, chain, b, (r,), np.int64), self._buf("lookup_len", 0, chain, b, (r,), f32))
        # the rows' cache lengths, the longest and the first exit row: one set per block, written once a step
        plan = _Plan(io, head_io, head_sess, x, self._buf("seqlens", 0, chain, b, (b,), np.int32),
                     self._buf("total", 0, chain, b, (), np.int32), self._buf("exit_index", 0, chain, b, (), np.int64),
                     out, {**seg_prev, **head_prev}, lookup)
        io.bind_ortvalue_input("input_ids" if first else "hidden", ov(x))
        io.bind_ortvalue_input("seqlens_k", ov(plan.seqlens))
        io.bind_ortvalue_input("total_len", ov(plan.total))
        io.bind_ortvalue_input("exit_index", ov(plan.exit_index))
        seg_outs = {"exit_hidden": out.exit_hidden, "hidden_out": out.hidden}
        if check:  # per-row values are [B, 1] in these graphs: bind column views of the [B] buffers
            seg_outs.update(exit_tokens=out.cand_tokens, exit_logits=out.cand_logits, exit_features=out.features,
                            exit_score=_col(out.score))
            self._bind(io, {**seg_prev, "lookup_token": _col(lookup[0]), "lookup_len": _col(lookup[1])}, seg_outs, None)
            for name, value in zip(("rule_w1", "rule_b1", "rule_w2", "rule_b2"), self._mlp_values[i]):
                io.bind_ortvalue_input(name, value)
        elif gated_exit:
            seg_outs.update(exit_gate=out.gate, exit_features=out.features, exit_score=out.score)
            self._bind(io, seg_prev, seg_outs, i)
        else:
            self._bind(io, {}, seg_outs, None)
            self._bind_head(head_io, out, head_prev, i, self._has_prev[i])
        if values is not None:
            self._bind_cache(io, self.suffix_layers(0) if full else self.segments[i], values)
        return plan

    def _bind_head(self, head_io, out: SegmentOut, prev: dict[str, np.ndarray], i: int, has_prev) -> None:
        """Bind the head graph to ``out``'s exit hidden (input) and logits, statistics and token (and, where the
        head decides, exit i's rule, ``prev`` and ``has_prev``, and the features, score and run)."""
        outs = {"logits": out.logits, "exit_stats": out.stats, "exit_token": out.token}
        if self._head_decides:
            outs.update(exit_features=out.features, exit_score=out.score, exit_run=out.run)
            head_io.bind_ortvalue_input("has_prev", has_prev)
        head_io.bind_ortvalue_input("exit_hidden", self.ort.OrtValue.ortvalue_from_numpy(out.exit_hidden))
        self._bind(head_io, prev, outs, i if self._head_decides else None)

    def _bind(self, io, inputs: dict[str, np.ndarray], outputs: dict[str, np.ndarray | None], rule: int | None) -> None:
        """Bind ``inputs``, the ``outputs`` that are not None, and exit ``rule``'s weights (None: none)."""
        ov = self.ort.OrtValue.ortvalue_from_numpy
        for name, arr in inputs.items():
            io.bind_ortvalue_input(name, ov(arr))
        for name, arr in outputs.items():
            if arr is not None:
                io.bind_ortvalue_output(name, ov(arr))
        if rule is not None:
            io.bind_ortvalue_input("rule_w", self._rule_values[rule][0])
            io.bind_ortvalue_input("rule_b", self._rule_values[rule][1])

    # ---------------------------------------------------------------- calls
    def _segment(self, i, x, slots, start, prev, decide, rows, draft, lookup):
        b, t = x.shape[:2]
        s0 = contiguous_start(slots)
        if s0 is not None and t <= MAX_PLAN_ROWS:  # decode steps, deferred rows with their new token, verification
            key = (i, s0, b, t, rows, draft)
            plan = self._plans.get(key)
            if plan is None:
                values = [self._cache_values(j, s0, b) for j in self.segments[i]]
                self.setup_events += 1
                plan = self._plans[key] = self._make_plan(i, s0, b, t, values, rows, draft)
            return self._run(i, plan, x, start, t, prev, decide, rows, lookup)
        if s0 is not None:  # a prompt chunk: bind its cache slot, fresh buffers
            plan = self._make_plan(i, None, b, t, [self._cache_values(j, s0, b) for j in self.segments[i]], rows,
                                   draft)
            return self._run(i, plan, x, start, t, prev, decide, rows, lookup)
        return self._gathered(i, x, slots, start, prev, decide, draft, lookup)

    def full(self, x, slots, start, rows=1):
        """Every layer in one call of the ``full`` graph (when the export has one and the slots are one
        block of the cache); else the segments one after the other (a decode step of candidate-check graphs:
        back to back on the step's chained plans)."""
        b, t = x.shape[:2]
        s0 = contiguous_start(slots)
        if (self._full is None and self.spec.candidates and t == 1 and rows == 1 and s0 is not None
                and self.cache is not None and x.dtype == np.int64 and int(start.max()) + 1 <= self.cache.capacity):
            # no graph of every layer (export.full_graph false): a decode step runs the segments back to back
            # on the step's chained buffers, as a checked step does, no row allowed to leave (the same plans,
            # so the same tokens; their candidate checks run, no LM head, and are not read): a step 10% cheaper
            # than segment call by segment call on the 2-core VM (docs/runtime.md, stop 51)
            return self.decode_until_exit(x, slots, start, None, np.zeros(b, bool))[1]
        if self._full is None or s0 is None or self.cache is None or x.dtype != np.int64 or not 1 <= rows <= t:
            return super().full(x, slots, start, rows)
        if int(start.max()) + t > self.cache.capacity:
            raise ConfigError(f"positions up to {int(start.max()) + t} exceed the cache capacity {self.cache.capacity}")
        last = len(self.segments) - 1
        key = ("full", s0, b, t, rows)
        plan = self._plans.get(key) if t <= MAX_PLAN_ROWS else None
        if plan is None:  # the cache's values are bound once per plan, not looked up on every call
            values = [self._cache_values(j, s0, b) for j in self.suffix_layers(0)]
            if t <= MAX_PLAN_ROWS:
                self.setup_events += 1
                plan = self._plans[key] = self._make_plan(last, s0, b, t, values, rows, full=True)
            else:  # a prompt chunk: fresh buffers
                plan = self._make_plan(last, None, b, t, values, rows, full=True)
        return self._run(last, plan, x, start, t, None, True, rows, session=self._full)

    def decode_until_exit(self, x, slots, start, lookup, allowed):
        """The engine's decode step, fast: for a batch over one block of the cache (T = 1, the exit rule in
        the graphs), the step's inputs are written once into the buffers every segment's plan shares, and
        the segments run back to back until one where an allowed row's score says exit, or the last; no
        argument is validated (the engine built them). Else :meth:`Backend.decode_until_exit`."""
        b = len(slots)
        s0 = contiguous_start(slots)
        if s0 is None or self.cache is None:
            return super().decode_until_exit(x, slots, start, lookup, allowed)
        plans = self._step_plans.get((s0, b))
        if plans is None:
            plans = []
            for i in range(len(self.segments)):
                key = (i, s0, b, 1, 1, False)
                if key not in self._plans:
                    self.setup_events += 1
                    self._plans[key] = self._make_plan(i, s0, b, 1, [self._cache_values(j, s0, b) for j in self.segments[i]])
                plans.append(self._plans[key])
            self._step_plans[(s0, b)] = plans
        p0 = plans[0]
        np.copyto(p0.x, x)
        np.copyto(p0.seqlens, start, casting="unsafe")
        p0.total[()] = int(start.max()) + 1
        p0.exit_index[()] = 0
        if lookup is not None and p0.lookup is not None:
            np.copyto(p0.lookup[0], lookup[0])
            np.copyto(p0.lookup[1], lookup[1])
        last = len(plans) - 1
        for i, plan in enumerate(plans):
            self._seg[i].run_with_iobinding(plan.io)
            if plan.head_io is not None:  # the last exit's LM head (or a softmax rule's decision)
                plan.head_sess.run_with_iobinding(plan.head_io)
            score = plan.out.score
            # batch 1 (the common case) reads one value: a numpy reduction costs microseconds at this scale
            if i == last or ((score[0] >= 0.0 and allowed[0]) if b == 1 else bool(((score >= 0.0) & allowed).any())):
                return i, plan.out
        raise AssertionError("unreachable")

    def _verify(self, x, slots, start):
        """One call of the ``verify_{B}`` graph (the layers; attention per sequence, so any slots) and the LM
        head on its B * T rows. Bindings are kept per (T, slots): a batch keeps its slots while it decodes."""
        b, t = x.shape[:2]
        key = (t, *map(int, slots))
        plan = self._verify_plans.get(key)
        if plan is None:
            if len(self._verify_plans) >= MAX_VERIFY_PLANS:  # batches come and go in serving: bound the bindings
                self._verify_plans.clear()
            self.setup_events += 1
            plan = self._verify_plans[key] = self._make_verify_plan(b, t, slots)
        np.copyto(plan.x, x)
        np.add(start, t - 1, out=plan.seqlens, casting="unsafe")
        self._verify_sess[b].run_with_iobinding(plan.io)
        plan.head_sess.run_with_iobinding(plan.head_io)
        return plan.out

    def _make_verify_plan(self, b: int, t: int, slots: np.ndarray) -> _Plan:
        if b not in self._verify_sess:
            self._verify_sess[b] = self._session(f"{VERIFY}{b}")
        ov = self.ort.OrtValue.ortvalue_from_numpy
        d, v, f32, r = self.spec.hidden_size, self.vocab_size, np.float32, b * t
        last = len(self.segments) - 1
        out = SegmentOut(hidden=None, exit_hidden=np.zeros((r, d), f32), logits=np.zeros((r, v), f32),
                         stats=np.zeros((r, 3), f32) if self.head_stats else None, token=np.zeros(r, np.int64))
        io = self._verify_sess[b].io_binding()
        plan = _Plan(io, self._head_sess.io_binding(), self._head_sess, np.zeros((b, t), np.int64),
                     np.zeros(b, np.int32), np.zeros((), np.int32), np.zeros((), np.int64), out, {})
        io.bind_ortvalue_input("input_ids", ov(plan.x))
        io.bind_ortvalue_input("seqlens_k", ov(plan.seqlens))
        io.bind_ortvalue_output("exit_hidden", ov(out.exit_hidden))
        for j in range(self.num_layers):
            for q, slot in enumerate(map(int, slots)):
                for kind, value in zip(("key", "value"), self._cache_values(j, slot, 1)):
                    io.bind_ortvalue_input(f"past_{kind}_{j}_{q}", value)
                    io.bind_ortvalue_output(f"present_{kind}_{j}_{q}", value)
        head_in = {}
        if self._head_decides:  # the last exit's score: nobody reads it (a rule of zeros, no previous exit)
            out.features, out.score, out.run = np.zeros((r, self.spec.num_features), f32), np.zeros(r, f32), np.zeros(r, f32)
            head_in = {"prev_exit_hidden": np.zeros((r, d), f32), "prev_token": np.zeros(r, np.int64),
                       "prev_run": np.zeros(r, f32)}
        self._bind_head(plan.head_io, out, head_in, last, self._has_prev[0])
        return plan

    def _draft_head(self):
        if self._draft_head_sess is None:
            self._draft_head_sess = self._session("draft_head")
        return self._draft_head_sess

    def _run(self, i: int, plan: _Plan, x: np.ndarray, start: np.ndarray, t: int, prev: SegmentOut | None,
             decide: bool, rows: int = 1, lookup: tuple[np.ndarray, np.ndarray] | None = None,
             session=None) -> SegmentOut:
        if x is not plan.x:
            np.copyto(plan.x, x)
        if plan.lookup is not None and lookup is not None:
            for buf, src in zip(plan.lookup, lookup):
                if src is not buf:
                    np.copyto(buf, src, casting="unsafe")
        if prev is not None and plan.prev:  # what the previous decision exit gave these rows
            for name, arr in plan.prev.items():
                src = getattr(prev, _PREV_FIELD[name])
                if src is not arr:
                    np.copyto(arr, src)
        np.add(start, t - 1, out=plan.seqlens, casting="unsafe")
        plan.total[()] = int(start.max()) + t
        plan.exit_index[()] = t - rows
        (session or self._seg[i]).run_with_iobinding(plan.io)
        if plan.head_io is not None and decide:
            plan.head_sess.run_with_iobinding(plan.head_io)
        return plan.out

    def _gathered(self, i, x, slots, start, prev, decide, draft=False, lookup=None):
        """T == 1 over scattered slots: copy their past into scratch, run, write the new rows back."""
        b = len(slots)
        p = int(start.max()) + 1
        c = self.cache
        ov = self.ort.OrtValue.ortvalue_from_numpy
        scratch = []
        for j in self.segments[i]:
            k = np.empty((b, self.num_kv_heads, p, self.head_dim), np.float32)
            v = np.empty_like(k)
            np.take(c.keys[j][:, :, :p], slots, axis=0, out=k)
            np.take(c.values[j][:, :, :p], slots, axis=0, out=v)
            scratch.append((k, v))
        self.gathered_rows += b * p * len(scratch)
        plan = self._make_plan(i, None, b, 1, [(ov(k), ov(v)) for k, v in scratch], draft=draft)
        out = self._run(i, plan, x, start, 1, prev, decide, lookup=lookup)
        rows = np.arange(b)
        for j, (k, v) in zip(self.segments[i], scratch):
            c.keys[j][slots, :, start] = k[rows, :, start]
            c.values[j][slots, :, start] = v[rows, :, start]
        return out

    def _head(self, i, exit_hidden):
        # a gated exit's rows that leave, or a candidate model's draft exit (its head has no statistics: the draft
        # head's, which has them, drafts)
        sess = self._head_sess if self.head_stats else self._draft_head()
        logits, stats, token = sess.run(["logits", "exit_stats", "exit_token"], {"exit_hidden": exit_hidden})
        return HeadOut(logits, stats, token)

    def _kvfill(self, i, hidden, slots, positions):
        layers = self.suffix_layers(i)
        if self._fill[i] is None:
            self._fill[i] = self._session(f"kvfill_{i}")
        outs = self._fill[i].run(None, {"hidden": np.ascontiguousarray(hidden, np.float32)[:, None],
                                        "positions": positions.astype(np.int64)[:, None]})
        b, kvh, hd = len(slots), self.num_kv_heads, self.head_dim
        for n, j in enumerate(layers):
            self.cache.keys[j][slots, :, positions] = outs[2 * n].reshape(b, kvh, hd)
            self.cache.values[j][slots, :, positions] = outs[2 * n + 1].reshape(b, kvh, hd)

