"""The layering is a contract (pyproject.toml, [tool.importlinter]); these tests keep it from rotting."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from edge.core.errors import ConfigError
from edge.runtime.backend import BUILTIN_BACKENDS, backend_names, make_backend

ROOT = Path(__file__).parents[2]


def test_import_contracts_are_kept():
    """`lint-imports` (import-linter) checks every contract in pyproject.toml: layers point down, the
    serving path imports no torch, directly or through anything it imports, and no module or package
    imports its way back to itself (lazy imports inside functions count)."""
    out = subprocess.run([sys.executable, "-c", "from importlinter.cli import lint_imports_command; "
                          "lint_imports_command()", "--no-cache"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "Contracts: 3 kept, 0 broken." in out.stdout


def test_backends_register_through_entry_points():
    assert {"torch", "onnxruntime"} <= set(backend_names())
    with pytest.raises(ConfigError, match="unknown backend 'tpu'.*onnxruntime"):
        make_backend("tpu")
    with pytest.raises(ConfigError, match="needs the model"):
        make_backend("torch")
    with pytest.raises(ConfigError, match="needs graphs_dir"):
        make_backend("onnxruntime")


def test_builtin_backends_are_the_declared_entry_points():
    """The factory finds the package's own backends without its metadata (a Triton bundle's copy); the table
    it reads must be what pyproject.toml declares, or an installed and a copied package would differ."""
    import tomllib

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["smartexit.backends"]
    assert declared == BUILTIN_BACKENDS
