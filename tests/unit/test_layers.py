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


PROJECT = ("edge", "calibration", "exporters", "scheduler")


def _project_imports() -> list[tuple[str, int, str, str]]:
    """(file, line, module, name) of every ``from <project module> import name`` in product code,
    those inside functions included."""
    import ast

    out = []
    for pkg in PROJECT:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                        and node.module.split(".")[0] in PROJECT:
                    out += [(str(path.relative_to(ROOT)), node.lineno, node.module, a.name) for a in node.names]
    return out


def test_every_project_import_names_something_that_exists():
    """A lazy import (inside a function) of a name that a refactoring removed fails only when that
    function runs, which may be a stage no test reaches (``bench crosscheck`` imported a removed
    ``bench_serve._capacity``); here every one resolves: the module imports and has the name, or the
    name is a submodule. A module whose own third-party import is absent here (TensorRT, say) is
    skipped by name, not silently."""
    import importlib

    imports = _project_imports()
    assert len(imports) > 500, "the scan must see the project's imports"
    missing, unavailable = [], set()
    for file, line, module, name in imports:
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.split(".")[0] in PROJECT:
                missing.append(f"{file}:{line}: no module {module}")
            else:
                unavailable.add(f"{module} ({exc.name})")
            continue
        if name != "*" and not hasattr(mod, name):
            try:
                importlib.import_module(f"{module}.{name}")
            except ModuleNotFoundError:
                missing.append(f"{file}:{line}: {module} has no {name}")
    assert not missing, "\n".join(missing)
    assert len(unavailable) <= 3, f"too many modules skipped for an absent dependency: {sorted(unavailable)}"
