"""Atomic writes and the manifest's hash checks."""
from __future__ import annotations

import pytest

from edge.core.artifacts import Manifest, atomic_dir, atomic_path, atomic_write_json, sha256_path
from edge.core.errors import ArtifactError


def test_atomic_path_failure_leaves_nothing(tmp_path):
    target = tmp_path / "out.bin"
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_bytes(b"half")
            raise RuntimeError("crash mid-write")
    assert list(tmp_path.iterdir()) == []


def test_atomic_path_failure_keeps_old_file(tmp_path):
    target = tmp_path / "out.json"
    atomic_write_json(target, {"v": 1})
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_text("garbage")
            raise RuntimeError
    assert target.read_text().strip().endswith("}") and '"v": 1' in target.read_text()
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]


def test_atomic_dir_replaces_whole_folder(tmp_path):
    target = tmp_path / "ckpt"
    with atomic_dir(target) as tmp:
        (tmp / "a").write_text("1")
    with pytest.raises(RuntimeError):
        with atomic_dir(target) as tmp:
            (tmp / "b").write_text("2")
            raise RuntimeError
    assert sorted(p.name for p in target.iterdir()) == ["a"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_manifest_refuses_changed_output(tmp_path):
    out = tmp_path / "thing.txt"
    out.write_text("original")
    m = Manifest(tmp_path)
    m.record("stage_a", inputs={}, config={"k": 1}, outputs={"thing": out}, metrics={"x": 1.0}, seconds=0.1)
    assert Manifest(tmp_path).verified_output("stage_a", "thing") == out
    out.write_text("tampered")
    with pytest.raises(ArtifactError, match="changed since stage 'stage_a'"):
        Manifest(tmp_path).verified_output("stage_a", "thing")


def test_manifest_missing_stage_and_output(tmp_path):
    m = Manifest(tmp_path)
    with pytest.raises(ArtifactError, match="has not run"):
        m.verified_output("distill", "checkpoint")
    m.record("distill", inputs={}, config={}, outputs={}, metrics={}, seconds=0)
    with pytest.raises(ArtifactError, match="no output 'checkpoint'"):
        m.verified_output("distill", "checkpoint")


def test_manifest_records_hashes_versions_time(tmp_path):
    f = tmp_path / "in.txt"
    f.write_text("x")
    m = Manifest(tmp_path)
    m.record("s", inputs={"in": f}, config={}, outputs={}, metrics={}, seconds=1)
    rec = Manifest(tmp_path).stage("s")
    assert rec["inputs"]["in"]["sha256"] == sha256_path(f)
    assert "torch" in rec["versions"] and "python" in rec["versions"]
    assert rec["time"].endswith("Z")


def test_folder_hash_changes_with_content(tmp_path):
    (tmp_path / "a").write_text("1")
    h1 = sha256_path(tmp_path)
    (tmp_path / "a").write_text("2")
    assert sha256_path(tmp_path) != h1


def test_publish_files_replaces_its_own_files_and_keeps_the_folders_others(tmp_path):
    """bench/ is shared by several benches: re-running one must not delete another's outputs (a re-run of
    `bench decode` once replaced the whole folder), and a failing writer changes nothing."""
    from edge.core.artifacts import publish_files

    bench = tmp_path / "bench"
    bench.mkdir()
    (bench / "energy.json").write_text("{}")
    (bench / "decode.json").write_text("old")
    paths = publish_files(bench, {"decode.json": lambda p: p.write_text("new"), "decode.md": lambda p: p.write_text("#")})
    assert paths == [bench / "decode.json", bench / "decode.md"]
    assert (bench / "energy.json").read_text() == "{}" and (bench / "decode.json").read_text() == "new"

    def fail(p):
        raise RuntimeError("plot failed")

    with pytest.raises(RuntimeError, match="plot failed"):
        publish_files(bench, {"decode.json": lambda p: p.write_text("newer"), "decode.png": fail})
    assert (bench / "decode.json").read_text() == "new" and not (bench / "decode.png").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench"]  # no temporary folder left beside it
