"""Training the exit gates (:class:`edge.model.exits.ExitGate`) of a multi-exit model.

A gate predicts, from an exit's normalised hidden state alone, whether that exit's argmax agrees
with the last layer's: CALM's learned early-exit classifier (Schuster et al. 2022, sec. 3.5), here
a small MLP per exit. The engine decides from gates and computes the vocabulary-sized LM head only
for the rows that exit. Gates train on the *train* split after the exit heads, with the decoder and
heads frozen (binary cross-entropy, Adam), so that the calibration split stays unseen: the
calibration stage fits calibrators on the gates' outputs and certifies the rule there.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from edge.model.exits import MultiExitModel
from edge.model.windows import teacher_forced


@torch.no_grad()
def gate_data(model: MultiExitModel, rows: np.ndarray) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Per decision exit, over every input position of ``rows`` [N, L] (token windows,
    :func:`edge.model.windows.stream_windows`): (normalised exit hidden [N * (L - 1), D], agrees with
    the last layer [N * (L - 1)] float)."""
    model.eval()
    xs: dict[int, list[torch.Tensor]] = {k: [] for k in model.exit_layers[:-1]}
    ys: dict[int, list[torch.Tensor]] = {k: [] for k in model.exit_layers[:-1]}
    for _, out in teacher_forced(model.backbone, rows, batch=1):
        top = out.logits.flatten(0, 1).argmax(-1)  # the last layer's prediction [B*T]
        for k in xs:
            e = model.exit_hidden(k, out.hidden_states[k]).flatten(0, 1)  # [B*T, D]
            xs[k].append(e)
            ys[k].append((F.linear(e, model.backbone.head_weight).argmax(-1) == top).float())
    return {k: (torch.cat(xs[k]), torch.cat(ys[k])) for k in xs}


def auroc(score: np.ndarray, y: np.ndarray) -> float:
    """Area under the ROC curve (Mann-Whitney U with average ranks for ties); 0.5 if one class."""
    y = np.asarray(y, bool)
    pos, neg = int(y.sum()), int((~y).sum())
    if pos == 0 or neg == 0:
        return 0.5
    order = np.argsort(score, kind="mergesort")
    ranks = np.empty(len(score))
    s = np.asarray(score)[order]
    i = 0
    while i < len(s):  # average ranks over ties
        j = i
        while j + 1 < len(s) and s[j + 1] == s[i]:
            j += 1
        ranks[order[i:j + 1]] = 0.5 * (i + j) + 1
        i = j + 1
    return float((ranks[y].sum() - pos * (pos + 1) / 2) / (pos * neg))


def train_gates(model: MultiExitModel, train: dict[int, tuple[torch.Tensor, torch.Tensor]],
                heldout: dict[int, tuple[torch.Tensor, torch.Tensor]], epochs: int = 6, lr: float = 2e-3,
                batch: int = 512, seed: int = 0) -> dict[str, dict[str, float]]:
    """Fit each exit's gate on ``train`` (from :func:`gate_data`); returns per exit the agreement rate
    and the gate's AUROC on ``heldout``."""
    g = torch.Generator().manual_seed(seed)
    metrics = {}
    for k, (x, y) in train.items():
        gate = model.heads[str(k)].gate
        opt = torch.optim.Adam(gate.parameters(), lr=lr)
        gate.train()
        for _ in range(epochs):
            perm = torch.randperm(len(x), generator=g)
            for i in range(0, len(x), batch):
                idx = perm[i:i + batch]
                loss = F.binary_cross_entropy_with_logits(gate(x[idx]), y[idx])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
        gate.eval()
        hx, hy = heldout[k]
        with torch.no_grad():
            s = gate(hx).numpy()
        metrics[str(k)] = {"agreement": float(hy.mean()), "gate_auroc": auroc(s, hy.numpy()), "train_tokens": len(x)}
    return metrics
