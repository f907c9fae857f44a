"""Open a serving bundle (``smartexit repo``'s ``smartexit/1/bundle``) as an engine host.

What Triton's model.py calls at load, and what the in-process side of ``smartexit bench serve`` uses,
so both run the same files with the same settings. It lives here, above ``calibration`` and
``exporters``, because it needs both: the bundle's hashes (exporters.triton) and the calibrated rule
(calibration.table).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from calibration.table import TableRule, ThresholdTable
from edge.core.errors import ArtifactError, ConfigError
from edge.runtime.backend import Backend
from edge.runtime.graphs import verify_graphs
from edge.runtime.host import EngineHost
from exporters.triton import RepoConfig, read_bundle


BACKEND_ENV = "SMARTEXIT_BACKEND_CONFIG"  # a JSON file: which backend serves the bundle (default ONNX Runtime)
SERVED_BACKENDS = ("onnxruntime", "tensorrt", "torch_static")


def read_backend_choice(path: str | Path | None) -> dict[str, Any]:
    """The serving backend of a bundle: ``{"name": "onnxruntime"}`` (also without a file),
    ``{"name": "tensorrt", "engines_dir": DIR}`` (plans built on this device by ``make jetson-engines``) or
    ``{"name": "torch_static", "checkpoint": DIR, "device": "cuda", "dtype": "float32"}`` (the GPU path
    without engines: edge/runtime/static_backend.py). ``smartexit jetson serve`` writes it.

    Raises:
        ConfigError: unreadable, not a JSON object, an unknown name or a missing field.
    """
    if path is None:
        return {"name": "onnxruntime"}
    try:
        choice = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{BACKEND_ENV}={path}: not a readable JSON file ({exc})") from exc
    if not isinstance(choice, dict) or choice.get("name") not in SERVED_BACKENDS:
        raise ConfigError(f"{path}: a JSON object whose 'name' is one of {', '.join(SERVED_BACKENDS)} is expected, "
                          f"got {choice!r:.200}")
    need = {"tensorrt": "engines_dir", "torch_static": "checkpoint"}.get(choice["name"])
    if need and not isinstance(choice.get(need), str):
        raise ConfigError(f"{path}: backend {choice['name']!r} needs {need!r} (a folder on this machine)")
    return choice


def bundle_backend(bundle_dir: Path, checkpoint_sha256: str, threads: int, choice: dict[str, Any]) -> Backend:
    """The backend that serves ``bundle_dir`` (its graphs already verified), as ``choice`` says."""
    name = choice["name"]
    if name == "onnxruntime":
        from edge.runtime.ort_backend import OrtBackend  # directly: entry points need the package's metadata

        return OrtBackend(graphs_dir=bundle_dir, checkpoint=None, threads=threads)
    if name == "tensorrt":
        from edge.runtime.portable_backend import TensorRTBackend

        return TensorRTBackend(graphs_dir=bundle_dir, engines_dir=choice["engines_dir"])
    from edge.core.artifacts import sha256_path
    from edge.runtime.static_backend import StaticTorchBackend  # imports torch: only for this choice

    ckpt = Path(choice["checkpoint"])
    actual = sha256_path(ckpt) if ckpt.is_dir() else None
    if actual != checkpoint_sha256:
        raise ArtifactError(f"{ckpt}: {'sha256 ' + actual[:16] + '...' if actual else 'no checkpoint folder'}; the "
                            f"bundle was exported from checkpoint {checkpoint_sha256[:16]}...: torch_static must load "
                            f"that one")
    return StaticTorchBackend(checkpoint=ckpt, device=choice.get("device"), dtype=choice.get("dtype", "float32"))


def open_bundle(bundle_dir: str | Path, threads: int | None = None, backend: dict[str, Any] | None = None,
                **host_overrides: Any) -> EngineHost:
    """The engine host over a bundle (hash-checked) with the calibrated rule, on ONNX Runtime unless
    ``backend`` (:func:`read_backend_choice`'s dict; default: the file ``$SMARTEXIT_BACKEND_CONFIG``
    names) says otherwise.

    ``host_overrides``: RepoConfig fields that replace the bundle's (``max_seqs``, ``audit``, ...).
    """
    bundle_dir = Path(bundle_dir)
    info = read_bundle(bundle_dir)
    verify_graphs(bundle_dir, info["checkpoint_sha256"])
    choice = backend if backend is not None else read_backend_choice(os.environ.get(BACKEND_ENV) or None)
    table = ThresholdTable.from_dict(json.loads((bundle_dir / "thresholds.json").read_text()),
                                     source=str(bundle_dir / "thresholds.json"))
    if table.checkpoint_sha256 != info["checkpoint_sha256"]:
        raise ArtifactError(f"{bundle_dir}: thresholds.json was calibrated for checkpoint "
                            f"{table.checkpoint_sha256[:16]}..., the graphs for {info['checkpoint_sha256'][:16]}...")
    known = {k: v for k, v in info.get("host", {}).items() if k in RepoConfig.__dataclass_fields__}
    cfg = RepoConfig(**{**known, **host_overrides})
    backend = bundle_backend(bundle_dir, info["checkpoint_sha256"], threads if threads is not None else cfg.threads,
                             choice)
    host_cfg = cfg.host_config(backend.spec.max_positions, table.kv_mode)
    fractions = table.certificate.get("expected_exit_fraction") or {}
    expected = sum(int(k) * v for k, v in fractions.items()) if fractions else None
    return EngineHost(backend, host_cfg, TableRule(table), eps=table.certificate.get("epsilon"),
                      expected_exit_layer=expected)
