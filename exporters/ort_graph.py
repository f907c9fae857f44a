"""One fused ONNX Runtime graph as it is written (:mod:`exporters.ort_fused`): :class:`Builder` accumulates
its nodes, initializers and I/O, and writes the decoder's pieces into it (RoPE tables, a layer's
GroupQueryAttention over the in-place cache, a decoder layer).
"""
from __future__ import annotations

import numpy as np
import onnx
import torch
from onnx import helper, numpy_helper

from edge.model.exits import MultiExitModel
from exporters.ort_quant import matmul

MS = "com.microsoft"
FUSED_OPSET = 17


class Builder:
    """Accumulates nodes, initializers and I/O of one graph."""

    def __init__(self, model: MultiExitModel) -> None:
        self.model, self.cfg = model, model.backbone.cfg
        self.nodes: list[onnx.NodeProto] = []
        self.inits: dict[str, onnx.TensorProto] = {}
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []

    def weight(self, name: str, t: torch.Tensor | np.ndarray) -> str:
        if name not in self.inits:
            a = t.detach().float().numpy() if isinstance(t, torch.Tensor) else np.asarray(t)
            self.inits[name] = numpy_helper.from_array(np.array(a, order="C"), name)  # keeps 0-d arrays 0-d
        return name

    def const(self, name: str, value, dtype=np.int64) -> str:
        return self.weight(name, np.asarray(value, dtype=dtype))

    def node(self, op: str, inputs: list[str], outputs: list[str], domain: str = "", **attrs) -> list[str]:
        self.nodes.append(helper.make_node(op, inputs, outputs, domain=domain, **attrs))
        return outputs

    def input(self, name: str, dtype: int, shape: list) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, dtype, shape))
        return name

    def output(self, name: str, dtype: int, shape: list) -> None:
        self.outputs.append(helper.make_tensor_value_info(name, dtype, shape))

    def linear(self, x: str, lin: torch.nn.Linear | list[torch.nn.Linear], name: str) -> str:
        """x @ W^T (+ b), in the linear's precision; a list packs linears that read x along the output
        (:func:`exporters.ort_quant.matmul`)."""
        return matmul(self, x, lin if isinstance(lin, list) else [lin], name)

    def model_proto(self, name: str) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, name, self.inputs, self.outputs, list(self.inits.values()))
        proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", FUSED_OPSET),
                                                        helper.make_opsetid(MS, 1)],
                                  producer_name="smartexit.ort_fused")
        proto.ir_version = 8
        return proto

    # ---------------------------------------------------------------- pieces
    def rope_tables(self) -> tuple[str, str]:
        """cos / sin [max_positions, hd/2] from the model's (possibly scaled) inverse frequencies."""
        bb = self.model.backbone
        pos = np.arange(self.cfg.max_position_embeddings, dtype=np.float64)[:, None]
        freqs = pos * bb.inv_freq.double().numpy()[None, :]
        return (self.weight("rope.cos", np.cos(freqs).astype(np.float32)),
                self.weight("rope.sin", np.sin(freqs).astype(np.float32)))

    def attention(self, j: int, qkv: str, cos: str, sin: str, per_seq: list[tuple[str, str]] | None) -> str:
        """Layer j's GroupQueryAttention over the in-place cache. ``per_seq`` None: one operator for the
        batch (``past_key_{j}`` [B, ...]); else one per sequence (``past_key_{j}_{q}`` [1, ...], the
        (seqlens, total) of :func:`exporters.ort_verify.per_sequence_lengths`), so that several new
        rows of several sequences are one call: ONNX Runtime's CPU GroupQueryAttention takes several
        rows with a past only at batch 1."""
        a, cfg = self.model.backbone.layers[j].self_attn, self.cfg
        window = cfg.sliding_window if cfg.sliding_window is not None else -1
        attrs = dict(domain=MS, num_heads=a.num_heads, kv_num_heads=a.num_kv_heads, do_rotary=1,
                     local_window_size=int(window))
        if per_seq is None:
            return self.node("GroupQueryAttention",
                             [qkv, "", "", f"past_key_{j}", f"past_value_{j}", "seqlens_k", "total_len", cos, sin],
                             [f"l{j}.att", f"present_key_{j}", f"present_value_{j}"], **attrs)[0]
        b = len(per_seq)
        parts = self.node("Split", [qkv, self.const(f"c.ones{b}", [1] * b)], [f"l{j}.qkv{q}" for q in range(b)], axis=0)
        atts = [self.node("GroupQueryAttention",
                          [part, "", "", f"past_key_{j}_{q}", f"past_value_{j}_{q}", seqlen, total, cos, sin],
                          [f"l{j}.att{q}", f"present_key_{j}_{q}", f"present_value_{j}_{q}"], **attrs)[0]
                for q, (part, (seqlen, total)) in enumerate(zip(parts, per_seq))]
        return self.node("Concat", atts, [f"l{j}.att"], axis=0)[0]

    def layer(self, j: int, resid: str, pending: str | None, cos: str, sin: str,
              per_seq: list[tuple[str, str]] | None = None) -> tuple[str, str]:
        """One decoder layer. The residual stream is ``resid`` + ``pending`` (pending None: resid
        alone). Returns (residual after attention, MLP output): their sum is the layer's output.
        ``per_seq``: attention sequence by sequence (:meth:`attention`)."""
        cfg, layer = self.cfg, self.model.backbone.layers[j]
        eps = float(cfg.rms_norm_eps)
        w1 = self.weight(f"l{j}.ln1", layer.input_layernorm.weight)
        if pending is None:
            x = self.node("SimplifiedLayerNormalization", [resid, w1], [f"l{j}.n1"], axis=-1, epsilon=eps)[0]
        else:
            x, _, _, resid = self.node("SkipSimplifiedLayerNormalization", [pending, resid, w1],
                                       [f"l{j}.n1", "", "", f"l{j}.r1"], domain=MS, epsilon=eps)
        a = layer.self_attn
        qkv = self.linear(x, [a.q_proj, a.k_proj, a.v_proj], f"l{j}.qkv")
        att = self.attention(j, qkv, cos, sin, per_seq)
        o = self.linear(att, a.o_proj, f"l{j}.o")
        w2 = self.weight(f"l{j}.ln2", layer.post_attention_layernorm.weight)
        x2, _, _, resid = self.node("SkipSimplifiedLayerNormalization", [o, resid, w2],
                                    [f"l{j}.n2", "", "", f"l{j}.r2"], domain=MS, epsilon=eps)
        m = layer.mlp
        # gate and up packed into one MatMul (one INT8 product with one input quantization when quantized:
        # ONNX Runtime fuses a Q/DQ pair into an integer MatMul only when it feeds that one MatMul)
        gu_both = self.linear(x2, [m.gate_proj, m.up_proj], f"l{j}.gateup")
        f = m.gate_proj.out_features
        gate, up = self.node("Split", [gu_both, self.const(f"c.split_gu{f}", [f, m.up_proj.out_features])],
                             [f"l{j}.gate", f"l{j}.up"], axis=-1)
        act = self.node("QuickGelu", [gate], [f"l{j}.silu"], domain=MS, alpha=1.0)[0]
        gu = self.node("Mul", [act, up], [f"l{j}.gu"])[0]
        return resid, self.linear(gu, m.down_proj, f"l{j}.down")
