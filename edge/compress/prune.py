"""Progressive structured pruning of MLP neurons and query heads in the layers just before each exit.

The layers that feed a decision exit decide how much an early exit costs, so they are the ones made
smaller. Each step measures importance on calibration windows, physically removes that step's share
(the ``nn.Linear`` matrices get smaller) and recovers with a short distillation from the unpruned
teacher (KL of every exit to the teacher's same exit; only the pruned layers train). Gradual pruning
with recovery in between follows Zhu & Gupta 2017; structured LLM pruning with short recovery follows
LLM-Pruner (Ma et al. 2023).

This module holds the plan (which layers, how many units each step) and the loop; the importance of
a unit (magnitude or first-order Taylor) is in :mod:`edge.compress.prune_importance`, the removal and
the shapes of a pruned model in :mod:`edge.compress.prune_surgery`, the distillation in
:mod:`edge.compress.prune_recovery`, the settings in :mod:`edge.compress.prune_config`.

Only query heads are removed, the same number in every KV group, so K/V (and the KV cache) keep
their shape and GQA stays uniform (the runtime's GroupQueryAttention op still applies).
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from edge.compress.prune_config import PruneConfig
from edge.compress.prune_importance import keep_heads_per_group, keep_top, measure_importance
from edge.compress.prune_recovery import recover
from edge.compress.prune_surgery import layer_shapes, prune_heads, prune_mlp
from edge.core.errors import ConfigError
from edge.model.exits import MultiExitModel


@dataclass
class LayerPrune:
    """One pruned layer (0-based), before and after."""

    layer: int
    neurons_before: int
    neurons_after: int
    heads_before: int
    heads_after: int
    params_before: int
    params_after: int


@dataclass
class PruneResult:
    importance: str
    layers: list[LayerPrune]
    params_before: int  # whole model (backbone + exit heads)
    params_after: int
    step_losses: list[list[float]]  # per pruning step, the loss of each recovery step
    shapes: dict[int, dict[str, int]]  # :func:`layer_shapes` of the pruned model
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (layer keys of ``shapes`` as strings)."""
        return {**asdict(self), "shapes": {str(k): v for k, v in self.shapes.items()}}


# ---- the plan: pure helpers ---------------------------------------------------------------------
def pruned_layers(exit_layers: list[int], layers_before_exit: int) -> list[int]:
    """0-based layers just before every decision exit (all exits but the last), clipped at layer 0."""
    out = {k - 1 - j for k in exit_layers[:-1] for j in range(layers_before_exit) if k - 1 - j >= 0}
    return sorted(out)


def schedule(total: int, steps: int) -> list[int]:
    """Units removed at each of ``steps`` steps: as equal as integers allow, summing to ``total``."""
    return [round(total * s / steps) - round(total * (s - 1) / steps) for s in range(1, steps + 1)]


def num_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


# ---- the progressive loop -----------------------------------------------------------------------
def _check_fits(cfg: PruneConfig, model: MultiExitModel, layers: list[int], length: int) -> None:
    if not layers:
        raise ConfigError(f"prune: the model has no decision exit before its last layer (exits {model.exit_layers})")
    if length < cfg.seq_len:
        raise ConfigError(f"prune.seq_len is {cfg.seq_len} but the calibration windows hold {length} tokens")
    for i in layers:
        attn, mlp = model.backbone.layers[i].self_attn, model.backbone.layers[i].mlp
        rep = attn.num_heads // attn.num_kv_heads
        if cfg.heads_per_group >= rep:
            raise ConfigError(f"prune.heads_per_group = {cfg.heads_per_group} would leave no query head in a KV "
                              f"group of layer {i} ({rep} query heads per KV head)")
        if round(cfg.mlp_fraction * mlp.down_proj.in_features) >= mlp.down_proj.in_features:
            raise ConfigError(f"prune.mlp_fraction = {cfg.mlp_fraction} would remove every neuron of layer {i}")


def prune_near_exits(model: MultiExitModel, teacher: MultiExitModel, windows_ids: Any,
                     cfg: PruneConfig) -> PruneResult:
    """Prune ``model`` in place near its decision exits (module docstring), distilling from ``teacher``
    (unpruned, left unchanged) on token windows ``windows_ids`` [N, L >= cfg.seq_len] (tensor or array).
    Modes and requires_grad flags of both models are restored. Returns sizes and parameter counts
    before / after, recovery losses, and the shapes to store with the weights.

    Raises:
        ConfigError: no decision exit, windows shorter than seq_len, or a removal that empties a layer.
    """
    start = time.perf_counter()
    dec = model.backbone
    layers = pruned_layers(model.exit_layers, cfg.layers_before_exit)
    device = dec.embed_tokens.weight.device
    ids_all = torch.as_tensor(windows_ids, dtype=torch.long, device=device)
    if ids_all.ndim != 2 or ids_all.shape[0] == 0:
        raise ConfigError(f"prune: calibration windows must be [N, L] with N >= 1, got shape {tuple(ids_all.shape)}")
    _check_fits(cfg, model, layers, ids_all.shape[1])
    ids_all = ids_all[:, :cfg.seq_len]
    gen = torch.Generator().manual_seed(cfg.seed)

    def draw() -> torch.Tensor:
        return ids_all[torch.randint(0, ids_all.shape[0], (cfg.batch_size,), generator=gen).to(device)]

    before = {i: (dec.layers[i].mlp.down_proj.in_features, dec.layers[i].self_attn.num_heads,
                  num_params(dec.layers[i])) for i in layers}
    params_before = num_params(model)
    neuron_plan = {i: schedule(round(cfg.mlp_fraction * before[i][0]), cfg.steps) for i in layers}
    head_plan = schedule(cfg.heads_per_group, cfg.steps)
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    modes = (model.training, teacher.training)
    step_losses: list[list[float]] = []
    try:
        model.train()  # no dropout in the decoder; train mode selects the fused causal attention
        teacher.train()
        for p in model.parameters():
            p.requires_grad_(False)
        for step in range(cfg.steps):
            scores = measure_importance(model, layers, [draw() for _ in range(cfg.calib_batches)], cfg.importance)
            for i in layers:
                layer = dec.layers[i]
                n_keep = layer.mlp.down_proj.in_features - neuron_plan[i][step]
                if n_keep < layer.mlp.down_proj.in_features:
                    prune_mlp(layer.mlp, keep_top(scores[i].neurons, n_keep))
                if head_plan[step]:
                    prune_heads(layer.self_attn, keep_heads_per_group(
                        scores[i].heads, layer.self_attn.num_kv_heads, head_plan[step]))
                layer.requires_grad_(True)  # new modules: make sure every parameter of the layer trains
            step_losses.append(recover(model, teacher, layers, draw, cfg))
    finally:
        model.zero_grad(set_to_none=True)  # the recovery's gradients are of no use to the caller
        model.train(modes[0])
        teacher.train(modes[1])
        for n, p in model.named_parameters():
            p.requires_grad_(flags.get(n, True))
    rows = [LayerPrune(i, before[i][0], dec.layers[i].mlp.down_proj.in_features, before[i][1],
                       dec.layers[i].self_attn.num_heads, before[i][2], num_params(dec.layers[i])) for i in layers]
    return PruneResult(cfg.importance.value, rows, params_before, num_params(model), step_losses,
                       layer_shapes(model), time.perf_counter() - start)
