"""The settings of pruning near the exits (:class:`PruneConfig`): how much to prune, how to rank
units, how to recover; checked when built."""
from __future__ import annotations

from dataclasses import dataclass

from edge.compress.prune_importance import Importance
from edge.core.errors import ConfigError


@dataclass
class PruneConfig:
    """How much to prune near the exits, how to rank units, how to recover."""

    layers_before_exit: int = 1  # pruned layers per decision exit: exit k (1-based) -> layers k-1, k-2, .. (0-based)
    mlp_fraction: float = 0.25  # share of MLP neurons removed in each pruned layer, after all steps
    heads_per_group: int = 0  # query heads removed per KV group in each pruned layer, after all steps
    importance: Importance = Importance.MAGNITUDE
    steps: int = 2  # progressive: the removal is spread over this many equal steps
    recovery_steps: int = 20  # distillation steps after each pruning step
    calib_batches: int = 2  # batches the importance is averaged over, each step
    lr: float = 3e-4
    batch_size: int = 4
    seq_len: int = 128
    temperature: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        try:
            self.importance = Importance(self.importance)
        except ValueError:
            raise ConfigError(f"prune.importance must be one of {[i.value for i in Importance]}, "
                              f"got {self.importance!r}") from None
        minimum = dict(layers_before_exit=1, steps=1, calib_batches=1, batch_size=1, heads_per_group=0,
                       recovery_steps=0, seq_len=2)  # seq_len: next-token targets need 2 tokens
        for name, low in minimum.items():
            if getattr(self, name) < low:
                raise ConfigError(f"prune.{name} must be >= {low}, got {getattr(self, name)}")
        if not 0.0 <= self.mlp_fraction < 1.0:
            raise ConfigError(f"prune.mlp_fraction must be in [0, 1), got {self.mlp_fraction}")
        if self.mlp_fraction == 0.0 and self.heads_per_group == 0:
            raise ConfigError("prune: nothing to remove (mlp_fraction = 0 and heads_per_group = 0)")
        for name in ("lr", "temperature"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"prune.{name} must be > 0, got {getattr(self, name)}")
