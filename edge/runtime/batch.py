"""One-off engine runs: a fresh engine over a backend generates a batch of prompts, every token time-stamped.

The one batch runner of the project: free-running calibration and evaluation (calibration.freerun), the
benchmarks (edge/pipeline/bench) and the engine's memory probe all generate with :func:`run_batch`.
Torch-free (numpy and the engine only), so a fresh process that measures memory imports what a device
imports to serve (:mod:`edge.pipeline.bench.engine_memory`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edge.runtime.backend import Backend
from edge.runtime.engine import Engine
from edge.runtime.engine_config import EngineConfig, KVMode
from edge.runtime.request import Mode, Request
from edge.runtime.rules import BatchExitRule
from edge.runtime.speculative import SpecConfig

_ENGINE_DEFAULT = EngineConfig.__dataclass_fields__["defer_exit_max_batch"].default


@dataclass
class RunResult:
    tokens: list[list[int]]  # [B][N]
    exit_layers: list[list[int]] | None  # [B][N]: the layer each token left at (None: a peer that has none)
    seconds: float
    token_latencies: list[float]  # seconds between consecutive tokens of a sequence
    spec_stats: list[dict[str, Any]] = field(default_factory=list)  # mode exact: SpecStats of each engine
    # mode exact, by draft source ("lookup", "exit"): SpecStats of each engine; "plain": its plain steps
    source_stats: list[dict[str, Any]] = field(default_factory=list)
    # the cache slot each prompt ran in: the engine's cache (left attached to the backend) still holds its
    # K/V there, the prompt's at full depth (calibration's reference reads them instead of prefilling again)
    slots: list[int] = field(default_factory=list)


def run_batch(backend: Backend, rule: BatchExitRule | None, prompts: list[list[int]], max_tokens: int,
              kv_mode: KVMode = KVMode.PROPAGATE, *, spec: SpecConfig | None = None,
              speculate_max_batch: int | None = 1, mode: Mode | None = None,
              defer_exit_max_batch: int | None = _ENGINE_DEFAULT, defer_inline: bool = False,
              exit_gate: bool = False, bounded_drafts: bool = False, prefill_together: bool = False) -> RunResult:
    """Greedy-generate ``max_tokens`` tokens for every prompt with one fresh engine, all prompts admitted
    at once (prompts of any lengths). Results are in prompt order.

    Args:
        spec: mode exact's settings; with it every request runs in mode exact, exit drafts while the decode
            batch holds at most ``speculate_max_batch`` sequences (None: any).
        mode: overrides the requests' mode (e.g. full: the exit graphs' own full depth); default bounded,
            or exact with ``spec``.
        defer_exit_max_batch: the engine's (None: rows exit at any batch size, so with deferral each row's
            tokens are those it would get alone: what free-running calibration and evaluation need).
        defer_inline: the engine's (with deferral, a leaving row's skipped layers computed in the same step:
            deferral's K/V and tokens without its extra calls; calibration and evaluation only).
        exit_gate: the engine's step gate (edge/runtime/gate.py), off by default: a batch run measures what
            the rule does (calibration, the benches' exit systems); on, it runs as the served engine does.
        bounded_drafts: the engine's (requests in mode bounded also take lookup and corpus drafts where they
            pay, with ``spec``'s settings); off by default, on as the served engine runs.
        prefill_together: the engine's (prompts of one length in consecutive slots prefilled in one call: the same
            tokens, fewer calls); off by default, as the served engine and the benches' timed runs prefill.
    """
    b = len(prompts)
    cfg = EngineConfig(max_seqs=b, max_running=b, max_len=max(len(p) for p in prompts) + max_tokens,
                       prefill_budget=sum(len(p) for p in prompts), kv_mode=kv_mode,
                       speculative=spec or SpecConfig(), speculate_max_batch=speculate_max_batch,
                       defer_exit_max_batch=defer_exit_max_batch, defer_inline=defer_inline,
                       exit_gate=exit_gate, bounded_drafts=bounded_drafts, prefill_together=prefill_together)
    engine = Engine(backend, cfg, rule)
    if mode is None:
        mode = Mode.BOUNDED if spec is None else Mode.EXACT
    stamps: dict[int, list[float]] = {}
    toks: dict[int, list[tuple[int, int]]] = {}

    def on_token(ev):
        stamps.setdefault(ev.request_id, []).append(time.perf_counter())
        toks.setdefault(ev.request_id, []).append((ev.token, ev.exit_layer))

    t0 = time.perf_counter()
    ids = [engine.submit(Request(list(p), max_tokens, on_token=on_token, mode=mode)) for p in prompts]
    seqs = list(engine.waiting)  # in prompt order; each gets its slot when admitted
    engine.run_until_idle()
    seconds = time.perf_counter() - t0
    gaps = [g for i in ids for g in np.diff(stamps.get(i, [])).tolist()]
    return RunResult([[t for t, _ in toks.get(i, [])] for i in ids], [[e for _, e in toks.get(i, [])] for i in ids],
                     seconds, gaps,
                     [] if spec is None else [engine.spec_stats.as_dict()],
                     [] if spec is None else [{**{k: v.as_dict() for k, v in engine.source_stats.items()},
                                               "plain_steps": engine.plain_steps}],
                     [s.admitted_slot for s in seqs])
