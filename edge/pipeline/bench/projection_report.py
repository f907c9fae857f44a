"""The projection's wording: its caveats and ``projection.md``.

:func:`caveats` says what the numbers are and are not (the JSON's and the Markdown's wording);
:func:`render_markdown` writes the caveats, the conditions and one row per shape from
``projection.json``'s result (edge/pipeline/bench/projection.py).
"""
from __future__ import annotations

from typing import Any

from edge.pipeline.bench.projection_replay import Replay


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
