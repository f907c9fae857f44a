"""``smartexit bench projection``: the engine's exit decisions at real model shapes, as a projection.

The bundled model is small; what a candidate check and an early exit buy at Qwen2.5-0.5B and
Llama-3.2-1B shapes is projected here, on random weights made locally (nothing is downloaded: the
cost of a step depends on the shapes, not on the values), exported to the same fused ONNX Runtime
graphs the engine runs (their weights in external data files), float32, ONNX Runtime CPU.

Exits are forced: the run's measured exit-depth distribution (the ``calibrate`` stage's certify walk:
where the shipped rule's tokens left, the last layer included) is replayed at each shape with every
exit moved to the same relative depth (projection_replay.py's :func:`scale_layer`). A decode step that
leaves at exit ``k`` is timed as the chain of segment graphs (each with its candidate check) up to ``k``,
stopping there; the last exit runs every segment and the LM head; full depth is the graph of every layer
and the head. The projected speed-up at batch 1 is ``t_full / sum_k f_k t_exit(k)``
(projection_replay.py's :func:`projected_speedup`). The check's and the boundary's cost in layers come
from the same loop, the chains taking turns call by call (edge/pipeline/bench/decision.py), at batch 1
and 16.

What this is not (said in the JSON and the Markdown too): the candidate check never chooses (the
exits are forced, so no quality is implied); no K/V of skipped layers is made, which is the cost of
neither K/V mode: the shipped mode at batch 1, ``defer``, recomputes the skipped layers' rows with
the sequence's next token in one call (more rows in that call), and this projection does not time
those rows. It is not run by ``make demo``: ``make bench-projection`` (minutes per shape: export,
load and timing of gigabytes of weights).

Here: the settings, a shape's export and timing in turn, the stage's files and record. The shapes and
their random-weight graphs are in projection_shapes.py, the replay of the exits in projection_replay.py,
the figures from the chains' times in projection_figures.py, the caveats and ``projection.md`` in
projection_report.py.
"""
from __future__ import annotations

import contextlib
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
from edge.core.errors import ConfigError
from edge.pipeline.bench.projection_figures import shape_figures
from edge.pipeline.bench.projection_replay import read_replay, replay_at
from edge.pipeline.bench.projection_report import caveats, render_markdown
from edge.pipeline.bench.projection_shapes import export_graphs, layer_params, shape_config
from edge.pipeline.bench.verify_cost import verify_costs

STAGE = "bench_projection"


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


def _log(t0: float, msg: str) -> None:
    print(f"[bench projection {time.time() - t0:7.1f}s] {msg}", flush=True)


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def measure_shape(name: str, fraction: dict[int, float], shortlist: int, cfg: ProjectionBenchConfig,
                  graphs_dir: Path, t0: float) -> dict[str, Any]:
    """Export shape ``name`` with exits at the keys of ``fraction`` (projection_replay.py's :func:`replay_at`)
    and a candidate shortlist of ``shortlist`` tokens into ``graphs_dir``, time the chains at each batch size
    (the exit chains at batch 1 only), and return the shape's part of ``projection.json``."""
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
