"""Backends: how one segment of the model is computed. One small interface, a registry by name.

The engine speaks numpy float32 at this boundary. A *segment* is the decoder
layers between two exits plus that exit's head; segment i ends at exit
``exit_layers[i]``. Public methods validate, private ones compute.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from edge.errors import ConfigError
from edge.exits import MultiExitModel, exit_decision_stats


@dataclass
class SegmentOut:
    hidden: np.ndarray  # [B, T, D] residual stream after the segment's last layer
    # the exit head, at each sequence's exit_index row only:
    exit_hidden: np.ndarray  # [B, D] normalised exit hidden (LM-head input)
    logits: np.ndarray  # [B, V] exit logits
    stats: np.ndarray  # [B, 3] float32: top-1 probability, top-1 minus top-2, entropy
    token: np.ndarray  # [B] int64 argmax of the logits
    keys: list[np.ndarray]  # per layer of the segment [B, KV, T, hd] for the new rows
    values: list[np.ndarray]


class Backend(abc.ABC):
    """Computes embeddings, segments and K/V fills for a multi-exit model."""

    name = "abstract"

    def __init__(self, model: MultiExitModel) -> None:
        cfg = model.backbone.cfg
        self.exit_layers = list(model.exit_layers)
        self.num_layers = cfg.num_layers
        self.vocab_size = cfg.vocab_size
        self.num_kv_heads, self.head_dim = cfg.num_kv_heads, cfg.head_dim
        self.sliding_window = cfg.sliding_window
        exit_layers = self.exit_layers
        starts = [0, *exit_layers[:-1]]
        # 0-based decoder layer indices of each segment
        self.segments = [list(range(a, b)) for a, b in zip(starts, exit_layers)]

    def suffix_layers(self, i: int) -> list[int]:
        """0-based layers of segments i..last (what ``kvfill(i)`` returns K/V for)."""
        return [j for seg in self.segments[i:] for j in seg]

    def embed(self, ids: np.ndarray) -> np.ndarray:
        """ids int64 [B, T] -> hidden [B, T, D]."""
        if ids.min(initial=0) < 0 or ids.max(initial=0) >= self.vocab_size:
            raise ConfigError(f"token ids outside the vocabulary [0, {self.vocab_size})")
        return self._embed(ids.astype(np.int64))

    def segment(self, i: int, hidden: np.ndarray, positions: np.ndarray, mask: np.ndarray,
                past_k: list[np.ndarray], past_v: list[np.ndarray], exit_index: np.ndarray) -> SegmentOut:
        """Run segment i on rows hidden [B, T, D] at positions [B, T] with past [B, KV, P, hd] per layer
        and additive mask [B, 1, T, P+T]; the exit head runs on row ``exit_index[b]`` of each sequence."""
        if len(past_k) != len(self.segments[i]) or len(past_v) != len(self.segments[i]):
            raise ConfigError(f"segment {i} has {len(self.segments[i])} layers, got {len(past_k)} past tensors")
        exit_index = np.asarray(exit_index, np.int64)
        if exit_index.shape != (hidden.shape[0],) or exit_index.min() < 0 or exit_index.max() >= hidden.shape[1]:
            raise ConfigError(f"exit_index must hold one row in [0, {hidden.shape[1]}) per sequence, got {exit_index}")
        return self._segment(i, hidden, positions, mask, past_k, past_v, exit_index)

    def kvfill(self, i: int, hidden: np.ndarray, positions: np.ndarray) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """K/V of every layer of segments i..last for rows that exited after segment i-1 (one call);
        hidden [B, T, D] is the raw residual at the exit."""
        if i == 0:
            raise ConfigError("segment 0 is never skipped")
        return self._kvfill(i, hidden, positions)

    @abc.abstractmethod
    def _embed(self, ids: np.ndarray) -> np.ndarray: ...

    @abc.abstractmethod
    def _segment(self, i, hidden, positions, mask, past_k, past_v, exit_index) -> SegmentOut: ...

    @abc.abstractmethod
    def _kvfill(self, i, hidden, positions) -> tuple[list[np.ndarray], list[np.ndarray]]: ...


class TorchBackend(Backend):
    """The reference: the PyTorch modules themselves."""

    name = "torch"

    def __init__(self, model: MultiExitModel) -> None:
        super().__init__(model)
        self.model = model.eval()

    @torch.no_grad()
    def _embed(self, ids):
        return self.model.backbone.embed(torch.from_numpy(ids)).numpy()

    @torch.no_grad()
    def _segment(self, i, hidden, positions, mask, past_k, past_v, exit_index):
        bb = self.model.backbone
        pos = torch.from_numpy(positions)
        cos, sin = bb.rope(pos)
        h = torch.from_numpy(hidden)
        m = torch.from_numpy(mask)
        keys, values = [], []
        for j, pk, pv in zip(self.segments[i], past_k, past_v):
            h, k, v = bb.layers[j](h, cos, sin, torch.from_numpy(pk), torch.from_numpy(pv), m)
            keys.append(k.numpy())
            values.append(v.numpy())
        layer = self.exit_layers[i]
        eh = self.model.exit_hidden(layer, h[torch.arange(h.shape[0]), torch.from_numpy(exit_index)])  # [B, D]
        logits = torch.nn.functional.linear(eh, bb.head_weight)
        stats, token = exit_decision_stats(logits)
        return SegmentOut(h.numpy(), eh.numpy(), logits.numpy(), stats.numpy(), token.numpy(), keys, values)

    @torch.no_grad()
    def _kvfill(self, i, hidden, positions):
        bb = self.model.backbone
        cos, sin = bb.rope(torch.from_numpy(positions))
        h = torch.from_numpy(hidden)
        keys, values = [], []
        for j in self.suffix_layers(i):
            k, v = bb.layers[j].kv_only(h, cos, sin)
            keys.append(k.numpy())
            values.append(v.numpy())
        return keys, values


BACKENDS: dict[str, Callable[..., Backend]] = {"torch": TorchBackend}


def register(name: str, factory: Callable[..., Backend]) -> None:
    BACKENDS[name] = factory


def make_backend(name: str, model: MultiExitModel, graphs_dir: str | Path | None = None, **kwargs) -> Backend:
    """Backend by name: ``torch`` or ``onnxruntime`` (which needs the exported graphs)."""
    if name == "onnxruntime" and "onnxruntime" not in BACKENDS:
        from edge.engine import ort_backend  # noqa: F401  (registers itself)
    if name not in BACKENDS:
        raise ConfigError(f"unknown backend {name!r}; known: {', '.join(sorted({*BACKENDS, 'onnxruntime'}))}")
    if name == "torch":
        return BACKENDS[name](model)
    return BACKENDS[name](model, graphs_dir, **kwargs)
