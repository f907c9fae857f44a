"""Run a multi-exit model over text and collect exit signals (teacher-forced).

The model reads non-overlapping windows of the token stream at full depth;
for every position and exit we keep the exit signals, the exit's argmax and
the true next token. Logits are reduced to signals window by window, so memory
stays at one window's [T, V] per exit.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from calibration.signals import exit_signals
from edge.errors import ConfigError
from edge.exits import MultiExitModel


@dataclass
class Collected:
    """Per-token data of one split; every array has N rows."""

    exit_layers: list[int]
    signals: dict[int, np.ndarray]  # exit -> [N, F]
    argmax: dict[int, np.ndarray]  # exit -> [N]
    next_token: np.ndarray  # [N]

    @property
    def n(self) -> int:
        return int(self.next_token.shape[0])

    @property
    def final(self) -> int:
        return self.exit_layers[-1]

    def correct(self) -> dict[int, np.ndarray]:
        """Decision exits -> 1 where the exit's argmax equals the full model's (the calibration target)."""
        full = self.argmax[self.final]
        return {k: (self.argmax[k] == full).astype(np.int64) for k in self.exit_layers[:-1]}


@torch.no_grad()
def collect(model: MultiExitModel, tokens: np.ndarray, seq_len: int, max_tokens: int) -> Collected:
    """Signals of up to ``max_tokens`` positions of ``tokens`` (windows of ``seq_len``).

    Raises:
        ConfigError: fewer tokens than one window (an empty split), or non-finite signals.
    """
    model.eval()
    windows = min((len(tokens) - 1) // seq_len, max(1, max_tokens // seq_len))
    if len(tokens) < 2 or windows < 1:
        raise ConfigError(f"empty split: {len(tokens)} tokens, fewer than one window of {seq_len + 1}")
    layers = model.exit_layers
    sig: dict[int, list[np.ndarray]] = {k: [] for k in layers}
    arg: dict[int, list[np.ndarray]] = {k: [] for k in layers}
    nxt = []
    for i in range(windows):
        w = torch.from_numpy(tokens[i * seq_len:(i + 1) * seq_len + 1].astype(np.int64)).unsqueeze(0)
        out = model.backbone(w[:, :-1])
        hidden = {k: model.exit_hidden(k, out.hidden_states[k])[0] for k in layers}  # [T, D]
        logits = {k: torch.nn.functional.linear(hidden[k], model.backbone.head_weight) for k in layers}  # [T, V]
        s = exit_signals({k: v.numpy() for k, v in logits.items()}, {k: v.numpy() for k, v in hidden.items()})
        for k in layers:
            sig[k].append(s[k])
            arg[k].append(logits[k].argmax(-1).numpy())
        nxt.append(w[0, 1:].numpy())
    return Collected(layers, {k: np.concatenate(v) for k, v in sig.items()},
                     {k: np.concatenate(v) for k, v in arg.items()}, np.concatenate(nxt))


@torch.no_grad()
def top1_accuracy(backbone, tokens: np.ndarray, seq_len: int, max_tokens: int) -> float:
    """Greedy next-token accuracy of a decoder at full depth on the same windows :func:`collect` reads."""
    backbone.eval()
    windows = min((len(tokens) - 1) // seq_len, max(1, max_tokens // seq_len))
    correct = total = 0
    for i in range(windows):
        w = torch.from_numpy(tokens[i * seq_len:(i + 1) * seq_len + 1].astype(np.int64)).unsqueeze(0)
        pred = backbone(w[:, :-1]).logits[0].argmax(-1)
        correct += int((pred == w[0, 1:]).sum())
        total += seq_len
    return correct / max(1, total)
