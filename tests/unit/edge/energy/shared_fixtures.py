"""Where the Jetson fixtures of the energy tests live.

- ``PROJECT_TEGRASTATS`` / ``PROJECT_JTOP``: ``tests/fixtures/{tegrastats,jtop}``, written by this project
  (each file's header says what it models). Always present: the parsers are tested on every clone.
- ``TEGRASTATS`` / ``JTOP``: real captures made on devices by other people, in
  ``../shared/data/jetson_fixtures`` beside the repository or ``$SMARTEXIT_SHARED/data/jetson_fixtures``.
  Another repository's data: read in place, never copied into this one; the tests that need them skip
  naming the missing file and where it was looked for.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[4]
PROJECT_TEGRASTATS = REPO / "tests" / "fixtures" / "tegrastats"
PROJECT_JTOP = REPO / "tests" / "fixtures" / "jtop"


def shared_dir() -> Path:
    env = os.environ.get("SMARTEXIT_SHARED")
    return Path(env) if env else REPO.parent / "shared"


FIXTURES = shared_dir() / "data" / "jetson_fixtures"
TEGRASTATS = FIXTURES / "tegrastats"
JTOP = FIXTURES / "jtop"


def skip_without(path: Path) -> None:
    """Skip the calling test where the real capture ``path`` is absent, naming it and where it was expected."""
    if not path.exists():
        what = "file" if path.suffix else "folder"
        pytest.skip(f"real Jetson capture {what} {path.name!r} not found: expected at {path} (the shared fixtures: "
                    f"../shared/data/jetson_fixtures beside the repository, or $SMARTEXIT_SHARED/data/"
                    f"jetson_fixtures; read in place, never copied into the repository)")


def tegrastats_logs() -> list[str]:
    """Every real tegrastats log's file name (collected at import: an absent folder gives none, and the
    tests that iterate them skip with the reason)."""
    return sorted(p.name for p in TEGRASTATS.glob("*.log")) if TEGRASTATS.is_dir() else []


def fixture_lines(path: Path) -> list[str]:
    """The non-blank lines of a fixture written by this project, its ``#`` header left out (tegrastats
    and jtop never print such lines; the header says who wrote the file and what it models)."""
    return [line for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]
