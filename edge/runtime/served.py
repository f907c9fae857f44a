"""Which backend serves an export: the choice file ``smartexit jetson serve`` writes, and the backend it names.

Read where a bundle is opened (scheduler.serving.bundle: Triton's model, the in-process host) and by the
benchmarks that measure the served backend on a device (``smartexit bench energy backend=served``).
Each backend's module is imported only when chosen (torch for torch_static, TensorRT for tensorrt).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from edge.core.errors import ArtifactError, ConfigError
from edge.runtime.backend import Backend, make_backend
from edge.runtime.graphs import load_ngram_table

CHOICE_FILE = Path("jetson") / "units" / "backend.json"  # in a run folder: where `smartexit jetson serve` writes it
ENGINES_DIR = Path("jetson") / "engines"  # in a run folder: the TensorRT plans of `make jetson-engines`
BACKEND_ENV = "SMARTEXIT_BACKEND_CONFIG"  # a JSON file: which backend serves the bundle (default ONNX Runtime)
SERVED_BACKENDS = ("onnxruntime", "onnxruntime_portable", "tensorrt", "torch_static")


def read_backend_choice(path: str | Path | None) -> dict[str, Any]:
    """The serving backend of a bundle: ``{"name": "onnxruntime"}`` (also without a file),
    ``{"name": "tensorrt", "engines_dir": DIR}`` (plans built on this device by ``make jetson-engines``) or
    ``{"name": "torch_static", "checkpoint": DIR, "device": "cuda", "dtype": "float32"}`` (the GPU path
    without engines: edge/runtime/static_backend.py; optional ``"pipeline": true``: each next decode segment
    launched before the exit's decision is read). ``smartexit jetson serve`` writes it.

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
    if not isinstance(choice.get("pipeline", False), bool):
        raise ConfigError(f"{path}: 'pipeline' must be true or false, got {choice['pipeline']!r:.50}")
    return choice


def open_backend(choice: dict[str, Any], graphs_dir: Path, checkpoint_sha256: str, threads: int,
                 prefill_threads: int = 0) -> Backend:
    """The backend ``choice`` names over the export in ``graphs_dir`` (a bundle or a run's ``onnx/``,
    already verified against ``checkpoint_sha256``), made by the one factory (edge.runtime.backend.make_backend):
    this maps a choice file's fields to its arguments, and torch_static's checkpoint must be that one.

    Raises:
        ArtifactError: torch_static's checkpoint is another; TensorRT engines of another export.
        MissingExtraError: TensorRT (or torch) is not installed here.
    """
    name = choice["name"]
    if name == "onnxruntime":
        return make_backend(name, graphs_dir=graphs_dir, checkpoint=None, threads=threads, prefill_threads=prefill_threads)
    if name == "onnxruntime_portable":  # the CPU reference of what TensorRT runs
        return make_backend(name, graphs_dir=graphs_dir, threads=threads)
    if name == "tensorrt":
        return make_backend(name, graphs_dir=graphs_dir, engines_dir=choice["engines_dir"])
    from edge.core.artifacts import sha256_path

    ckpt = Path(choice["checkpoint"])
    actual = sha256_path(ckpt) if ckpt.is_dir() else None
    if actual != checkpoint_sha256:
        raise ArtifactError(f"{ckpt}: {'sha256 ' + actual[:16] + '...' if actual else 'no checkpoint folder'}; the "
                            f"graphs were exported from checkpoint {checkpoint_sha256[:16]}...: torch_static must load "
                            f"that one")
    backend = make_backend(name, checkpoint=ckpt, device=choice.get("device"), dtype=choice.get("dtype", "float32"),
                           pipeline=choice.get("pipeline", False))
    backend.ngram_table = load_ngram_table(graphs_dir)  # the export's: the exit rule's lookup may fall back to it
    return backend
