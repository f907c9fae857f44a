"""``smartexit bench projection``: the engine's exit decisions at real model shapes, as a projection.

The bundled model is small; what a candidate check and an early exit buy at Qwen2.5-0.5B and
Llama-3.2-1B shapes is projected here, on random weights made locally (nothing is downloaded: the
cost of a step depends on the shapes, not on the values), exported to the same fused ONNX Runtime
graphs the engine runs (their weights in external data files), float32, ONNX Runtime CPU.

Exits are forced: the run's measured exit-depth distribution (the ``calibrate`` stage's certify walk:
where the shipped rule's tokens left, the last layer included) is replayed at each shape with every
exit moved to the same relative depth (:func:`scale_layer`). A decode step that leaves at exit ``k``
is timed as the chain of segment graphs (each with its candidate check) up to ``k``, stopping there;
the last exit runs every segment and the LM head; full depth is the graph of every layer and the
head. The projected speed-up at batch 1 is ``t_full / sum_k f_k t_exit(k)``
(:func:`projected_speedup`). The check's and the boundary's cost in layers come from the same
loop, the chains taking turns call by call (edge/pipeline/bench/decision.py), at batch 1 and 16.

What this is not (said in the JSON and the Markdown too): the candidate check never chooses (the
exits are forced, so no quality is implied); no K/V of skipped layers is made, which is the cost of
neither K/V mode: the shipped mode at batch 1, ``defer``, recomputes the skipped layers' rows with
the sequence's next token in one call (more rows in that call), and this projection does not time
those rows. It is not run by ``make demo``: ``make bench-projection`` (minutes per shape: export,
load and timing of gigabytes of weights).
"""
from __future__ import annotations

import contextlib
import copy
import gc
import os
import resource
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edge.core.artifacts import Manifest, atomic_write_json, atomic_write_text
from edge.core.errors import ArtifactError, ConfigError
from edge.model.config import Arch, ModelConfig, RopeConfig, preset
from edge.pipeline.bench.verify_cost import verify_costs

STAGE = "bench_projection"

# Shapes from the models' Hugging Face config.json (Qwen/Qwen2.5-0.5B, meta-llama/Llama-3.2-1B);
# max_position_embeddings is cut to 1024: it only sizes the RoPE tables (the benchmark's cache holds
# ``past`` + 8 tokens), and Llama-3's RoPE scaling changes the tables' values, not a step's cost.
SHAPES: dict[str, ModelConfig] = {
    "qwen2_0_5b": ModelConfig(arch=Arch.QWEN2, vocab_size=151936, hidden_size=896, num_layers=24, num_heads=14,
                              num_kv_heads=2, head_dim=64, intermediate_size=4864, rms_norm_eps=1e-6,
                              max_position_embeddings=1024, tie_word_embeddings=True, qkv_bias=True,
                              rope=RopeConfig(theta=1e6)),
    "llama3_1b": ModelConfig(arch=Arch.LLAMA, vocab_size=128256, hidden_size=2048, num_layers=16, num_heads=32,
                             num_kv_heads=8, head_dim=64, intermediate_size=8192, rms_norm_eps=1e-5,
                             max_position_embeddings=1024, tie_word_embeddings=True, rope=RopeConfig(theta=5e5)),
    # the unit tests' shape (seconds), also a smoke run of the whole path
    "micro": preset("micro"),
}

# The replayed run when none is given: a calibrated bundled-ee run (exits 1, 2, 3, 4, 6, 8 of 12, a
# 256-token shortlist, eps 0.009, delta 0.05, K/V mode defer); its certify walk's exit counts out of
# 47616 tokens (1536 prompts x 31 judged tokens).
DEFAULT_RUN = {"num_layers": 12, "shortlist": 256, "kv_mode": "defer",
               "counts": {1: 4337, 2: 2726, 3: 2596, 4: 2842, 6: 1991, 8: 478, 12: 32646}}
# calibrate writes each fraction as count / tokens in float64: their sum is 1 to ~1e-15, so a sum
# further than this from 1 is not an exit distribution
SUM_TOL = 1e-6


def shape_config(name: str) -> ModelConfig:
    """A fresh copy of the :data:`SHAPES` entry ``name``.

    Raises:
        ConfigError: an unknown name.
    """
    if name not in SHAPES:
        raise ConfigError(f"bench projection: unknown shape {name!r}; known: {', '.join(SHAPES)}")
    return copy.deepcopy(SHAPES[name])


@dataclass
class ProjectionBenchConfig:
    run_dir: str = "artifacts/demo"  # whose exit distribution is replayed; results go to <run_dir>/bench
    shapes: list[str] = field(default_factory=lambda: ["qwen2_0_5b", "llama3_1b"])
    threads: int = 2  # ONNX Runtime's intra-op pool (and torch's, for the export)
    batch_sizes: list[int] = field(default_factory=lambda: [1, 16])  # 1 is required: the projection is at batch 1
    past: int = 96  # cached tokens per row during the timed steps
    calls: int = 10  # timed steps of each chain per repeat
    repeats: int = 5  # interleaved rounds over the chains; medians and min-max over these
    seed: int = 0  # the random weights'
    keep_graphs: bool = False  # keep <run_dir>/bench/projection_graphs/<shape> (gigabytes) after measuring
    # rho(k) of mode exact's verification at batch 1 and at these batch sizes (a verify graph each: another
    # copy of the layers on disk and, while timed, in memory); [] measures none
    verify_batches: list[int] = field(default_factory=lambda: [4])

    def __post_init__(self) -> None:
        if not self.shapes:
            raise ConfigError("bench projection: shapes is empty")
        cfgs = [shape_config(s) for s in self.shapes]
        if 1 not in self.batch_sizes or min(self.batch_sizes) < 1:
            raise ConfigError(f"bench projection: batch_sizes {self.batch_sizes} must be >= 1 and include 1")
        if min(self.threads, self.past, self.calls, self.repeats) < 1:
            raise ConfigError("bench projection: threads, past, calls and repeats must be >= 1")
        if not all(isinstance(b, int) and 2 <= b <= 64 for b in self.verify_batches):
            raise ConfigError(f"bench projection: verify_batches {self.verify_batches} must be batch sizes in 2..64")
        for name, c in zip(self.shapes, cfgs):
            if self.past >= c.max_position_embeddings:
                raise ConfigError(f"bench projection: past {self.past} is beyond shape {name}'s "
                                  f"{c.max_position_embeddings} positions")


@dataclass
class Replay:
    """The shipped model's exits and where its tokens left: what is replayed at another depth.

    Raises:
        ConfigError: ``fraction`` is not a distribution over layers 1..``num_layers``
            (:func:`check_distribution`).
    """

    source: str  # where the numbers come from
    num_layers: int
    fraction: dict[int, float]  # exit layer (1-based, the last included) -> fraction of tokens leaving there
    shortlist: int  # K, the candidate tokens of a check
    kv_mode: str  # the K/V mode the run ships (calibrate's choice)
    checkpoint: str | None = None  # the run's checkpoint whose exits these are (None: the default)
    free_run: dict[str, Any] | None = None  # the run's held-out free run (its summary), for comparison

    def __post_init__(self) -> None:
        check_distribution(self.fraction, self.num_layers)


def check_distribution(fraction: dict[int, float], n: int) -> None:
    """Raises ConfigError unless ``fraction`` maps layers within 1..``n`` to non-negative fractions that
    sum to 1 (within :data:`SUM_TOL`)."""
    bad = [k for k in fraction if not 1 <= k <= n]
    if bad:
        raise ConfigError(f"exit distribution: layers {bad} are outside the shipped model's 1..{n}")
    if any(f < 0 for f in fraction.values()):
        raise ConfigError(f"exit distribution: negative fractions in {fraction}")
    total = sum(fraction.values())
    if abs(total - 1.0) > SUM_TOL:
        raise ConfigError(f"exit distribution: fractions sum to {total:.9g}, not 1 ({fraction})")


def scale_layer(k: int, n: int, layers: int) -> int:
    """Layer ``k`` of ``n`` moved to the same relative depth in a model of ``layers`` layers:
    round(k * layers / n), halves up, kept within 1..layers (an exit cannot come before the first
    layer; the last layer maps to the last)."""
    return min(max((2 * k * layers + n) // (2 * n), 1), layers)


def scale_distribution(fraction: dict[int, float], n: int, layers: int) -> dict[int, float]:
    """Exit fractions over layers 1..``n`` replayed in a model of ``layers`` layers: each layer moved by
    :func:`scale_layer`, the fractions of layers that land together added. The keys of the result are
    the target's exit layers (the last one, ``layers``, always among them).

    Raises:
        ConfigError: as :func:`check_distribution`.
    """
    check_distribution(fraction, n)
    out = {layers: 0.0}
    for k, f in fraction.items():
        t = scale_layer(k, n, layers)
        out[t] = out.get(t, 0.0) + f
    return dict(sorted(out.items()))


def projected_speedup(full_ms: float, exit_ms: dict[int, float], fraction: dict[int, float]) -> float:
    """``full_ms / sum_k fraction[k] * exit_ms[k]``: the step time at full depth over the expected step
    time when a fraction ``fraction[k]`` of steps leaves at exit ``k`` (``exit_ms[k]``: such a step)."""
    return full_ms / sum(f * exit_ms[k] for k, f in fraction.items())


def read_replay(run_dir: Path) -> Replay:
    """The replay of ``run_dir``'s calibrated rule: its checkpoint's exits and shortlist, the calibrate
    stage's certify-walk exit fractions, K/V mode and held-out free run; :data:`DEFAULT_RUN` where the
    run has not been calibrated.

    Raises:
        ArtifactError: the checkpoint changed since the manifest recorded it, or calibrate's metrics lack
            the certify walk's exit fractions or the K/V mode.
        ConfigError: the recorded exit fractions are not a distribution over the checkpoint's exits.
    """
    from edge.model.exits import read_exits_json

    manifest = Manifest(run_dir)
    if "calibrate" not in manifest.data["stages"]:
        c = DEFAULT_RUN
        tokens = sum(c["counts"].values())
        return Replay(f"default (no calibrated run in {run_dir}): a calibrated bundled-ee run's certify walk, "
                      f"{tokens} tokens", c["num_layers"], {k: v / tokens for k, v in c["counts"].items()},
                      c["shortlist"], c["kv_mode"])
    ckpt = manifest.served_checkpoint()
    exits = read_exits_json(ckpt)
    metrics = manifest.stage("calibrate")["metrics"]
    try:
        walk, kv_mode = metrics["certify_walk"], str(metrics["kv_mode"])
        fraction = {int(k): float(v) for k, v in walk["exit_fraction"].items()}
    except KeyError as exc:
        raise ArtifactError(f"{manifest.path}: calibrate's metrics have no {exc.args[0]!r}; re-run calibrate") from None
    extra = sorted(set(fraction) - set(exits["exit_layers"]))
    if extra:
        raise ConfigError(f"{manifest.path}: calibrate's exit fractions name layers {extra} that are not exits of "
                          f"{ckpt} ({exits['exit_layers']})")
    return Replay(f"{run_dir}: calibrate's certify walk ({walk.get('n_tokens')} tokens, lambda {walk.get('lambda')})",
                  int(exits["num_layers"]), fraction, int(exits["exits"]["shortlist"]), kv_mode, str(ckpt),
                  metrics.get("free_run"))


def replay_at(shape: str, replay: Replay) -> dict[int, float]:
    """``replay``'s exit fractions moved to shape ``shape``'s depth (:func:`scale_distribution`); its keys
    are the shape's exit layers.

    Raises:
        ConfigError: an unknown shape, one so shallow that no decision exit is left, or a shortlist
            larger than its vocabulary.
    """
    mcfg = shape_config(shape)
    fraction = scale_distribution(replay.fraction, replay.num_layers, mcfg.num_layers)
    if len(fraction) < 2:
        raise ConfigError(f"bench projection: shape {shape} ({mcfg.num_layers} layers) keeps no decision exit of "
                          f"the replayed {sorted(replay.fraction)} of {replay.num_layers} layers")
    if replay.shortlist > mcfg.vocab_size:
        raise ConfigError(f"bench projection: the shortlist ({replay.shortlist}) exceeds shape {shape}'s vocabulary "
                          f"({mcfg.vocab_size})")
    return fraction


def _log(t0: float, msg: str) -> None:
    print(f"[bench projection {time.time() - t0:7.1f}s] {msg}", flush=True)


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def export_graphs(cfg: ModelConfig, exit_layers: list[int], shortlist: int, seed: int, out: Path,
                  verify_batches: tuple[int, ...] = ()) -> None:
    """Random float32 weights of shape ``cfg`` (std 0.02) with exits at ``exit_layers`` and a candidate
    shortlist of ``shortlist`` tokens, exported to ``out``: ``checks/`` (the fused segment graphs with
    their checks, ``head``, ``full`` and a ``verify_{B}`` graph per B of ``verify_batches``) and
    ``split/`` (the segments without checks). One set of graphs is in memory at a time, and the torch
    weights are gone when this returns."""
    import torch

    from edge.model.decoder import Decoder
    from edge.model.exits import ExitConfig, MultiExitModel
    from edge.model.segments import segment_layers
    from edge.pipeline.bench.decision import split_graphs
    from exporters.ort_fused import FULL, FusedGraph, build_fused, build_verify, save_fused

    # Every graph's weights go to external data, not only past protobuf's 2 GiB: saving a graph whole
    # serialises it in memory (measured: a 1.98 GB full graph took the export's peak from 6.2 to 10 GiB).
    # ONNX Runtime runs the same graph either way (the weights are loaded into the session).
    limit = 0
    with torch.no_grad():
        decoder = Decoder(cfg)
        decoder.init_weights(seed, std=0.02)
        # the candidate ids are the first K (the shortlist buffer's initial value): which rows are scored
        # does not change what a check costs
        model = MultiExitModel(decoder, ExitConfig(layers=exit_layers, adapter_rank=0, shortlist=shortlist)).eval()
        graphs = [g for g in build_fused(model, segment_layers(model.exit_layers), full=False)
                  if g.name.startswith("segment_") or g.name == "head"]  # kvfill_*: not timed here
        save_fused(graphs, out / "checks", limit)
        del graphs
        # the graph of every layer is a one-exit model's only segment (what build_fused's ``full`` is), built
        # after the segments' protos are gone: building one graph holds its weights about three times over
        # (_Builder.model_proto copies them twice), this export's peak (measured: 18.9 GiB at llama3_1b)
        whole = MultiExitModel(decoder, ExitConfig(layers=[cfg.num_layers], adapter_rank=0)).eval()
        graph = next(g for g in build_fused(whole, [list(range(cfg.num_layers))], full=False)
                     if g.name == "segment_0")
        save_fused([FusedGraph(FULL, graph.proto)], out / "checks", limit)
        del graph
        for b in verify_batches:  # mode exact's several-sequence verification, one graph in memory at a time
            save_fused([build_verify(whole, b)], out / "checks", limit)
        del whole
        split_graphs(model, out / "split", limit)
    del model, decoder
    gc.collect()


def layer_params(cfg: ModelConfig) -> float:
    """Parameters of one decoder layer of shape ``cfg`` (all but the embedding, LM head and final norm)."""
    table = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    return (cfg.num_params() - table - cfg.hidden_size) / cfg.num_layers


def shape_figures(chain_ms: dict[str, dict[str, list[float]]], fraction: dict[int, float], num_layers: int,
                  past: int) -> dict[str, Any]:
    """The projection's figures from the chains' times (batch -> chain -> ms per repeat; batch "1" has
    ``exit_{k}`` for every decision exit ``k`` of ``fraction``, whose keys are the exit layers): the
    decision cost per batch (of the medians), and at batch 1 the projected speed-up with each figure's
    min-max over repeats (a repeat's chains took turns call by call, so its values are paired)."""
    from edge.pipeline.bench.decision import cost_from_times

    exits = sorted(fraction)
    n, t1 = len(exits), chain_ms["1"]
    costs = {b: cost_from_times({k: float(np.median(v)) for k, v in times.items()}, num_layers, n, int(b), past)
             for b, times in chain_ms.items()}

    def exit_ms(pick) -> dict[int, float]:  # a step leaving at each exit; the last runs every segment and the head
        return {k: pick(t1[f"exit_{k}"] if k != num_layers else t1["checks"]) for k in exits}

    def spread(values: list[float]) -> dict[str, float]:
        return {"min": float(min(values)), "max": float(max(values))}

    median = exit_ms(lambda v: float(np.median(v)))
    reps = range(len(t1["full"]))
    per_rep = [cost_from_times({k: t1[k][r] for k in ("full", "split", "checks", "head")}, num_layers, n, 1, past)
               for r in reps]
    speedups = [projected_speedup(t1["full"][r], exit_ms(lambda v, r=r: v[r]), fraction) for r in reps]
    vs_split = [projected_speedup(t1["split"][r], exit_ms(lambda v, r=r: v[r]), fraction) for r in reps]
    mean_exit = sum(k * f for k, f in fraction.items())
    b1 = costs["1"]
    return {
        "exit_layers": exits,
        "exit_fraction": {str(k): f for k, f in fraction.items()},
        "mean_exit_layer": mean_exit,
        "layers_skipped_frac": 1.0 - mean_exit / num_layers,
        "layer_ms": b1.layer_ms,
        "decision_cost_layers": b1.check_layers,
        "boundary_layers": b1.boundary_layers,
        "head_layers": b1.head_ms / b1.layer_ms,
        "speedup_exit_vs_full_b1": projected_speedup(float(np.median(t1["full"])), median, fraction),
        # against the same layers cut at the exits without checks: what the exits buy apart from how the one
        # graph of every layer runs against the segment graphs (a bigger graph ran 3-10 % slower here)
        "speedup_exit_vs_split_b1": projected_speedup(float(np.median(t1["split"])), median, fraction),
        "speedup_layers_only": num_layers / mean_exit,  # counting layers alone: no head, check, boundary or embedding
        "exit_ms_b1": {str(k): v for k, v in median.items()},
        "spread_b1": {"layer_ms": spread([c.layer_ms for c in per_rep]),
                      "decision_cost_layers": spread([c.check_layers for c in per_rep]),
                      "boundary_layers": spread([c.boundary_layers for c in per_rep]),
                      "speedup_exit_vs_full_b1": spread(speedups),
                      "speedup_exit_vs_split_b1": spread(vs_split)},
        "decision_cost": {b: c.to_dict() for b, c in costs.items()},
    }


def measure_shape(name: str, fraction: dict[int, float], shortlist: int, cfg: ProjectionBenchConfig,
                  graphs_dir: Path, t0: float) -> dict[str, Any]:
    """Export shape ``name`` with exits at the keys of ``fraction`` (:func:`replay_at`) and a candidate
    shortlist of ``shortlist`` tokens into ``graphs_dir``, time the chains at each batch size (the exit
    chains at batch 1 only), and return the shape's part of ``projection.json``."""
    from edge.pipeline.bench.decision import chain_times, decision_chains

    mcfg = shape_config(name)
    exits = sorted(fraction)
    _log(t0, f"{name}: {mcfg.num_params() / 1e9:.2f}B parameters, exits {exits}; exporting")
    t_export = time.perf_counter()
    export_graphs(mcfg, exits, shortlist, cfg.seed, graphs_dir, tuple(b for b in cfg.verify_batches if b > 1))
    export_s = time.perf_counter() - t_export
    nbytes = sum(f.stat().st_size for f in graphs_dir.rglob("*") if f.is_file())
    _log(t0, f"{name}: exported {nbytes / 2**30:.2f} GiB of graphs in {export_s:.0f} s; timing")
    base = decision_chains(graphs_dir / "checks", graphs_dir / "split", len(exits))
    # a step leaving at a decision exit: the segments up to it, then stop (leaving at the last is "checks")
    leave = {f"exit_{k}": base["checks"][:i + 1] for i, k in enumerate(exits[:-1])}
    t_measure = time.perf_counter()
    chain_ms = {}
    for b in cfg.batch_sizes:
        # call by call: a step of these shapes outlasts the shifts of a shared machine's load, which would
        # otherwise land on one chain's calls and not another's (measured: +-10 % between chains' batches)
        chain_ms[str(b)] = chain_times({**base, **(leave if b == 1 else {})}, mcfg, b, cfg.past, cfg.threads,
                                       cfg.calls, cfg.repeats, by_call=True)
        _log(t0, f"{name} batch {b}: " + ", ".join(f"{k} {np.median(v):.1f} ms" for k, v in chain_ms[str(b)].items()))
    verify = None
    if cfg.verify_batches:  # rho(k): k new rows per sequence in one call, batch 1 and the verify batches
        verify = verify_costs(graphs_dir / "checks", mcfg.num_layers, mcfg.num_kv_heads, mcfg.head_dim,
                              mcfg.hidden_size, mcfg.vocab_size, cfg.past, sorted({1, *cfg.verify_batches}),
                              threads=cfg.threads, repeats=cfg.repeats)
        _log(t0, f"{name} rho(k): " + "; ".join(f"batch {b} " + ", ".join(f"k={k} {v:.2f}" for k, v in r.items()
                                                                         if k != "step_ms")
                                                for b, r in verify.items()))
    figures = shape_figures(chain_ms, fraction, mcfg.num_layers, cfg.past)
    sp = figures["spread_b1"]["speedup_exit_vs_full_b1"]
    _log(t0, f"{name}: layer {figures['layer_ms']:.2f} ms, check {figures['decision_cost_layers']:.3f} layers, "
             f"boundary {figures['boundary_layers']:.3f} layers; projected speed-up at batch 1 "
             f"{figures['speedup_exit_vs_full_b1']:.3f}x ({sp['min']:.3f}-{sp['max']:.3f})")
    return {
        "model": {"arch": mcfg.arch.value, "params": mcfg.num_params(), "layers": mcfg.num_layers,
                  "hidden": mcfg.hidden_size, "heads": mcfg.num_heads, "kv_heads": mcfg.num_kv_heads,
                  "head_dim": mcfg.head_dim, "intermediate": mcfg.intermediate_size, "vocab": mcfg.vocab_size,
                  "shortlist": shortlist},
        **figures,
        # a check's weight bytes in layers' (batch-1 decode reads every weight once a step): arithmetic, the
        # scale of a check's cost where the measured difference of two chains is within their noise
        "check_bytes_layers": shortlist * mcfg.hidden_size / layer_params(mcfg),
        "chain_ms": chain_ms,
        # mode exact's verification: a call of k new rows per sequence over a plain step, by batch (batch 1:
        # the graph of every layer; above: the verify graph), the LM head on every row included
        "verify_cost_ratio": verify,
        "verify_cost_ratio_k4_b1": None if verify is None else verify["1"].get("4"),
        **{f"verify_cost_ratio_k4_b{b}": verify[str(b)].get("4") for b in cfg.verify_batches if b > 1 and verify},
        "export_s": export_s,
        "measure_s": time.perf_counter() - t_measure,
        "graphs_bytes": nbytes,
        "peak_rss_gib": _peak_rss_gib(),  # the process's, up to the end of this shape
    }


def caveats(replay: Replay) -> list[str]:
    """What the numbers are and are not: the JSON's and the Markdown's wording."""
    return [
        "A projection: random float32 weights at the named shapes, exits forced by replaying the run's exit-depth "
        "distribution at the same relative depths; nothing about quality follows from it.",
        "The candidate check runs in every segment graph but never chooses: a step stops at its replayed exit.",
        "No K/V of skipped layers is made: neither shipped K/V mode's cost. The run ships "
        f"'{replay.kv_mode}'; at batch 1 'defer' recomputes a leaving token's skipped rows with its next token in "
        "one call (more rows in that call), which this projection does not time; 'propagate' would run kvfill "
        "graphs, not timed either.",
        "t_exit(k): the segment graphs up to exit k, then stop (the last exit: every segment and the LM head); "
        "t_full: the graph of every layer and the LM head, what the engine runs when no row may leave. The speed-up "
        "is also given against 'split' (the same layers cut at the exits, no checks, and the head), which separates "
        "what exits buy from how one large graph runs against several smaller ones. The engine's host work per "
        "call is in neither.",
    ]


def render_markdown(result: dict[str, Any]) -> str:
    """``projection.md``: the caveats, the conditions and one row per shape."""
    c, r = result["conditions"], result["replay"]
    lines = ["# Exit decisions at real model shapes: a projection", "",
             *[f"- {x}" for x in result["caveats"]], "",
             f"Replayed: {r['source']}; shipped exits {sorted(int(k) for k in r['fraction'])} of {r['num_layers']} "
             f"layers, K = {r['shortlist']}, K/V mode {r['kv_mode']}; {_replayed_vs_free_run(r)}.",
             f"Conditions: ONNX Runtime {c['onnxruntime']} CPU, {c['threads']} threads, float32, {c['past']} cached "
             f"tokens, {c['calls']} steps x {c['repeats']} interleaved repeats per chain; medians (min-max over "
             f"repeats); {c['cpu_count']} CPUs. Layers = one decoder layer's time at batch 1; a check's weight "
             "bytes in layers is arithmetic, not measured.", "",
             "| shape | params | exits (fraction) | layer ms | check, layers | check bytes, layers | boundary, layers "
             "| LM head, layers | speed-up b1 | vs split | layers only | check, largest batch | export s | peak GiB |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]

    def cell(s: dict[str, Any], key: str, spec: str = ".3f") -> str:
        sp = s["spread_b1"][key]
        return f"{s[key]:{spec}} ({sp['min']:{spec}} to {sp['max']:{spec}})"

    for name, s in result["shapes"].items():
        exits = ", ".join(f"{k} ({f:.3f})" for k, f in s["exit_fraction"].items())
        b = max(s["decision_cost"], key=int)
        lines.append(
            f"| {name} | {s['model']['params'] / 1e9:.2f}B | {exits} | {cell(s, 'layer_ms', '.2f')} | "
            f"{cell(s, 'decision_cost_layers')} | {s['check_bytes_layers']:.4f} | {cell(s, 'boundary_layers')} | "
            f"{s['head_layers']:.2f} | **{cell(s, 'speedup_exit_vs_full_b1')}x** | {cell(s, 'speedup_exit_vs_split_b1')}x | "
            f"{s['speedup_layers_only']:.3f}x | "
            f"{s['decision_cost'][b]['check_layers']:.3f} (batch {b}) | {s['export_s']:.0f} | "
            f"{s['peak_rss_gib']:.1f} |")
    verify = {name: s["verify_cost_ratio"] for name, s in result["shapes"].items() if s.get("verify_cost_ratio")}
    if verify:
        lines += ["", "Mode exact's verification, rho(k): a call of k new rows per sequence over a plain step (batch 1: "
                  "the graph of every layer; above: the verify graph), the LM head on every row included:", ""]
        for name, by_batch in verify.items():
            lines.append(f"- {name}: " + "; ".join(
                f"batch {b} (plain step {r['step_ms']:.1f} ms) " + ", ".join(f"k={k} {v:.2f}" for k, v in r.items()
                                                                          if k != "step_ms")
                for b, r in by_batch.items()))
    return "\n".join(lines + [""])


def _replayed_vs_free_run(r: dict[str, Any]) -> str:
    """The replayed distribution's exited fraction and mean exit layer, and the run's held-out free run's."""
    f = {int(k): v for k, v in r["fraction"].items()}
    text = (f"it leaves early at {1 - f.get(r['num_layers'], 0.0):.3f} of tokens, mean exit layer "
            f"{sum(k * v for k, v in f.items()):.2f}")
    fr = r.get("free_run")
    if fr:
        text += (f" (the run's held-out free run: {fr['exited_frac']:.3f} and {fr['mean_exit_layer']:.2f}, "
                 f"{fr.get('tokens', '?')} tokens)")
    return text


def main(cfg: ProjectionBenchConfig) -> int:
    """Replay the run's exits at each shape of ``cfg``, write ``<run_dir>/bench/projection.json`` and
    ``projection.md``, and record stage ``bench_projection``."""
    import onnxruntime as ort
    import torch

    t0 = time.time()
    torch.set_num_threads(cfg.threads)
    run = Path(cfg.run_dir)
    replay = read_replay(run)
    _log(t0, f"replaying {replay.source}")
    plans = {name: replay_at(name, replay) for name in cfg.shapes}  # every shape's errors before any export
    out = run / "bench"
    shapes: dict[str, Any] = {}
    for name, fraction in plans.items():
        graphs_dir = out / "projection_graphs" / name
        shutil.rmtree(graphs_dir, ignore_errors=True)  # an earlier run's graphs are of other weights or code
        try:
            shapes[name] = measure_shape(name, fraction, replay.shortlist, cfg, graphs_dir, t0)
        finally:
            if not cfg.keep_graphs:
                shutil.rmtree(graphs_dir, ignore_errors=True)
        shapes[name]["graphs_dir"] = str(graphs_dir) if cfg.keep_graphs else None
        gc.collect()
    with contextlib.suppress(OSError):  # the graphs' folder, when no shape's graphs are kept in it
        (out / "projection_graphs").rmdir()
    result = {
        "kind": "projection",
        "caveats": caveats(replay),
        "config": asdict(cfg),
        "conditions": {"threads": cfg.threads, "repeats": cfg.repeats, "calls": cfg.calls, "past": cfg.past,
                       "batch_sizes": cfg.batch_sizes, "dtype": "float32", "onnxruntime": ort.__version__,
                       "cpu_count": os.cpu_count()},
        "replay": {**asdict(replay), "fraction": {str(k): v for k, v in replay.fraction.items()}},
        "shapes": shapes,
        "seconds": time.time() - t0,
    }
    atomic_write_json(out / "projection.json", result)
    atomic_write_text(out / "projection.md", render_markdown(result))
    metrics = {name: {k: s[k] for k in ("layer_ms", "decision_cost_layers", "boundary_layers",
                                         "speedup_exit_vs_full_b1", "exit_layers") + tuple(
                          k for k in s if k.startswith("verify_cost_ratio_k4_"))} for name, s in shapes.items()}
    inputs = {} if replay.checkpoint is None else {"checkpoint": replay.checkpoint}
    Manifest(run).record(STAGE, inputs=inputs, config=asdict(cfg),
                         outputs={"json": out / "projection.json", "markdown": out / "projection.md"},
                         metrics={"kind": "projection", **metrics}, seconds=time.time() - t0)
    _log(t0, f"wrote {out / 'projection.json'}")
    return 0
