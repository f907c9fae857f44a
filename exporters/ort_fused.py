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
    gate's logit) and the exit rule's features and score from the gates (:meth:`_Builder.decision_gated`:
    inputs ``rule_w``, ``rule_b``, ``prev_gate``, ``prev_exit_hidden``; outputs ``exit_features``,
    ``exit_score``): a gated decision needs no LM head.
``head`` (one for every exit: the LM head's weight is stored, and loaded, once)
    in:  ``exit_hidden`` [B, D]
    out: ``logits`` [B, V], ``exit_stats`` [B, 3], ``exit_token`` int64 [B]; the head of a model with one
         exit or a candidate shortlist has no ``exit_stats`` (:func:`head_has_stats`: nothing reads them, and
         they are not free)
    Without gates (and with more than one exit) it also computes the exit rule's features and
    linear score (:meth:`_Builder.decision`): inputs ``rule_w`` [6], ``rule_b`` [], ``has_prev`` bool []
    (false at the first exit) and the previous exit's ``prev_token`` int64 [B], ``prev_run`` [B],
    ``prev_exit_hidden`` [B, D]; outputs ``exit_features`` [B, 6], ``exit_score`` [B] (exit where >= 0),
    ``exit_run`` [B]. With gates it runs for the rows that exit only.
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

Parity with the torch model is checked by :func:`exporters.parity.check_fused_parity`.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from edge.core.errors import ConfigError
from edge.model.exits import MultiExitModel
from exporters.ort_quant import matmul, output_rows

MS = "com.microsoft"
FULL = "full"  # the graph of every layer, first to last (a segment graph without decision exits)
VERIFY = "verify_"  # + B: the graph of every layer for B sequences of several new rows each
FUSED_OPSET = 17
GQA_HEAD_MULTIPLE = 16  # ONNX Runtime's CPU GroupQueryAttention needs head_size % 16 == 0


def fused_supported(model: MultiExitModel) -> str | None:
    """None if the fused graphs can express ``model``, else the reason."""
    cfg = model.backbone.cfg
    if cfg.head_dim % GQA_HEAD_MULTIPLE:
        return f"head_dim {cfg.head_dim} is not a multiple of {GQA_HEAD_MULTIPLE} (ONNX Runtime's CPU GroupQueryAttention)"
    return None


class _Builder:
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

    def per_sequence_lengths(self, b: int) -> list[tuple[str, str]]:
        """(seqlens_k [1] int32, total length [] int32) of each of ``b`` sequences, from ``seqlens_k`` [b]:
        what a GroupQueryAttention of one sequence reads (its total is its own last index + 1)."""
        names = [f"vf.seqlen{q}" for q in range(b)]
        self.node("Split", ["seqlens_k", self.const(f"c.ones{b}", [1] * b)], names, axis=0)
        one = self.weight("c.int32_one", np.array(1, np.int32))
        out = []
        for q, name in enumerate(names):
            sq = self.node("Squeeze", [name, self.const("c.axis0", [0])], [f"vf.seqlen{q}_s"])[0]
            out.append((name, self.node("Add", [sq, one], [f"vf.total{q}"])[0]))
        return out

    def attention(self, j: int, qkv: str, cos: str, sin: str, per_seq: list[tuple[str, str]] | None) -> str:
        """Layer j's GroupQueryAttention over the in-place cache. ``per_seq`` None: one operator for the
        batch (``past_key_{j}`` [B, ...]); else one per sequence (``past_key_{j}_{q}`` [1, ...], the
        (seqlens, total) of :meth:`per_sequence_lengths`), so that several new rows of several
        sequences are one call: ONNX Runtime's CPU GroupQueryAttention takes several rows with a past
        only at batch 1."""
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

    def exit_norm(self, layer: int, h: str) -> str:
        """``exit_hidden`` [B * R, D]: the exit's adapter and norm on residual rows h [B * R, D]."""
        model, cfg = self.model, self.cfg
        if layer == model.num_layers:
            norm_w = model.backbone.norm.weight
        else:
            head = model.heads[str(layer)]
            if head.down is not None:
                low = self.node("MatMul", [h, self.weight(f"e{layer}.down_t", head.down.weight.T)], [f"e{layer}.lo"])[0]
                ad = self.node("MatMul", [low, self.weight(f"e{layer}.up_t", head.up.weight.T)], [f"e{layer}.ad"])[0]
                h = self.node("Add", [h, ad], [f"e{layer}.h"])[0]
            norm_w = head.norm.weight
        eh = self.node("SimplifiedLayerNormalization", [h, self.weight(f"e{layer}.norm", norm_w)], ["exit_hidden"],
                       axis=-1, epsilon=float(cfg.rms_norm_eps))[0]
        self.output("exit_hidden", TensorProto.FLOAT, ["rows", cfg.hidden_size])  # B * R
        return eh

    def lm_head(self, eh: str, stats: bool = True) -> None:
        """``logits`` [B, V], ``exit_stats`` [B, 3] (``stats``) and ``exit_token`` [B] from exit hidden rows
        [B, D]. Without ``stats`` the token is the first index of the largest logit (ArgMax), which is the
        statistics' TopK's first index too (ONNX: of equal values the lower index comes first)."""
        bb = self.model.backbone
        if bb.head_q is None:
            logits = self.node("MatMul", [eh, self.weight("lm_head_t", bb.head_weight.T)], ["logits"])[0]
        else:  # the quantized copy of the LM head (edge.compress)
            logits = self.node("Identity", [self.linear(eh, bb.head_q, "lm_head")], ["logits"])[0]
        self.output("logits", TensorProto.FLOAT, ["batch", self.cfg.vocab_size])
        if stats:
            self.decision_stats(logits)
            self.output("exit_stats", TensorProto.FLOAT, ["batch", 3])
        else:
            self.node("ArgMax", [logits], ["exit_token"], axis=-1, keepdims=0, select_last_index=0)
        self.output("exit_token", TensorProto.INT64, ["batch"])

    def gate(self, layer: int, eh: str) -> None:
        """``exit_gate`` [B]: the exit's gate logit (:class:`edge.model.exits.ExitGate`)."""
        g = self.model.heads[str(layer)].gate
        a = self.linear(eh, g.fc1, f"e{layer}.gate1")
        a = self.node("QuickGelu", [a], [f"e{layer}.gsilu"], domain=MS, alpha=1.0)[0]  # SiLU
        z = self.linear(a, g.fc2, f"e{layer}.gate2")  # [B, 1]
        self.node("Reshape", [z, self.const("c.flat", [-1])], ["exit_gate"])
        self.output("exit_gate", TensorProto.FLOAT, ["batch"])

    def cosine(self, a: str, c: str) -> str:
        """Row cosine [B] of a, c [B, D]; 0 where either row is zero (calibration.signals._cosine)."""
        axis = self.const("c.axis_last", [-1])
        dot = self.node("ReduceSum", [self.node("Mul", [a, c], ["cs.ac"])[0], axis], ["cs.dot"], keepdims=0)[0]
        na = self.node("ReduceSum", [self.node("Mul", [a, a], ["cs.aa"])[0], axis], ["cs.na"], keepdims=0)[0]
        nc = self.node("ReduceSum", [self.node("Mul", [c, c], ["cs.cc"])[0], axis], ["cs.nc"], keepdims=0)[0]
        norms = self.node("Sqrt", [self.node("Mul", [na, nc], ["cs.nn"])[0]], ["cs.norms"])[0]
        zero, one = self.weight("c.zero_f", np.zeros((), np.float32)), self.weight("c.one_f0", np.ones((), np.float32))
        ok = self.node("Greater", [norms, zero], ["cs.ok"])[0]
        safe = self.node("Where", [ok, norms, one], ["cs.safe"])[0]
        ratio = self.node("Div", [dot, safe], ["cs.ratio"])[0]
        clipped = self.node("Clip", [ratio, self.weight("c.m1", np.array(-1.0, np.float32)), one], ["cs.clip"])[0]
        return self.node("Where", [ok, clipped, zero], ["cs.cos"])[0]

    def decision(self, eh: str) -> None:
        """The exit rule's features and score (softmax signals), in the ``head`` graph: the host only
        compares ``exit_score`` [B] with 0 (after a graph call the host's caches are cold, and each numpy
        operation on a few numbers cost 10-20 us there; the rule took 0.39 ms of a 4 ms step).

        Features [B, 6], the columns of :data:`calibration.signals.SIGNAL_NAMES` as
        :func:`calibration.signals.signals_from_stats` computes them, in float32: the exit's statistics
        (top-1 probability, margin, entropy), agreement with the previous exit's argmax, the run of
        consecutive agreements over the number of exits, and the cosine with the previous exit's
        hidden; exact zeros for the last three where ``has_prev`` is false (the first decision exit:
        one graph serves every exit, so "first" is an input, not a graph variant). Inputs ``rule_w`` [6],
        ``rule_b`` []: the rule's linear score (threshold folded into the bias), so ``exit_score`` =
        features @ rule_w + rule_b; ``exit_run`` [B] carries the run to the next exit."""
        d = self.cfg.hidden_size
        w = self.input("rule_w", TensorProto.FLOAT, [6])
        bias = self.input("rule_b", TensorProto.FLOAT, [])
        has = self.input("has_prev", TensorProto.BOOL, [])
        prev_token = self.input("prev_token", TensorProto.INT64, ["batch"])
        prev_run = self.input("prev_run", TensorProto.FLOAT, ["batch"])
        prev_eh = self.input("prev_exit_hidden", TensorProto.FLOAT, ["batch", d])
        same = self.node("And", [self.node("Equal", ["exit_token", prev_token], ["dc.eq"])[0], has], ["dc.same"])[0]
        agree = self.node("Cast", [same], ["dc.agree"], to=TensorProto.FLOAT)[0]
        one = self.weight("c.one_f0", np.ones((), np.float32))
        run = self.node("Mul", [agree, self.node("Add", [prev_run, one], ["dc.run1"])[0]], ["exit_run"])[0]  # [B]
        runm = self.node("Div", [run, self.weight("c.m_exits", np.array(len(self.model.exit_layers), np.float32))],
                         ["dc.runm"])[0]
        cos = self.node("Where", [has, self.cosine(eh, prev_eh), self.weight("c.zero_f", np.zeros((), np.float32))],
                        ["dc.cos"])[0]
        feats = self.node("Concat", ["exit_stats", self._col(agree, "agree1"), self._col(runm, "runm1"),
                                     self._col(cos, "cos1")], ["exit_features"], axis=1)[0]
        self.output("exit_run", TensorProto.FLOAT, ["batch"])
        self._score(feats, w, bias, 6)

    def decision_gated(self, eh: str, first_decision: bool) -> None:
        """The same from the gates, in a gated decision segment (no LM head needed): features [B, 3], the
        columns of ``calibration.signals.GATED_SIGNAL_NAMES`` as ``gated_signals`` computes them: the
        gate probability, the previous decision exit's and the cosine with its hidden (zeros at the
        first decision exit). Inputs ``rule_w`` [3], ``rule_b`` []; later decision exits also take
        ``prev_gate`` [B] and ``prev_exit_hidden`` [B, D]."""
        d = self.cfg.hidden_size
        w = self.input("rule_w", TensorProto.FLOAT, [3])
        bias = self.input("rule_b", TensorProto.FLOAT, [])
        g = self.node("Sigmoid", ["exit_gate"], ["dc.g"])[0]
        if first_decision:
            feats = self.node("Pad", [self._col(g, "g1"), self.const("c.pad2", [0, 0, 0, 2])], ["exit_features"])[0]
        else:
            pg = self.node("Sigmoid", [self.input("prev_gate", TensorProto.FLOAT, ["batch"])], ["dc.pg"])[0]
            cos = self.cosine(eh, self.input("prev_exit_hidden", TensorProto.FLOAT, ["batch", d]))
            feats = self.node("Concat", [self._col(g, "g1"), self._col(pg, "pg1"), self._col(cos, "cos1")],
                              ["exit_features"], axis=1)[0]
        self._score(feats, w, bias, 3)

    def decision_shortlist(self, eh: str) -> None:
        """The candidate-set check (:mod:`edge.model.candidates`, same formulas in float32) in a decision
        segment: candidate logits against the shortlist's LM-head rows, the two best candidates' tokens and
        logits, the features [B, F] (columns ``edge.model.candidates.signal_names(D)``: nine named ones, then
        the exit hidden ``eh`` itself) and the rule's score, an MLP of them whose weights are inputs
        (``rule_w1`` [F, H], ``rule_b1`` [H], ``rule_w2`` [H, 1], ``rule_b2`` [1]).

        Inputs ``lookup_token`` int64 [B, 1] and ``lookup_len`` [B, 1] (the context lookup's token and match
        length / MAX_N), ``prev_tokens`` int64 [B, 2] and ``prev_logits`` [B, 2] (the previous check's; -1
        and 0 before the first). Outputs ``exit_tokens`` [B, 2], ``exit_logits`` [B, 2], ``exit_features``
        [B, F], ``exit_score`` [B, 1]. Eleven nodes after the exit norm (a W8A8 head: its integer product over
        the shortlist rows instead of the float MatMul, two nodes once ONNX Runtime fuses it), every one on the
        rows' own shapes (no reshape, slice or first-check variant): at batch 1 a node costs a few microseconds
        whatever it computes (docs/runtime.md)."""
        from edge.model.candidates import num_features

        model = self.model
        f = num_features(self.cfg.hidden_size)
        if model.shortlist_act_scale() is None:  # a float head (or float activations): its rows, float32
            rows = model.shortlist_rows()  # [K, D]
            z = self.node("MatMul", [eh, self.weight("sl.rows_t", rows.T.contiguous())], ["sl.z"])[0]  # [B, K]
        else:  # a W8A8 head's own integer product over its shortlist rows, as the head scores those tokens
            # (int8 rows, a quarter of the float rows' bytes; no change in time measurable on a CPU: docs/runtime.md)
            z = self.linear(eh, output_rows(model.backbone.head_q, model.shortlist), "sl")
        vals, idx = self.node("TopK", [z, self.const("c.k2", [2])], ["exit_logits", "sl.idx"], axis=-1, largest=1,
                              sorted=1)
        tokens = self.node("Gather", [self.weight("sl.ids", model.shortlist.numpy().astype(np.int64)), idx],
                           ["exit_tokens"], axis=0)[0]  # [B, 2]
        ltok = self.input("lookup_token", TensorProto.INT64, ["batch", 1])
        llen = self.input("lookup_len", TensorProto.FLOAT, ["batch", 1])
        ptok = self.input("prev_tokens", TensorProto.INT64, ["batch", 2])
        plog = self.input("prev_logits", TensorProto.FLOAT, ["batch", 2])
        la = self.node("Cast", [self.node("Equal", [tokens, ltok], ["sl.leq"])[0]], ["sl.la"], to=TensorProto.FLOAT)[0]
        agree = self.node("Cast", [self.node("Equal", [tokens, ptok], ["sl.peq"])[0]], ["sl.agree"],
                          to=TensorProto.FLOAT)[0]
        feats = self.node("Concat", [vals, la, llen, agree, plog, eh], ["exit_features"], axis=1)[0]  # [B, F]
        w1 = self.input("rule_w1", TensorProto.FLOAT, [f, "hidden"])
        b1 = self.input("rule_b1", TensorProto.FLOAT, ["hidden"])
        w2 = self.input("rule_w2", TensorProto.FLOAT, ["hidden", 1])
        b2 = self.input("rule_b2", TensorProto.FLOAT, [1])
        h = self.node("Relu", [self.node("Gemm", [feats, w1, b1], ["sl.h0"])[0]], ["sl.h"])[0]
        self.node("Gemm", [h, w2, b2], ["exit_score"])
        self.output("exit_tokens", TensorProto.INT64, ["batch", 2])
        self.output("exit_logits", TensorProto.FLOAT, ["batch", 2])
        self.output("exit_features", TensorProto.FLOAT, ["batch", f])
        self.output("exit_score", TensorProto.FLOAT, ["batch", 1])

    def _col(self, x: str, name: str) -> str:
        """[B] -> [B, 1]."""
        return self.node("Unsqueeze", [x, self.const("c.unsq1", [1])], [f"dc.{name}"])[0]

    def _score(self, feats: str, w: str, bias: str, f: int) -> None:
        self.node("Add", [self.node("MatMul", [feats, w], ["dc.fw"])[0], bias], ["exit_score"])
        self.output("exit_features", TensorProto.FLOAT, ["batch", f])
        self.output("exit_score", TensorProto.FLOAT, ["batch"])

    def decision_stats(self, logits: str) -> None:
        """exit_stats [B, 3] (top-1 probability, top-1 minus top-2, entropy) and exit_token [B]:
        :func:`edge.model.exits.exit_decision_stats` (same formulas), from one TopK and one exp pass."""
        k2 = self.const("c.k2", [2])
        axis = self.const("c.axis_last", [-1])
        vals, idx = self.node("TopK", [logits, k2], ["st.top", "st.idx"], axis=-1, largest=1, sorted=1)
        m, z2 = self.node("Split", [vals, self.const("c.split11", [1, 1])], ["st.m", "st.z2"], axis=-1)
        d = self.node("Sub", [logits, m], ["st.d"])[0]
        e = self.node("Exp", [d], ["st.e"])[0]
        total = self.node("ReduceSum", [e, axis], ["st.sum"], keepdims=1)[0]
        ed = self.node("ReduceSum", [self.node("Mul", [e, d], ["st.ed"])[0], axis], ["st.sed"], keepdims=1)[0]
        top1 = self.node("Reciprocal", [total], ["st.top1"])[0]
        e2 = self.node("Exp", [self.node("Sub", [z2, m], ["st.dz2"])[0]], ["st.e2"])[0]
        fone = self.weight("c.one_f", np.ones(1, np.float32))
        margin = self.node("Mul", [self.node("Sub", [fone, e2], ["st.1me2"])[0], top1], ["st.margin"])[0]
        ent = self.node("Sub", [self.node("Log", [total], ["st.logs"])[0],
                                self.node("Mul", [ed, top1], ["st.edn"])[0]], ["st.ent0"])[0]
        ent = self.node("Relu", [ent], ["st.ent"])[0]  # rounding can dip below 0
        self.node("Concat", [top1, margin, ent], ["exit_stats"], axis=-1)
        self.node("Gather", [idx, self.const("c.zero_s", 0)], ["exit_token"], axis=-1)


def _segment_proto(model: MultiExitModel, layers: list[int], exit_layer: int | None, first: bool, last: bool,
                   name: str) -> onnx.ModelProto:
    """A segment graph; ``exit_layer`` None: the layers only (hidden in, hidden_out out, no head)."""
    b = _Builder(model)
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
        eh = b.exit_norm(exit_layer, rows)
        if model.gated and not last:  # decides from its gate; the head runs for the rows that exit
            b.gate(exit_layer, eh)
            b.decision_gated(eh, first_decision=first)
        elif model.has_shortlist and not last:  # decides over the candidates; no LM head for the check
            b.decision_shortlist(eh)
    for j in layers:
        for kind in ("key", "value"):
            b.output(f"present_{kind}_{j}", TensorProto.FLOAT, ["batch", kv, "capacity", hd])
    return b.model_proto(name)


def _verify_proto(model: MultiExitModel, b: int) -> onnx.ModelProto:
    """``verify_{b}``: every layer for ``b`` sequences of T new rows each, attention sequence by sequence,
    the last exit's hidden state at every row (:data:`VERIFY` in the module docstring)."""
    g = _Builder(model)
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
    per_seq = g.per_sequence_lengths(b)
    resid, pending = h, None
    for j in layers:
        resid, pending = g.layer(j, resid, pending, cos, sin, per_seq)
    out = g.node("Add", [resid, pending], ["hidden_out"])[0]
    rows = g.node("Reshape", [out, g.const("c.rows_d", [-1, d])], ["exit_rows"])[0]  # [b * T, D]
    g.exit_norm(model.num_layers, rows)
    for j in layers:
        for q in range(b):
            for kind in ("key", "value"):
                g.output(f"present_{kind}_{j}_{q}", TensorProto.FLOAT, [1, kv, "capacity", hd])
    return g.model_proto(f"{VERIFY}{b}")


def build_verify(model: MultiExitModel, b: int) -> FusedGraph:
    """The ``verify_{b}`` graph of ``model`` alone (what :func:`build_fused` adds per verify batch), for a
    caller that builds its graphs one at a time to bound memory."""
    reason = fused_supported(model)
    if reason:
        raise ConfigError(f"fused ONNX Runtime graphs: {reason}")
    with torch.no_grad():
        return FusedGraph(f"{VERIFY}{b}", _verify_proto(model.eval(), b))


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
    b = _Builder(model)
    eh = b.input("exit_hidden", TensorProto.FLOAT, ["batch", b.cfg.hidden_size])
    b.lm_head(eh, head_has_stats(model) if stats is None else stats)
    if head_decides(model):
        b.decision(eh)
    return b.model_proto("head")


def stats_head(model: MultiExitModel) -> FusedGraph:
    """The ``head`` graph with the decision statistics whatever the model: what ``draft_head`` is made from
    (:func:`save_draft_head`), so that a draft exit's stop rule reads them where ``head`` has none."""
    with torch.no_grad():
        return FusedGraph("head", _head_proto(model.eval(), stats=True))


def _kvfill_proto(model: MultiExitModel, layers: list[int], name: str) -> onnx.ModelProto:
    b = _Builder(model)
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
            out.append(FusedGraph(f"{VERIFY}{b}", _verify_proto(model, b)))
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
