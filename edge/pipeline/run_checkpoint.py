"""What every stage after distillation starts with: the run's verified multi-exit checkpoint."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from edge.core.artifacts import Manifest
from edge.model.exits import MultiExitModel, load_multi_exit
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
    path = manifest.verified_output("distill", "checkpoint")
    return RunCheckpoint(manifest, path, load_multi_exit(path), load_tokenizer(path))
