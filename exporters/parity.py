"""Parity gate for exported graphs: ONNX Runtime (CPU) against the torch model, graph by graph.

Each graph gets the inputs the torch model itself produced, so a difference is
that graph's own error, not one accumulated along the chain. Covered: a prefill
of every prompt alone (P = 0, T = len) and a batched decode of all prompts
together with a past of *different* lengths per row (padded cache slots hidden
by the mask), ``decode_steps`` tokens long. Also checked: every graph passes
``onnx.checker``, uses the recorded opset, and has no ``com.microsoft`` node
(TensorRT's ONNX parser supports the standard ONNX operator set only: onnx-tensorrt's
docs/operators.md). The fused graphs have a gate of their own, through the engine's backends
(:mod:`exporters.fused_parity`); the report and the near-tie judgments here serve both.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import torch

from edge.core.errors import ArtifactError, ConfigError
from edge.runtime.ortsession import session_options
from edge.model.candidates import CANDIDATE_SIGNAL_NAMES
from edge.model.exits import MultiExitModel, exit_decision_stats
from edge.model.decoder import attention_mask
from edge.runtime.graphs import load_graphs_json
from edge.model.segments import segment_layers

# fp32 on CPU: ORT and torch do the same math with different kernels and summation order;
# observed max abs diffs are ~1e-6 (hidden) to ~1e-5 (logits of a random model). atol 1e-4
# leaves an order of magnitude of headroom; rtol covers logits of large magnitude.
PARITY_ATOL = 1e-4
PARITY_RTOL = 1e-4
DECODE_STEPS = 3
# Quantized graphs (edge.compress): torch's fake quantization and ONNX Runtime's integer kernels agree
# on every code except where an activation lands within float rounding noise of a rounding boundary:
# there the two round to adjacent INT8 codes, and each such flip moves an output by one activation step
# (1/127 of the range, ~0.8%) times a weight. Measured on the bundled model: at most 1.5% of an
# output's scale. 5% of the scale (about six steps) leaves room without hiding a wrong scale or a
# mis-packed weight (those move outputs by tens of %). An exit argmax may then differ only at a near tie:
# where torch's logits of the two tokens are closer than NEAR_TIE of the row's largest |logit| (measured
# logit differences reach ~1% of it), and an exit decision only where |score| < NEAR_TIE of the scores'.
QUANT_RTOL = 5e-2
NEAR_TIE = 2e-2
CONTRIB_DOMAIN = "com.microsoft"


@dataclass
class ParityReport:
    """Outcome of :func:`check_parity`."""

    passed: bool
    max_abs_diff: dict[str, dict[str, float]]  # graph -> output -> max |ort - torch| over all runs
    argmax_agreement: float  # share of (exit, token) positions whose logits argmax agree; must be 1.0
    failures: list[str] = field(default_factory=list)
    atol: float = PARITY_ATOL
    rtol: float = PARITY_RTOL
    near_ties: int = 0  # argmax differences counted as agreeing: near ties within the measured difference

    def worst(self, n: int = 5) -> list[tuple[str, str, float]]:
        """The n largest (graph, output, diff), NaN first."""
        rows = [(g, o, d) for g, outs in self.max_abs_diff.items() for o, d in outs.items()]
        return sorted(rows, key=lambda r: -(math.inf if math.isnan(r[2]) else r[2]))[:n]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def require_parity(report: ParityReport) -> None:
    """Raise :class:`ArtifactError` with the numbers if ``report`` did not pass."""
    if report.passed:
        return
    worst = ", ".join(f"{g}/{o} {d:.3g}" for g, o, d in report.worst())
    more = len(report.failures) - 8
    raise ArtifactError(
        f"ONNX parity failed (atol {report.atol:g}, rtol {report.rtol:g}): argmax agreement "
        f"{report.argmax_agreement:.2%} (must be 100%); largest max abs diffs: {worst}; "
        f"failures: {'; '.join(report.failures[:8])}" + (f" (+{more} more)" if more > 0 else ""))


def near_ties(ref_logits: np.ndarray, got_logits: np.ndarray) -> np.ndarray:
    """[...] bool: rows where torch's logit of ONNX Runtime's argmax token is within NEAR_TIE of the row's
    largest |logit| of torch's maximum (a tolerance fixed in advance: a bound from the row's own measured
    difference would accept every disagreement, since two argmaxes differ only by that much)."""
    chosen = got_logits.argmax(-1)
    gap = ref_logits.max(-1) - np.take_along_axis(ref_logits, chosen[..., None], -1)[..., 0]
    return gap <= NEAR_TIE * np.abs(ref_logits).max(-1)


def candidate_ties(ref_tokens: np.ndarray, ref_logits: np.ndarray, got_tokens: np.ndarray, got_logits: np.ndarray
                   ) -> np.ndarray:
    """[B] bool: rows where a candidate check's two best candidates (tokens [B, 2], logits [B, 2]) differ between
    torch and ONNX Runtime only as a near tie can: at each position whose token differs, the logit ONNX Runtime
    gave its token is within NEAR_TIE of the row's largest |logit| of torch's at that position (the check outputs
    only its two best, so a tie of the second with the third is judged by the values; as :func:`near_ties`, the
    tolerance is fixed in advance). Rows whose candidates agree are False."""
    differ = got_tokens != ref_tokens
    close = np.abs(got_logits - ref_logits) <= NEAR_TIE * np.abs(ref_logits).max(-1, keepdims=True)
    return differ.any(-1) & (close | ~differ).all(-1)


# the check's features computed from its candidate tokens (edge.model.candidates): where two candidates nearly tie
# and the kernels order them differently, these flip between 0 and 1
TOKEN_FEATURES = tuple(CANDIDATE_SIGNAL_NAMES.index(n) for n in ("lookup_agree1", "lookup_agree2", "agree_prev1",
                                                                  "agree_prev2"))


class _Comparer:
    """Runs graphs in ORT on torch-made inputs and accumulates diffs, failures and argmax counts."""

    def __init__(self, graphs_dir: Path, meta: dict[str, Any], atol: float, rtol: float,
                 scale_rtol: float | None = None) -> None:
        so = session_options(ort)
        self.meta, self.atol, self.rtol, self.scale_rtol = meta, atol, rtol, scale_rtol
        self.ties = 0
        self.sessions = {name: ort.InferenceSession(str(graphs_dir / g["file"]), so, providers=["CPUExecutionProvider"])
                         for name, g in meta["graphs"].items()}
        self.diff: dict[str, dict[str, float]] = {}
        self.failed: dict[str, str] = {}  # first failure per graph/output
        self.agree = self.total = 0

    def run(self, name: str, phase: str, feeds: dict[str, torch.Tensor], refs: list[torch.Tensor]) -> None:
        outputs = self.meta["graphs"][name]["outputs"]
        got = self.sessions[name].run(outputs, {k: v.detach().contiguous().numpy() for k, v in feeds.items()})
        for out, o, r in zip(outputs, got, refs):
            r = r.detach().numpy()
            key = f"{name}/{out}"
            if o.shape != r.shape:
                self.failed.setdefault(key, f"{key} ({phase}): shape {o.shape} != torch {r.shape}")
                self.diff.setdefault(name, {})[out] = float("nan")
                continue
            d = float(np.abs(o - r).max()) if o.size else 0.0
            prev = self.diff.setdefault(name, {}).get(out, 0.0)
            self.diff[name][out] = d if (math.isnan(d) or d > prev) else prev
            if self.scale_rtol is not None:
                scale = float(np.abs(r).max()) if r.size else 0.0
                if not d <= self.scale_rtol * (scale or 1.0):
                    self.failed.setdefault(key, f"{key} ({phase}): max abs diff {d:.3g} > {self.scale_rtol:g} x "
                                                f"scale {scale:.3g}")
            elif not np.allclose(o, r, atol=self.atol, rtol=self.rtol):
                self.failed.setdefault(
                    key, f"{key} ({phase}): max abs diff {d:.3g} > atol {self.atol:g} + rtol {self.rtol:g}*|ref|")
            if out == "logits":
                same = o.argmax(-1) == r.argmax(-1)
                if self.scale_rtol is not None:
                    tie = ~same & near_ties(r, o)
                    self.ties += int(tie.sum())
                    same = same | tie
                self.agree += int(same.sum())
                self.total += same.size
                if not same.all():
                    self.failed.setdefault(
                        f"{key}#argmax", f"{key} ({phase}): argmax differs at {int((~same).sum())} of {same.size} tokens")


def _static_failures(graphs_dir: Path, meta: dict[str, Any]) -> list[str]:
    """Checker, opset and contrib-op failures of every graph listed in graphs.json."""
    failures = []
    for name, g in meta["graphs"].items():
        path = graphs_dir / g["file"]
        try:
            onnx.checker.check_model(str(path))
        except onnx.checker.ValidationError as exc:
            failures.append(f"{name}: onnx.checker failed: {str(exc).splitlines()[0]}")
        proto = onnx.load(str(path), load_external_data=False)
        opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), None)
        if opset != meta.get("opset"):
            failures.append(f"{name}: opset {opset} != graphs.json opset {meta.get('opset')}")
        nodes = list(proto.graph.node) + [n for f in proto.functions for n in f.node]
        contrib = sorted({n.op_type for n in nodes if n.domain == CONTRIB_DOMAIN})
        if contrib:
            failures.append(f"{name}: {CONTRIB_DOMAIN} contrib ops {contrib} (TensorRT rejects them)")
    return failures


def _pipeline(model: MultiExitModel, cmp: _Comparer, phase: str, ids: torch.Tensor, positions: torch.Tensor,
              past: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor) -> tuple[list, torch.Tensor]:
    """Torch forward through every graph, comparing ORT on the same inputs.

    Exit heads run on each sequence's last row (as the engine asks for its newest token); the one
    ``head`` graph runs on every exit's torch-made exit hidden.
    Returns (new per-layer (k, v) [B, KV, T, hd], final exit logits [B, 1, V])."""
    backbone = model.backbone
    exit_index = torch.full((ids.shape[0],), ids.shape[1] - 1, dtype=torch.long)
    cos, sin = backbone.rope(positions)
    h = backbone.embed(ids)  # [B, T, D]
    cmp.run("embed", phase, {"input_ids": ids}, [h])
    new_kv, logits = [], None
    seg_layers = segment_layers(model.exit_layers)
    for i, (layers, exit_layer) in enumerate(zip(seg_layers, model.exit_layers)):
        feeds = {"hidden": h, "positions": positions, "attn_mask": mask}
        if i > 0:  # kvfill of segments i..last from the raw hidden state at the previous exit
            refs = [x for seg in seg_layers[i:] for j in seg for x in backbone.layers[j].kv_only(h, cos, sin)]
            cmp.run(f"kvfill_{i}", phase, {"hidden": h, "positions": positions}, refs)
        presents = []
        for j in layers:
            pk, pv = past[j]
            feeds[f"past_key_{j}"], feeds[f"past_value_{j}"] = pk, pv
            h, k, v = backbone.layers[j](h, cos, sin, pk, pv, mask)
            presents += [k, v]
            new_kv.append((k, v))
        feeds["exit_index"] = exit_index
        rows = h[torch.arange(h.shape[0]), exit_index].unsqueeze(1)  # [B, 1, D]
        e = model.exit_hidden(exit_layer, rows)  # [B, 1, D]
        cmp.run(f"segment_{i}", phase, feeds, [h, e, *presents])
        logits = model.exit_logits(exit_layer, rows)  # [B, 1, V]
        cmp.run("head", f"{phase}, exit {exit_layer}", {"exit_hidden": e}, [logits, *exit_decision_stats(logits)])
    return new_kv, logits


def check_parity(model: MultiExitModel, graphs_dir: str | Path, prompts: list[list[int]],
                 atol: float = PARITY_ATOL, rtol: float = PARITY_RTOL,
                 decode_steps: int = DECODE_STEPS, scale_rtol: float | None = None) -> ParityReport:
    """Compare every exported graph in ONNX Runtime (CPU) with ``model`` in torch.

    Args:
        model: the model the graphs were exported from.
        graphs_dir: folder written by :func:`exporters.onnx_export.export_onnx`.
        prompts: token id lists (lengths may differ); each is prefilled alone, then all
            are decoded together for ``decode_steps`` greedy tokens with per-row past lengths.
        atol, rtol: elementwise tolerance (``np.allclose``) for every output.
        scale_rtol: instead, max |ort - torch| <= scale_rtol * max |torch| per output, and exit argmaxes
            may differ at near ties (quantized graphs: :data:`QUANT_RTOL`).

    Returns:
        A :class:`ParityReport`; ``passed`` needs every output within tolerance, 100% argmax
        agreement of exit logits, and every graph clean (checker, opset, no contrib ops).

    Raises:
        ConfigError: no prompts, or an empty one.
        ArtifactError: graphs.json missing or malformed.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ConfigError("check_parity needs at least one prompt, each with at least one token")
    graphs_dir = Path(graphs_dir)
    meta = load_graphs_json(graphs_dir)
    failures = _static_failures(graphs_dir, meta)
    if list(meta["exit_layers"]) != list(model.exit_layers):
        failures.append(f"graphs.json exit_layers {meta['exit_layers']} != model exit_layers {model.exit_layers}")
        return ParityReport(False, {}, 0.0, failures, atol, rtol)
    cmp = _Comparer(graphs_dir, meta, atol, rtol, scale_rtol)
    cfg = model.backbone.cfg
    window = cfg.sliding_window
    kvh, hd, nl = cfg.num_kv_heads, cfg.head_dim, cfg.num_layers
    model = model.eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        # (a) prefill each prompt alone: empty past (P = 0)
        caches, nexts = [], []
        for n, prompt in enumerate(prompts):
            ids = torch.tensor([prompt], dtype=torch.long)
            pos = torch.arange(len(prompt)).unsqueeze(0)  # [1, T]
            empty = [(torch.zeros(1, kvh, 0, hd), torch.zeros(1, kvh, 0, hd))] * nl
            kv, logits = _pipeline(model, cmp, f"prefill {n}", ids, pos, empty, attention_mask(pos, pos, window=window))
            caches.append(kv)
            nexts.append(int(logits[0, -1].argmax()))
        # (b) batched decode, T = 1: row r's cache holds len(prompt r) real slots, then padding
        # filled with noise the mask must hide.
        b, pmax = len(prompts), max(map(len, prompts))
        lens = torch.tensor([len(p) for p in prompts])
        past = []
        for j in range(nl):
            k = torch.randn(b, kvh, pmax, hd, generator=g) * 10
            v = torch.randn(b, kvh, pmax, hd, generator=g) * 10
            for r in range(b):
                k[r, :, : lens[r]], v[r, :, : lens[r]] = caches[r][j][0][0], caches[r][j][1][0]
            past.append((k, v))
        k_pos = torch.arange(pmax).unsqueeze(0).expand(b, pmax)  # [B, P]
        k_valid = k_pos < lens.unsqueeze(1)
        ids = torch.tensor(nexts).unsqueeze(1)  # [B, 1]
        for s in range(decode_steps):
            q_pos = (lens + s).unsqueeze(1)  # [B, 1]
            k_pos = torch.cat((k_pos, q_pos), dim=1)
            k_valid = torch.cat((k_valid, torch.ones(b, 1, dtype=torch.bool)), dim=1)
            mask = attention_mask(q_pos, k_pos, k_valid, window)  # [B, 1, 1, P + 1]
            kv, logits = _pipeline(model, cmp, f"decode step {s}", ids, q_pos, past, mask)
            past = [(torch.cat((pk, k), 2), torch.cat((pv, v), 2)) for (pk, pv), (k, v) in zip(past, kv)]
            ids = logits[:, -1].argmax(-1, keepdim=True)
    failures += list(cmp.failed.values())
    agreement = cmp.agree / cmp.total if cmp.total else 0.0
    if scale_rtol is not None:
        atol, rtol = 0.0, scale_rtol
    return ParityReport(not failures and agreement == 1.0, cmp.diff, agreement, failures, atol, rtol, cmp.ties)
