"""What every stage after distillation starts with: the run's verified multi-exit checkpoint."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from edge.core.artifacts import Manifest
from edge.compress.checkpoint import load_served
from edge.model.exits import MultiExitModel
from edge.model.tokenizer import load_tokenizer


@dataclass
class RunCheckpoint:
    manifest: Manifest
    path: Path  # the multi-exit checkpoint folder, hash-checked against the manifest
    model: MultiExitModel
    tokenizer: object


def open_run(run_dir: str | Path, threads: int) -> RunCheckpoint:
    """Load the checkpoint ``distill`` wrote in ``run_dir`` (refused if it changed since)."""
    torch.set_num_threads(threads)
    manifest = Manifest(run_dir)
    path = manifest.served_checkpoint()
    return RunCheckpoint(manifest, path, load_served(path), load_tokenizer(path))
