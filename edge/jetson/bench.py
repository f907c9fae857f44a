"""``smartexit jetson bench`` (``make jetson-bench DEVICE=user@host``, from the development machine).

Over ssh, in the checkout on the device: ``smartexit jetson check save=true`` (versions, power mode,
clocks: the conditions of the numbers), ``smartexit bench decode`` (the ONNX Runtime CPU engine against
its peers, as on the development machine) and ``smartexit bench energy meter=jtop backend=served``: the
backend ``make jetson-serve`` chose (the TensorRT engines, or torch_static on CUDA) without and with the
exit rule, tokens/s and joules per token on jtop's INA3221 rails (NVML has no power on Orin). Then the results come back
into ``artifacts/<run>/jetson/``:

- ``bench/``: the device's ``bench/`` folder (decode.json / .md / .png, energy.json / .md / .png);
- ``device/``: check.json, parity.json (the engines against ONNX Runtime) and the device's manifest.json.

The ``jetson_bench`` stage recorded here carries the device's bench metrics (as its manifest recorded
them) and identity; ``smartexit report`` renders them as its ``jetson`` section.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edge.core.artifacts import Manifest
from edge.core.errors import ArtifactError, ConfigError
from edge.jetson import commands
from edge.jetson.check import CHECK_JSON
from edge.jetson.engines import DEVICE_DIR
from edge.jetson.push import remote_run
from edge.jetson.steps import Runner, Step

STAGE = "jetson_bench"
RESULTS_DIR = Path("jetson") / "bench"


@dataclass
class JetsonBenchConfig:
    """``smartexit jetson bench``: decode and energy benchmarks on ``device``, results pulled back."""

    run_dir: str = "artifacts/demo"
    device: str = ""  # user@host
    remote_dir: str = "smartexit"
    ssh_options: list[str] = field(default_factory=list)
    remote_smartexit: str = ".venv/bin/smartexit"  # relative to remote_dir
    decode_args: list[str] = field(default_factory=lambda: ["--config", "configs/bench_decode.yaml"])
    # the served backend (jetson/units/backend.json: TensorRT engines, or torch_static on CUDA) without and
    # with the exit rule, on jtop's power rails
    energy_args: list[str] = field(default_factory=lambda: ["--config", "configs/bench_energy.yaml", "meter=jtop",
                                                            "backend=served"])
    timeout_s: float = 7200.0  # per benchmark
    dry_run: bool = False

    def __post_init__(self) -> None:
        commands.check_remote_dir(self.remote_dir)


def remote_steps(cfg: JetsonBenchConfig) -> list[Step]:
    """The commands run on the device, in its checkout."""
    rel_run = f"artifacts/{Path(cfg.run_dir).name}"

    def on_device(what: str, argv: list[str], **kw) -> Step:
        return Step(what, commands.ssh_argv(cfg.device, commands.remote_shell(cfg.remote_dir, argv), cfg.ssh_options),
                    **kw)

    se = cfg.remote_smartexit
    return [on_device("the device's versions, power mode and clocks (1: unsupported, still benchmarked)",
                      [se, "jetson", "check", f"run_dir={rel_run}", "save=true"], ok=(0, 1)),
            on_device("decode benchmark on the device", [se, "bench", "decode", *cfg.decode_args, f"run_dir={rel_run}"],
                      timeout=cfg.timeout_s),
            on_device("energy benchmark on the device (jtop power rails)",
                      [se, "bench", "energy", *cfg.energy_args, f"run_dir={rel_run}"], timeout=cfg.timeout_s)]


def pull_steps(cfg: JetsonBenchConfig) -> list[Step]:
    """The copies back into ``<run>/jetson/``."""
    src, here = remote_run(cfg.remote_dir, cfg.run_dir), Path(cfg.run_dir)
    ssh = cfg.ssh_options
    return [Step("the device's bench results",
                 commands.rsync_pull_argv(cfg.device, f"{src}/bench/", here / RESULTS_DIR, ssh)),
            Step("the device's check and parity results", commands.rsync_pull_argv(
                cfg.device, f"{src}/{DEVICE_DIR.as_posix()}/", here / DEVICE_DIR, ssh)),
            Step("the device's manifest (its bench metrics)", commands.rsync_pull_argv(
                cfg.device, f"{src}/manifest.json", here / DEVICE_DIR / "manifest.json", ssh))]


def bench_metrics(device_manifest: dict[str, Any], check: dict[str, Any] | None) -> dict[str, Any]:
    """The ``jetson_bench`` stage's metrics: the device's identity and its recorded bench metrics (pure)."""
    stages = device_manifest.get("stages", {})
    facts = (check or {}).get("facts", {})
    stack = facts.get("stack") or {}
    clocks = facts.get("clocks") or {}
    device = {"model": facts.get("model"), "l4t": facts.get("l4t"), "jetpack": facts.get("jetpack"),
              "cuda": stack.get("cuda"), "tensorrt": stack.get("tensorrt"),
              "power_mode": (facts.get("power_mode") or {}).get("name"),
              "gpu_max_mhz": (clocks.get("gpu") or {}).get("max_hz", 0) // 1_000_000 or None,
              "verdict": (check or {}).get("verdict")}
    engines = stages.get("jetson_engines", {}).get("metrics", {})
    return {"device": device, "engine_parity_passed": engines.get("parity_passed"),
            "engine_precision": engines.get("precision"),
            "decode": stages.get("bench_decode", {}).get("metrics"),
            "energy": stages.get("bench_energy", {}).get("metrics")}


def main(cfg: JetsonBenchConfig) -> int:
    if not cfg.device:
        raise ConfigError("device is required: make jetson-bench DEVICE=user@host (smartexit jetson bench device=...)")
    t0 = time.time()
    runner = Runner(cfg.dry_run)
    run_dir = Path(cfg.run_dir)
    manifest = Manifest(run_dir)
    if not manifest.path.is_file():
        raise ArtifactError(f"{manifest.path} is missing: {run_dir} is not a run folder")
    for step in remote_steps(cfg):
        runner.run(step)
    if not cfg.dry_run:
        for d in (RESULTS_DIR, DEVICE_DIR):
            (run_dir / d).mkdir(parents=True, exist_ok=True)
    for step in pull_steps(cfg):
        runner.run(step)
    if cfg.dry_run:
        runner.note(f"would record stage {STAGE} in {manifest.path} (the report's jetson section)")
        return 0
    device_manifest = json.loads((run_dir / DEVICE_DIR / "manifest.json").read_text())
    check_path = run_dir / CHECK_JSON
    check = json.loads(check_path.read_text()) if check_path.is_file() else None
    metrics = bench_metrics(device_manifest, check)
    manifest.record(STAGE, inputs={}, config={"device": cfg.device, "remote_dir": cfg.remote_dir,
                                               "decode_args": cfg.decode_args, "energy_args": cfg.energy_args},
                    outputs={"results": run_dir / RESULTS_DIR, "device": run_dir / DEVICE_DIR}, metrics=metrics,
                    seconds=time.time() - t0)
    print(f"jetson bench: results in {run_dir / 'jetson'}; `make report` adds them as the report's jetson section")
    return 0
