"""TensorRT engines from the exported ONNX graphs: trtexec command lines, a Python-API builder (the runner,
``TrtRunner``, is the runtime's: edge/runtime/trt_runner.py).

TensorRT plans are specific to the GPU, the TensorRT version and the JetPack they were built
with (TensorRT developer guide, "Version Compatibility" / "Hardware Compatibility": a plan is
portable only within a TensorRT version and GPU architecture), so engines are built on the device
that runs them. This module therefore always
writes ``build_engines.sh`` (one ``trtexec`` line per graph, paths relative to the script's
folder) and, where TensorRT and a CUDA GPU are present, also builds the plans itself.

Optimisation profile (one per engine; B batch, T new tokens, P past length):

- min: B=1, T=1, P=0. TensorRT supports empty tensors (dimensions of length 0) since 7.1; the
  TensorRT 7.0 check ``x > 0`` on profile dimensions is gone (NVIDIA/TensorRT#337), and TensorRT 10
  accepts an empty input bound to any non-null address. P=0 is the prefill of a new sequence, so
  one engine serves prefill and decode (one graph that always takes a possibly zero-length past;
  docs/runtime.md). (check on device: trtexec accepts ``past_key_0:1x2x0x16`` in --minShapes.)
- opt: ``opt_batch``, ``opt_seq`` (1: decode-optimised), ``opt_past``.
- max: ``max_batch``, ``max_seq`` (the prefill chunk), ``max_past`` (the context window).
  The mask's last axis is P + T for each of min / opt / max. engines.json records every input's
  shapes; the TensorRT backend reads the largest T from them as its ``max_chunk``
  (edge/runtime/portable_backend.py ``profile_max_chunk``), and the engine never sends a longer call.

The LM head is one graph, ``head``, and so one engine for every exit: its vocabulary x hidden
weight is in one plan, loaded once (docs/runtime.md, "One LM head per process"). Its input is a
segment's ``exit_hidden`` [B, 1, D], so its profile has the batch axis only (1, ``opt_batch``,
``max_batch``); the runtime binds a segment's ``exit_hidden`` output buffer as the head's input.
"""
from __future__ import annotations

import enum
import os
import shlex
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import onnx

from edge.core.artifacts import atomic_path, atomic_write_json, atomic_write_text, sha256_file
from edge.core.errors import ArtifactError, ConfigError
from edge.runtime.graphs import load_graphs_json, verify_graphs
# running a plan is the runtime's; users import TrtRunner and NoCudaDeviceError from here too
from edge.runtime.trt_runner import NoCudaDeviceError, TrtRunner, require_tensorrt  # noqa: F401

STAGE = "engines"
ENGINES_JSON = "engines.json"
SCRIPT = "build_engines.sh"
COMMANDS_JSON = "trtexec_commands.json"
ENGINES_FORMAT = 1
# JetPack installs trtexec here without putting it on PATH.
JETPACK_TRTEXEC_DIR = "/usr/src/tensorrt/bin"
QDQ_OPS = frozenset({"QuantizeLinear", "DequantizeLinear"})
MATMUL_OPS = frozenset({"MatMul", "Gemm"})
Shape = tuple[int, ...]


class Precision(str, enum.Enum):
    FP16 = "fp16"
    FP32 = "fp32"
    INT8 = "int8"  # explicit quantization: the graphs must carry Q/DQ nodes (calibrators are deprecated)


@dataclass
class EngineBuildConfig:
    """Precision, workspace and optimisation-profile bounds of the engines."""

    precision: Precision = Precision.FP16
    workspace_mib: int = 1024
    max_batch: int = 16
    opt_batch: int = 4
    max_seq: int = 256  # the largest prefill chunk (the backend states it: the host clamps the budget to it)
    opt_seq: int = 1  # decode-optimised
    max_past: int = 512  # the context window
    opt_past: int = 128
    timing_cache: str | None = None  # default: <out_dir>/timing.cache
    # Types come from the graph, no precision flags; TensorRT 11 drops the FP16/INT8 builder
    # flags in favour of strong typing.
    strongly_typed: bool = False

    def __post_init__(self) -> None:
        try:
            self.precision = Precision(self.precision)
        except ValueError:
            raise ConfigError(f"engines.precision must be one of {[p.value for p in Precision]}, "
                              f"got {self.precision!r}") from None
        for name in ("workspace_mib", "max_batch", "opt_batch", "max_seq", "opt_seq", "max_past"):
            if getattr(self, name) < 1:
                raise ConfigError(f"engines.{name} must be >= 1, got {getattr(self, name)}")
        if self.opt_past < 0:
            raise ConfigError(f"engines.opt_past must be >= 0, got {self.opt_past}")
        for opt, mx in (("opt_batch", "max_batch"), ("opt_seq", "max_seq"), ("opt_past", "max_past")):
            if getattr(self, opt) > getattr(self, mx):
                raise ConfigError(f"engines.{opt}={getattr(self, opt)} exceeds engines.{mx}={getattr(self, mx)}")

    def timing_cache_path(self, out_dir: str | Path) -> Path:
        return Path(self.timing_cache) if self.timing_cache else Path(out_dir) / "timing.cache"


# --- pure functions ---------------------------------------------------------------------------------

def _model_dim(model_dims: dict[str, int], key: str) -> int:
    if not isinstance(model_dims.get(key), int):
        raise ArtifactError(f"graphs.json 'model' entry lacks integer {key!r} (has {sorted(model_dims)}); re-export")
    return model_dims[key]


def profile_shapes(graph_name: str, input_names: list[str], model_dims: dict[str, int],
                   cfg: EngineBuildConfig) -> dict[str, tuple[Shape, Shape, Shape]]:
    """(min, opt, max) shape of every input of one exported graph.

    Args:
        graph_name: ``embed``, ``segment_{i}``, ``kvfill_{i}`` or ``head``.
        input_names: the graph's inputs as recorded in graphs.json.
        model_dims: graphs.json's ``model`` entry (hidden_size, num_kv_heads, head_dim, ...).
        cfg: the profile bounds.

    Returns:
        ``{input: (min, opt, max)}`` in ``input_names`` order.

    Raises:
        ArtifactError: unknown graph kind, an input this graph kind does not have, or a missing dim.
    """
    bts = ((1, 1, 0), (cfg.opt_batch, cfg.opt_seq, cfg.opt_past), (cfg.max_batch, cfg.max_seq, cfg.max_past))
    kind = graph_name.split("_")[0]
    if kind not in ("embed", "segment", "kvfill", "head") or (kind == "head") != (graph_name == "head"):
        raise ArtifactError(f"unknown graph {graph_name!r}: expected embed, segment_<i>, kvfill_<i> or head")
    d = _model_dim(model_dims, "hidden_size")
    out: dict[str, tuple[Shape, Shape, Shape]] = {}
    for name in input_names:
        if kind == "head":
            if name != "exit_hidden":
                raise ArtifactError(f"graph {graph_name!r} has an unexpected input {name!r}")
            shape = [(b, 1, d) for b, _, _ in bts]  # [B, 1, D]: one row per sequence, batch axis only
        elif kind == "embed" and name == "input_ids":
            shape = [(b, t) for b, t, _ in bts]  # [B, T]
        elif kind != "embed" and name == "hidden":
            shape = [(b, t, d) for b, t, _ in bts]  # [B, T, D]
        elif kind != "embed" and name == "positions":
            shape = [(b, t) for b, t, _ in bts]  # [B, T]
        elif kind == "segment" and name == "attn_mask":
            shape = [(b, 1, t, p + t) for b, t, p in bts]  # [B, 1, T, P + T]
        elif kind == "segment" and name == "exit_index":
            shape = [(b,) for b, _, _ in bts]  # [B]
        elif kind == "segment" and name.startswith(("past_key_", "past_value_")):
            kv, hd = _model_dim(model_dims, "num_kv_heads"), _model_dim(model_dims, "head_dim")
            shape = [(b, kv, p, hd) for b, _, p in bts]  # [B, KV, P, hd]
        else:
            raise ArtifactError(f"graph {graph_name!r} has an unexpected input {name!r}")
        out[name] = (shape[0], shape[1], shape[2])
    return out


def _dims(shape: Shape) -> str:
    return "x".join(str(s) for s in shape)


def trtexec_argv(onnx_path: str | Path, engine_path: str | Path, shapes: dict[str, tuple[Shape, Shape, Shape]],
                 cfg: EngineBuildConfig) -> list[str]:
    """The ``trtexec`` command line that builds one engine (TensorRT 10 flags).

    The timing cache is ``cfg.timing_cache`` or ``timing.cache`` beside the engine. INT8 also enables
    FP16 so layers without Q/DQ run in FP16, not FP32; FP32 disables TF32 (trtexec enables it by
    default on Ampere and later, Orin included) so an FP32 engine is an exact reference. With
    ``strongly_typed`` the graph's types decide and no precision flag is passed.
    """
    engine_path = Path(engine_path)
    argv = ["trtexec", f"--onnx={onnx_path}", f"--saveEngine={engine_path}"]
    for flag, i in (("--minShapes", 0), ("--optShapes", 1), ("--maxShapes", 2)):
        argv.append(f"{flag}=" + ",".join(f"{name}:{_dims(s[i])}" for name, s in shapes.items()))
    argv.append(f"--memPoolSize=workspace:{cfg.workspace_mib}M")
    if cfg.strongly_typed:
        argv.append("--stronglyTyped")
    else:
        argv += {Precision.FP16: ["--fp16"], Precision.INT8: ["--fp16", "--int8"],
                 Precision.FP32: ["--noTF32"]}[cfg.precision]
    cache = cfg.timing_cache or engine_path.parent / "timing.cache"
    argv += [f"--timingCacheFile={cache}", "--profilingVerbosity=detailed", "--dumpLayerInfo"]
    return argv


def graph_features(onnx_path: str | Path) -> dict[str, bool]:
    """What an ONNX graph carries: Q/DQ nodes, MatMul/Gemm nodes, float16 tensors (no weights loaded)."""
    proto = onnx.load(str(onnx_path), load_external_data=False)
    ops = {n.op_type for n in proto.graph.node}
    fp16 = onnx.TensorProto.FLOAT16
    typed = [*proto.graph.input, *proto.graph.output, *proto.graph.value_info]
    return {"qdq": bool(ops & QDQ_OPS), "matmul": bool(ops & MATMUL_OPS),
            "fp16": any(t.data_type == fp16 for t in proto.graph.initializer)
            or any(v.type.tensor_type.elem_type == fp16 for v in typed)}


def check_precision(graphs_dir: str | Path, meta: dict[str, Any], cfg: EngineBuildConfig) -> None:
    """Refuse a precision the graphs cannot give.

    INT8 comes only from Q/DQ nodes (explicit quantization): every graph with a MatMul/Gemm must
    carry Q/DQ (``embed`` is a table lookup and is exempt). A strongly typed FP16 build needs a
    graph that carries float16 tensors, else it would silently build FP32.

    Raises:
        ConfigError: naming the graph and what it lacks.
    """
    if cfg.precision is Precision.FP32 or (cfg.precision is Precision.FP16 and not cfg.strongly_typed):
        return
    for name, g in meta["graphs"].items():
        feats = graph_features(Path(graphs_dir) / g["file"])
        if cfg.precision is Precision.INT8 and feats["matmul"] and not feats["qdq"]:
            raise ConfigError(
                f"engines.precision=int8 but {Path(graphs_dir) / g['file']} (graph {name!r}) has no "
                f"QuantizeLinear/DequantizeLinear nodes: TensorRT builds INT8 from Q/DQ only; export a "
                f"quantized model or use precision=fp16")
        if cfg.precision is Precision.FP16 and cfg.strongly_typed and not feats["fp16"]:
            raise ConfigError(
                f"engines.strongly_typed with precision=fp16, but {Path(graphs_dir) / g['file']} (graph "
                f"{name!r}) has no float16 tensors: a strongly typed network takes its types from the graph "
                f"and would build FP32; set strongly_typed=false or export an fp16 graph")


def _graph_jobs(graphs_dir: Path, out_dir: Path, meta: dict[str, Any], cfg: EngineBuildConfig):
    """(name, onnx path, plan path, shapes) per graph, in graphs.json order."""
    for name, g in meta["graphs"].items():
        shapes = profile_shapes(name, g["inputs"], meta.get("model", {}), cfg)
        yield name, graphs_dir / g["file"], out_dir / f"{name}.plan", shapes


def _rel(path: Path, start: Path) -> str:
    return os.path.relpath(path.resolve(), start.resolve())


def write_trtexec_script(graphs_dir: str | Path, out_dir: str | Path, cfg: EngineBuildConfig) -> Path:
    """Write ``<out_dir>/build_engines.sh`` and ``<out_dir>/trtexec_commands.json``.

    Paths in both are relative to ``out_dir`` (the script ``cd``s there), so the run folder can be
    copied to the Jetson as a whole.

    Returns:
        The script's path.

    Raises:
        ArtifactError: graphs_dir is not an export folder; ConfigError: see :func:`check_precision`.
    """
    graphs_dir, out_dir = Path(graphs_dir), Path(out_dir)
    meta = load_graphs_json(graphs_dir)
    check_precision(graphs_dir, meta, cfg)
    out_dir.mkdir(parents=True, exist_ok=True)
    rel_cfg = EngineBuildConfig(**{**asdict(cfg), "timing_cache": _rel(cfg.timing_cache_path(out_dir), out_dir)})
    commands = {name: trtexec_argv(_rel(onnx_path, out_dir), plan.name, shapes, rel_cfg)
                for name, onnx_path, plan, shapes in _graph_jobs(graphs_dir, out_dir, meta, cfg)}
    lines = [
        "#!/usr/bin/env bash",
        "# Build SmartExit's TensorRT engines with trtexec.",
        "# Run this on the Jetson (or GPU machine) that will run the engines: a TensorRT plan only runs",
        "# on the GPU model, TensorRT version and JetPack it was built with. Paths are relative to",
        "# this script's folder; copy the whole run folder (onnx/ and engines/) to the device.",
        f"# precision {cfg.precision.value}, strongly_typed {cfg.strongly_typed}, "
        f"checkpoint sha256 {meta.get('checkpoint_sha256')}",
        "set -euo pipefail",
        'cd "$(dirname "$0")"',
        f'export PATH="$PATH:{JETPACK_TRTEXEC_DIR}"',
        *(shlex.join(argv) for argv in commands.values()),
    ]
    script = atomic_write_text(out_dir / SCRIPT, "\n".join(lines) + "\n")
    os.chmod(script, 0o755)
    atomic_write_json(out_dir / COMMANDS_JSON, {
        "format": ENGINES_FORMAT, "cwd": "the folder holding this file", "precision": cfg.precision.value,
        "strongly_typed": cfg.strongly_typed, "checkpoint_sha256": meta.get("checkpoint_sha256"),
        "commands": commands})
    return script


# --- building with the Python API (TensorRT and a CUDA GPU required) --------------------------------

def _require_tensorrt(script: Path | None = None):
    where = f"run {script} there" if script else f"run the {SCRIPT} that `smartexit engines` writes"
    return require_tensorrt(
        f", so no engines were built. Engines are built on the device that runs them: on a Jetson "
        f"(deploy/jetson), copy the run folder and {where} with JetPack's trtexec ({JETPACK_TRTEXEC_DIR}); or "
        f"install the 'tensorrt' extra (pip install 'smartexit[tensorrt]') on a machine with an NVIDIA GPU",
        f"engines are built on the GPU that runs them; on a Jetson, {where}")


def _build_plan(trt, onnx_path: Path, shapes: dict[str, tuple[Shape, Shape, Shape]], cfg: EngineBuildConfig,
                cache_bytes: bytes) -> tuple[bytes, bytes]:
    """Serialized engine and updated timing cache for one graph."""
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED) if cfg.strongly_typed else 0
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):  # by path: external data resolves beside the graph
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise ArtifactError(f"{onnx_path}: TensorRT's ONNX parser rejected the graph: {errors}")
    inputs = {network.get_input(i).name for i in range(network.num_inputs)}
    if inputs != set(shapes):
        raise ArtifactError(f"{onnx_path}: network inputs {sorted(inputs)} != graphs.json inputs {sorted(shapes)}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, cfg.workspace_mib << 20)
    if not cfg.strongly_typed:
        if cfg.precision in (Precision.FP16, Precision.INT8):
            config.set_flag(trt.BuilderFlag.FP16)
        if cfg.precision is Precision.INT8:
            config.set_flag(trt.BuilderFlag.INT8)
        if cfg.precision is Precision.FP32:
            config.clear_flag(trt.BuilderFlag.TF32)  # same as trtexec --noTF32
    config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED
    profile = builder.create_optimization_profile()
    for name, (mn, opt, mx) in shapes.items():
        profile.set_shape(name, mn, opt, mx)
    if config.add_optimization_profile(profile) < 0:
        raise ConfigError(f"{onnx_path}: TensorRT rejected the optimisation profile {shapes}")
    cache = config.create_timing_cache(cache_bytes)
    if not config.set_timing_cache(cache, False):  # another TensorRT version / GPU: start afresh
        cache = config.create_timing_cache(b"")
        config.set_timing_cache(cache, False)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise ArtifactError(f"{onnx_path}: TensorRT failed to build an engine (its log above says why)")
    return bytes(plan), bytes(cache.serialize())


def build_engines(graphs_dir: str | Path, out_dir: str | Path, cfg: EngineBuildConfig,
                  checkpoint_sha256: str) -> dict[str, Any]:
    """Verify the graphs, write the trtexec script, then build every graph into ``<out_dir>/<graph>.plan``.

    Returns:
        The content of ``<out_dir>/engines.json`` (per engine: file, sha256, precision, shapes,
        TensorRT version, build seconds, checkpoint sha256).

    Raises:
        ArtifactError: graphs of another checkpoint, changed files, a graph TensorRT rejects.
        ConfigError: a precision the graphs cannot give (:func:`check_precision`).
        MissingExtraError: TensorRT is not installed (the script is written all the same).
        NoCudaDeviceError: no CUDA GPU (the script is written all the same).
    """
    graphs_dir, out_dir = Path(graphs_dir), Path(out_dir)
    meta = verify_graphs(graphs_dir, checkpoint_sha256)
    script = write_trtexec_script(graphs_dir, out_dir, cfg)
    trt = _require_tensorrt(script)
    import torch

    cache_path = cfg.timing_cache_path(out_dir)
    cache_bytes = cache_path.read_bytes() if cache_path.is_file() else b""
    engines: dict[str, Any] = {}
    tmp = Path(tempfile.mkdtemp(prefix=".building.", dir=out_dir))  # plans move in only if all build
    try:
        for name, onnx_path, plan_path, shapes in _graph_jobs(graphs_dir, out_dir, meta, cfg):
            t0 = time.perf_counter()
            plan, cache_bytes = _build_plan(trt, onnx_path, shapes, cfg, cache_bytes)
            (tmp / plan_path.name).write_bytes(plan)
            with atomic_path(cache_path) as p:  # the cache is worth keeping even if a later graph fails
                p.write_bytes(cache_bytes)
            engines[name] = {
                "file": plan_path.name, "sha256": sha256_file(tmp / plan_path.name),
                "precision": cfg.precision.value, "strongly_typed": cfg.strongly_typed,
                "shapes": {k: {"min": list(v[0]), "opt": list(v[1]), "max": list(v[2])} for k, v in shapes.items()},
                "tensorrt_version": trt.__version__, "build_seconds": round(time.perf_counter() - t0, 3),
                "checkpoint_sha256": checkpoint_sha256, "onnx_sha256": meta["graphs"][name]["sha256"],
            }
        for info in engines.values():
            os.chmod(tmp / info["file"], 0o644)
            os.replace(tmp / info["file"], out_dir / info["file"])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    result = {"format": ENGINES_FORMAT, "tensorrt_version": trt.__version__,
              "device": torch.cuda.get_device_name(), "checkpoint_sha256": checkpoint_sha256,
              "build": {**asdict(cfg), "precision": cfg.precision.value}, "engines": engines}
    atomic_write_json(out_dir / ENGINES_JSON, result)
    return result


# --- stage entry -------------------------------------------------------------------------------------

@dataclass
class EnginesConfig:
    """``smartexit engines``: build TensorRT engines from ``<run_dir>/onnx`` into ``<run_dir>/engines``."""

    run_dir: str = "artifacts/demo"
    build: EngineBuildConfig = field(default_factory=EngineBuildConfig)
