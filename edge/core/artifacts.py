"""The artifacts folder: atomic writes, content hashes and ``manifest.json``.

Every stage reads from and writes to ``artifacts/<run>/``. The manifest records,
per stage, its inputs with their sha256, its config, its outputs with their
sha256, its metrics, package versions and time. A stage that consumes another
stage's output calls :meth:`Manifest.verified_output`, which refuses a file whose
hash is not the one recorded when it was produced.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import shutil
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Iterator

from edge.core.errors import ArtifactError

STAGE_TIME_FORMAT = "%Y-%m-%dT%H:%M:%SZ"  # a stage record's "time": when it ended, UTC (time.strftime / strptime)

_VERSIONED = ("smartexit", "torch", "numpy", "safetensors", "tokenizers", "transformers", "onnx",
              "onnxruntime", "scikit-learn")


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; rename it over ``path`` only if the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        os.chmod(tmp_path, 0o644)  # mkstemp creates 0600; artifacts are ordinary readable files
        os.replace(tmp_path, path)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


@contextlib.contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """Yield a temporary folder; it replaces ``path`` as a whole only if the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        yield tmp
        os.chmod(tmp, 0o755)
        if path.exists():
            old = path.with_name(f".{path.name}.old.{os.getpid()}")
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old)
        else:
            os.replace(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def publish_files(folder: str | Path, writers: dict[str, Callable[[Path], Any]]) -> list[Path]:
    """Write files into a shared ``folder`` (one that other stages also write to) without touching the rest:
    each ``writers[name](path)`` writes its file to a temporary folder beside ``folder``; only when every
    one has succeeded is each renamed into ``folder`` (an existing file of that name replaced). A failing
    writer leaves ``folder`` as it was.

    Returns:
        The published paths, in the order of ``writers``.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{folder.name}.", dir=folder.parent) as tmp_dir:
        tmp = Path(tmp_dir)
        for name, write in writers.items():
            write(tmp / name)
        out = []
        for name in writers:
            os.chmod(tmp / name, 0o644)
            os.replace(tmp / name, folder / name)
            out.append(folder / name)
    return out


def atomic_write_text(path: str | Path, text: str) -> Path:
    with atomic_path(path) as tmp:
        tmp.write_text(text)
    return Path(path)


def atomic_write_json(path: str | Path, obj: Any) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=_json_default) + "\n")


def _json_default(o: Any) -> Any:
    if hasattr(o, "item"):
        return o.item()
    if hasattr(o, "tolist"):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def sha256_path(path: str | Path) -> str:
    """sha256 of a file, or of a folder (relative names and file hashes, sorted). Hidden entries
    (a name starting with '.', at any depth) are derived caches, such as ONNX Runtime's optimised
    graphs in ``.ort_cache/``, and are not part of the artifact."""
    path = Path(path)
    if path.is_file():
        return sha256_file(path)
    if not path.is_dir():
        raise ArtifactError(f"{path} does not exist")
    h = hashlib.sha256()
    files = (p for p in path.rglob("*") if p.is_file()
             and not any(part.startswith(".") for part in p.relative_to(path).parts))
    for f in sorted(files):
        h.update(f.relative_to(path).as_posix().encode() + b"\0" + sha256_file(f).encode() + b"\n")
    return h.hexdigest()


def package_versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in _VERSIONED:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


class Manifest:
    """``artifacts/<run>/manifest.json``: what each stage read, did and wrote."""

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "manifest.json"
        if self.path.is_file():
            try:
                self.data = json.loads(self.path.read_text())
            except json.JSONDecodeError as exc:
                raise ArtifactError(f"{self.path} is not valid JSON: {exc}") from exc
        else:
            self.data = {"run": self.run_dir.name, "stages": {}}

    def rel(self, path: str | Path) -> str:
        path = Path(path).resolve()
        try:
            return path.relative_to(self.run_dir.resolve()).as_posix()
        except ValueError:
            return str(path)

    def _abs(self, rel: str) -> Path:
        p = Path(rel)
        return p if p.is_absolute() else self.run_dir / p

    def stage(self, name: str) -> dict[str, Any]:
        try:
            return self.data["stages"][name]
        except KeyError:
            raise ArtifactError(f"{self.path}: stage {name!r} has not run in this run folder") from None

    def verified_output(self, stage: str, key: str) -> Path:
        """Path of ``stage``'s output ``key`` after checking its hash against the record.

        Raises:
            ArtifactError: the stage or output is not recorded, the file is gone, or its
                sha256 differs from the one recorded when the stage wrote it.
        """
        rec = self.stage(stage).get("outputs", {}).get(key)
        if rec is None:
            raise ArtifactError(f"{self.path}: stage {stage!r} recorded no output {key!r}")
        path = self._abs(rec["path"])
        if not path.exists():
            raise ArtifactError(f"{path} (output {key!r} of stage {stage!r}) is missing")
        actual = sha256_path(path)
        if actual != rec["sha256"]:
            raise ArtifactError(
                f"{path} changed since stage {stage!r} wrote it: sha256 {actual[:16]}... != recorded "
                f"{rec['sha256'][:16]}...; re-run {stage!r}"
            )
        return path

    def served_checkpoint(self) -> Path:
        """The checkpoint this run serves: the ``compress`` stage's output where that stage ran, else
        ``distill``'s.

        Raises:
            ArtifactError: as :meth:`verified_output`, or the distilled checkpoint changed after
                ``compress`` read it (a compressed model of another checkpoint is an error).
        """
        distilled = self.verified_output("distill", "checkpoint")
        if "compress" not in self.data["stages"]:
            return distilled
        read = self.stage("compress").get("inputs", {}).get("checkpoint", {}).get("sha256")
        if read != sha256_path(distilled):
            raise ArtifactError(f"{self.path}: the distilled checkpoint changed after stage 'compress' read it; "
                                "re-run 'compress'")
        return self.verified_output("compress", "checkpoint")

    def record(self, stage: str, *, inputs: dict[str, str | Path], config: dict[str, Any],
               outputs: dict[str, str | Path], metrics: dict[str, Any], seconds: float) -> None:
        """Record a finished stage (hashing its inputs and outputs) and rewrite the manifest atomically."""
        self.data["stages"][stage] = {
            "inputs": {k: {"path": self.rel(p), "sha256": sha256_path(p)} for k, p in inputs.items()},
            "config": config,
            "outputs": {k: {"path": self.rel(p), "sha256": sha256_path(p)} for k, p in outputs.items()},
            "metrics": metrics,
            "versions": package_versions(),
            "time": time.strftime(STAGE_TIME_FORMAT, time.gmtime()),
            "seconds": round(seconds, 3),
        }
        atomic_write_json(self.path, self.data)
