"""The engine the ``calibrate`` stage (:mod:`edge.pipeline.calibrate`) certifies on, as it will be served: torch over
the model, or the export's ONNX Runtime graphs, and the export's corpus n-gram table its context lookup may fall
back to."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from calibration.freerun import Served
from edge.core.errors import ArtifactError, CheckpointError, ConfigError
from edge.model.exits import read_exits_json
from edge.pipeline.calibrate_config import CalibBackend, CalibrateConfig


def served_engine(choice: CalibBackend, manifest, ckpt: Path, model, threads: int) -> Served:
    """The engine calibration runs: torch over ``model``, or the export's ONNX Runtime graphs of ``ckpt``.

    Raises:
        ConfigError: onnxruntime asked for (or implied by a compressed checkpoint) without an export of
            this checkpoint.
    """
    from edge.runtime.backend import make_backend  # onnxruntime's module is imported only now

    compressed = "compressed_from" in read_exits_json(ckpt).get("source", {})
    if choice is CalibBackend.TORCH or (choice is CalibBackend.AUTO and not compressed):
        return Served.torch(model)
    try:
        graphs = manifest.verified_output("export", "graphs")
        backend = make_backend("onnxruntime", graphs_dir=graphs, checkpoint=ckpt, threads=threads)
    except (ArtifactError, CheckpointError, ConfigError) as exc:
        why = "a compressed model is calibrated on the graphs that serve it" if compressed else "backend=onnxruntime"
        raise ConfigError(f"calibrate: {why}, but there is no current export of {ckpt} ({exc}); run `smartexit "
                          f"export run_dir={manifest.run_dir}` first (or backend=torch)") from exc
    return Served(backend)


def corpus_table(cfg: CalibrateConfig, manifest, model) -> Any:
    """The export's corpus n-gram table for the context lookup to fall back to (``lookup_corpus``, a shortlist
    model, a current export that has one), else None: the rule then reads the context alone, and its table
    says so (a calibration before any export, on the torch model, is one)."""
    from edge.runtime.graphs import load_ngram_table

    if not (cfg.lookup_corpus and model.has_shortlist):
        return None
    try:
        return load_ngram_table(manifest.verified_output("export", "graphs"))
    except ArtifactError:
        return None
