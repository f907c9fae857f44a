"""What the fused ONNX Runtime graphs (:mod:`exporters.ort_fused`) compute at an exit, written into a
:class:`exporters.ort_graph.Builder`: the exit's adapter and norm (``exit_hidden``), the LM head with its
decision statistics, the exit gate, and the exit rule's features and score in its three forms (softmax
signals in the ``head`` graph; gates, or a candidate shortlist, in a decision segment).
"""
from __future__ import annotations

import numpy as np
from onnx import TensorProto

from exporters.ort_graph import MS, Builder
from exporters.ort_quant import output_rows


def exit_norm(b: Builder, layer: int, h: str) -> str:
    """``exit_hidden`` [B * R, D]: the exit's adapter and norm on residual rows h [B * R, D]."""
    model, cfg = b.model, b.cfg
    if layer == model.num_layers:
        norm_w = model.backbone.norm.weight
    else:
        head = model.heads[str(layer)]
        if head.down is not None:
            low = b.node("MatMul", [h, b.weight(f"e{layer}.down_t", head.down.weight.T)], [f"e{layer}.lo"])[0]
            ad = b.node("MatMul", [low, b.weight(f"e{layer}.up_t", head.up.weight.T)], [f"e{layer}.ad"])[0]
            h = b.node("Add", [h, ad], [f"e{layer}.h"])[0]
        norm_w = head.norm.weight
    eh = b.node("SimplifiedLayerNormalization", [h, b.weight(f"e{layer}.norm", norm_w)], ["exit_hidden"],
                axis=-1, epsilon=float(cfg.rms_norm_eps))[0]
    b.output("exit_hidden", TensorProto.FLOAT, ["rows", cfg.hidden_size])  # B * R
    return eh


def lm_head(b: Builder, eh: str, stats: bool = True) -> None:
    """``logits`` [B, V], ``exit_stats`` [B, 3] (``stats``) and ``exit_token`` [B] from exit hidden rows
    [B, D]. Without ``stats`` the token is the first index of the largest logit (ArgMax), which is the
    statistics' TopK's first index too (ONNX: of equal values the lower index comes first)."""
    bb = b.model.backbone
    if bb.head_q is None:
        logits = b.node("MatMul", [eh, b.weight("lm_head_t", bb.head_weight.T)], ["logits"])[0]
    else:  # the quantized copy of the LM head (edge.compress)
        logits = b.node("Identity", [b.linear(eh, bb.head_q, "lm_head")], ["logits"])[0]
    b.output("logits", TensorProto.FLOAT, ["batch", b.cfg.vocab_size])
    if stats:
        decision_stats(b, logits)
        b.output("exit_stats", TensorProto.FLOAT, ["batch", 3])
    else:
        b.node("ArgMax", [logits], ["exit_token"], axis=-1, keepdims=0, select_last_index=0)
    b.output("exit_token", TensorProto.INT64, ["batch"])


def gate(b: Builder, layer: int, eh: str) -> None:
    """``exit_gate`` [B]: the exit's gate logit (:class:`edge.model.exits.ExitGate`)."""
    g = b.model.heads[str(layer)].gate
    a = b.linear(eh, g.fc1, f"e{layer}.gate1")
    a = b.node("QuickGelu", [a], [f"e{layer}.gsilu"], domain=MS, alpha=1.0)[0]  # SiLU
    z = b.linear(a, g.fc2, f"e{layer}.gate2")  # [B, 1]
    b.node("Reshape", [z, b.const("c.flat", [-1])], ["exit_gate"])
    b.output("exit_gate", TensorProto.FLOAT, ["batch"])


def cosine(b: Builder, a: str, c: str) -> str:
    """Row cosine [B] of a, c [B, D]; 0 where either row is zero (calibration.signals._cosine)."""
    axis = b.const("c.axis_last", [-1])
    dot = b.node("ReduceSum", [b.node("Mul", [a, c], ["cs.ac"])[0], axis], ["cs.dot"], keepdims=0)[0]
    na = b.node("ReduceSum", [b.node("Mul", [a, a], ["cs.aa"])[0], axis], ["cs.na"], keepdims=0)[0]
    nc = b.node("ReduceSum", [b.node("Mul", [c, c], ["cs.cc"])[0], axis], ["cs.nc"], keepdims=0)[0]
    norms = b.node("Sqrt", [b.node("Mul", [na, nc], ["cs.nn"])[0]], ["cs.norms"])[0]
    zero, one = b.weight("c.zero_f", np.zeros((), np.float32)), b.weight("c.one_f0", np.ones((), np.float32))
    ok = b.node("Greater", [norms, zero], ["cs.ok"])[0]
    safe = b.node("Where", [ok, norms, one], ["cs.safe"])[0]
    ratio = b.node("Div", [dot, safe], ["cs.ratio"])[0]
    clipped = b.node("Clip", [ratio, b.weight("c.m1", np.array(-1.0, np.float32)), one], ["cs.clip"])[0]
    return b.node("Where", [ok, clipped, zero], ["cs.cos"])[0]


def decision(b: Builder, eh: str) -> None:
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
    d = b.cfg.hidden_size
    w = b.input("rule_w", TensorProto.FLOAT, [6])
    bias = b.input("rule_b", TensorProto.FLOAT, [])
    has = b.input("has_prev", TensorProto.BOOL, [])
    prev_token = b.input("prev_token", TensorProto.INT64, ["batch"])
    prev_run = b.input("prev_run", TensorProto.FLOAT, ["batch"])
    prev_eh = b.input("prev_exit_hidden", TensorProto.FLOAT, ["batch", d])
    same = b.node("And", [b.node("Equal", ["exit_token", prev_token], ["dc.eq"])[0], has], ["dc.same"])[0]
    agree = b.node("Cast", [same], ["dc.agree"], to=TensorProto.FLOAT)[0]
    one = b.weight("c.one_f0", np.ones((), np.float32))
    run = b.node("Mul", [agree, b.node("Add", [prev_run, one], ["dc.run1"])[0]], ["exit_run"])[0]  # [B]
    runm = b.node("Div", [run, b.weight("c.m_exits", np.array(len(b.model.exit_layers), np.float32))],
                  ["dc.runm"])[0]
    cos = b.node("Where", [has, cosine(b, eh, prev_eh), b.weight("c.zero_f", np.zeros((), np.float32))],
                 ["dc.cos"])[0]
    feats = b.node("Concat", ["exit_stats", _col(b, agree, "agree1"), _col(b, runm, "runm1"),
                              _col(b, cos, "cos1")], ["exit_features"], axis=1)[0]
    b.output("exit_run", TensorProto.FLOAT, ["batch"])
    _score(b, feats, w, bias, 6)


def decision_gated(b: Builder, eh: str, first_decision: bool) -> None:
    """The same from the gates, in a gated decision segment (no LM head needed): features [B, 3], the
    columns of ``calibration.signals.GATED_SIGNAL_NAMES`` as ``gated_signals`` computes them: the
    gate probability, the previous decision exit's and the cosine with its hidden (zeros at the
    first decision exit). Inputs ``rule_w`` [3], ``rule_b`` []; later decision exits also take
    ``prev_gate`` [B] and ``prev_exit_hidden`` [B, D]."""
    d = b.cfg.hidden_size
    w = b.input("rule_w", TensorProto.FLOAT, [3])
    bias = b.input("rule_b", TensorProto.FLOAT, [])
    g = b.node("Sigmoid", ["exit_gate"], ["dc.g"])[0]
    if first_decision:
        feats = b.node("Pad", [_col(b, g, "g1"), b.const("c.pad2", [0, 0, 0, 2])], ["exit_features"])[0]
    else:
        pg = b.node("Sigmoid", [b.input("prev_gate", TensorProto.FLOAT, ["batch"])], ["dc.pg"])[0]
        cos = cosine(b, eh, b.input("prev_exit_hidden", TensorProto.FLOAT, ["batch", d]))
        feats = b.node("Concat", [_col(b, g, "g1"), _col(b, pg, "pg1"), _col(b, cos, "cos1")],
                       ["exit_features"], axis=1)[0]
    _score(b, feats, w, bias, 3)


def decision_shortlist(b: Builder, eh: str) -> None:
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

    model = b.model
    f = num_features(b.cfg.hidden_size)
    if model.shortlist_act_scale() is None:  # a float head (or float activations): its rows, float32
        rows = model.shortlist_rows()  # [K, D]
        z = b.node("MatMul", [eh, b.weight("sl.rows_t", rows.T.contiguous())], ["sl.z"])[0]  # [B, K]
    else:  # a W8A8 head's own integer product over its shortlist rows, as the head scores those tokens
        # (int8 rows, a quarter of the float rows' bytes; no change in time measurable on a CPU: docs/runtime.md)
        z = b.linear(eh, output_rows(model.backbone.head_q, model.shortlist), "sl")
    vals, idx = b.node("TopK", [z, b.const("c.k2", [2])], ["exit_logits", "sl.idx"], axis=-1, largest=1,
                       sorted=1)
    tokens = b.node("Gather", [b.weight("sl.ids", model.shortlist.numpy().astype(np.int64)), idx],
                    ["exit_tokens"], axis=0)[0]  # [B, 2]
    ltok = b.input("lookup_token", TensorProto.INT64, ["batch", 1])
    llen = b.input("lookup_len", TensorProto.FLOAT, ["batch", 1])
    ptok = b.input("prev_tokens", TensorProto.INT64, ["batch", 2])
    plog = b.input("prev_logits", TensorProto.FLOAT, ["batch", 2])
    la = b.node("Cast", [b.node("Equal", [tokens, ltok], ["sl.leq"])[0]], ["sl.la"], to=TensorProto.FLOAT)[0]
    agree = b.node("Cast", [b.node("Equal", [tokens, ptok], ["sl.peq"])[0]], ["sl.agree"],
                   to=TensorProto.FLOAT)[0]
    feats = b.node("Concat", [vals, la, llen, agree, plog, eh], ["exit_features"], axis=1)[0]  # [B, F]
    w1 = b.input("rule_w1", TensorProto.FLOAT, [f, "hidden"])
    b1 = b.input("rule_b1", TensorProto.FLOAT, ["hidden"])
    w2 = b.input("rule_w2", TensorProto.FLOAT, ["hidden", 1])
    b2 = b.input("rule_b2", TensorProto.FLOAT, [1])
    h = b.node("Relu", [b.node("Gemm", [feats, w1, b1], ["sl.h0"])[0]], ["sl.h"])[0]
    b.node("Gemm", [h, w2, b2], ["exit_score"])
    b.output("exit_tokens", TensorProto.INT64, ["batch", 2])
    b.output("exit_logits", TensorProto.FLOAT, ["batch", 2])
    b.output("exit_features", TensorProto.FLOAT, ["batch", f])
    b.output("exit_score", TensorProto.FLOAT, ["batch", 1])


def _col(b: Builder, x: str, name: str) -> str:
    """[B] -> [B, 1]."""
    return b.node("Unsqueeze", [x, b.const("c.unsq1", [1])], [f"dc.{name}"])[0]


def _score(b: Builder, feats: str, w: str, bias: str, f: int) -> None:
    b.node("Add", [b.node("MatMul", [feats, w], ["dc.fw"])[0], bias], ["exit_score"])
    b.output("exit_features", TensorProto.FLOAT, ["batch", f])
    b.output("exit_score", TensorProto.FLOAT, ["batch"])


def decision_stats(b: Builder, logits: str) -> None:
    """exit_stats [B, 3] (top-1 probability, top-1 minus top-2, entropy) and exit_token [B]:
    :func:`edge.model.exits.exit_decision_stats` (same formulas), from one TopK and one exp pass."""
    k2 = b.const("c.k2", [2])
    axis = b.const("c.axis_last", [-1])
    vals, idx = b.node("TopK", [logits, k2], ["st.top", "st.idx"], axis=-1, largest=1, sorted=1)
    m, z2 = b.node("Split", [vals, b.const("c.split11", [1, 1])], ["st.m", "st.z2"], axis=-1)
    d = b.node("Sub", [logits, m], ["st.d"])[0]
    e = b.node("Exp", [d], ["st.e"])[0]
    total = b.node("ReduceSum", [e, axis], ["st.sum"], keepdims=1)[0]
    ed = b.node("ReduceSum", [b.node("Mul", [e, d], ["st.ed"])[0], axis], ["st.sed"], keepdims=1)[0]
    top1 = b.node("Reciprocal", [total], ["st.top1"])[0]
    e2 = b.node("Exp", [b.node("Sub", [z2, m], ["st.dz2"])[0]], ["st.e2"])[0]
    fone = b.weight("c.one_f", np.ones(1, np.float32))
    margin = b.node("Mul", [b.node("Sub", [fone, e2], ["st.1me2"])[0], top1], ["st.margin"])[0]
    ent = b.node("Sub", [b.node("Log", [total], ["st.logs"])[0],
                         b.node("Mul", [ed, top1], ["st.edn"])[0]], ["st.ent0"])[0]
    ent = b.node("Relu", [ent], ["st.ent"])[0]  # rounding can dip below 0
    b.node("Concat", [top1, margin, ent], ["exit_stats"], axis=-1)
    b.node("Gather", [idx, b.const("c.zero_s", 0)], ["exit_token"], axis=-1)
