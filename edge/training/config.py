"""The ``distill`` stage's settings: multi-exit distillation (:class:`DistillConfig`) and its LayerSkip
switches (:class:`LayerSkipConfig`). A module of their own so that the stage (:mod:`edge.training.distill`)
and the LayerSkip trainer (:mod:`edge.training.layerskip`) both read them without importing each other.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from edge.core.errors import ConfigError
from edge.model.exits import ExitConfig


class Curriculum(str, enum.Enum):
    NONE = "none"
    ROTATIONAL = "rotational"
    GRADUAL = "gradual"


class ExitWeighting(str, enum.Enum):
    UNIFORM = "uniform"  # every early exit at exit_loss_scale, the final layer at 1 (a plain sum at scale 1)
    LAYERSKIP = "layerskip"  # the paper's e~_l = scale * sum_{i<=l} i, e~_{L-1} = L - 1, normalised to sum 1


@dataclass
class LayerSkipConfig:
    """LayerSkip training switches (``distill`` with ``layerskip.enabled=true``)."""

    enabled: bool = False
    p_max: float = 0.0  # layer-dropout rate of the deepest layer
    curriculum: Curriculum = Curriculum.NONE
    rotation_groups: int = 2  # rotational: R interleaved groups of early exits, one group on per period
    rotation_period: int = 1  # rotational: C steps before the next group takes over
    gradual_frac: float = 0.5  # gradual: fraction of training after which every exit is on
    exit_loss_scale: float = 1.0  # weight of the early exits' losses relative to the final layer's
    exit_weighting: ExitWeighting = ExitWeighting.UNIFORM
    # LayerSkip trains the shared head from every exit; false keeps the final norm and the (tied) LM
    # head for the final layer's loss alone, which protects full depth and saves their weight gradients.
    head_grad_from_exits: bool = True
    ckpt_every: int = 25

    def __post_init__(self) -> None:
        self.curriculum = Curriculum(self.curriculum)
        self.exit_weighting = ExitWeighting(self.exit_weighting)
        if not 0.0 <= self.p_max < 1.0:
            raise ConfigError(f"layerskip.p_max must be in [0, 1), got {self.p_max}")
        if self.rotation_groups < 1 or self.rotation_period < 1 or self.ckpt_every < 1:
            raise ConfigError("layerskip.rotation_groups, rotation_period and ckpt_every must be >= 1")
        if not 0.0 <= self.gradual_frac <= 1.0:
            raise ConfigError(f"layerskip.gradual_frac must be in [0, 1], got {self.gradual_frac}")
        if not (math.isfinite(self.exit_loss_scale) and self.exit_loss_scale >= 0):
            raise ConfigError(f"layerskip.exit_loss_scale must be a finite number >= 0, got {self.exit_loss_scale}")


@dataclass
class DistillConfig:
    run_dir: str = "artifacts/demo"
    model: str = "bundled"  # "bundled", "bundled-ee" or a local HF folder
    exits: ExitConfig = field(default_factory=ExitConfig)
    steps: int = 200
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 2e-3
    temperature: float = 2.0
    kl_weight: float = 0.7
    freeze_backbone: bool = True
    seed: int = 0
    train_tokens: int = 500_000  # tokens of the train split to sample windows from
    eval_windows: int = 64  # held-out windows of seq_len tokens for the metrics
    threads: int = 2
    layerskip: LayerSkipConfig = field(default_factory=LayerSkipConfig)
    gate_windows: int = 160  # train-split windows of seq_len tokens that fit the exit gates (exits.gate_hidden > 0)

    def __post_init__(self) -> None:
        if isinstance(self.layerskip, dict):
            self.layerskip = LayerSkipConfig(**self.layerskip)
        if self.layerskip.enabled and (self.freeze_backbone or self.exits.adapter_rank):
            raise ConfigError("distill: layerskip.enabled trains the decoder through its own head at every "
                              "exit: set freeze_backbone=false and exits.adapter_rank=0")
        if self.steps < 0 or self.batch_size < 1 or self.seq_len < 2:
            raise ConfigError("distill: steps >= 0, batch_size >= 1 and seq_len >= 2 are required")
        if self.train_tokens < self.seq_len + 2:  # train_exits / train_layerskip need one window and a start
            raise ConfigError(f"distill.train_tokens must be >= seq_len + 2 = {self.seq_len + 2} (one training "
                              f"window), got {self.train_tokens}")
        if self.eval_windows < 1 or self.gate_windows < 1:
            raise ConfigError(f"distill: eval_windows and gate_windows must be >= 1, got {self.eval_windows} "
                              f"and {self.gate_windows}")
        if self.threads < 1:
            raise ConfigError(f"distill.threads must be >= 1, got {self.threads}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError(f"distill.lr must be a finite number > 0, got {self.lr}")
        if not 0.0 <= self.kl_weight <= 1.0:
            raise ConfigError(f"distill.kl_weight must be in [0, 1], got {self.kl_weight}")
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ConfigError(f"distill.temperature must be a finite number > 0, got {self.temperature}")
