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
from edge.core.errors import ConfigError, SmartExitError

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


def _parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The usage and help text; a stage's own arguments are read by :func:`_stage_args`."""
    parser = argparse.ArgumentParser(prog="smartexit", description="SmartExit early-exit LLM pipeline")
    sub = parser.add_subparsers(dest="stage", required=True, metavar="STAGE")
    stages = {}
    for name, (_, _, _, help_text) in STAGES.items():
        p = sub.add_parser(name, help=help_text, description=help_text,
                           epilog="Any config key is also a flag: --key VALUE, --key=VALUE or key=VALUE, in any order "
                                  "(--eval-data DIR is eval_data=DIR).")
        p.add_argument("--config", help="YAML file with this stage's settings (applied before the overrides)")
        p.add_argument("overrides", nargs="*", metavar="key=value")
        stages[name] = p
    return parser, stages


class _Help(Exception):
    """``-h`` / ``--help`` among a stage's arguments."""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) >= 2 and f"{argv[0]} {argv[1]}" in STAGES:  # two-word stages: `bench decode`
        argv = [f"{argv[0]} {argv[1]}", *argv[2:]]
    parser, stage_parsers = _parser()
    if not argv or argv[0] not in STAGES:
        parser.parse_args(argv)  # the overview for -h, else a usage error naming the stages (exit 2)
        return 2
    stage = argv[0]
    try:
        try:
            config, overrides = _stage_args(argv[1:])
        except _Help:
            stage_parsers[stage].print_help()
            return 0
        cfg_cls, entry = _load(stage)
        cfg = parse_overrides(cfg_cls(), overrides, config)
        return int(entry(cfg))
    except SmartExitError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code


def _stage_args(args: list[str]) -> tuple[str | None, list[str]]:
    """A stage's arguments, in any order, as (``--config`` file, ``key=value`` overrides in the order given).

    ``key=value`` is taken as it is; ``--key VALUE`` and ``--key=VALUE`` become ``key=VALUE`` with the key's
    dashes made underscores (any config key works as a flag). A flag's value is the next argument whatever
    it looks like (``--prompt "# x"``, ``--threshold -1``).

    Raises:
        ConfigError: a bare word, a flag without a value, or ``--config`` given twice.
        _Help: ``-h`` or ``--help``.
    """
    config, out, i = None, [], 0
    while i < len(args):
        arg = args[i]
        if arg in ("-h", "--help"):
            raise _Help
        if not arg.startswith("--"):
            if "=" not in arg or arg.startswith("="):
                raise ConfigError(f"unexpected argument {arg!r}; use key=value or --key value")
            out.append(arg)
            i += 1
            continue
        key, eq, value = arg[2:].partition("=")
        if not key:
            raise ConfigError(f"unexpected argument {arg!r}; use key=value or --key value")
        if not eq:
            if i + 1 >= len(args):
                raise ConfigError(f"{arg} needs a value")
            value, i = args[i + 1], i + 1
        if key == "config":
            if config is not None:
                raise ConfigError(f"--config given twice ({config} and {value})")
            config = value
        else:
            out.append(f"{key.replace('-', '_')}={value}")
        i += 1
    return config, out


if __name__ == "__main__":
    raise SystemExit(main())
