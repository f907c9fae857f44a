"""``smartexit jetson engines`` (``make jetson-engines``, on the device): TensorRT engines, then parity.

One engine per portable graph (``onnx/``; the fused graphs carry ONNX Runtime contrib ops TensorRT's
parser rejects), built by the device's own ``trtexec`` (a plan runs only on the GPU and TensorRT
version it was built with):

- precision per graph: ``--int8`` (with ``--fp16`` for the layers without Q/DQ) only for a graph that
  carries QuantizeLinear / DequantizeLinear (a compressed run's export: explicit quantization; no
  calibrator), ``--fp16`` otherwise; never ``--fp8`` (Orin is sm_87);
- optimisation profile from the serving config (the ``repo`` stage's ``max_seqs`` = batch limit,
  ``prefill_budget`` = prefill chunk) and the context window (graphs.json ``model.max_positions``);
- one timing cache (``jetson/engines/timing.cache``) kept across graphs and rebuilds;
- an engine whose ONNX graph, command line and plan are unchanged is not rebuilt.

Then each engine runs once on the inputs recorded at push time, and its outputs are compared with
ONNX Runtime's (:mod:`edge.jetson.parity`); ``jetson/device/parity.json`` holds the verdict, and
``jetson serve`` refuses to start unless it passed for this export.
"""
from __future__ import annotations

import json
import re
import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edge.core.artifacts import Manifest, atomic_write_json, sha256_file
from edge.core.errors import ArtifactError, ConfigError
from edge.jetson import commands
from edge.jetson.parity import GraphParity, compare_graph, parse_trtexec_outputs
from edge.jetson.record import PARITY_DIR, PARITY_JSON as PARITY_INPUTS, load_recorded
from edge.jetson.steps import Runner, Step, require_jetson
from edge.runtime.graphs import load_graphs_json
from edge.runtime.served import ENGINES_DIR
from exporters.tensorrt import EngineBuildConfig, Precision, graph_features, profile_shapes

STAGE = "jetson_engines"
DEVICE_DIR = Path("jetson") / "device"
PARITY_JSON = DEVICE_DIR / "parity.json"
SCRIPT = "build_engines.sh"


@dataclass
class JetsonEnginesConfig:
    """``smartexit jetson engines``: build ``<run>/jetson/engines/*.plan`` and check them against ONNX Runtime."""

    run_dir: str = "artifacts/demo"
    root: str = "/"  # the device's file system root (a fixture tree in the tests)
    trtexec: str = commands.TRTEXEC
    workspace_mib: int = 1024
    opt_batch: int = 4  # the profile's optimum (capped by the serving batch limit)
    opt_past: int = 128  # (capped by the context window)
    build_timeout_s: float = 3600.0
    parity: bool = True
    dry_run: bool = False

    def __post_init__(self) -> None:
        for name in ("workspace_mib", "opt_batch"):
            if getattr(self, name) < 1:
                raise ConfigError(f"jetson engines: {name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class Limits:
    """The serving limits the profiles are built for."""

    max_batch: int  # repo.max_seqs: sequences in one decode batch
    max_chunk: int  # repo.prefill_budget: prompt tokens per engine step
    context: int  # graphs.json model.max_positions


def serving_limits(manifest: Manifest, meta: dict[str, Any]) -> Limits:
    """Batch and chunk from the ``repo`` stage's config (what the served engine runs with), context
    from the export.

    Raises:
        ArtifactError: the repo stage has not run (``make repo``) or lacks those keys.
    """
    try:
        repo = manifest.stage("repo")["config"]
        return Limits(int(repo["max_seqs"]), int(repo["prefill_budget"]), int(meta["model"]["max_positions"]))
    except KeyError as exc:
        raise ArtifactError(f"{manifest.path}: the repo stage's config or graphs.json lacks {exc}; run "
                            f"`make repo` (the serving config sets the engines' profiles)") from exc


def precision_for(features: dict[str, bool]) -> Precision:
    """INT8 (explicit Q/DQ) only where the graph carries Q/DQ nodes; FP16 otherwise."""
    return Precision.INT8 if features["qdq"] else Precision.FP16


def build_config(limits: Limits, precision: Precision, cfg: JetsonEnginesConfig, cache: Path) -> EngineBuildConfig:
    return EngineBuildConfig(precision=precision, workspace_mib=cfg.workspace_mib, max_batch=limits.max_batch,
                             opt_batch=min(cfg.opt_batch, limits.max_batch),
                             max_seq=min(limits.max_chunk, limits.context), opt_seq=1, max_past=limits.context,
                             opt_past=min(cfg.opt_past, limits.context), timing_cache=str(cache))


@dataclass(frozen=True)
class EngineJob:
    graph: str
    onnx: Path
    plan: Path
    precision: Precision
    argv: list[str]


def engine_jobs(graphs_dir: Path, out_dir: Path, meta: dict[str, Any], limits: Limits,
                cfg: JetsonEnginesConfig) -> list[EngineJob]:
    """One trtexec build per portable graph, in graphs.json order."""
    jobs = []
    cache = out_dir / "timing.cache"
    for name, g in meta["graphs"].items():
        onnx_path = graphs_dir / g["file"]
        precision = precision_for(graph_features(onnx_path))
        bcfg = build_config(limits, precision, cfg, cache)
        shapes = profile_shapes(name, g["inputs"], meta["model"], bcfg)
        plan = out_dir / f"{name}.plan"
        jobs.append(EngineJob(name, onnx_path, plan, precision,
                              commands.trtexec_build_argv(cfg.trtexec, onnx_path, plan, shapes, bcfg)))
    return jobs


def build_script(jobs: list[EngineJob]) -> str:
    """``build_engines.sh``: the same trtexec lines, to rebuild by hand on this device (bash)."""
    return "\n".join(["#!/usr/bin/env bash",
                      "# Generated by `smartexit jetson engines`: the TensorRT engines of this run, built on this",
                      "# Jetson with its own trtexec (a plan runs only where it was built).",
                      "set -euo pipefail", *(shlex.join(j.argv) for j in jobs), ""])


def tensorrt_version(trtexec_log: str) -> str | None:
    """'[I] TensorRT version: 10.3.0' in trtexec's log (check on device: the exact wording)."""
    m = re.search(r"TensorRT version:\s*([0-9][0-9.]*)", trtexec_log)
    return m.group(1) if m else None


def _up_to_date(job: EngineJob, onnx_sha: str, previous: dict[str, Any]) -> bool:
    old = previous.get(job.graph)
    return (old is not None and job.plan.is_file() and old.get("argv") == job.argv
            and old.get("onnx_sha256") == onnx_sha and old.get("plan_sha256") == sha256_file(job.plan))


def parity_step(cfg: JetsonEnginesConfig, job: EngineJob, entry: dict[str, Any], parity_dir: Path,
                out_json: Path) -> Step:
    shapes = {k: v["shape"] for k, v in entry["inputs"].items()}
    inputs = {k: parity_dir / v["file"] for k, v in entry["inputs"].items()}
    return Step(f"parity of {job.graph}: the engine on the recorded inputs",
                commands.trtexec_infer_argv(cfg.trtexec, job.plan, shapes, inputs, out_json))


def check_parity(recorded: dict[str, Any], parity_dir: Path, out_dir: Path, jobs: list[EngineJob]) -> list[GraphParity]:
    """Compare each engine's exported outputs (``<out_dir>/<graph>.json``) with the recorded ones."""
    results = []
    for job in jobs:
        entry = recorded["graphs"].get(job.graph)
        if entry is None:
            continue
        ref = {k: np.load(parity_dir / v["file"]) for k, v in entry["outputs"].items()}
        got = parse_trtexec_outputs((out_dir / f"{job.graph}.json").read_text())
        results.append(compare_graph(job.graph, ref, got, job.precision.value, recorded["reduction"], entry["layers"]))
    return results


def build_all(jobs: list[EngineJob], meta: dict[str, Any], out_dir: Path, runner: Runner,
              cfg: JetsonEnginesConfig) -> tuple[dict[str, Any], str | None]:
    """Build what changed; write build_engines.sh and engines.json.

    Returns:
        (engines.json's table by graph, the TensorRT version trtexec reported).
    """
    info_path = out_dir / "engines.json"
    previous = json.loads(info_path.read_text()).get("engines", {}) if info_path.is_file() else {}
    runner.write(out_dir / SCRIPT, build_script(jobs), "the trtexec lines, to rebuild by hand", 0o755)
    engines: dict[str, Any] = {}
    trt_version = None
    for job in jobs:
        onnx_sha = meta["graphs"][job.graph]["sha256"]
        if not cfg.dry_run and _up_to_date(job, onnx_sha, previous):
            runner.note(f"{job.plan} is up to date (same graph, same command line)")
            engines[job.graph] = previous[job.graph]
            trt_version = trt_version or previous[job.graph].get("tensorrt")
            continue
        t = time.time()
        res = runner.run(Step(f"build {job.graph} ({job.precision.value})", job.argv, timeout=cfg.build_timeout_s))
        if res is None:
            continue
        trt_version = trt_version or tensorrt_version(res.stdout)
        log = out_dir / "logs" / f"{job.graph}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(res.stdout + res.stderr)
        engines[job.graph] = {"file": job.plan.name, "precision": job.precision.value, "argv": job.argv,
                              "onnx_sha256": onnx_sha, "plan_sha256": sha256_file(job.plan),
                              "tensorrt": trt_version, "build_seconds": round(time.time() - t, 3)}
    if not cfg.dry_run:
        atomic_write_json(info_path, {"tensorrt": trt_version, "engines": engines})
    return engines, trt_version


def main(cfg: JetsonEnginesConfig) -> int:
    t0 = time.time()
    runner = Runner(cfg.dry_run)
    require_jetson(cfg.root, "engines", runner)
    run_dir = Path(cfg.run_dir).resolve()  # absolute: the script and engines.json work from anywhere
    manifest = Manifest(run_dir)
    graphs = manifest.verified_output("export", "graphs")
    meta = load_graphs_json(graphs)
    limits = serving_limits(manifest, meta)
    out_dir, parity_dir, device_dir = run_dir / ENGINES_DIR, run_dir / PARITY_DIR, run_dir / DEVICE_DIR
    jobs = engine_jobs(graphs, out_dir, meta, limits, cfg)
    runner.note(f"profiles: batch <= {limits.max_batch}, prefill chunk <= {limits.max_chunk}, context {limits.context} "
                f"(repo stage + graphs.json); precisions: " + ", ".join(f"{j.graph} {j.precision.value}" for j in jobs))
    recorded = None
    if cfg.parity and cfg.dry_run and not (parity_dir / PARITY_INPUTS).is_file():
        runner.note(f"no parity recording in {parity_dir} yet (make jetson-push records one): a real run would stop "
                    f"before building; the builds it would run:")
    elif cfg.parity:
        recorded = load_recorded(parity_dir)
        want = manifest.stage("export")["outputs"]["graphs"]["sha256"]
        if recorded["graphs_sha256"] != want:
            raise ArtifactError(f"{parity_dir}: recorded for another export (sha256 "
                                f"{recorded['graphs_sha256'][:12]}... != {want[:12]}...); push again "
                                f"(make jetson-push)")
        case = recorded["case"]
        if case["batch"] > limits.max_batch or case["new"] > limits.max_chunk or case["past"] > limits.context:
            raise ConfigError(f"the recorded parity case {case} lies outside the engines' profile {limits}")
    _, trt_version = build_all(jobs, meta, out_dir, runner, cfg)
    if recorded is None:
        return 0
    outs = device_dir / "parity"
    if not cfg.dry_run:
        outs.mkdir(parents=True, exist_ok=True)
    for job in jobs:
        if job.graph in recorded["graphs"]:
            runner.run(parity_step(cfg, job, recorded["graphs"][job.graph], parity_dir, outs / f"{job.graph}.json"))
    if cfg.dry_run:
        runner.note(f"would compare each engine's outputs with ONNX Runtime's ({parity_dir}) into "
                    f"{run_dir / PARITY_JSON}, and record stage {STAGE} in {manifest.path}")
        return 0
    results = check_parity(recorded, parity_dir, outs, jobs)
    passed = bool(results) and all(r.passed for r in results)
    atomic_write_json(run_dir / PARITY_JSON, {
        "passed": passed, "graphs_sha256": recorded["graphs_sha256"], "tensorrt": trt_version,
        "graphs": {r.graph: r.to_dict() for r in results}})
    for r in results:
        worst = max((o.max_abs_diff / o.tolerance for o in r.outputs if o.max_abs_diff is not None and o.tolerance),
                    default=0.0)
        print(f"parity {r.graph:<10} {r.precision:<5} {'ok' if r.passed else 'FAILED':<6} worst error / tolerance "
              f"{worst:.3f}" + (f", argmax {r.argmax_agree}/{r.argmax_rows}" if r.argmax_rows else ""))
    manifest.record(STAGE, inputs={"graphs": graphs, "parity_inputs": parity_dir},
                    config={"run_dir": cfg.run_dir, "trtexec": cfg.trtexec, "limits": vars(limits)},
                    outputs={"engines": out_dir, "parity": run_dir / PARITY_JSON},
                    metrics={"tensorrt": trt_version, "parity_passed": passed,
                             "precision": {j.graph: j.precision.value for j in jobs}}, seconds=time.time() - t0)
    if not passed:
        print(f"engine parity FAILED (see {run_dir / PARITY_JSON}): `make jetson-serve` will refuse this run")
        return 1
    print(f"{len(jobs)} engines in {out_dir} match ONNX Runtime; next: make jetson-serve")
    return 0
