"""One engine run of a benchmark: a fresh engine over a backend, greedy, every token time-stamped.

Torch-free (numpy and the engine only), so a fresh process that measures memory imports what a
device imports to serve (:mod:`edge.pipeline.bench.engine_memory`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edge.runtime.engine import Engine, EngineConfig, KVMode, Mode, Request
from edge.runtime.speculative import SpecConfig


@dataclass
class RunResult:
    tokens: list[list[int]]  # [B][N]
    exit_layers: list[list[int]] | None
    seconds: float
    token_latencies: list[float]  # seconds between consecutive tokens of a sequence
    spec_stats: list[dict[str, Any]] = field(default_factory=list)  # mode exact: SpecStats of each engine
    # mode exact, by draft source ("lookup", "exit"): SpecStats of each engine; "plain": its plain steps
    source_stats: list[dict[str, Any]] = field(default_factory=list)


def run_engine(backend, rule, prompts: list[list[int]], n: int, kv_mode: KVMode,
               spec: SpecConfig | None = None, speculate_max_batch: int | None = 1, mode: Mode | None = None
               ) -> RunResult:
    """Generate with a fresh engine; with ``spec``, every request in mode exact, exit drafts while the
    decode batch holds at most ``speculate_max_batch`` sequences (None: any); ``mode`` overrides the
    requests' mode (e.g. full: the exit graphs' own full depth)."""
    b = len(prompts)
    cfg = EngineConfig(max_seqs=b, max_running=b, max_len=len(prompts[0]) + n,
                       prefill_budget=b * len(prompts[0]), kv_mode=kv_mode, speculative=spec or SpecConfig(),
                       speculate_max_batch=speculate_max_batch)
    engine = Engine(backend, cfg, rule)
    if mode is None:
        mode = Mode.BOUNDED if spec is None else Mode.EXACT
    stamps: dict[int, list[float]] = {}
    toks: dict[int, list[tuple[int, int]]] = {}

    def on_token(ev):
        stamps.setdefault(ev.request_id, []).append(time.perf_counter())
        toks.setdefault(ev.request_id, []).append((ev.token, ev.exit_layer))

    t0 = time.perf_counter()
    ids = [engine.submit(Request(p, n, on_token=on_token, mode=mode)) for p in prompts]
    engine.run_until_idle()
    seconds = time.perf_counter() - t0
    gaps = [g for i in ids for g in np.diff(stamps[i]).tolist()]
    return RunResult([[t for t, _ in toks[i]] for i in ids], [[e for _, e in toks[i]] for i in ids], seconds, gaps,
                     [] if spec is None else [engine.spec_stats.as_dict()],
                     [] if spec is None else [{**{k: v.as_dict() for k, v in engine.source_stats.items()},
                                               "plain_steps": engine.plain_steps}])
