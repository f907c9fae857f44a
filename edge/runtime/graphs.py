"""The export folder's table of contents, ``graphs.json``: what the runtime reads to run an export.

``exporters/onnx_export.py`` writes it; the runtime (ONNX Runtime backend, Triton model, TensorRT
engine builder) reads and verifies it with the functions here, so serving needs the export folder
and nothing from the exporter (no torch).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from edge.core.artifacts import sha256_file
from edge.core.errors import ArtifactError

GRAPHS_JSON = "graphs.json"
GRAPHS_FORMAT = 7  # 2: segment graphs output exit_stats, exit_token; 3: exit head on exit_index rows only;
# 4: fused ONNX Runtime graphs (exporters/ort_fused.py) beside the portable ones, model.max_positions;
# 5: one LM head graph ("head") for every exit, segments end at exit_hidden; model.gated
# 6: fused segments' exit_index is the first of the rows whose exit hidden is output (all rows for a
# self-speculative verification call)
# 7: model.shortlist (the candidate token ids of decision exits, [] for none): with one, decision segments
# check their candidates in the graph (exit_tokens, exit_logits, exit_features, exit_score); fused "full",
# every layer in one graph; shortlist_rows.npy
FUSED_DIR = "fused"
SHORTLIST_ROWS = "shortlist_rows.npy"  # float32 [K, D]: the LM head's rows of a candidate shortlist
NGRAM_TABLE = "ngram.npz"  # == edge.model.ngram.NGRAM_FILE; the corpus n-gram table of mode exact's corpus drafts (edge/model/ngram.py), if built


def load_ngram_table(graphs_dir: str | Path):
    """The export's corpus n-gram table (:class:`edge.model.ngram.NgramTable`: mode exact's corpus drafts, and
    the table an exit rule's context lookup may fall back to), or None where the export has none."""
    from edge.model.ngram import NgramTable

    path = Path(graphs_dir) / NGRAM_TABLE
    return NgramTable.load(path) if path.is_file() else None


def load_graphs_json(graphs_dir: str | Path) -> dict[str, Any]:
    """Read ``graphs.json`` of an export folder.

    Raises:
        ArtifactError: missing, not JSON, or not a graphs.json this module wrote.
    """
    path = Path(graphs_dir) / GRAPHS_JSON
    if not path.is_file():
        raise ArtifactError(f"{path} is missing: {graphs_dir} is not an ONNX export folder (run `smartexit export`)")
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ArtifactError(f"{path} is not valid JSON: {exc}") from exc
    if meta.get("format") != GRAPHS_FORMAT or not isinstance(meta.get("graphs"), dict):
        raise ArtifactError(f"{path}: expected format {GRAPHS_FORMAT} with a 'graphs' table, "
                            f"got format {meta.get('format')!r} (an export from an older SmartExit: re-run "
                            f"`smartexit export`)")
    return meta


def verify_graphs(graphs_dir: str | Path, checkpoint_sha256: str) -> dict[str, Any]:
    """Check that the graphs in ``graphs_dir`` are the ones exported from ``checkpoint_sha256``.

    Returns:
        The parsed ``graphs.json``.

    Raises:
        ArtifactError: the export is of another checkpoint, or a graph file (or its external
            data) is missing or its sha256 differs from the one recorded at export time.
    """
    graphs_dir = Path(graphs_dir)
    meta = load_graphs_json(graphs_dir)
    recorded = meta.get("checkpoint_sha256")
    if recorded != checkpoint_sha256:
        raise ArtifactError(
            f"{graphs_dir / GRAPHS_JSON}: graphs were exported from checkpoint sha256 {recorded}, "
            f"expected {checkpoint_sha256}; re-export for this checkpoint")
    fused = (meta.get("fused") or {}).get("graphs", {})
    rows = meta.get("model", {}).get("shortlist_rows")
    extra = [("shortlist rows", rows)] if rows else []
    for name, g in [*meta["graphs"].items(), *((f"fused/{k}", v) for k, v in fused.items()), *extra]:
        for file, want in ((g["file"], g["sha256"]), (g.get("external_data"), g.get("external_data_sha256"))):
            if file is None:
                continue
            path = graphs_dir / file
            if not path.is_file():
                raise ArtifactError(f"{path} (graph {name!r}) is missing")
            actual = sha256_file(path)
            if actual != want:
                raise ArtifactError(
                    f"{path} (graph {name!r}) sha256 {actual} != recorded {want}: the file changed after export "
                    f"(a segment graph from another checkpoint?); re-export")
    return meta


def shortlist_act_scale(meta: dict[str, Any]) -> float | None:
    """The activation scale a W8A8 head quantizes the exit hidden with before the candidate product, as the
    export recorded it beside the shortlist rows (None: float activations, or no shortlist)."""
    rec = meta.get("model", {}).get("shortlist_rows") or {}
    return None if rec.get("act_scale") is None else float(rec["act_scale"])


def shortlist_rows(graphs_dir: str | Path, meta: dict[str, Any]):
    """The LM head's rows of the export's candidate shortlist, float32 [K, D] (None without a shortlist).

    Raises:
        ArtifactError: graphs.json names a rows file that is missing or changed.
    """
    import numpy as np

    rec = meta.get("model", {}).get("shortlist_rows")
    if not rec:
        return None
    path = Path(graphs_dir) / rec["file"]
    if not path.is_file() or sha256_file(path) != rec["sha256"]:
        raise ArtifactError(f"{path} (the shortlist's LM-head rows) is missing or changed after export; re-export")
    return np.load(path).astype(np.float32)
