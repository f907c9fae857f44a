"""tests/fixtures holds only what this project wrote. Real device captures by other people live in
../shared/data/jetson_fixtures (another repository's data): read in place, never committed here. Each
fixture says in its header that the project wrote it, and none repeats a real capture's line."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"
SHARED = Path(os.environ.get("SMARTEXIT_SHARED") or REPO.parent / "shared") / "data" / "jetson_fixtures"
# lines every device prints the same (file-format constants, not anyone's measurement)
FORMAT_LINES = {"TARGET_USERSPACE_LIB_DIR_PATH=usr/lib/aarch64-linux-gnu/nvidia",
                "Serial Number: [XXX Show with: jetson_release -s XXX]"}


def fixture_files() -> list[Path]:
    return sorted(p for p in FIXTURES.rglob("*") if p.is_file() and p.name != "README.md")


def test_every_fixture_says_the_project_wrote_it():
    files = fixture_files()
    assert len(files) >= 10, f"the fixtures are missing from {FIXTURES}"
    unmarked = [str(p.relative_to(REPO)) for p in files if "Written by the SmartExit project" not in p.read_text()]
    assert unmarked == [], f"fixtures without the header saying who wrote them and what they model: {unmarked}"


def test_no_real_capture_is_copied_into_the_fixtures():
    if not SHARED.is_dir():
        pytest.skip(f"the shared Jetson captures are not at {SHARED}: nothing to compare the fixtures with")
    real: dict[str, str] = {}
    for p in sorted(SHARED.rglob("*")):
        if p.is_file():
            for line in p.read_text(errors="replace").splitlines():
                if len(line.strip()) >= 40 and line.strip() not in FORMAT_LINES:
                    real.setdefault(line.strip(), str(p.relative_to(SHARED)))
    copied = [f"{p.relative_to(REPO)}:{n} repeats {real[line.strip()]}"
              for p in fixture_files() for n, line in enumerate(p.read_text().splitlines(), 1)
              if line.strip() in real]
    assert real and copied == [], copied
