"""Multi-exit model: exit heads at chosen layers over a (frozen) decoder.

An exit after layer k is the decoder's hidden state h_k, an optional low-rank
residual adapter, a norm initialised from the final norm, and the *shared* LM
head. The exit after the last layer is the decoder's own head. Layer indices
are 1-based: exit 3 reads the hidden state after the third decoder layer.

A multi-exit checkpoint is a folder: the decoder in HF layout (``config.json``,
``model.safetensors``, ``tokenizer.json``) plus ``exits.safetensors`` (the exit
heads) and ``exits.json`` (layers, adapter rank, sha256 of the weights and the
distillation metrics).
"""
from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass, field
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from edge.core.artifacts import atomic_path, atomic_write_json, sha256_file
from edge.model.checkpoint import load_decoder, save_decoder
from edge.core.errors import CheckpointError, ConfigError
from edge.model.decoder import Decoder, RMSNorm

EXITS_JSON = "exits.json"
EXITS_WEIGHTS = "exits.safetensors"
SHORTLIST_KEY = "shortlist"  # the candidate token ids [K] in exits.safetensors


@dataclass
class ExitConfig:
    """Where the exits are and what an exit head holds."""

    layers: list[int] = field(default_factory=lambda: [3, 6, 9, 12])
    adapter_rank: int = 32  # 0 = norm + shared head only
    # Exit gates (0 = none): a small MLP per decision exit, exit hidden [D] -> gate_hidden -> 1, that
    # predicts whether the exit agrees with the last layer. With gates, the engine decides from them
    # and runs the LM head only for the rows that exit: a decision no longer costs a vocabulary-sized
    # matrix product (at batch 1 on the bundled model, the head costs about as much as two layers).
    gate_hidden: int = 0
    # Candidate shortlist (0 = none): decision exits score their hidden state against the K rows of the
    # LM head of the K tokens the training text uses most (edge/model/candidates.py), so a check costs a
    # K x D product instead of the vocabulary's, and a leaving token is emitted from those K.
    shortlist: int = 0

    def __post_init__(self) -> None:
        if not self.layers:
            raise ConfigError("exits.layers must name at least one layer")
        if sorted(set(self.layers)) != list(self.layers):
            raise ConfigError(f"exits.layers must be strictly increasing, got {self.layers}")
        if self.layers[0] < 1:
            raise ConfigError(f"exits.layers are 1-based layer numbers, got {self.layers}")
        if self.adapter_rank < 0:
            raise ConfigError(f"exits.adapter_rank must be >= 0, got {self.adapter_rank}")
        if self.gate_hidden < 0:
            raise ConfigError(f"exits.gate_hidden must be >= 0, got {self.gate_hidden}")
        if self.shortlist < 0:
            raise ConfigError(f"exits.shortlist must be >= 0, got {self.shortlist}")
        if self.shortlist and self.gate_hidden:
            raise ConfigError("exits.shortlist and exits.gate_hidden are two kinds of cheap decision: choose one")

    def resolved(self, num_layers: int) -> list[int]:
        """Exit layers with the final layer always present; errors if one is past the model's depth."""
        if self.layers[-1] > num_layers:
            raise ConfigError(f"exits.layers {self.layers} go past the model's {num_layers} layers")
        return self.layers if self.layers[-1] == num_layers else [*self.layers, num_layers]


class ExitGate(nn.Module):
    """Normalised exit hidden [.., D] -> logit [..] of P(this exit agrees with the last layer)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, 1)

    def forward(self, e: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.silu(self.fc1(e)))[..., 0]


class ExitHead(nn.Module):
    """h [.., D] -> normalised hidden [.., D]; logits come from the shared LM head."""

    def __init__(self, dim: int, eps: float, rank: int, gate_hidden: int = 0) -> None:
        super().__init__()
        self.norm = RMSNorm(dim, eps)
        self.down = nn.Linear(dim, rank, bias=False) if rank else None
        self.up = nn.Linear(rank, dim, bias=False) if rank else None
        if rank:
            nn.init.zeros_(self.up.weight)  # starts as the plain final-norm head
        self.gate = ExitGate(dim, gate_hidden) if gate_hidden else None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.down is not None:
            h = h + self.up(self.down(h))
        return self.norm(h)


class MultiExitModel(nn.Module):
    """A :class:`Decoder` with exit heads; ``exit_layers`` always ends with the last layer."""

    def __init__(self, backbone: Decoder, exits: ExitConfig) -> None:
        super().__init__()
        self.backbone = backbone
        self.exit_cfg = exits
        self.exit_layers = exits.resolved(backbone.cfg.num_layers)
        cfg = backbone.cfg
        self.heads = nn.ModuleDict()
        for layer in self.exit_layers[:-1]:
            head = ExitHead(cfg.hidden_size, cfg.rms_norm_eps, exits.adapter_rank, exits.gate_hidden)
            head.norm.weight.data.copy_(backbone.norm.weight.data)
            self.heads[str(layer)] = head
        if exits.shortlist > cfg.vocab_size:
            raise ConfigError(f"exits.shortlist {exits.shortlist} exceeds the vocabulary ({cfg.vocab_size} tokens)")
        # the candidate tokens of decision exits (set by distill: choose_shortlist); ids [K]
        self.register_buffer("shortlist", torch.arange(exits.shortlist, dtype=torch.int64), persistent=False)

    @property
    def num_layers(self) -> int:
        return self.backbone.cfg.num_layers

    def exit_hidden(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """Normalised hidden state of exit ``layer`` for h [B, T, D] (the input of the LM head)."""
        if layer == self.num_layers:
            return self.backbone.norm(h)
        return self.heads[str(layer)](h)

    @property
    def has_shortlist(self) -> bool:
        """Decision exits decide over the candidate shortlist (:mod:`edge.model.candidates`)."""
        return self.exit_cfg.shortlist > 0 and len(self.exit_layers) > 1

    def shortlist_rows(self) -> torch.Tensor:
        """The LM head's rows of the shortlist tokens [K, D] (float32, on the host, where the candidate check
        of the host-side backends runs, also for a model on a GPU; a quantized head's values as it computes them)."""
        bb = self.backbone
        w = bb.head_weight if bb.head_q is None else bb.head_q.quantized_weight()  # the quantized head's grid values
        return w.detach().float()[self.shortlist].cpu()

    def shortlist_act_scale(self) -> float | None:
        """The activation scale a W8A8 LM head quantizes its input with (None: a float head, or one whose
        activations stay float): a check scores its candidates with the head's own product, so the exit
        hidden is quantized with it too (in the fused graphs an integer product over int8 rows, a quarter of
        the float rows' bytes: docs/runtime.md)."""
        head = self.backbone.head_q  # a QuantLinear (edge.compress, a layer above this module) or None
        if head is None or not head.enabled or not head.has_act_quant:
            return None
        return float(head.act_scale)

    @property
    def gated(self) -> bool:
        """Decision exits carry gates (:class:`ExitGate`)."""
        return self.exit_cfg.gate_hidden > 0 and len(self.exit_layers) > 1

    def exit_gate(self, layer: int, e: torch.Tensor) -> torch.Tensor:
        """Gate logit [..] of decision exit ``layer`` from its normalised hidden e [.., D]."""
        gate = self.heads[str(layer)].gate
        if gate is None:
            raise ConfigError(f"exit {layer} has no gate (exits.gate_hidden = 0)")
        return gate(e)

    def exit_logits(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, V] of exit ``layer`` from the hidden state after that layer."""
        return self.backbone.logits(self.exit_hidden(layer, h))

    def forward(self, ids: torch.Tensor) -> dict[int, torch.Tensor]:
        """Teacher-forced logits of every exit: {layer: [B, T, V]}."""
        out = self.backbone(ids)
        return {k: self.exit_logits(k, out.hidden_states[k]) for k in self.exit_layers}

    def freeze_backbone(self) -> None:
        for p in self.backbone.parameters():
            p.requires_grad_(False)


def exit_decision_stats(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What an exit rule reads instead of the logits, computed where the logits are (in the graph).

    logits [..., V] -> (stats [..., 3] float32: softmax top-1 probability, top-1 minus top-2
    probability, entropy in nats; argmax [...] int64, lowest id on ties). With m the max logit,
    e = exp(z - m), S = sum(e):
    top1 = 1/S, margin = (1 - exp(z2 - m))/S, entropy = log S - sum(e (z - m))/S. Exported as
    ReduceMax / Exp / ReduceSum / TopK / ArgMax, which TensorRT parses.
    """
    z = logits.float()
    m = z.amax(-1, keepdim=True)  # [..., 1]
    d = z - m  # [..., V], <= 0
    e = d.exp()
    total = e.sum(-1)  # [...], >= 1
    second = z.topk(2, dim=-1).values[..., 1] - m[..., 0]  # [...], z2 - m <= 0
    top1 = 1.0 / total
    margin = (1.0 - second.exp()) / total
    entropy = (total.log() - (e * d).sum(-1) / total).clamp_min(0.0)  # rounding can dip below 0
    return torch.stack([top1, margin, entropy], -1), z.argmax(-1)


def choose_shortlist(tokens: np.ndarray, k: int, vocab_size: int) -> torch.Tensor:
    """The ``k`` token ids that occur most often in ``tokens`` (the training text), most frequent first
    (ties: lower id first). FR-Spec (Zhao et al., ACL 2025) ranks its draft vocabulary the same way."""
    counts = np.bincount(np.asarray(tokens, np.int64), minlength=vocab_size)[:vocab_size]
    order = np.lexsort((np.arange(vocab_size), -counts))
    return torch.from_numpy(order[:k].astype(np.int64))


def save_multi_exit(model: MultiExitModel, folder: str | Path, *, tokenizer: str | Path | None,
                    metrics: dict[str, Any], source: dict[str, Any], dtype: torch.dtype = torch.float16) -> Path:
    """Write a multi-exit checkpoint folder (caller wraps it in :func:`atomic_dir`); the decoder's
    weights in ``dtype`` (a quantized model's in float32, so that its grid points stay exact)."""
    folder = Path(folder)
    save_decoder(model.backbone, folder, dtype=dtype)
    if tokenizer is not None:
        shutil.copyfile(tokenizer, folder / "tokenizer.json")
    heads = {f"exit.{k}": v.detach().contiguous() for k, v in model.heads.state_dict().items()}
    if model.exit_cfg.shortlist:
        heads[SHORTLIST_KEY] = model.shortlist.detach().contiguous()
    with atomic_path(folder / EXITS_WEIGHTS) as tmp:
        save_file(heads, str(tmp), metadata={"format": "pt"})
    atomic_write_json(folder / EXITS_JSON, {
        "exit_layers": model.exit_layers,
        "exits": asdict(model.exit_cfg),
        "num_layers": model.num_layers,
        "backbone_sha256": sha256_file(folder / "model.safetensors"),
        "heads_sha256": sha256_file(folder / EXITS_WEIGHTS),
        "source": source,
        "metrics": metrics,
    })
    return folder


def read_exits_json(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / EXITS_JSON
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: {folder} is not a multi-exit checkpoint (run `smartexit distill`)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from exc


def load_multi_exit(folder: str | Path, prepare: Callable[[Decoder], None] | None = None) -> MultiExitModel:
    """Load a multi-exit checkpoint, checking that its files are the ones ``exits.json`` names.

    Raises:
        CheckpointError: missing / corrupt files, or weights whose sha256 differs from exits.json.
    """
    folder = Path(folder)
    meta = read_exits_json(folder)
    for name, key in (("model.safetensors", "backbone_sha256"), (EXITS_WEIGHTS, "heads_sha256")):
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"{path} is missing")
        actual = sha256_file(path)
        if actual != meta.get(key):
            raise CheckpointError(f"{path} does not match {folder / EXITS_JSON}: sha256 {actual} != {meta.get(key)}")
    backbone = load_decoder(folder, prepare=prepare)
    try:
        exits = ExitConfig(**meta["exits"])
    except (KeyError, TypeError) as exc:
        raise CheckpointError(f"{folder / EXITS_JSON}: malformed 'exits' entry: {exc}") from exc
    model = MultiExitModel(backbone, exits)
    try:
        heads = load_file(str(folder / EXITS_WEIGHTS))
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{folder / EXITS_WEIGHTS} is corrupt: {exc}") from exc
    if exits.shortlist:
        ids = heads.pop(SHORTLIST_KEY, None)
        if ids is None or ids.shape != (exits.shortlist,) or ids.min() < 0 or ids.max() >= backbone.cfg.vocab_size:
            raise CheckpointError(f"{folder / EXITS_WEIGHTS}: no valid '{SHORTLIST_KEY}' of {exits.shortlist} token ids, "
                                  f"which exits.json's shortlist asks for")
        model.shortlist.copy_(ids.to(torch.int64))
    state = {k.removeprefix("exit."): v.float() for k, v in heads.items()}
    try:
        model.heads.load_state_dict(state)
    except RuntimeError as exc:
        raise CheckpointError(f"{folder / EXITS_WEIGHTS} does not fit exits.json: {exc}") from exc
    return model.eval()
