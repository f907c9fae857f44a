"""Where the shared Jetson fixtures live: ``../shared/data/jetson_fixtures`` beside the repository, or
``$SMARTEXIT_SHARED/data/jetson_fixtures``. They are read in place, never copied into the repository;
tests that need them skip with the reason where they are absent."""
from __future__ import annotations

import os
from pathlib import Path

import pytest


def shared_dir() -> Path:
    env = os.environ.get("SMARTEXIT_SHARED")
    return Path(env) if env else Path(__file__).resolve().parents[4] / ".." / "shared"


FIXTURES = shared_dir() / "data" / "jetson_fixtures"
TEGRASTATS = FIXTURES / "tegrastats"
JTOP = FIXTURES / "jtop"


def skip_without(path: Path) -> None:
    if not path.exists():
        pytest.skip(f"shared Jetson fixtures not found at {path.resolve()} (set SMARTEXIT_SHARED to the folder "
                    "holding data/jetson_fixtures)")


def tegrastats_logs() -> list[str]:
    """Every tegrastats log's file name (collected at import: an absent folder gives none, and the
    tests that iterate them skip with the reason)."""
    return sorted(p.name for p in TEGRASTATS.glob("*.log")) if TEGRASTATS.is_dir() else []
