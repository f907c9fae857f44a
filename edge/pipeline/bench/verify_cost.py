"""rho(k) of the graphs mode exact verifies with, from their files: a call carrying k new rows of each of B
sequences over a plain step (one row each), the LM head on every row included, the shapes called in turn.

At batch 1 the rows go to the graph of every layer (``full``); above batch 1 to the ``verify_{B}`` graph
(exporters/ort_fused.py), the plain step to ``full``. Used by the projection benchmark at real model
shapes, where the weights are read from memory once per call whatever its rows (the engine's own graphs
are measured by edge/pipeline/bench/speculation.py through its backend).
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from edge.core.errors import ConfigError


class _Call:
    """One bound call: a graph (and the head after it) on B sequences of T new rows, its cache in place."""

    def __init__(self, ort, sess, head, b: int, t: int, past: int, caches: dict[str, np.ndarray], per_seq: bool,
                 hidden: int, vocab: int) -> None:
        ov = ort.OrtValue.ortvalue_from_numpy
        rng = np.random.default_rng(b * 16 + t)
        self.sess, self.head = sess, head
        self.io, self.head_io = sess.io_binding(), head.io_binding()
        names = {i.name for i in sess.get_inputs()}
        self._keep = [rng.integers(0, vocab, (b, t)).astype(np.int64), np.full(b, past + t - 1, np.int32),
                      np.array(past + t, np.int32), np.array(0, np.int64), np.zeros((b * t, hidden), np.float32)]
        ids, seqlens, total, first, eh = self._keep
        self.io.bind_ortvalue_input("input_ids", ov(ids))
        self.io.bind_ortvalue_input("seqlens_k", ov(seqlens))
        for name, value in (("total_len", total), ("exit_index", first)):
            if name in names:
                self.io.bind_ortvalue_input(name, ov(value))
        for key, arr in caches.items():  # "key_j" / "value_j" -> [B_max, KV, C, hd]
            kind, j = key.split("_")
            views = [(f"_{j}_{q}", arr[q:q + 1]) for q in range(b)] if per_seq else [(f"_{j}", arr[:b])]
            for suffix, view in views:
                value = ov(view)
                self.io.bind_ortvalue_input(f"past_{kind}{suffix}", value)
                self.io.bind_ortvalue_output(f"present_{kind}{suffix}", value)
        self.io.bind_ortvalue_output("exit_hidden", ov(eh))
        self.head_io.bind_ortvalue_input("exit_hidden", ov(eh))
        head_in = {i.name for i in head.get_inputs()} - {"exit_hidden"}
        if head_in:
            raise ConfigError(f"verify cost: the head graph takes {sorted(head_in)} besides exit_hidden (a "
                              f"decision head); time an export whose head is the LM head alone")
        for o in head.get_outputs():
            self.head_io.bind_output(o.name)

    def run(self) -> None:
        self.sess.run_with_iobinding(self.io)
        self.head.run_with_iobinding(self.head_io)


def verify_costs(graphs_dir: Path, num_layers: int, kv_heads: int, head_dim: int, hidden: int, vocab: int,
                 past: int, batches: list[int], rows=(1, 2, 4, 8), threads: int = 2, repeats: int = 9
                 ) -> dict[str, dict[str, float]]:
    """{batch: {k: median time of a call of k rows per sequence / median of a call of 1}} for each batch of
    ``batches`` (1, or one with a ``verify_{B}.onnx`` in ``graphs_dir``), every shape called in turn
    ``repeats`` times after two unmeasured rounds. ``graphs_dir`` holds ``full.onnx``, ``head.onnx`` and the
    verify graphs (external data beside them is read as ONNX Runtime does)."""
    import onnxruntime as ort

    from edge.runtime.ortsession import session_options

    if past < 1 or repeats < 1 or not batches:
        raise ConfigError(f"verify cost: past ({past}) and repeats ({repeats}) must be >= 1, with some batch")
    graphs_dir = Path(graphs_dir)
    missing = [b for b in batches if b > 1 and not (graphs_dir / f"verify_{b}.onnx").is_file()]
    if missing:
        raise ConfigError(f"verify cost: {graphs_dir} has no verify graph for batches {missing}")
    open_ = lambda name: ort.InferenceSession(str(graphs_dir / name), session_options(ort, threads),  # noqa: E731
                                              providers=["CPUExecutionProvider"])
    full, head = open_("full.onnx"), open_("head.onnx")
    cap = past + max(rows)
    rng = np.random.default_rng(0)
    caches = {f"{kind}_{j}": (0.1 * rng.standard_normal((max(batches), kv_heads, cap, head_dim))).astype(np.float32)
              for j in range(num_layers) for kind in ("key", "value")}
    calls: dict[tuple[int, int], _Call] = {}
    for b in batches:
        verify = open_(f"verify_{b}.onnx") if b > 1 else None
        for k in rows:
            several = b > 1 and k > 1
            calls[(b, k)] = _Call(ort, verify if several else full, head, b, k, past, caches, several, hidden, vocab)
    times: dict[tuple[int, int], list[float]] = {key: [] for key in calls}
    for rep in range(repeats + 2):
        for key, call in calls.items():
            t0 = time.perf_counter()
            call.run()
            if rep >= 2:  # the first calls of a shape plan its memory
                times[key].append(time.perf_counter() - t0)
    out: dict[str, dict[str, float]] = {}
    for b in batches:
        one = float(np.median(times[(b, 1)]))
        out[str(b)] = {str(k): float(np.median(times[(b, k)])) / one for k in rows}
        out[str(b)]["step_ms"] = one * 1e3
    return out
