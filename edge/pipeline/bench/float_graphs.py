"""The distilled float model's graphs, for benchmarks that compare a compressed run against it.

A compressed run's ``export`` stage writes the graphs of the compressed model (``<run>/onnx``, with
exits; ``<run>/onnx_full``, full depth). The float model's are exported here on first use, under
``<run>/bench/float_onnx/{exits,full}``, gated on fused parity with the float model, and reused
while their ``graphs.json`` names the distilled checkpoint's hash. For a run that is not compressed
the run's own export is the float model's.
"""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from edge.core.artifacts import Manifest, sha256_path
from edge.core.errors import ArtifactError
from edge.runtime.graphs import verify_graphs

FLOAT_DIR = "float_onnx"


def float_graphs(manifest: Manifest, prompts: list[list[int]]) -> dict[str, Path]:
    """{"exits": graphs with exit heads, "full": full-depth graphs} of the distilled float model.

    Args:
        manifest: the run's manifest (distill, and export when the run is not compressed).
        prompts: held-out prompts for the parity gate of a fresh export.

    Raises:
        ArtifactError: a fresh export failed its parity gate (nothing is kept then).
    """
    distilled = manifest.verified_output("distill", "checkpoint")
    if manifest.served_checkpoint() == distilled:  # not compressed: the run's own export is the float model's
        return {"exits": manifest.verified_output("export", "graphs"),
                "full": manifest.verified_output("export", "graphs_full")}
    sha = sha256_path(distilled)
    root = manifest.run_dir / "bench" / FLOAT_DIR
    out = {"exits": root / "exits", "full": root / "full"}
    try:
        for p in out.values():
            verify_graphs(p, sha)
        return out
    except ArtifactError:
        pass  # absent or of another checkpoint: export below
    from edge.model.exits import load_multi_exit
    from edge.pipeline.export import full_depth
    from exporters.onnx_config import ExportConfig
    from exporters.onnx_export import export_onnx
    from exporters.fused_parity import check_fused_parity
    from exporters.parity import require_parity

    model = load_multi_exit(distilled)
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".float-onnx.", dir=root))
    try:
        for key, m in (("exits", model), ("full", full_depth(model))):
            export_onnx(m, staging / key, ExportConfig(), checkpoint_sha256=sha)
            require_parity(check_fused_parity(m, staging / key, prompts))
        for key, path in out.items():
            shutil.rmtree(path, ignore_errors=True)
            (staging / key).rename(path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out
