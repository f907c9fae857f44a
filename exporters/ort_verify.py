"""The ``verify_{B}`` graphs of :mod:`exporters.ort_fused` (its module docstring gives their inputs and
outputs): every layer for B sequences of several new rows each, in one call, the matrix products on all
rows at once and attention sequence by sequence.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto

from edge.model.exits import MultiExitModel
from exporters.ort_exits import exit_norm
from exporters.ort_graph import Builder

VERIFY = "verify_"  # + B: the graph of every layer for B sequences of several new rows each


def per_sequence_lengths(g: Builder, b: int) -> list[tuple[str, str]]:
    """(seqlens_k [1] int32, total length [] int32) of each of ``b`` sequences, from ``seqlens_k`` [b]:
    what a GroupQueryAttention of one sequence reads (its total is its own last index + 1)."""
    names = [f"vf.seqlen{q}" for q in range(b)]
    g.node("Split", ["seqlens_k", g.const(f"c.ones{b}", [1] * b)], names, axis=0)
    one = g.weight("c.int32_one", np.array(1, np.int32))
    out = []
    for q, name in enumerate(names):
        sq = g.node("Squeeze", [name, g.const("c.axis0", [0])], [f"vf.seqlen{q}_s"])[0]
        out.append((name, g.node("Add", [sq, one], [f"vf.total{q}"])[0]))
    return out


def verify_proto(model: MultiExitModel, b: int) -> onnx.ModelProto:
    """``verify_{b}``: every layer for ``b`` sequences of T new rows each, attention sequence by sequence,
    the last exit's hidden state at every row (``verify_{B}`` in :mod:`exporters.ort_fused`'s docstring)."""
    g = Builder(model)
    cfg = g.cfg
    d, kv, hd = cfg.hidden_size, cfg.num_kv_heads, cfg.head_dim
    ids = g.input("input_ids", TensorProto.INT64, [b, "seq"])
    h = g.node("Gather", [g.weight("embed", model.backbone.embed_tokens.weight), ids], ["embedded"])[0]
    g.input("seqlens_k", TensorProto.INT32, [b])
    layers = range(cfg.num_layers)
    for j in layers:
        for q in range(b):
            for kind in ("key", "value"):
                g.input(f"past_{kind}_{j}_{q}", TensorProto.FLOAT, [1, kv, "capacity", hd])
    cos, sin = g.rope_tables()
    per_seq = per_sequence_lengths(g, b)
    resid, pending = h, None
    for j in layers:
        resid, pending = g.layer(j, resid, pending, cos, sin, per_seq)
    out = g.node("Add", [resid, pending], ["hidden_out"])[0]
    rows = g.node("Reshape", [out, g.const("c.rows_d", [-1, d])], ["exit_rows"])[0]  # [b * T, D]
    exit_norm(g, model.num_layers, rows)
    for j in layers:
        for q in range(b):
            for kind in ("key", "value"):
                g.output(f"present_{kind}_{j}_{q}", TensorProto.FLOAT, [1, kv, "capacity", hd])
    return g.model_proto(f"{VERIFY}{b}")
