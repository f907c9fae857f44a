"""Fixtures of the Jetson deployment tests: a run folder (a real tiny export, manifest records) and a
device root file system assembled from the project's identity fixtures (tests/fixtures/jetson/identity).
These tests run on any CPU machine, on every clone."""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch

from edge.core.artifacts import Manifest
from tests.unit.edge.jetson.jetson_identity import block, identity_file

CKPT = "c" * 64
REPO_CONFIG = {"run_dir": "x", "max_seqs": 4, "prefill_budget": 8, "max_running": 4}  # the serving limits


@pytest.fixture(scope="session")
def tiny_export(tmp_path_factory) -> Path:
    """A real ONNX export of a tiny multi-exit model (tests/unit/exporters/test_onnx_export.py's)."""
    from exporters.onnx_config import ExportConfig
    from exporters.onnx_export import export_onnx
    from tests.unit.exporters.test_onnx_export import make_model

    torch.set_num_threads(1)
    torch.manual_seed(0)  # the exit adapters start from torch's default init: the same weights whichever test runs first
    out = tmp_path_factory.mktemp("jetson_export") / "onnx"
    export_onnx(make_model(), out, ExportConfig(), CKPT)
    return out


def make_run(root: Path, export: Path, name: str = "run") -> Path:
    """A run folder as the pipeline leaves it after `make repo`: the export, a threshold table, a Triton
    repository and stand-in checkpoints, each recorded in manifest.json; the Makefile's stamp files
    (exits.json, compress.json) are there too, in dependency order, so `make -n` sees nothing stale."""
    run = root / name
    shutil.copytree(export, run / "onnx")
    shutil.copytree(export, run / "onnx_full")
    for d in ("multi_exit", "compressed"):
        (run / d).mkdir(parents=True)
        (run / d / "config.json").write_text("{}\n")  # stand-ins: never loaded by these tests
        (run / d / "tokenizer.json").write_text("{}\n")
    (run / "multi_exit" / "exits.json").write_text("{}\n")
    (run / "compressed" / "compress.json").write_text("{}\n")
    (run / "calibration").mkdir()
    (run / "calibration" / "thresholds.json").write_text(json.dumps({"checkpoint_sha256": CKPT}) + "\n")
    model = run / "triton" / "smartexit"
    (model / "1" / "bundle").mkdir(parents=True)
    (model / "config.pbtxt").write_text('name: "smartexit"\n')
    (model / "1" / "bundle" / "bundle.json").write_text("{}\n")
    m = Manifest(run)
    m.record("distill", inputs={}, config={}, outputs={"checkpoint": run / "multi_exit"}, metrics={}, seconds=0)
    m.record("compress", inputs={"checkpoint": run / "multi_exit"}, config={}, outputs={"checkpoint": run / "compressed"}, metrics={}, seconds=0)
    m.record("export", inputs={}, config={}, outputs={"graphs": run / "onnx", "graphs_full": run / "onnx_full"},
             metrics={}, seconds=0)
    m.record("calibrate", inputs={}, config={}, outputs={"thresholds": run / "calibration" / "thresholds.json"},
             metrics={}, seconds=0)
    m.record("repo", inputs={}, config=dict(REPO_CONFIG), outputs={"repository": run / "triton"}, metrics={}, seconds=0)
    t = time.time() - 5
    for i, rel in enumerate(("multi_exit/exits.json", "compressed/compress.json", "onnx/graphs.json",
                             "calibration/thresholds.json", "triton/smartexit/config.pbtxt")):
        os.utime(run / rel, (t + i, t + i))
    return run


@pytest.fixture
def run_dir(tmp_path, tiny_export) -> Path:
    return make_run(tmp_path, tiny_export)


def device_root(root: Path, *, release: str = "R36.4.4 | JetPack 6.2.1 | AGX Orin 64GB",
                triton: str | None = "2.49.0", trtexec: bool = True) -> Path:
    """A stand-in for a Jetson's file system under ``root``.

    From the project's identity fixtures: /etc/nv_tegra_release (the sample block named by ``release``) and
    the device-tree model string (the first line of device_tree_model.txt).
    SYNTHETIC (marked, formats from their public sources): /proc/meminfo (proc(5)), empty trtexec and
    tritonserver files where JetPack and the Triton tarball put them, TRITON_VERSION holding ``triton``.
    """
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "nv_tegra_release").write_text(block("nv_tegra_release_samples.txt", release))
    model = identity_file("device_tree_model.txt").read_text().splitlines()
    dt = root / "proc" / "device-tree"
    dt.mkdir(parents=True)
    first = next(line for line in model if line and not line.startswith("#"))
    (dt / "model").write_bytes(first.split(" || ")[0].encode() + b"\0")  # NUL-terminated on the device
    from tests.unit.edge.jetson.test_jetson_facts import MEMINFO_SYNTHETIC

    (root / "proc" / "meminfo").write_text(MEMINFO_SYNTHETIC)
    if trtexec:
        (root / "usr/src/tensorrt/bin").mkdir(parents=True)
        (root / "usr/src/tensorrt/bin/trtexec").write_text("")
    if triton is not None:
        (root / "opt/tritonserver/bin").mkdir(parents=True)
        (root / "opt/tritonserver/bin/tritonserver").write_text("")
        (root / "opt/tritonserver/TRITON_VERSION").write_text(triton + "\n")
    return root
