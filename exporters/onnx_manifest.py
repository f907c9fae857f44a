"""What an export wrote, as ``graphs.json`` records it: each graph's file, I/O names, hashes and checker
answer (:class:`GraphInfo`), and the whole export (:class:`ExportManifest`: exits, segments, checkpoint,
opset, model dimensions, the ONNX Runtime graphs)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import onnx

from edge.runtime.graphs import FUSED_DIR, GRAPHS_FORMAT


@dataclass
class GraphInfo:
    """One exported graph: file, I/O names, content hash (and its external data file, if any)."""

    file: str
    inputs: list[str]
    outputs: list[str]
    sha256: str
    external_data: str | None = None
    external_data_sha256: str | None = None
    checker: str | None = None  # what onnx.checker.check_model answered for this file (None: not run)


@dataclass
class ExportManifest:
    """What :func:`export_onnx` wrote; ``to_dict`` is the content of ``graphs.json``."""

    out_dir: Path
    exit_layers: list[int]  # 1-based, last = num_layers
    segments: list[dict[str, Any]]  # {"index", "exit_layer" (1-based), "layers" (0-based indices)}
    graphs: dict[str, GraphInfo]  # "embed", "segment_{i}", "kvfill_{i}", "head"
    checkpoint_sha256: str
    opset: int
    model: dict[str, Any] = field(default_factory=dict)  # hidden_size, num_kv_heads, head_dim, vocab_size, gated...
    fused: dict[str, GraphInfo] = field(default_factory=dict)  # the ONNX Runtime graphs, in FUSED_DIR
    fused_skipped: str | None = None  # why there are none
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": GRAPHS_FORMAT,
            "exit_layers": self.exit_layers,
            "segments": self.segments,
            "graphs": {k: asdict(v) for k, v in self.graphs.items()},
            "checkpoint_sha256": self.checkpoint_sha256,
            "opset": self.opset,
            "checker": {"onnx": onnx.__version__},  # and each graph's answer under graphs.<name>.checker
            "model": self.model,
            "fused": {"dir": FUSED_DIR, "graphs": {k: asdict(v) for k, v in self.fused.items()}} if self.fused else None,
            "fused_skipped": self.fused_skipped,
            "seconds": round(self.seconds, 3),
        }
