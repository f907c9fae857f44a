"""The projection's figures of one shape from its chains' times.

:func:`shape_figures` turns the timed chains (edge/pipeline/bench/projection.py's ``measure_shape``)
into what ``projection.json`` reports: the decision cost per batch in layers, and at batch 1 the
projected speed-up against full depth and against the split graphs, each with its min-max over
repeats.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from edge.pipeline.bench.projection_replay import projected_speedup


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
