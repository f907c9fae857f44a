"""The corpus split and the shipped calibration / test text."""
from __future__ import annotations

import hashlib
import json

from edge.core.data import DATA_DIR, Split, load_split, split_of


def test_split_is_deterministic_and_by_path():
    # known answers at the bucket edges, worked out from the rule (int(sha256(path)[:8], 16) % 100: 0-3
    # calibration, 4-7 test, the rest train): pkg/mod30.py b71347d4 -> 0, pkg/mod51.py 9383d633 -> 3,
    # pkg/mod10.py 6ed1ceb8 -> 4, pkg/mod1.py d2e67573 -> 7, pkg/mod174.py 59ba4b58 -> 8,
    # json/decoder.py 3b2e3cb3 -> 39. A changed hash, digest slice or bucket edge moves one of them.
    paths = ["pkg/mod30.py", "pkg/mod51.py", "pkg/mod10.py", "pkg/mod1.py", "pkg/mod174.py", "json/decoder.py"]
    assert [split_of(p) for p in paths] == [Split.CALIBRATION, Split.CALIBRATION, Split.TEST, Split.TEST,
                                            Split.TRAIN, Split.TRAIN]
    counts = {s: 0 for s in Split}
    for i in range(5000):
        counts[split_of(f"pkg/mod{i}.py")] += 1
    assert 0.02 < counts[Split.CALIBRATION] / 5000 < 0.06
    assert 0.02 < counts[Split.TEST] / 5000 < 0.06


def test_shipped_splits_match_split_record():
    record = json.loads((DATA_DIR / "split.json").read_text())
    for split in (Split.CALIBRATION, Split.TEST):
        docs = load_split(split)
        rec = record["splits"][split.value]
        assert [d.path for d in docs] == rec["paths"]
        assert sum(len(d.text.encode()) for d in docs) == rec["bytes"]
        assert hashlib.sha256("\n".join(d.path for d in docs).encode()).hexdigest() == rec["paths_sha256"]
        assert all(split_of(d.path) is split for d in docs)
    calib = {d.path for d in load_split(Split.CALIBRATION)}
    test = {d.path for d in load_split(Split.TEST)}
    assert not calib & test
