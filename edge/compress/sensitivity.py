"""Per-layer sensitivity: quantize one decoder layer at a time and measure how far each exit moves.

Every layer's linears are quantized at once, their activation ranges observed on the float model,
then only layer j is switched on (the others compute in float) and the model is scored against the
float reference (:mod:`edge.compress.quality`): KL divergence of the last exit and of each decision
exit, and the loss of exit agreement. Layers are ranked by the KL summed over the exits; the layers
whose output an exit reads, and the most sensitive others, are *critical* (quantization-aware
training); the rest are quantized after training.
"""
from __future__ import annotations

import copy
from dataclasses import asdict, dataclass

import torch

from edge.compress.apply import calibrate_activations, layer_linears, observe, quantize_layers
from edge.compress.quality import Reference, evaluate
from edge.compress.quant import Observer, QuantSpec
from edge.model.exits import MultiExitModel


@dataclass
class LayerSensitivity:
    layer: int  # 0-based
    kl: dict[int, float]  # exit -> KL(reference || this) per token with only this layer quantized
    agreement_drop: dict[int, float]  # exit -> reference agreement minus this agreement (decision exits)
    score: float  # KL summed over the exits

    def to_dict(self) -> dict:
        d = asdict(self)
        d["kl"] = {str(k): v for k, v in self.kl.items()}
        d["agreement_drop"] = {str(k): v for k, v in self.agreement_drop.items()}
        return d


@dataclass
class Sensitivity:
    layers: list[LayerSensitivity]
    ranking: list[int]  # 0-based layers, most sensitive first
    feeds_exit: list[int]  # the layers whose output a decision exit reads
    critical: list[int]  # feeds_exit + the most sensitive others

    def weights(self) -> dict[int, float]:
        """Per-layer weight in [0, 1]: score / the largest score (the sparse regularizer's lambdas)."""
        top = max((s.score for s in self.layers), default=0.0) or 1.0
        return {s.layer: s.score / top for s in self.layers}

    def to_dict(self) -> dict:
        return {"layers": [s.to_dict() for s in self.layers], "ranking": self.ranking,
                "feeds_exit": self.feeds_exit, "critical": self.critical}


def feeding_layers(model: MultiExitModel) -> list[int]:
    """0-based layers whose output a decision exit reads (exit k reads layer k - 1's output)."""
    return [k - 1 for k in model.exit_layers[:-1]]


@torch.no_grad()
def analyse(model: MultiExitModel, ref: Reference, calib: list[torch.Tensor], spec: QuantSpec,
            extra_critical: int) -> Sensitivity:
    """Rank ``model``'s layers by their sensitivity to ``spec`` (activation ranges by min/max on
    ``calib`` batches of ids [B, T]); ``extra_critical`` most sensitive layers join the exit feeders."""
    q = quantize_layers(copy.deepcopy(model), {j: spec for j in range(model.num_layers)})
    observe(q, calib)
    calibrate_activations(q, Observer.MINMAX)
    base = evaluate(model, ref).exit_agreement
    out = []
    for j in range(model.num_layers):
        for other in range(model.num_layers):
            for lin in layer_linears(q, other).values():
                lin.enabled = other == j
        r = evaluate(q, ref)
        out.append(LayerSensitivity(j, dict(r.kl_vs_reference),
                                    {k: base[k] - r.exit_agreement[k] for k in model.exit_layers[:-1]},
                                    float(sum(r.kl_vs_reference.values()))))
    ranking = [s.layer for s in sorted(out, key=lambda s: -s.score)]
    feeds = feeding_layers(model)
    critical = sorted(set(feeds) | set([j for j in ranking if j not in feeds][:extra_critical]))
    return Sensitivity(out, ranking, feeds, critical)
