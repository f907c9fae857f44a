"""Putting :class:`QuantLinear` into a model, observing activations, calibrating their ranges.

A decoder layer has four groups of linears that read one input each (q/k/v read the attention norm's
output, gate/up the MLP norm's): a group shares one activation scale, because the exported graphs
quantize that input once (one Q/DQ pair before the packed QKV MatMul, and before gate and up).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from edge.compress.quant import Observer, Precision, QuantLinear, QuantSpec, fake_quant_act, observer_scale
from edge.model.decoder import Decoder
from edge.model.exits import MultiExitModel

GROUPS = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",),
          ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",))
LINEARS = tuple(name for group in GROUPS for name in group)


def _get(layer: nn.Module, dotted: str) -> nn.Module:
    mod = layer
    for part in dotted.split("."):
        mod = getattr(mod, part)
    return mod


def _set(layer: nn.Module, dotted: str, new: nn.Module) -> None:
    parent, _, leaf = dotted.rpartition(".")
    setattr(_get(layer, parent) if parent else layer, leaf, new)


def decoder_layers(model: MultiExitModel | Decoder) -> nn.ModuleList:
    return model.backbone.layers if isinstance(model, MultiExitModel) else model.layers


def layer_linears(model: MultiExitModel | Decoder, j: int) -> dict[str, nn.Linear]:
    layer = decoder_layers(model)[j]
    return {name: _get(layer, name) for name in LINEARS}


def quantize_layers(model: MultiExitModel | Decoder, specs: dict[int, QuantSpec]) -> MultiExitModel | Decoder:
    """Replace the linears of each 0-based layer in ``specs`` by :class:`QuantLinear` (in place)."""
    for j, spec in specs.items():
        layer = decoder_layers(model)[j]
        for name, lin in layer_linears(model, j).items():
            if isinstance(lin, QuantLinear):
                lin = nn.Linear(lin.in_features, lin.out_features, bias=lin.bias is not None)  # re-spec
                lin.load_state_dict({k: v for k, v in _get(layer, name).state_dict().items()
                                     if k in ("weight", "bias")})
            _set(layer, name, QuantLinear.from_linear(lin, spec))
    return model


def quantize_head(model: MultiExitModel | Decoder, spec: QuantSpec) -> None:
    """Give the decoder a quantized copy of its LM head (``Decoder.head_q``; with tied embeddings the
    embedding itself stays float for the lookup)."""
    dec = model.backbone if isinstance(model, MultiExitModel) else model
    w = dec.head_weight
    lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    dec.head_q = QuantLinear.from_linear(lin, spec)


def quant_linears(model: nn.Module) -> Iterable[tuple[str, QuantLinear]]:
    return ((n, m) for n, m in model.named_modules() if isinstance(m, QuantLinear))


def precision_of(model: nn.Module) -> str:
    """The model's precision as its quantized linears name it: ``fp32`` when none is quantized, else their
    kinds joined (``w8a8``, ``w4``, ``w4+w8a8``)."""
    kinds = {m.spec.precision.value for _, m in quant_linears(model)}
    return "fp32" if not kinds else "+".join(sorted(kinds))


def quantized_layers(model: MultiExitModel | Decoder) -> dict[int, QuantSpec]:
    """0-based layer -> spec of the layers whose linears are quantized."""
    return {j: lins["self_attn.q_proj"].spec for j in range(len(decoder_layers(model)))
            if isinstance((lins := layer_linears(model, j))["self_attn.q_proj"], QuantLinear)}


@torch.no_grad()
def observe(model: MultiExitModel, batches: Iterable[torch.Tensor]) -> None:
    """Run ``batches`` of ids [B, T] through the decoder with every QuantLinear recording its input
    (activations unquantized while observing, so each layer sees the ranges of the float model)."""
    qls = [m for _, m in quant_linears(model)]
    saved = [m.act_scale.clone() for m in qls]
    for m in qls:
        m.observing, m.obs_amax, m.obs_rows = True, 0.0, []
        m.act_scale.zero_()
    try:
        for ids in batches:
            model(ids)  # every exit's logits: the head's input is each exit's hidden state
    finally:
        for m, s in zip(qls, saved):
            m.observing = False
            m.act_scale.copy_(s)


@dataclass
class RangeChoice:
    layer: int
    group: str
    observer: str  # the observer picked (by measured output error)
    scale: float
    errors: dict[str, float]  # observer -> relative output error of the group


@torch.no_grad()
def calibrate_activations(model: MultiExitModel, observer: Observer | None = None) -> list[RangeChoice]:
    """Set each W8A8 group's activation scale from what :func:`observe` recorded. ``observer`` None:
    try min/max, percentile and MSE and keep, per group, the one whose quantized outputs are closest to
    the float outputs (relative squared error over the sampled rows); else use ``observer``."""
    choices = []
    head = model.backbone.head_q
    if isinstance(head, QuantLinear) and head.spec.precision is Precision.W8A8:
        choices.append(_calibrate_group(-1, "lm_head", [head], observer))
    for j, spec in quantized_layers(model).items():
        if spec.precision is not Precision.W8A8:
            continue
        lins = layer_linears(model, j)
        for group in GROUPS:
            choices.append(_calibrate_group(j, "+".join(n.split(".")[-1] for n in group), [lins[n] for n in group],
                                            observer))
    return choices


def _calibrate_group(layer: int, name: str, members: list[QuantLinear], observer: Observer | None) -> RangeChoice:
    rows = torch.cat(members[0].obs_rows) if members[0].obs_rows else torch.zeros(0, members[0].in_features)
    amax = members[0].obs_amax
    errors = {}
    for kind in ([observer] if observer is not None else list(Observer)):
        xq = fake_quant_act(rows, torch.tensor(observer_scale(rows, amax, kind)))
        num = sum(float((F.linear(xq, m.quantized_weight(), m.bias) - F.linear(rows, m.weight, m.bias)).pow(2).sum())
                  for m in members)
        den = sum(float(F.linear(rows, m.weight, m.bias).pow(2).sum()) for m in members)
        errors[kind.value] = num / max(den, 1e-30)
    best = min(errors, key=errors.get)
    scale = observer_scale(rows, amax, Observer(best))
    for m in members:
        m.act_scale.fill_(scale)
        m.obs_rows = []
    return RangeChoice(layer, name, best, scale, errors)


def model_bytes(model: MultiExitModel) -> int:
    """Bytes of the weights as stored for serving: INT8 codes + a float scale per output channel (W8A8),
    INT4 codes (half a byte) + a float scale per block (W4), float32 for everything else (a tied LM
    head counted once). Buffers (activation scales) add a few bytes per layer and are ignored."""
    total = 0
    quantized = set()
    for _, m in quant_linears(model):
        n, k = m.weight.shape
        quantized.add(id(m.weight))
        if m.spec.precision is Precision.W4:
            total += n * k // 2 + 4 * m.w4_scale.numel()
        else:
            total += n * k + 4 * n
        if m.bias is not None:
            quantized.add(id(m.bias))
            total += 4 * m.bias.numel()
    seen = set()
    for p in model.parameters():
        if id(p) not in quantized and id(p) not in seen:
            seen.add(id(p))
            total += 4 * p.numel()
    return total
