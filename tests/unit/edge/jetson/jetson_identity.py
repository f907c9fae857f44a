"""The real device-identity strings in ``../shared/data/jetson_fixtures/identity/`` (provenance in its
SOURCES.md), read in place: never copied into the repository. Tests that need them skip with the reason
where the folder is absent (``$SMARTEXIT_SHARED`` points elsewhere)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[4]


def shared_dir() -> Path:
    env = os.environ.get("SMARTEXIT_SHARED")
    return Path(env) if env else REPO.parent / "shared"


IDENTITY = shared_dir() / "data" / "jetson_fixtures" / "identity"


def identity_file(name: str) -> Path:
    path = IDENTITY / name
    if not path.is_file():
        pytest.skip(f"shared Jetson identity fixtures not found at {path} (set SMARTEXIT_SHARED to the folder "
                    f"holding data/jetson_fixtures)")
    return path


def blocks(name: str) -> list[tuple[str, str]]:
    """(separator line, content) of each '=== ...' block of an identity file; the comment lines before the
    first separator are the file's header, not content (inside a block, a leading '#' is file content)."""
    out: list[tuple[str, list[str]]] = []
    for line in identity_file(name).read_text().splitlines():
        if line.startswith("=== "):
            out.append((line[4:], []))
        elif out:
            out[-1][1].append(line)
    return [(head, "\n".join(body) + "\n") for head, body in out]


def block(name: str, starts: str) -> str:
    """The content of the block whose separator starts with ``starts``."""
    found = [text for head, text in blocks(name) if head.startswith(starts)]
    assert found, f"no block starting {starts!r} in {name}"
    return found[0]
