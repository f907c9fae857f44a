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

import warnings
from pathlib import Path

import numpy as np

from edge.core.artifacts import sha256_path
from edge.runtime.backend import Backend, HeadOut, ModelSpec, SegmentOut
from edge.runtime.graphs import load_graphs_json, load_ngram_table, verify_graphs
from edge.runtime.cache import contiguous_start
from edge.core.errors import ConfigError, require
from edge.runtime.ort_plans import Plan, PlanBinder, has_stats
from edge.runtime.ortsession import open_session, pool_threads

FULL = "full"  # the fused graph of every layer (exporters/ort_fused.py)
VERIFY = "verify_"  # + B: the fused graph of every layer for B sequences of several rows (exporters/ort_fused.py)

PREFERRED_PROVIDERS = ("CUDAExecutionProvider", "CPUExecutionProvider")
_PREV_FIELD = {"prev_exit_hidden": "exit_hidden", "prev_token": "token", "prev_run": "run", "prev_gate": "gate",
               "prev_tokens": "cand_tokens", "prev_logits": "cand_logits"}
MAX_PLAN_ROWS = 8  # calls of up to this many rows per sequence keep their binding (a prompt chunk does not)
MAX_VERIFY_PLANS = 64  # verify bindings kept (per rows and slots); more are dropped and rebuilt as needed


def pick_providers(available: list[str], requested: list[str] | None = None) -> list[str]:
    """Providers to use, in preference order, among those this build offers."""
    if requested:
        missing = [p for p in requested if p not in available]
        if missing:
            raise ConfigError(f"onnxruntime providers {missing} are not available; this build has {available}")
        return list(requested)
    return [p for p in PREFERRED_PROVIDERS if p in available]


class OrtBackend(Backend):
    name = "onnxruntime"

    def __init__(self, graphs_dir: str | Path | None = None, checkpoint: str | Path | None = None,
                 threads: int = 0, providers: list[str] | None = None, cache: bool = True,
                 prefill_threads: int = 0) -> None:
        """``cache``: open graphs through the optimised-graph cache (edge/runtime/ortsession.py).
        ``prefill_threads``: > 0: prompt chunks (calls of more than MAX_PLAN_ROWS rows) run the graph of every
        layer on a session of their own with a pool of that many threads that sleep between calls, and every other
        session on a pool of its own of ``threads`` (ONNX Runtime mixes no shared pool with own ones in a process);
        the same kernels split the same products among threads, so the same numbers (tested). For a served engine
        kept on one thread for its decode steps (a second, spinning, thread slowed them and took the core the
        serving stack needs) where spare cores could take its prompts; another copy of that graph's weights. On
        2 cores it measured faster prompts in process and slower serving at the SLA edge: off by default
        (docs/serving.md, stop 67)."""
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

        if prefill_threads < 0:
            raise ConfigError(f"prefill_threads must be >= 0, got {prefill_threads}")
        # ONNX Runtime refuses a session its own pool once a process has the shared one
        unused = ("the export has no graph of every layer" if FULL not in fused["graphs"] else
                  f"this process already runs ONNX Runtime's shared pool ({pool_threads()} threads), which rules out "
                  f"a session's own pool" if pool_threads() is not None else None)
        if prefill_threads and unused:
            warnings.warn(f"prefill_threads={prefill_threads} not used: {unused}", RuntimeWarning, stacklevel=2)
            prefill_threads = 0
        # with a prompt session of its own every session has its own pool (``threads`` each, ONNX Runtime allows no
        # mix in one process); else all share one
        own = threads if prefill_threads else None

        def session(name: str, own_threads: int | None = None):
            g = fused["graphs"][name]
            return open_session(ort, graphs_dir / g["file"], threads, self.providers, source_sha256=g["sha256"],
                                cache=cache, own_threads=own if own_threads is None else own_threads)

        self._seg = [session(f"segment_{i}") for i in range(len(self.segments))]
        # every layer in one graph (calls in which no row may leave early); absent with one segment
        self._full = session(FULL) if FULL in fused["graphs"] else None
        # prompt chunks' own session of the same graph (another copy of its weights), where asked for
        self.prefill_threads = prefill_threads
        self._prefill = session(FULL, own_threads=prefill_threads) if prefill_threads else None
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
        # the head of a model with one exit or a candidate shortlist has no decision statistics (nothing reads them:
        # exporters/ort_fused.py head_has_stats); a candidate model's draft exit reads the draft head's
        self.head_stats = has_stats(self._head_sess)
        self.pool_threads = pool_threads()
        self.gathered_rows = 0  # past rows copied for batches over scattered slots
        self._plans: dict[tuple, Plan] = {}  # (segment, first slot, B, T, rows, draft)
        # the plans' buffers, cache views and bound exit rule (edge/runtime/ort_plans.py)
        self._binder = PlanBinder(ort, self, self._head_sess, self.head_stats)

    def _attached(self) -> None:
        self._plans.clear()
        self._verify_plans: dict[tuple, Plan] = {}
        self._binder.attach(self.cache)
        self._step_plans: dict[tuple[int, int], list[Plan]] = {}

    def _make_plan(self, i: int, s0: int | None, b: int, t: int, values: list[tuple] | None, rows: int = 1,
                   draft: bool = False, full: bool = False, sess=None) -> Plan:
        """Segment i's plan (:meth:`PlanBinder.segment_plan`) on its graph (``full``: the graph of every layer;
        ``sess``: that graph's session if not the shared one) and the exact head, or the draft head when ``draft``."""
        head_sess = self._draft_head() if draft else self._head_sess
        graph = sess if sess is not None else self._full if full else self._seg[i]
        return self._binder.segment_plan(graph, head_sess, i, s0, b, t, values, rows, draft, full)

    # ---------------------------------------------------------------- calls
    def _segment(self, i, x, slots, start, prev, decide, rows, draft, lookup):
        b, t = x.shape[:2]
        s0 = contiguous_start(slots)
        if s0 is not None and t <= MAX_PLAN_ROWS:  # decode steps, deferred rows with their new token, verification
            key = (i, s0, b, t, rows, draft)
            plan = self._plans.get(key)
            if plan is None:
                values = [self._binder.cache_values(j, s0, b) for j in self.segments[i]]
                self.setup_events += 1
                plan = self._plans[key] = self._make_plan(i, s0, b, t, values, rows, draft)
            return self._run(i, plan, x, start, t, prev, decide, rows, lookup)
        if s0 is not None:  # a prompt chunk: bind its cache slot, fresh buffers
            plan = self._make_plan(i, None, b, t, [self._binder.cache_values(j, s0, b) for j in self.segments[i]], rows,
                                   draft)
            return self._run(i, plan, x, start, t, prev, decide, rows, lookup)
        return self._gathered(i, x, slots, start, prev, decide, draft, lookup)

    @property
    def prefills_together(self) -> bool:
        """With a graph of every layer (its attention over a block of slots from position 0): yes. A segment
        graph takes one sequence's chunk at a time (its exit reads one sequence's rows)."""
        return self._full is not None

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
        # a prompt chunk runs on the prompts' own session where there is one
        sess = self._prefill if t > MAX_PLAN_ROWS and self._prefill is not None else self._full
        if plan is None:  # the cache's values are bound once per plan, not looked up on every call
            values = [self._binder.cache_values(j, s0, b) for j in self.suffix_layers(0)]
            if t <= MAX_PLAN_ROWS:
                self.setup_events += 1
                plan = self._plans[key] = self._make_plan(last, s0, b, t, values, rows, full=True)
            else:  # a prompt chunk: fresh buffers
                plan = self._make_plan(last, None, b, t, values, rows, full=True, sess=sess)
        return self._run(last, plan, x, start, t, None, True, rows, session=sess)

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
                    self._plans[key] = self._make_plan(i, s0, b, 1, [self._binder.cache_values(j, s0, b) for j in self.segments[i]])
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
            if b not in self._verify_sess:
                self._verify_sess[b] = self._session(f"{VERIFY}{b}")
            plan = self._binder.verify_plan(self._verify_sess[b], self._head_sess, b, t, slots)
            self._verify_plans[key] = plan
        np.copyto(plan.x, x)
        np.add(start, t - 1, out=plan.seqlens, casting="unsafe")
        self._verify_sess[b].run_with_iobinding(plan.io)
        plan.head_sess.run_with_iobinding(plan.head_io)
        return plan.out

    def _draft_head(self):
        if self._draft_head_sess is None:
            self._draft_head_sess = self._session("draft_head")
        return self._draft_head_sess

    def _run(self, i: int, plan: Plan, x: np.ndarray, start: np.ndarray, t: int, prev: SegmentOut | None,
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

