"""`smartexit jetson bench`: the commands run on the device, the results pulled back (real rsync through a
stand-in ssh), the jetson_bench stage, and the report's jetson section."""
from __future__ import annotations

import json
import shlex
import shutil
import sys

import pytest

from edge.core.artifacts import Manifest
from edge.jetson import bench as bench_mod
from edge.jetson.bench import JetsonBenchConfig, bench_metrics
from edge.jetson.facts import collect
from edge.jetson.check import evaluate, verdict
from edge.pipeline import report
from edge.pipeline.cli import main as cli
from tests.unit.edge.jetson.conftest import device_root
from tests.unit.edge.jetson.test_jetson_check import CLOCKS, block, fake_tools, jp62_dpkg
from tests.unit.edge.jetson.test_jetson_push import fake_device  # noqa: F401  (fixture)

# SYNTHETIC bench metrics in the shape bench decode / bench energy record (edge/pipeline/bench); invented
# numbers for this test only
DECODE = {"batches": {"1": {"systems": {"(c) full depth": {"tokens_per_s": 100.0}, "(d) exits": {"tokens_per_s": 120.0}}}}}
ENERGY = {"meter": "jtop", "meter_available": True, "joules_per_token": {"full": 0.5, "exits": 0.4},
          "backend": "tensorrt", "full_is": "the served model on tensorrt without an exit rule",
          "tokens_per_s": {"full": 90.0, "exits": 117.0}, "speed_ratio_shipped_vs_full": 1.3,
          "ratio_shipped_vs_full": 0.8, "false_exit_rate": 0.004, "false_exit_tokens": 992,
          "false_exits_judged_against": "tensorrt, full-depth decode"}

# stands in for `smartexit` on the device: writes what the real stages write (check.json; bench files and
# their manifest records), reading the same arguments
FAKE_SMARTEXIT = """#!{python}
import json, shutil, sys
from pathlib import Path
args = sys.argv[1:]
kv = dict(a.split("=", 1) for a in args if "=" in a and not a.startswith("--"))
run = Path(kv["run_dir"])
m = json.loads((run / "manifest.json").read_text())
if args[:2] == ["jetson", "check"]:
    (run / "jetson/device").mkdir(parents=True, exist_ok=True)
    shutil.copy({check!r}, run / "jetson/device/check.json")
else:
    (run / "bench").mkdir(exist_ok=True)
    (run / "bench" / (args[1] + ".json")).write_text("{{}}")
    m["stages"]["bench_" + args[1]] = {{"metrics": json.loads({metrics!r})[args[1]], "args": args}}
    (run / "manifest.json").write_text(json.dumps(m))
"""


def test_dry_run_prints_remote_and_pull_commands(run_dir, capsys):
    rc = cli(["jetson", "bench", f"run_dir={run_dir}", "device=me@orin", "dry_run=true"])
    lines = [shlex.split(line) for line in capsys.readouterr().out.splitlines() if line and not line.startswith("#")]
    assert rc == 0
    assert lines[:3] == [
        ["ssh", "me@orin", "cd smartexit && .venv/bin/smartexit jetson check run_dir=artifacts/run save=true"],
        ["ssh", "me@orin", "cd smartexit && .venv/bin/smartexit bench decode --config configs/bench_decode.yaml "
                           "run_dir=artifacts/run"],
        ["ssh", "me@orin", "cd smartexit && .venv/bin/smartexit bench energy --config configs/bench_energy.yaml "
                           "meter=jtop backend=served run_dir=artifacts/run"]]
    assert lines[3:] == [
        ["rsync", "-a", "me@orin:smartexit/artifacts/run/bench/", f"{run_dir}/jetson/bench"],
        ["rsync", "-a", "me@orin:smartexit/artifacts/run/jetson/device/", f"{run_dir}/jetson/device"],
        ["rsync", "-a", "me@orin:smartexit/artifacts/run/manifest.json", f"{run_dir}/jetson/device/manifest.json"]]
    assert not (run_dir / "jetson").exists() and "jetson_bench" not in Manifest(run_dir).data["stages"]


def test_bench_on_a_stand_in_device(run_dir, tmp_path, fake_device, capsys):  # noqa: F811
    root = device_root(tmp_path / "root")
    facts = collect(root, fake_tools(jp62_dpkg(), block(CLOCKS, "`nvpmodel -q` | Orin Nano"),
                                     block(CLOCKS, "`sudo jetson_clocks --show` | AGX Orin")),
                    root / "opt/tritonserver", python=(3, 10, 12))
    check = tmp_path / "check.json"
    check.write_text(json.dumps({"verdict": verdict(evaluate(facts)), "facts": facts.to_dict()}))
    remote_run = fake_device / "smartexit" / "artifacts" / "run"
    remote_run.mkdir(parents=True)
    shutil.copy(run_dir / "manifest.json", remote_run / "manifest.json")  # as pushed
    fake = tmp_path / "smartexit"
    fake.write_text(FAKE_SMARTEXIT.format(python=sys.executable, check=str(check),
                                          metrics=json.dumps({"decode": DECODE, "energy": ENERGY})))
    fake.chmod(0o755)
    cfg = JetsonBenchConfig(run_dir=str(run_dir), device="me@orin", remote_smartexit=str(fake))
    assert bench_mod.main(cfg) == 0
    assert (run_dir / "jetson/bench/decode.json").is_file() and (run_dir / "jetson/device/check.json").is_file()
    stage = Manifest(run_dir).stage("jetson_bench")
    m = stage["metrics"]
    assert m["device"]["l4t"] == "36.4.4" and m["device"]["tensorrt"] == "10.3.0.30" and m["device"]["gpu_max_mhz"] == 1300
    assert m["decode"] == DECODE and m["energy"] == ENERGY
    # the report renders it as its jetson section
    only = Manifest(tmp_path / "report_run")
    only.data["stages"]["jetson_bench"] = stage
    only.path.parent.mkdir(parents=True)
    only.path.write_text(json.dumps(only.data))
    rep = report.build(only.run_dir)
    md = report.render_markdown(rep)
    assert rep["jetson"]["device"]["jetpack"] == "6.2.1"
    assert "## On the Jetson" in md and "| 1 | (d) exits | 120.0 |" in md and "exits 0.4" in md
    assert "Served backend `tensorrt`" in md and "exits / full 1.300" in md and "exits / full 0.800" in md
    assert "false exits 0.0040 of 992 tokens (against tensorrt, full-depth decode)" in md


def test_bench_metrics_without_a_check():
    m = bench_metrics({"stages": {"bench_decode": {"metrics": DECODE}}}, None)
    assert m["decode"] == DECODE and m["energy"] is None and m["device"]["l4t"] is None


def test_bench_needs_a_device(run_dir, capsys):
    assert cli(["jetson", "bench", f"run_dir={run_dir}"]) == 2
    assert "DEVICE=user@host" in capsys.readouterr().err


@pytest.mark.parametrize("remote", ["~/smartexit", ""])
def test_bench_rejects_tilde(remote, capsys):
    assert cli(["jetson", "bench", "device=me@orin", f"remote_dir={remote}"]) == 2
