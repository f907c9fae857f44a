"""What every stage after distillation starts with: the run, verified.

:func:`open_run` checks the run's served checkpoint against its manifest; the rest is read on first
use, each artifact hash-checked against the manifest that recorded it: the tokenizer, the model, the
export's graphs, the threshold table (bound to the checkpoint), its rule and K/V mode, held-out prompts.
One preamble for every stage and benchmark, so none re-reads a run its own way.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from calibration.table import TableRule, ThresholdTable, load_table
from edge.compress.checkpoint import load_served
from edge.core.artifacts import Manifest
from edge.core.data import Document, Split, heldout_prompts, load_split
from edge.core.errors import ConfigError
from edge.model.exits import MultiExitModel
from edge.model.tokenizer import load_tokenizer
from edge.runtime.engine_config import KVMode


@dataclass
class Run:
    manifest: Manifest
    path: Path  # the served multi-exit checkpoint folder (compressed where compress ran), hash-checked
    threads: int
    _test: list[Document] | None = field(default=None, repr=False)

    @cached_property
    def tokenizer(self) -> Any:
        return load_tokenizer(self.path)

    @cached_property
    def model(self) -> MultiExitModel:
        """The served model (torch)."""
        return load_served(self.path)

    def graphs(self, full: bool = False) -> Path:
        """The export's folder: the exits graphs, or (``full``) the same decoder without exit heads."""
        return self.manifest.verified_output("export", "graphs_full" if full else "graphs")

    @cached_property
    def thresholds(self) -> Path:
        return self.manifest.verified_output("calibrate", "thresholds")

    @cached_property
    def table(self) -> ThresholdTable:
        """The calibrated table, refused unless it was calibrated for this checkpoint."""
        return load_table(self.thresholds, self.path)

    @property
    def rule(self) -> TableRule:
        return TableRule(self.table)

    @property
    def kv_mode(self) -> KVMode:
        """The K/V mode the table was certified for."""
        return KVMode(self.table.kv_mode)

    def prompts(self, n: int, length: int, seed: int) -> list[list[int]]:
        """``n`` held-out prompts of ``length`` tokens (the test split; seeded)."""
        if self._test is None:
            self._test = load_split(Split.TEST)
        return heldout_prompts(self.tokenizer, self._test, n, length, seed)


def check_threads(threads: int, key: str = "threads") -> None:
    """Refuse a torch / ONNX Runtime thread count below 1 (``torch.set_num_threads(0)`` raises; ORT reads 0 as
    "its default", which is not what a user who typed it meant).

    Raises:
        ConfigError: naming ``key`` and the value.
    """
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ConfigError(f"{key} must be a whole number >= 1, got {threads!r}")


def open_run(run_dir: str | Path, threads: int) -> Run:
    """The run in ``run_dir`` with torch at ``threads`` threads.

    Raises:
        ConfigError: ``threads`` is not a whole number >= 1 (torch refuses anything else, with a traceback).
        ArtifactError: the checkpoint is missing or changed since ``distill`` (or ``compress``) wrote it.
    """
    check_threads(threads)
    torch.set_num_threads(threads)
    manifest = Manifest(run_dir)
    path = manifest.served_checkpoint()
    return Run(manifest, path, threads)
