"""ONNX Runtime graphs with fused operators, for the CPU (and CUDA) runtime.

The portable export (:mod:`exporters.onnx_export`) keeps attention, RoPE and RMSNorm decomposed
so that TensorRT can parse it; after ONNX Runtime's own optimisations it still runs about 84
nodes per decoder layer, and at batch 1 a node costs more than its arithmetic. These graphs are
written from the same weights with ONNX Runtime's fused operators instead, about 10 nodes per
layer (contrib ops, https://onnxruntime.ai/docs/reference/operators/ContribOperators.html, are
fine in graphs meant only for ONNX Runtime; docs/runtime.md says why both families exist):

    SkipSimplifiedLayerNormalization   residual add + RMSNorm in one pass
    MatMul                             Q, K and V from one packed weight
    GroupQueryAttention                RoPE from position tables, causal GQA over a fixed-capacity
                                       cache that it appends to *in place* (past_key and
                                       present_key are bound to the same buffer)
    MatMul                             o_proj
    SkipSimplifiedLayerNormalization
    MatMul, Split, QuickGelu, Mul      gate and up from one packed weight, SiLU (QuickGelu with alpha 1 is
                                       x * sigmoid(x))
    MatMul                             down_proj

Graphs (``j`` = 0-based decoder layer; B batch, T new rows, C cache capacity, D hidden, KV
key/value heads, hd head dim, V vocabulary). A call has T == 1 (a decode step, any B; each row
has its own cache length) or B == 1 (a prompt chunk or a sequence's deferred rows with the
new token): ONNX Runtime's GroupQueryAttention takes several rows per sequence only at batch 1
(``verify_{B}`` below splits the attention by sequence to verify several sequences in one call).

``segment_{i}`` (one per exit; the segments end at the exit's normalised hidden state: the LM head
is not in them)
    in:  ``input_ids`` int64 [B, T] (segment 0) or ``hidden`` float32 [B, T, D] (the residual),
         ``seqlens_k`` int32 [B] (index of each row's last new token = cached + T - 1),
         ``total_len`` int32 [] (max over rows of cached + T),
         ``exit_index`` int64 [] (the first row whose exit hidden is computed: T - R for the last R
         rows of each sequence; T - 1 in a decode step or a prompt chunk, 0 when a verification
         call of self-speculative decoding needs the full model's prediction at every row),
         ``past_key_{j}``, ``past_value_{j}`` float32 [B, KV, C, hd]
    out: ``hidden_out`` [B, T, D] (not in the last segment), ``exit_hidden`` [B * R, D] (after the
         exit's adapter and norm: the LM head's input; sequence-major, [B, D] when R == 1),
         ``present_key_{j}``, ``present_value_{j}`` [B, KV, C, hd]: bind them to the same
         buffers as the past (the engine's cache), and only the new rows are written.
    With exit gates (``exits.gate_hidden`` > 0) a decision segment also outputs ``exit_gate`` [B] (the
    gate's logit) and the exit rule's features and score from the gates
    (:func:`exporters.ort_exits.decision_gated`: inputs ``rule_w``, ``rule_b``, ``prev_gate``,
    ``prev_exit_hidden``; outputs ``exit_features``, ``exit_score``): a gated decision needs no LM head.
``head`` (one for every exit: the LM head's weight is stored, and loaded, once)
    in:  ``exit_hidden`` [B, D]
    out: ``logits`` [B, V], ``exit_stats`` [B, 3], ``exit_token`` int64 [B]; the head of a model with one
         exit or a candidate shortlist has no ``exit_stats`` (:func:`head_has_stats`: nothing reads them, and
         they are not free)
    Without gates (and with more than one exit) it also computes the exit rule's features and
    linear score (:func:`exporters.ort_exits.decision`): inputs ``rule_w`` [6], ``rule_b`` [],
    ``has_prev`` bool [] (false at the first exit) and the previous exit's ``prev_token`` int64 [B],
    ``prev_run`` [B], ``prev_exit_hidden`` [B, D]; outputs ``exit_features`` [B, 6], ``exit_score`` [B]
    (exit where >= 0), ``exit_run`` [B]. With gates it runs for the rows that exit only.
``draft_head`` (the ``head`` graph, with its statistics in any case (:func:`stats_head`), its LM-head weight
quantized to int8, per output channel, activations quantized per call: ONNX Runtime's dynamic quantization;
same inputs, and the outputs with ``exit_stats``)
    What self-speculative decoding drafts with: a draft only proposes a token that the full model
    then verifies in float32, so the output stays exact, and a draft step's head costs about half.
``verify_{B}`` (every layer, B a static batch: mode exact's verification of several sequences' drafts)
    in:  ``input_ids`` int64 [B, T], ``seqlens_k`` int32 [B] (as above), ``past_key_{j}_{q}``,
         ``past_value_{j}_{q}`` float32 [1, KV, C, hd] (sequence q's cache slot: bind views of the
         engine's cache, any slots)
    out: ``exit_hidden`` [B * T, D] (the last exit's, every row), ``present_key_{j}_{q}``,
         ``present_value_{j}_{q}`` (bound to the past's buffers)
    The matrix products run on all B * T rows at once; attention runs one GroupQueryAttention per
    sequence (batch 1, T rows), the only form ONNX Runtime's CPU kernel takes several rows with a
    past in. Each graph holds another copy of the layers (loaded only when a batch of that size
    verifies).
``kvfill_{i}`` (segments i..last, for rows that exited after segment i-1: CALM's propagation)
    in:  ``hidden`` [B, T, D] (the residual at the exit), ``positions`` int64 [B, T]
    out: ``key_{j}``, ``value_{j}`` float32 [B, T, KV * hd] (rotated keys; the caller writes them)

Why one ``head`` graph and not a head in every segment graph (or one graph sharing an initializer
with the others): docs/runtime.md, "One LM head per process".

The graphs are written with :class:`exporters.ort_graph.Builder` (its nodes and the decoder layers), what an
exit computes (:mod:`exporters.ort_exits`) and the ``verify_{B}`` graphs' own pieces (:mod:`exporters.ort_verify`).

Parity with the torch model is checked by :func:`exporters.fused_parity.check_fused_parity`.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, numpy_helper

from edge.core.errors import ConfigError
from edge.model.exits import MultiExitModel
from exporters.ort_exits import decision, decision_gated, decision_shortlist, exit_norm, gate, lm_head
from exporters.ort_graph import MS, Builder
from exporters.ort_verify import VERIFY, verify_proto

FULL = "full"  # the graph of every layer, first to last (a segment graph without decision exits)
GQA_HEAD_MULTIPLE = 16  # ONNX Runtime's CPU GroupQueryAttention needs head_size % 16 == 0


def fused_supported(model: MultiExitModel) -> str | None:
    """None if the fused graphs can express ``model``, else the reason."""
    cfg = model.backbone.cfg
    if cfg.head_dim % GQA_HEAD_MULTIPLE:
        return f"head_dim {cfg.head_dim} is not a multiple of {GQA_HEAD_MULTIPLE} (ONNX Runtime's CPU GroupQueryAttention)"
    return None


def _segment_proto(model: MultiExitModel, layers: list[int], exit_layer: int | None, first: bool, last: bool,
                   name: str) -> onnx.ModelProto:
    """A segment graph; ``exit_layer`` None: the layers only (hidden in, hidden_out out, no head)."""
    b = Builder(model)
    cfg = b.cfg
    d, kv, hd = cfg.hidden_size, cfg.num_kv_heads, cfg.head_dim
    if first:
        ids = b.input("input_ids", TensorProto.INT64, ["batch", "seq"])
        h = b.node("Gather", [b.weight("embed", model.backbone.embed_tokens.weight), ids], ["embedded"])[0]
    else:
        h = b.input("hidden", TensorProto.FLOAT, ["batch", "seq", d])
    b.input("seqlens_k", TensorProto.INT32, ["batch"])
    b.input("total_len", TensorProto.INT32, [])
    if exit_layer is not None:
        b.input("exit_index", TensorProto.INT64, [])
    for j in layers:
        for kind in ("key", "value"):
            b.input(f"past_{kind}_{j}", TensorProto.FLOAT, ["batch", kv, "capacity", hd])
    cos, sin = b.rope_tables()
    resid, pending = h, None
    for j in layers:
        resid, pending = b.layer(j, resid, pending, cos, sin)
    out = b.node("Add", [resid, pending], ["hidden_out"])[0]
    if not last or exit_layer is None:
        b.output("hidden_out", TensorProto.FLOAT, ["batch", "seq", d])
    if exit_layer is not None:
        first_row = b.node("Unsqueeze", ["exit_index", b.const("c.axis0", [0])], ["exit_first"])[0]
        rows = b.node("Slice", [out, first_row, b.const("c.int64_max", [np.iinfo(np.int64).max]),
                                b.const("c.axis1", [1])], ["exit_rows3"])[0]  # [B, R, D]
        rows = b.node("Reshape", [rows, b.const("c.rows_d", [-1, d])], ["exit_rows"])[0]  # [B * R, D]
        eh = exit_norm(b, exit_layer, rows)
        if model.gated and not last:  # decides from its gate; the head runs for the rows that exit
            gate(b, exit_layer, eh)
            decision_gated(b, eh, first_decision=first)
        elif model.has_shortlist and not last:  # decides over the candidates; no LM head for the check
            decision_shortlist(b, eh)
    for j in layers:
        for kind in ("key", "value"):
            b.output(f"present_{kind}_{j}", TensorProto.FLOAT, ["batch", kv, "capacity", hd])
    return b.model_proto(name)


def build_verify(model: MultiExitModel, b: int) -> FusedGraph:
    """The ``verify_{b}`` graph of ``model`` alone (what :func:`build_fused` adds per verify batch), for a
    caller that builds its graphs one at a time to bound memory."""
    reason = fused_supported(model)
    if reason:
        raise ConfigError(f"fused ONNX Runtime graphs: {reason}")
    with torch.no_grad():
        return FusedGraph(f"{VERIFY}{b}", verify_proto(model.eval(), b))


def head_decides(model: MultiExitModel) -> bool:
    """Whether the ``head`` graph computes the exit rule's score: decision exits without gates or a
    candidate shortlist (those decide in the segment graph)."""
    return not model.gated and not model.has_shortlist and len(model.exit_layers) > 1


def head_has_stats(model: MultiExitModel) -> bool:
    """Whether the ``head`` graph outputs the softmax decision statistics: not where its calls never read
    them, which is a model with one exit (full depth only) and a candidate-shortlist model (its checks decide
    in the segment graphs; its head serves full-depth calls, which read logits and token, and its draft exits'
    stop rules read the statistics from ``draft_head``). They cost 9 of the head's 63 us at one row and 119 of
    307 at sixteen on the demo model (docs/runtime.md)."""
    return not model.has_shortlist and len(model.exit_layers) > 1


def _head_proto(model: MultiExitModel, stats: bool | None = None) -> onnx.ModelProto:
    """``head``: the LM head, decision statistics (``stats``; None: :func:`head_has_stats`) and (softmax
    rules) the exit rule's score, for every exit."""
    b = Builder(model)
    eh = b.input("exit_hidden", TensorProto.FLOAT, ["batch", b.cfg.hidden_size])
    lm_head(b, eh, head_has_stats(model) if stats is None else stats)
    if head_decides(model):
        decision(b, eh)
    return b.model_proto("head")


def stats_head(model: MultiExitModel) -> FusedGraph:
    """The ``head`` graph with the decision statistics whatever the model: what ``draft_head`` is made from
    (:func:`save_draft_head`), so that a draft exit's stop rule reads them where ``head`` has none."""
    with torch.no_grad():
        return FusedGraph("head", _head_proto(model.eval(), stats=True))


def _kvfill_proto(model: MultiExitModel, layers: list[int], name: str) -> onnx.ModelProto:
    b = Builder(model)
    cfg = b.cfg
    d, kv, hd = cfg.hidden_size, cfg.num_kv_heads, cfg.head_dim
    h = b.input("hidden", TensorProto.FLOAT, ["batch", "seq", d])
    pos = b.input("positions", TensorProto.INT64, ["batch", "seq"])
    cos, sin = b.rope_tables()
    split = b.const("c.split_kv", [kv * hd, kv * hd])
    for j in layers:
        layer = model.backbone.layers[j]
        a = layer.self_attn
        x = b.node("SimplifiedLayerNormalization", [h, b.weight(f"l{j}.ln1", layer.input_layernorm.weight)],
                   [f"l{j}.n1"], axis=-1, epsilon=float(cfg.rms_norm_eps))[0]
        kvp = b.linear(x, [a.k_proj, a.v_proj], f"l{j}.kv")
        k, v = b.node("Split", [kvp, split], [f"l{j}.k", f"value_{j}"], axis=-1)
        b.node("RotaryEmbedding", [k, pos, cos, sin], [f"key_{j}"], domain=MS, interleaved=0, num_heads=kv)
        b.output(f"key_{j}", TensorProto.FLOAT, ["batch", "seq", kv * hd])
        b.output(f"value_{j}", TensorProto.FLOAT, ["batch", "seq", kv * hd])
    return b.model_proto(name)


@dataclass
class FusedGraph:
    name: str
    proto: onnx.ModelProto


def build_fused(model: MultiExitModel, segments: list[list[int]], full: bool = True,
                verify_batches: tuple[int, ...] = ()) -> list[FusedGraph]:
    """The fused ``segment_{i}``, ``kvfill_{i}`` and ``head`` graphs of ``model`` cut at ``segments``
    (0-based layers per segment; exits after each), with ``full`` (and more than one segment) the
    graph of every layer, :data:`FULL`, and a ``verify_{B}`` graph for each B of ``verify_batches``.

    Raises:
        ConfigError: the model has a shape the fused operators do not support (see
            :func:`fused_supported`).
    """
    reason = fused_supported(model)
    if reason:
        raise ConfigError(f"fused ONNX Runtime graphs: {reason}")
    model = model.eval()
    out = []
    n = len(segments)
    with torch.no_grad():
        for i, layers in enumerate(segments):
            out.append(FusedGraph(f"segment_{i}", _segment_proto(model, layers, model.exit_layers[i], i == 0,
                                                                 i == n - 1, f"segment_{i}")))
        for i in range(1, n):
            suffix = [j for seg in segments[i:] for j in seg]
            out.append(FusedGraph(f"kvfill_{i}", _kvfill_proto(model, suffix, f"kvfill_{i}")))
        out.append(FusedGraph("head", _head_proto(model)))
        if full and n > 1:  # every layer in one call, for calls in which no row may leave early
            out.append(FusedGraph(FULL, _segment_proto(model, [j for seg in segments for j in seg], model.num_layers,
                                                       True, True, FULL)))
        for b in verify_batches:
            out.append(FusedGraph(f"{VERIFY}{b}", verify_proto(model, b)))
    return out


def build_layer_spans(model: MultiExitModel, spans: list[list[int]]) -> list[FusedGraph]:
    """Graphs of bare layer spans (hidden in, hidden out, no exit head), for measuring what cutting
    the decoder into segments costs by itself (``span_{k}``)."""
    reason = fused_supported(model)
    if reason:
        raise ConfigError(f"fused ONNX Runtime graphs: {reason}")
    with torch.no_grad():
        return [FusedGraph(f"span_{k}", _segment_proto(model.eval(), layers, None, False, False, f"span_{k}"))
                for k, layers in enumerate(spans)]


def save_fused(graphs: list[FusedGraph], out_dir: Path, external_data_threshold: int | None = None
               ) -> dict[str, tuple[str, list[str], list[str], str | None]]:
    """Write each graph as ``<name>.onnx`` in ``out_dir``, its weights in ``<name>.onnx.data`` when they
    exceed ``external_data_threshold`` bytes (protobuf cannot hold more than 2 GiB); returns
    name -> (file name, input names, output names, external data file or None). (``onnx.checker``
    does not know ONNX Runtime's SimplifiedLayerNormalization, registered in the default domain:
    loading the graphs into ONNX Runtime and the parity gate are the checks.)"""
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {}
    out_dir.mkdir(parents=True, exist_ok=True)
    for g in graphs:
        path = out_dir / f"{g.name}.onnx"
        weights = sum(numpy_helper.to_array(t).nbytes for t in g.proto.graph.initializer)
        data = None
        if external_data_threshold is not None and weights > external_data_threshold:
            data = f"{path.name}.data"
            onnx.save_model(g.proto, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                            location=data, size_threshold=1024)
        else:
            onnx.save_model(g.proto, str(path))
        files[g.name] = (path.name, [i.name for i in g.proto.graph.input], [o.name for o in g.proto.graph.output],
                         data)
    return files


DRAFT_HEAD = "draft_head"


def save_draft_head(head: Path, out_dir: Path, external_data: bool = False
                    ) -> tuple[str, list[str], list[str], str | None]:
    """Write ``draft_head.onnx`` next to ``head`` (:data:`DRAFT_HEAD` in the module docstring): the LM
    head's MatMul with int8 weights, its weights in ``draft_head.onnx.data`` when ``external_data``
    (as :func:`save_fused` stores the head's). Returns what :func:`save_fused` returns for one graph."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    path = out_dir / f"{DRAFT_HEAD}.onnx"
    src = onnx.load(str(head))
    consts = {t.name for t in src.graph.initializer}
    if not any(n.op_type == "MatMul" and n.input[1] in consts for n in src.graph.node):
        # the head is quantized already (edge.compress): the draft head is the head itself
        data = f"{path.name}.data" if external_data else None
        if external_data:
            onnx.save_model(src, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=data,
                            size_threshold=1024)
        else:
            onnx.save_model(src, str(path))
        return path.name, [i.name for i in src.graph.input], [o.name for o in src.graph.output], data
    quiet = logging.getLogger().level
    logging.getLogger().setLevel(logging.ERROR)  # the quantizer advises a pre-processing pass a head does not need
    try:
        quantize_dynamic(str(head), str(path), weight_type=QuantType.QInt8, per_channel=True,
                         op_types_to_quantize=["MatMul"])  # the head's only MatMul with a constant weight
    finally:
        logging.getLogger().setLevel(quiet)
    proto = onnx.load(str(path))
    data = None
    if external_data:
        data = f"{path.name}.data"
        onnx.save_model(proto, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=data, size_threshold=1024)
    return path.name, [i.name for i in proto.graph.input], [o.name for o in proto.graph.output], data
