"""docs/architecture.md agrees with the folder tree: every package folder is a box of its picture and a row
of its table, every module of a folder is named in that row, and every module a row names exists."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parents[2]
DOC = ROOT / "docs" / "architecture.md"
PACKAGES = ("edge", "calibration", "exporters", "scheduler")


def _folders() -> dict[str, set[str]]:
    """Every folder of the packages that holds modules -> its modules' file names (``__init__`` aside)."""
    out: dict[str, set[str]] = {}
    for pkg in PACKAGES:
        for init in (ROOT / pkg).rglob("__init__.py"):
            folder = init.parent
            modules = {p.name for p in folder.glob("*.py") if p.name != "__init__.py"}
            if modules:
                out[folder.relative_to(ROOT).as_posix() + "/"] = modules
    return out


def _rows(text: str) -> dict[str, str]:
    """Table rows ``| `folder/` | ... |`` -> the row's text."""
    return {m.group(1): m.group(2) for m in re.finditer(r"^\| `([a-z_/]+/)` \|(.*)\|$", text, re.M)}


def test_every_folder_is_in_the_picture_and_the_table():
    text = DOC.read_text()
    picture = text.split("```")[1]
    rows = _rows(text)
    folders = _folders()
    assert set(folders) == set(rows), ("folders without a row: " f"{sorted(set(folders) - set(rows))}; rows without "
                                       f"a folder: {sorted(set(rows) - set(folders))}")
    missing = [f for f in folders if re.search(rf"(^|\s){re.escape(f)}(\s|$)", picture, re.M) is None]
    assert not missing, f"folders that are not a box of the picture: {missing}"


def test_every_module_is_named_in_its_folders_row_and_nothing_else():
    rows = _rows(DOC.read_text())
    for folder, modules in _folders().items():
        named = set(re.findall(r"`([a-z_0-9]+\.py)`", rows.get(folder, "")))
        assert modules - named == set(), f"{folder}: modules not named in docs/architecture.md: {sorted(modules - named)}"
        assert named - modules == set(), f"{folder}: docs/architecture.md names modules that are not there: " \
                                         f"{sorted(named - modules)}"


def test_the_check_would_catch_a_missing_module(tmp_path):
    """The row parser reads what a row names: a row without a module is caught (the check can fail)."""
    rows = _rows("| `edge/core/` | `errors.py` (the errors) |\n")
    assert set(re.findall(r"`([a-z_0-9]+\.py)`", rows["edge/core/"])) == {"errors.py"}
    assert _folders()["edge/core/"] - {"errors.py"}, "edge/core has more modules than the stand-in row names"
