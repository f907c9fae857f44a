"""Parity gate for the fused ONNX Runtime graphs (:mod:`exporters.ort_fused`): the engine's ONNX Runtime backend
against its torch backend, making the calls the engine makes (prefill, batched decode on consecutive and scattered
slots, K/V fills) on caches of their own, every output and cache compared relative to its scale. The portable
graphs' gate, the report and the near-tie judgments both gates share are :mod:`exporters.parity`.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from edge.core.errors import ConfigError
from edge.model.exits import MultiExitModel
from exporters.parity import DECODE_STEPS, NEAR_TIE, TOKEN_FEATURES, ParityReport, candidate_ties, near_ties

# fp32, two kernels for the same math (ONNX Runtime's fused operators vs torch): the rounding of a
# dot product of length n grows like eps32 * sqrt(n) relative to its scale (eps32 = 1.2e-7); over a
# vocabulary-sized LM head (n up to 4096-128k) and a dozen layers of residual updates that is
# about 1e-5 of the output's scale. 1e-4 leaves an order of magnitude; argmax must agree exactly.
FUSED_RTOL = 1e-4


def check_fused_parity(model: MultiExitModel, graphs_dir: str | Path, prompts: list[list[int]],
                       rtol: float = FUSED_RTOL, decode_steps: int = DECODE_STEPS,
                       allow_near_ties: bool = False) -> ParityReport:
    """Compare the fused ONNX Runtime graphs with ``model`` in torch, through the engine's backends.

    Both backends run the same calls on caches of their own: each prompt's prefill (B = 1, T = len),
    then ``decode_steps`` batched one-row steps over all prompts (per-row cache lengths), once on
    consecutive slots (the in-place path) and once over every other slot (the gathered path), and a
    K/V fill of every later segment. Every segment gets the torch backend's input, so a difference is
    that graph's own. An output passes when max |ort - torch| <= rtol * max |torch| (relative to the
    output's scale: FUSED_RTOL says why), and every exit argmax agrees (``allow_near_ties``: or differs
    at a near tie, :func:`near_ties`; quantized graphs).
    """
    from edge.runtime.backend import make_backend
    from edge.runtime.torch_backend import TorchBackend
    from edge.runtime.cache import KVCache

    if not prompts or any(len(p) == 0 for p in prompts):
        raise ConfigError("check_fused_parity needs at least one prompt, each with at least one token")
    model = model.eval()
    ref = TorchBackend(model)
    got = make_backend("onnxruntime", graphs_dir=graphs_dir)
    cfg = model.backbone.cfg
    b = len(prompts)
    slots_total = 2 * b  # room for the scattered layout
    cap = max(map(len, prompts)) + decode_steps + 1
    caches = [KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, slots_total, cap) for _ in range(2)]
    ref.attach(caches[0])
    got.attach(caches[1])
    rng = np.random.default_rng(0)  # some exit rule: the features and score are part of the graphs
    forms = {k: (rng.standard_normal(ref.spec.num_features), 0.1) for k in ref.exit_layers[:-1]}
    ref.set_rule(forms)
    got.set_rule(forms)
    diff: dict[str, dict[str, float]] = {}
    failures: list[str] = []
    agree = total = ties = 0

    def compare(name: str, phase: str, o, r, form=None) -> None:
        nonlocal agree, total, ties
        # a candidate check whose candidates differ at a near tie: its token-derived features, its decision and its
        # token follow the kernels' order of the tied candidates (judged on the candidates' logits instead)
        ctie = None
        if allow_near_ties and getattr(r, "cand_tokens", None) is not None and getattr(o, "cand_tokens", None) is not None:
            ctie = candidate_ties(r.cand_tokens, r.cand_logits, o.cand_tokens, o.cand_logits)
            ties += int(ctie.sum())
        for field_name in ("hidden", "exit_hidden", "logits", "stats", "gate", "features", "score", "run"):
            a, e = getattr(o, field_name, None), getattr(r, field_name, None)
            if e is None or (a is None and field_name == "stats" and not got.head_stats):
                continue  # a head graph without statistics (nobody reads them: ort_fused.head_has_stats)
            if field_name == "features" and ctie is not None and ctie.any():
                a = a.copy()
                a[np.ix_(ctie, TOKEN_FEATURES)] = e[np.ix_(ctie, TOKEN_FEATURES)]
            d = float(np.abs(a - e).max())
            diff.setdefault(name, {})[field_name] = max(d, diff.get(name, {}).get(field_name, 0.0))
            if allow_near_ties and field_name == "score":
                # the exit rule's score is a difference of terms near its threshold (0), so its own scale says
                # nothing about the terms': what must agree is the decision, except at a near tie
                flip = (a >= 0) != (e >= 0)
                near = np.abs(e) <= NEAR_TIE * (float(np.abs(e).max()) or 1.0)
                if ctie is not None:
                    flip = flip & ~ctie.reshape(flip.shape)  # a candidates' near tie: counted above
                ties += int((flip & near).sum())
                if (flip & ~near).any():
                    failures.append(f"{name}/score ({phase}): the exit decision differs at "
                                    f"{int((flip & ~near).sum())} rows beyond a near tie")
                continue
            scale = float(np.abs(e).max()) or 1.0
            if field_name == "score" and form is not None and r.features is not None:
                # a dot product's rounding grows with its terms, not with its sum: over a check's 9 + D
                # features the terms cancel to a score far smaller than themselves, so the terms' size is the scale
                w, b0 = form
                scale = max(scale, float((np.abs(r.features) @ np.abs(np.asarray(w, np.float64))).max() + abs(b0)))
            if not d <= rtol * scale:
                failures.append(f"{name}/{field_name} ({phase}): max abs diff {d:.3g} > {rtol:g} x scale {scale:.3g}")
        if r.token is None:
            return
        same = o.token == r.token
        if allow_near_ties and not same.all() and getattr(r, "logits", None) is not None:
            tie = ~same & near_ties(r.logits, o.logits)
            ties += int(tie.sum())
            same = same | tie
        if ctie is not None:
            same = same | ctie  # counted above
        agree += int(same.sum())
        total += same.size
        if not same.all():
            failures.append(f"{name}/exit_token ({phase}): argmax differs at {int((~same).sum())} of {same.size}")

    def run_all(x, slots, start, phase):
        prev = None
        for i in range(len(ref.segments)):
            r = ref.segment(i, x, slots, start, prev)
            o = got.segment(i, x, slots, start, prev)
            prev = r
            compare(f"segment_{i}", phase, o, r, forms.get(ref.exit_layers[i]))  # with its exit's head, gates aside
            if r.gate is not None:  # a gated exit: the head graph on its own, on the same rows
                compare("head", f"{phase}, exit {i}", got.head(i, r.exit_hidden), ref.head(i, r.exit_hidden))
            if i + 1 < len(ref.segments):
                h = r.hidden[:, -1]
                ref.kvfill(i + 1, h, slots, start + x.shape[1] - 1)
                got.kvfill(i + 1, h, slots, start + x.shape[1] - 1)
            x = r.hidden
        return r

    for layout, slots in (("consecutive", np.arange(b)), ("scattered", np.arange(b) * 2)):
        nexts = []
        for n, prompt in enumerate(prompts):
            r = run_all(np.array([prompt], np.int64), slots[n:n + 1], np.array([0]), f"prefill {n}, {layout}")
            nexts.append(int(r.token[0]))
        start = np.array([len(p) for p in prompts])
        ids = np.array(nexts, np.int64)[:, None]
        for s in range(decode_steps):
            r = run_all(ids, slots, start, f"decode step {s}, {layout}")
            ids, start = r.token[:, None].astype(np.int64), start + 1
        for j in range(cfg.num_layers):  # every cached row both backends wrote, incl. the K/V fills
            for kind, a, e in (("key", caches[1].keys[j], caches[0].keys[j]),
                               ("value", caches[1].values[j], caches[0].values[j])):
                d = float(np.abs(a[slots] - e[slots]).max())
                diff.setdefault("cache", {})[f"{kind}_{j}"] = d
                scale = float(np.abs(e[slots]).max()) or 1.0
                if not d <= rtol * scale:
                    failures.append(f"cache/{kind}_{j} ({layout}): max abs diff {d:.3g} > {rtol:g} x scale {scale:.3g}")
    agreement = agree / total if total else 0.0
    return ParityReport(not failures and agreement == 1.0, diff, agreement, failures, 0.0, rtol, ties)
