"""The measurement windows sections 6-8 of deploy/gpu_check.py share: engine runs of several systems on
the same prompts, rotated over rounds, each system's window repeated for ``window_s`` seconds (one energy
window on the meter where there is one); and a captured decode plan's replay timed (one layer's time: GPU
work and launch, no host work)."""
from __future__ import annotations

import time
from typing import Any

from edge.pipeline.gpu_check.engine_runs import engine_run


def replay_ms(plan, sync, n: int = 200) -> float:
    """Milliseconds per replay of a captured decode plan (its inputs as they are), after 10 warm-ups."""
    for _ in range(10):
        plan()
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        plan()
    sync()
    return 1e3 * (time.perf_counter() - t0) / n


def rotate(systems: dict[str, tuple], groups: list[list[list[int]]], steps: int, window_s: float, rounds: int,
           meter, sync, depth: int) -> dict[str, Any]:
    """Engine runs of each system (name -> (backend, rule); "full": requests in mode full) on prompt groups
    (one group per run, cycled; a group is one batch), rotated for ``rounds`` rounds, each system's window
    repeated for ``window_s`` seconds (one energy window on ``meter``). Per system: decode tokens/s (after
    every request's first token), tokens, mean exit layer, share of tokens that left early, median
    joules per token over its windows (None without a meter)."""
    import numpy as np

    from edge.runtime.engine_config import EngineConfig
    from edge.runtime.request import Mode

    batch = len(groups[0])
    longest = max(len(p) for g in groups for p in g)
    cfg = EngineConfig(max_seqs=batch, max_running=batch, max_len=longest + steps + 2,
                       prefill_budget=longest * batch, defer_exit_max_batch=None)
    turn = {"n": 0}

    def run(name: str) -> tuple[float, int, list[int]]:
        """One engine run: decode seconds (after every request's first token), decode tokens, exit layers."""
        backend, rule = systems[name]
        prompts = groups[turn["n"] % len(groups)]
        turn["n"] += 1
        seconds, _, layers = engine_run(backend, rule, cfg, prompts, steps, sync,
                                        Mode.FULL if name == "full" else Mode.BOUNDED)
        return seconds, len(layers), layers

    names = list(systems)
    for name in names:  # warm-up: graphs captured, allocator settled
        run(name)
    acc = {name: {"seconds": 0.0, "tokens": 0, "layers": [], "joules": []} for name in names}
    for rnd in range(rounds):
        for name in (names if rnd % 2 == 0 else names[::-1]):
            a = acc[name]
            turn["n"] = 0  # every system's window starts at the same group
            if meter is not None:
                meter.start()
            t0, tokens = time.perf_counter(), 0
            while True:
                sec, n, layers = run(name)
                a["seconds"] += sec
                a["tokens"] += n
                a["layers"] += layers
                tokens += n
                if time.perf_counter() - t0 >= window_s:
                    break
            if meter is not None:
                m = meter.stop()
                if m.joules is not None:
                    a["joules"].append(m.joules / tokens)
    row: dict[str, Any] = {}
    for name, a in acc.items():
        layers = np.array(a["layers"])
        row[name] = {"decode_tokens_per_s": a["tokens"] / a["seconds"], "tokens": a["tokens"],
                     "mean_exit_layer": float(layers.mean()), "left_early": float((layers < depth).mean()),
                     "joules_per_token": float(np.median(a["joules"])) if a["joules"] else None}
    return row
