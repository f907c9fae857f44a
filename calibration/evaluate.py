"""Evaluating an exit rule on held-out data: teacher-forced and free-running.

Definitions (issue 3): a *false exit* is a generated token whose early-exit
prediction differs from the full model's greedy prediction on the same prefix;
*accuracy* is top-1 next-token accuracy against the real text; *accuracy loss*
is (acc_full - acc_exit) / acc_full.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from calibration.collect import Collected
from calibration.risk import cascade
from edge.exits import MultiExitModel
from edge.engine.backend import TorchBackend
from edge.engine.engine import KVMode, generate_batch


@dataclass
class EvalResult:
    false_exit_rate: float
    accuracy_full: float
    accuracy_exit: float
    accuracy_loss_rel: float
    layers_skipped_frac: float
    exit_fraction: dict[str, float]  # exit layer -> fraction of tokens


def evaluate_cascade(data: Collected, probs: dict[int, np.ndarray], lam: float) -> EvalResult:
    """Teacher-forced: each token exits at the first exit with prob >= lam (probs: decision exits -> [N])."""
    exit_at = cascade(probs, lam, data.final)  # [N]
    emitted = np.empty(data.n, dtype=np.int64)
    for k in data.exit_layers:
        sel = exit_at == k
        emitted[sel] = data.argmax[k][sel]
    full = data.argmax[data.final]
    acc_full = float((full == data.next_token).mean())
    acc_exit = float((emitted == data.next_token).mean())
    return EvalResult(
        false_exit_rate=float((emitted != full).mean()),
        accuracy_full=acc_full,
        accuracy_exit=acc_exit,
        accuracy_loss_rel=(acc_full - acc_exit) / acc_full if acc_full > 0 else 0.0,
        layers_skipped_frac=float(((data.final - exit_at) / data.final).mean()),
        exit_fraction={str(k): float((exit_at == k).mean()) for k in data.exit_layers},
    )


@dataclass
class FreeRunResult:
    prompts: int
    tokens: int  # decoded tokens judged (the first token of each prompt comes from full-depth prefill)
    false_exits: int  # exited early and differs from the full model on the same prefix
    full_depth_mismatches: int  # ran full depth yet differs (approximate K/V left by earlier exits)
    false_exit_rate: float  # (false_exits + full_depth_mismatches) / tokens
    exited_frac: float
    mean_exit_layer: float


@torch.no_grad()
def free_run(model: MultiExitModel, prompts: list[list[int]], max_new_tokens: int, rule,
             kv_mode: KVMode) -> FreeRunResult:
    """Greedy generation with early exits in the engine (torch backend, ``kv_mode`` for skipped layers);
    every decoded token is checked against the full model run on exactly the prefix generated."""
    tokens = false_exits = stale = exited = 0
    layer_sum = 0
    depth = model.num_layers
    for p, (gen, layers) in zip(prompts, generate_batch(TorchBackend(model), rule, prompts, max_new_tokens, kv_mode)):
        full_pred = model.backbone(torch.tensor([p + gen])).logits[0].argmax(-1)  # [T]: prediction for t+1
        for i in range(1, len(gen)):  # token 0 comes from the full-depth prefill
            ref = int(full_pred[len(p) + i - 1])
            tokens += 1
            layer_sum += layers[i]
            if layers[i] < depth:
                exited += 1
                false_exits += gen[i] != ref
            else:
                stale += gen[i] != ref
    return FreeRunResult(
        prompts=len(prompts), tokens=tokens, false_exits=false_exits, full_depth_mismatches=stale,
        false_exit_rate=(false_exits + stale) / max(1, tokens), exited_frac=exited / max(1, tokens),
        mean_exit_layer=layer_sum / max(1, tokens),
    )
