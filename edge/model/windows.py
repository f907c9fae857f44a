"""Teacher-forced passes over rows of token ids: the one loop that evaluation, collection and training share.

A *row* is a window of L token ids. The decoder reads ``row[:-1]`` at full depth, and position t
predicts ``row[t + 1]``; positions before ``first`` are context only (a prompt), positions
first..L-2 are judged. :func:`stream_windows` cuts a token stream into such rows,
:func:`random_windows` draws training rows, :func:`teacher_forced` runs the decoder over rows batch
by batch; on it, :func:`read_exits` gives what every exit gives there (as numpy, for calibration),
:func:`exit_metrics` measures a multi-exit model and :func:`base_model_metrics` the base model a
fine-tuned decoder came from.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch
import torch.nn.functional as F

from edge.core.errors import ConfigError
from edge.model.bundled import resolve_model
from edge.model.checkpoint import load_decoder
from edge.model.decoder import Decoder, DecoderOutput
from edge.model.exits import ExitConfig, MultiExitModel, exit_decision_stats


def stream_windows(tokens: np.ndarray, seq_len: int, max_windows: int) -> np.ndarray:
    """Non-overlapping rows [N, seq_len + 1] of a token stream, N = min(max_windows, (len - 1) // seq_len).

    Consecutive rows share one token: the last target of row i is the first input of row i + 1.

    Raises:
        ConfigError: fewer tokens than one row (an empty split).
    """
    tokens = np.asarray(tokens)
    n = min(max_windows, (len(tokens) - 1) // seq_len)
    if n < 1:
        raise ConfigError(f"empty split: {len(tokens)} tokens, fewer than one window of {seq_len + 1}")
    idx = np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]  # [N, seq_len + 1]
    return tokens[idx].astype(np.int64)


def random_windows(tokens: np.ndarray, seed: int, step: int, batch_size: int, seq_len: int) -> torch.Tensor:
    """Random rows [B, seq_len + 1] of the token stream, determined by (seed, step) alone, so that a
    resumed training run sees the batches it would have seen."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(tokens) - seq_len - 1, size=batch_size)
    return torch.from_numpy(np.stack([tokens[s:s + seq_len + 1] for s in starts]).astype(np.int64))


@torch.no_grad()
def teacher_forced(backbone: Decoder, rows: np.ndarray, batch: int, logits: bool = True
                   ) -> Iterator[tuple[torch.Tensor, DecoderOutput]]:
    """Read ``rows`` [N, L] at full depth, ``batch`` rows per pass.

    Yields (the rows of the pass as int64 [B, L], the decoder's output on their first L - 1 tokens; with
    ``logits`` False, without the LM head over every position: a caller that reads the head at the judged
    positions only, through the exit it reads, computes it there).
    The caller's own computation on an output runs outside this generator: wrap it in
    ``torch.no_grad()`` too.

    Raises:
        ConfigError: no rows, or rows shorter than 2 tokens.
    """
    rows = np.asarray(rows, dtype=np.int64)
    if rows.ndim != 2 or rows.shape[0] == 0 or rows.shape[1] < 2:
        raise ConfigError(f"teacher-forced pass: expected token ids [N >= 1, L >= 2], got shape {rows.shape}")
    backbone.eval()
    for a in range(0, rows.shape[0], batch):
        ids = torch.from_numpy(rows[a:a + batch])
        yield ids, backbone(ids[:, :-1], head=logits)


@torch.no_grad()
def exit_metrics(model: MultiExitModel, rows: np.ndarray, first: int = 0, batch: int = 1) -> dict:
    """Per-exit agreement with the final layer and top-1 accuracy; final-layer perplexity; the oracle
    exit depth; over the judged positions first..L-2 of ``rows`` [N, L].

    A token's *oracle exit* is the first exit from which every later exit's argmax equals the final
    layer's: the earliest a rule that never exits falsely could have let it go (``oracle_exit_hist``:
    fraction of tokens per exit).
    """
    model.eval()
    layers = model.exit_layers
    final = layers[-1]
    agree = {k: 0 for k in layers}
    correct = {k: 0 for k in layers}
    oracle = np.zeros(len(layers), dtype=np.int64)
    nll, count = 0.0, 0
    for ids, out in teacher_forced(model.backbone, rows, batch, logits=False):
        target = ids[:, first + 1:]  # [B, T]
        logits = {k: model.exit_logits(k, out.hidden_states[k][:, first:]) for k in layers}  # [B, T, V]
        top = {k: lg.argmax(-1) for k, lg in logits.items()}  # [B, T]
        for k in layers:
            agree[k] += (top[k] == top[final]).sum().item()
            correct[k] += (top[k] == target).sum().item()
        same = torch.stack([top[k] == top[final] for k in layers])  # [E, B, T]
        from_here = same.flip(0).int().cumprod(0).flip(0)  # [E, B, T]: 1 where this and every later exit agree
        oracle += np.bincount((len(layers) - from_here.sum(0)).reshape(-1).numpy(), minlength=len(layers))
        nll += F.cross_entropy(logits[final].flatten(0, 1), target.reshape(-1), reduction="sum").item()
        count += target.numel()
    return {
        "tokens": count,
        "heldout_ppl": math.exp(nll / count),
        "heldout_top1": correct[final] / count,
        "exit_agreement": {str(k): agree[k] / count for k in layers},
        "exit_accuracy": {str(k): correct[k] / count for k in layers},
        "oracle_exit_hist": {str(k): int(c) / count for k, c in zip(layers, oracle)},
        "oracle_mean_exit_layer": float(np.dot(layers, oracle) / count),
    }


def full_depth(decoder: Decoder, exit_layers: list[int] | None = None) -> MultiExitModel:
    """A decoder read at full depth (and, with ``exit_layers``, early at those layers through its own
    final norm and head), as a :class:`MultiExitModel` without exit heads of its own."""
    return MultiExitModel(decoder, ExitConfig(layers=exit_layers or [decoder.cfg.num_layers], adapter_rank=0))


def base_model_metrics(base_model: str, rows: np.ndarray, first: int = 0, exit_layers: list[int] | None = None,
                       batch: int = 1) -> dict:
    """Held-out perplexity and top-1 of the model a fine-tuned decoder came from, at full depth, on the
    judged positions of ``rows`` (as :func:`exit_metrics` reads them): ``base_heldout_ppl``,
    ``base_heldout_top1``.

    With ``exit_layers``, also its agreement, accuracy and oracle exit depth when read early through
    its own final norm and head at those layers (``base_exit_agreement``, ``base_exit_accuracy``,
    ``base_oracle_exit_hist``, ``base_oracle_mean_exit_layer``): what LayerSkip training starts from.

    Raises:
        CheckpointError: the base model cannot be found or loaded.
    """
    got = exit_metrics(full_depth(load_decoder(resolve_model(base_model)), exit_layers), rows, first, batch)
    keys = ["heldout_ppl", "heldout_top1"]
    if exit_layers:
        keys += ["exit_agreement", "exit_accuracy", "oracle_exit_hist", "oracle_mean_exit_layer"]
    return {f"base_{k}": got[k] for k in keys}


@dataclass
class ExitReadout:
    """What every exit gives at the judged positions of one pass, rows flattened: N = B * (L - 1 - first)."""

    hidden: dict[int, np.ndarray]  # exit -> normalised hidden [N, D] (the LM head's input)
    stats: dict[int, np.ndarray]  # exit -> softmax statistics [N, 3] (exit_decision_stats, as the graphs)
    tokens: dict[int, np.ndarray]  # exit -> argmax [N]
    gates: dict[int, np.ndarray]  # decision exit -> gate logit [N]; empty for a model without exit gates


@torch.no_grad()
def read_exits(model: MultiExitModel, rows: np.ndarray, first: int, batch: int) -> Iterator[ExitReadout]:
    """Teacher-forced, what the engine's segment graphs give at every exit, for the judged positions
    first..L-2 of ``rows`` [N, L], one :class:`ExitReadout` per pass of ``batch`` rows (rows in order,
    positions ascending)."""
    model.eval()
    layers = model.exit_layers
    for _, out in teacher_forced(model.backbone, rows, batch, logits=False):
        hidden = {k: model.exit_hidden(k, out.hidden_states[k][:, first:]).flatten(0, 1) for k in layers}  # [N, D]
        stats, tokens = {}, {}
        for k in layers:
            st, tk = exit_decision_stats(model.backbone.logits(hidden[k]))
            stats[k], tokens[k] = st.numpy(), tk.numpy()  # [N, 3], [N]
        gates = {k: model.exit_gate(k, hidden[k]).reshape(-1).numpy() for k in layers[:-1]} if model.gated else {}
        yield ExitReadout({k: v.numpy() for k, v in hidden.items()}, stats, tokens, gates)
