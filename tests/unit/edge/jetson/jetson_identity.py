"""Device-identity texts for the Jetson tests, from two places:

- the project's own, ``tests/fixtures/jetson/identity/`` (the default): written by hand in the layouts the
  device's files and tools print (each file's header says what it models). Always present, so the
  deployment tests and the fact parsers run on every clone;
- real strings captured by other people, ``../shared/data/jetson_fixtures/identity/`` (provenance in its
  SOURCES.md; ``real=True``): another repository's data, read in place and never copied into this one.
  Tests that need them skip naming the missing file and where it was expected (``$SMARTEXIT_SHARED``
  points elsewhere).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[4]
PROJECT_IDENTITY = REPO / "tests" / "fixtures" / "jetson" / "identity"


def shared_dir() -> Path:
    env = os.environ.get("SMARTEXIT_SHARED")
    return Path(env) if env else REPO.parent / "shared"


IDENTITY = shared_dir() / "data" / "jetson_fixtures" / "identity"


def identity_file(name: str, real: bool = False) -> Path:
    """The project's fixture ``name``, or (``real``) the shared capture of that name; a missing shared file
    skips the calling test, naming it."""
    if not real:
        return PROJECT_IDENTITY / name
    path = IDENTITY / name
    if not path.is_file():
        pytest.skip(f"real Jetson identity file {name!r} not found: expected at {path} (the shared fixtures: "
                    f"../shared/data/jetson_fixtures beside the repository, or $SMARTEXIT_SHARED/data/"
                    f"jetson_fixtures; read in place, never copied into the repository)")
    return path


def blocks(name: str, real: bool = False) -> list[tuple[str, str]]:
    """(separator line, content) of each '=== ...' block of an identity file; the comment lines before the
    first separator are the file's header, not content (inside a block, a leading '#' is file content)."""
    out: list[tuple[str, list[str]]] = []
    for line in identity_file(name, real).read_text().splitlines():
        if line.startswith("=== "):
            out.append((line[4:], []))
        elif out:
            out[-1][1].append(line)
    return [(head, "\n".join(body) + "\n") for head, body in out]


def block(name: str, starts: str, real: bool = False) -> str:
    """The content of the block whose separator starts with ``starts``."""
    found = [text for head, text in blocks(name, real) if head.startswith(starts)]
    assert found, f"no block starting {starts!r} in {name}"
    return found[0]
