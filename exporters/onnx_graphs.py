"""The portable graphs' interface and what is traced for each: the I/O names of the segment, head and
kvfill graphs, the torch modules that call the model's own layers for ``embed``, ``segment_{i}``, ``head``
and ``kvfill_{i}``, and which axes of their tensors are dynamic or fixed (exporters/onnx_export.py
documents every graph's tensors)."""
from __future__ import annotations

import torch
from torch import nn

from edge.model.decoder import rope_cos_sin
from edge.model.exits import MultiExitModel, exit_decision_stats


def segment_io(layers: list[int]) -> tuple[list[str], list[str]]:
    """Input and output names of the segment graph over 0-based ``layers``."""
    past = [n for j in layers for n in (f"past_key_{j}", f"past_value_{j}")]
    present = [n for j in layers for n in (f"present_key_{j}", f"present_value_{j}")]
    return (["hidden", "positions", "attn_mask", *past, "exit_index"],
            ["hidden_out", "exit_hidden", *present])


def head_io() -> tuple[list[str], list[str]]:
    """Input and output names of the head graph."""
    return ["exit_hidden"], ["logits", "exit_stats", "exit_token"]


def kvfill_io(layers: list[int]) -> tuple[list[str], list[str]]:
    """Input and output names of the kvfill graph over 0-based ``layers``."""
    present = [n for j in layers for n in (f"present_key_{j}", f"present_value_{j}")]
    return ["hidden", "positions"], present


# --- graph modules: thin wrappers that call the model's own layers ---------------------------------

class EmbedGraph(nn.Module):
    def __init__(self, model: MultiExitModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.backbone.embed(input_ids)  # [B, T, D]


class SegmentGraph(nn.Module):
    def __init__(self, model: MultiExitModel, layers: list[int], exit_layer: int) -> None:
        super().__init__()
        self.model, self.layers, self.exit_layer = model, layers, exit_layer

    def forward(self, hidden, positions, attn_mask, *rest):
        *past, exit_index = rest
        backbone = self.model.backbone
        cos, sin = rope_cos_sin(positions, backbone.inv_freq)  # [B, 1, T, hd]
        h, presents = hidden, []
        for n, j in enumerate(self.layers):
            # always a mask tensor: Attention's mask=None fast path is SDPA, not for export
            h, k, v = backbone.layers[j](h, cos, sin, past[2 * n], past[2 * n + 1], attn_mask)
            presents += [k, v]  # [B, KV, T, hd]
        rows = torch.gather(h, 1, exit_index.view(-1, 1, 1).expand(-1, 1, h.shape[-1]))  # [B, 1, D]
        e = self.model.exit_hidden(self.exit_layer, rows)  # [B, 1, D]
        return (h, e, *presents)


class HeadGraph(nn.Module):
    def __init__(self, model: MultiExitModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, exit_hidden):
        logits = self.model.backbone.logits(exit_hidden)  # [B, 1, V]
        stats, token = exit_decision_stats(logits)  # [B, 1, 3], [B, 1]
        return logits, stats, token


class KVFillGraph(nn.Module):
    def __init__(self, model: MultiExitModel, layers: list[int]) -> None:
        super().__init__()
        self.model, self.layers = model, layers

    def forward(self, hidden, positions):
        backbone = self.model.backbone
        cos, sin = rope_cos_sin(positions, backbone.inv_freq)
        out = []
        for j in self.layers:
            out += list(backbone.layers[j].kv_only(hidden, cos, sin))
        return tuple(out)


def dynamic_axes(inputs: list[str], outputs: list[str]) -> dict[str, dict[int, str]]:
    axes: dict[str, dict[int, str]] = {}
    for name in inputs + outputs:
        if name == "attn_mask":
            axes[name] = {0: "batch", 2: "seq", 3: "total"}
        elif name.startswith("past_"):
            axes[name] = {0: "batch", 2: "past"}
        elif name.startswith("present_"):
            axes[name] = {0: "batch", 2: "seq"}
        elif name in ("exit_index", "exit_hidden", "logits", "exit_stats", "exit_token"):
            axes[name] = {0: "batch"}  # one row per sequence
        else:  # input_ids, positions, hidden, hidden_out
            axes[name] = {0: "batch", 1: "seq"}
    return axes


def static_dims(name: str, d: int, kv_heads: int, head_dim: int, vocab: int) -> dict[int, int]:
    """Fixed axes of a graph output (the rest are the dynamic axes of :func:`dynamic_axes`)."""
    if name.startswith("present_"):
        return {1: kv_heads, 3: head_dim}
    one = {1: 1}  # exit outputs: one row per sequence
    return {"exit_token": one, "logits": {**one, 2: vocab}, "exit_stats": {**one, 2: 3},
            "exit_hidden": {**one, 2: d}}.get(name, {2: d})

