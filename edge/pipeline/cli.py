"""``smartexit <stage> [--config FILE] [key=value ...]``.

Each stage is a typed config dataclass and a ``main(cfg) -> int``. A
:class:`SmartExitError` (bad path, bad config, mismatched artifact) prints
``error: ...`` and exits with code 2.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import Callable

from edge.core.configio import parse_overrides
from edge.core.errors import SmartExitError

# stage -> (module, config class, entry point, one-line help)
STAGES: dict[str, tuple[str, str, str, str]] = {
    "train-tiny": ("edge.pipeline.train_tiny", "TrainConfig", "main", "train the bundled tiny model (an hour or two)"),
    "distill": ("edge.pipeline.distill", "DistillConfig", "main", "train exit heads by multi-exit distillation"),
    "train-scheduler": ("edge.pipeline.train_scheduler", "TrainSchedulerConfig", "main",
                        "train the learned scheduler (recurrent PPO) in the simulator -> scheduler/assets/ppo"),
    "compress": ("edge.pipeline.compress", "CompressConfig", "main",
                 "quantize (INT8 QAT + PTQ, or INT4) and optionally prune the distilled model -> <run>/compressed"),
    "bench compress": ("edge.pipeline.bench.compress", "CompressBenchConfig", "main",
                       "every compression recipe: bytes, quality, exit agreement, decode speed vs fp32 and llama.cpp"),
    "calibrate": ("edge.pipeline.calibrate", "CalibrateConfig", "main",
                  "calibrated exit thresholds with a certified false-exit bound (--calib-data DIR to certify on "
                  "your own text, --eval-data DIR to check on it)"),
    "export": ("edge.pipeline.export", "ExportStageConfig", "main", "ONNX graphs per segment, gated on parity with torch"),
    "repo": ("edge.pipeline.repo", "RepoConfig", "main",
             "Triton model repository (python backend, decoupled) over the export and threshold table"),
    "engines": ("edge.pipeline.engines", "EnginesConfig", "main",
                "TensorRT engines from the ONNX graphs (on the device) + trtexec command lines"),
    "bench decode": ("edge.pipeline.bench.decode", "DecodeBenchConfig", "main",
                     "decode throughput: transformers, LayerSkip, SmartExit full depth and with exits"),
    "bench projection": ("edge.pipeline.bench.projection", "ProjectionBenchConfig", "main",
                         "exit decisions at Qwen2.5-0.5B and Llama-3.2-1B shapes (random weights made locally): a "
                         "check's cost in layers and the projected speed-up of the run's exits"),
    "bench energy": ("edge.pipeline.bench.energy", "EnergyBenchConfig", "main",
                     "energy per token (jtop / tegrastats / NVML / RAPL; CPU-seconds proxy without a sensor): "
                     "full depth vs exits vs the compressed model"),
    "bench serve": ("edge.pipeline.bench.serve", "BenchServeConfig", "main",
                    "serving load test: trace / Poisson arrivals through Ray Serve + Triton vs the engine in process"),
    "bench audit": ("edge.pipeline.bench.audit", "BenchAuditConfig", "main",
                    "the online false-exit audit on held-out code vs another domain (word salad)"),
    "bench crosscheck": ("edge.pipeline.bench.crosscheck", "CrossCheckConfig", "main",
                         "the load client against NVIDIA aiperf on the same stack (needs `make aiperf-check`)"),
    "bench scheduler": ("edge.pipeline.bench.scheduler", "BenchSchedulerConfig", "main",
                        "the learned SLA scheduler vs fixed budgets and heuristics: simulator grid, real stack, "
                        "simulator validation (--trace FILE: any file with the Azure trace's columns)"),
    "serve": ("edge.pipeline.serve", "ServeStackConfig", "main",
              "start tritonserver + the Ray Serve OpenAI-compatible front end (Ctrl-C / SIGTERM stops all)"),
    "profile": ("edge.pipeline.profile", "ProfileConfig", "main",
                "measure the engine's step time vs prefill tokens, batch and exit depth; fit the simulator's latency model"),
    "generate": ("edge.pipeline.generate", "GenerateConfig", "main", "reference early-exit generation on held-out prompts"),
    "report": ("edge.pipeline.report", "ReportConfig", "main", "write report.json / report.md from the run manifest"),
    # Jetson deployment (deploy/jetson/jetson.mk; every action takes dry_run=true)
    "jetson check": ("edge.jetson.check", "CheckConfig", "main", "on the device: versions against the supported table"),
    "jetson push": ("edge.jetson.push", "PushConfig", "main", "copy the run to a Jetson, sha256 checked on arrival"),
    "jetson engines": ("edge.jetson.engines", "JetsonEnginesConfig", "main",
                       "on the device: TensorRT engines per graph, then parity against ONNX Runtime"),
    "jetson serve": ("edge.jetson.serve", "JetsonServeConfig", "main", "on the device: systemd units, started"),
    "jetson status": ("edge.jetson.serve", "JetsonServiceConfig", "status", "on the device: units and /health"),
    "jetson stop": ("edge.jetson.serve", "JetsonServiceConfig", "stop", "on the device: stop the units"),
    "jetson bench": ("edge.jetson.bench", "JetsonBenchConfig", "main",
                     "decode and energy benchmarks on a Jetson, results pulled into <run>/jetson"),
}


def _load(stage: str) -> tuple[type, Callable[[object], int]]:
    module, cfg_name, fn_name, _ = STAGES[stage]
    mod = importlib.import_module(module)
    return getattr(mod, cfg_name), getattr(mod, fn_name)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) >= 2 and f"{argv[0]} {argv[1]}" in STAGES:  # two-word stages: `bench decode`
        argv = [f"{argv[0]} {argv[1]}", *argv[2:]]
    parser = argparse.ArgumentParser(prog="smartexit", description="SmartExit early-exit LLM pipeline")
    sub = parser.add_subparsers(dest="stage", required=True, metavar="STAGE")
    for name, (_, _, _, help_text) in STAGES.items():
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--config", help="YAML file with this stage's settings")
        p.add_argument("overrides", nargs="*", metavar="key=value")
    args, extra = parser.parse_known_args(argv)
    try:
        cfg_cls, entry = _load(args.stage)
        cfg = parse_overrides(cfg_cls(), args.overrides + _flags_to_overrides(extra), args.config)
        return int(entry(cfg))
    except SmartExitError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code


def _flags_to_overrides(extra: list[str]) -> list[str]:
    """``--eval-data DIR`` / ``--eval-data=DIR`` -> ``eval_data=DIR`` (any config key works as a flag)."""
    out, i = [], 0
    while i < len(extra):
        arg = extra[i]
        if not arg.startswith("--"):
            raise SmartExitError(f"unexpected argument {arg!r}; use key=value")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(extra):
                raise SmartExitError(f"{arg} needs a value")
            value, i = extra[i + 1], i + 1
        out.append(f"{key.replace('-', '_')}={value}")
        i += 1
    return out


if __name__ == "__main__":
    raise SystemExit(main())
