"""The corpus split and the shipped calibration / test text."""
from __future__ import annotations

import hashlib
import json

from edge.core.data import DATA_DIR, Split, load_split, split_of


def test_split_is_deterministic_and_by_path():
    assert split_of("json/decoder.py") == split_of("json/decoder.py")
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
