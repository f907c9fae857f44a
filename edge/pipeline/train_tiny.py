"""``smartexit train-tiny``: the stage. The work is :mod:`edge.training.train_tiny`'s; this module reads the run, calls it and
records what it made."""
from __future__ import annotations

from edge.training.train_tiny import TrainConfig, train


def main(cfg: TrainConfig) -> int:
    train(cfg)
    return 0
