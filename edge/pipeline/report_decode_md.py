"""The report's Markdown about decoding speed and energy: the decode benchmark (with the step gate, what a check
costs, self-speculation), energy per token, the projection to real model shapes and the Jetson's own bench."""
from __future__ import annotations

from typing import Any

from edge.pipeline.report_format import fmt


def bench_md(b: dict[str, Any]) -> list[str]:
    lines = ["## Decode benchmark", "", "| batch | system | tokens/s | p50 ms | p95 ms | mean exit layer |",
             "| ---: | --- | ---: | ---: | ---: | ---: |"]
    for batch, row in b["batches"].items():
        for s, v in row["systems"].items():
            lines.append(f"| {batch} | {s} | {v['tokens_per_s']:.1f} | {fmt(v['token_latency_p50_ms'], '.2f')} | "
                         f"{fmt(v['token_latency_p95_ms'], '.2f')} | {fmt(v['mean_exit_layer'], '.2f')} |")
    if b.get("goals"):
        from edge.pipeline.bench.summary import goals_table

        lines += ["", *goals_table(b["goals"])]
    scalars = {k: v for k, v in b.items() if not isinstance(v, dict)
               and (k.startswith("speedup") and "speculative" not in k or k == "false_exit_rate")}
    by_mode = {k: v for k, v in b.items() if k.endswith("_by_mode")}
    lines += ["", f"- (d) = exits with skipped layers' K/V by {b.get('kv_mode')}: "
              + ", ".join(f"{k} {fmt(v, '.3f')}" for k, v in scalars.items()),
              "- both K/V modes: " + "; ".join(
                  f"{k} " + ", ".join(f"{m} {fmt(x, '.3f')}" for m, x in v.items()) for k, v in by_mode.items()),
              *_gate_md(b),
              "- decode step of (d) at batch 1, ms: " + ", ".join(f"{k} {v:.3f}" for k, v in b["profile_b1"].items()),
              *_decision_md(b),
              "- peak RSS over the libraries-imported baseline (MiB): " + ", ".join(f"{k} {v:.0f}" for k, v in (b.get("peak_rss_mib") or {}).items()),
              *_speculative_md(b),
              "", "Details: `bench/decode.md`.", "", "![decode throughput](bench/decode.png)", ""]
    return lines


def _gate_md(b: dict[str, Any]) -> list[str]:
    """(d) as the served engine runs it: the step gate (edge/runtime/gate.py) checks exits only at batch sizes
    where checking steps measured cheaper than full depth, and lossless lookup / corpus drafts run where a round
    is expected to pay (EngineConfig.bounded_drafts)."""
    keys = sorted(k.removeprefix("speedup_exit_gated_vs_full_b") for k in b if k.startswith("speedup_exit_gated_vs_full_b"))
    if not keys or all(b.get(f"speedup_exit_gated_vs_full_b{k}") is None for k in keys):
        return []
    return ["- (d) as served (the step gate runs checks only where they measured cheaper than full depth; lossless "
            "lookup and corpus drafts where a round pays): " + ", ".join(
        f"batch {k} (d)/(c) {fmt(b.get(f'speedup_exit_gated_vs_full_b{k}'), '.3f')}, steps checked "
        f"{fmt(b.get(f'gate_share_checked_b{k}'), '.2f')}" for k in sorted(keys, key=int))]


def _decision_md(b: dict[str, Any]) -> list[str]:
    """What a candidate check costs, in layers (edge/pipeline/bench/decision.py), when the run measured it."""
    if b.get("decision_cost_layers_b1") is None:
        return []
    big = next((k for k in b if k.startswith("decision_cost_layers_b") and k != "decision_cost_layers_b1"), None)
    return [f"- a candidate check, in layers (its nodes inside a call): batch 1 {fmt(b['decision_cost_layers_b1'], '.3f')}"
            + (f", batch {big.rsplit('_b', 1)[1]} {fmt(b[big], '.3f')}" if big else "")
            + f"; cutting a call in two at batch 1 {fmt(b.get('boundary_cost_layers_b1'), '.3f')}; a check point in "
            f"the engine at batch 1, host work included, {fmt(b.get('check_point_cost_layers_b1'), '.3f')}"]


def _speculative_md(b: dict[str, Any]) -> list[str]:
    """(e) self-speculative decoding: ratios, acceptance, the batch-1 sweep of draft exits and stop rules."""
    if b.get("speculative_mismatches") is None:  # a run benchmarked before (e) existed
        return []
    sc = b.get("speculative_config") or {}
    spec = {k: (row.get("speculative") or {}) for k, row in b["batches"].items()}
    lines = ["", f"**(e) self-speculative decoding** (mode exact, draft exit {sc.get('draft_exit')}, rule "
             f"{sc.get('stop')}): tokens differing from full depth (c) "
             f"**{fmt(b.get('speculative_mismatches'), 'd')}** of "
             f"{fmt(b.get('speculative_tokens_compared'), 'd')}; (e)/(c) "
             + ", ".join(f"batch {k} {fmt(row.get('speedup_speculative_vs_full'), '.3f')}"
                         for k, row in b["batches"].items())
             + f"; (e)/(b) LayerSkip at batch 1 {fmt(b.get('speedup_speculative_vs_layerskip_b1'), '.3f')}; "
             "acceptance rate / mean accepted length / tokens per round: "
             + ", ".join(f"batch {k} {fmt(st.get('acceptance_rate'), '.3f')} / "
                         f"{fmt(st.get('mean_accepted_length'), '.2f')} / {fmt(st.get('tokens_per_round'), '.2f')}"
                         for k, st in spec.items())]
    by_exit, stops = b.get("speculative_by_draft_exit"), b.get("speculative_stop_rules")
    if by_exit:
        lines += ["", "| draft exit (batch 1, calibrated rule) | (e)/(c) | acceptance rate | mean accepted length |",
                  "| ---: | ---: | ---: | ---: |"]
        lines += [f"| {k} | {fmt(r['speedup_vs_full'], '.3f')} | {fmt(r['acceptance_rate'], '.3f')} | "
                  f"{fmt(r['mean_accepted_length'], '.2f')} |" for k, r in by_exit.items()]
    if stops:
        lines += ["", "| stop rule (batch 1) | (e)/(c) | acceptance rate | tokens per round |",
                  "| --- | ---: | ---: | ---: |"]
        lines += [f"| {k} | {fmt(r['speedup_vs_full'], '.3f')} | {fmt(r['acceptance_rate'], '.3f')} | "
                  f"{fmt(r['tokens_per_round'], '.2f')} |" for k, r in stops.items()]
        lines += ["", f"Calibrated rule / best fixed-or-top-1 rule: "
                  f"{fmt(b.get('speculative_calibrated_vs_best_other_b1'), '.3f')}."]
    return lines


def _range(r: list[float] | None) -> str:
    """`` (lo-hi)`` of a ratio's per-repeat min-max, or nothing."""
    return "" if not r else f" ({r[0]:.3f}-{r[1]:.3f})"


def energy_md(e: dict[str, Any]) -> list[str]:
    """Energy (or, without a sensor, the CPU-time proxy) per token per system (bench/energy.md has the spread)."""
    systems = list(e["cpu_seconds_per_token"])
    if e["meter_available"]:
        head = (f"Meter `{e['meter']}` (rails: {', '.join(e['rails']) or '-'}). Joules per token: " + ", ".join(
            f"{n} {fmt(e['joules_per_token'][n], '.4g')}" for n in systems) + f"; exits / full depth "
            f"x{fmt(e.get('ratio_exit_vs_full'), '.3f')}, shipped ({e['shipped_system']}) / full depth "
            f"x{fmt(e.get('ratio_shipped_vs_full'), '.3f')}.")
    else:
        head = (f"**No power sensor on this machine** ({e['meter_reason']}): no joules. As a proxy, CPU-seconds "
                "per token (process user + system time; not energy): " + ", ".join(
                    f"{n} {fmt(1e3 * e['cpu_seconds_per_token'][n], '.3g')} ms" for n in systems)
                + f"; shipped ({e['shipped_system']}) / full depth x{fmt(e.get('cpu_ratio_shipped_vs_full'), '.3f')}"
                + f"; exits / full depth x{fmt(e.get('cpu_ratio_exit_vs_full'), '.3f')}"
                + _range(e.get("cpu_ratio_exit_vs_full_range"))
                + (f", the compressed model's x{fmt(e['cpu_ratio_compressed_exit_vs_compressed_full'], '.3f')}"
                   + _range(e.get("cpu_ratio_compressed_exit_vs_compressed_full_range"))
                   if e.get("cpu_ratio_compressed_exit_vs_compressed_full") is not None else "")
                + (f"; as served (step gate, lossless drafts) / its own full depth "
                   f"x{fmt(e['cpu_ratio_served_vs_full_depth'], '.3f')}"
                   + _range(e.get("cpu_ratio_served_vs_full_depth_range"))
                   if e.get("cpu_ratio_served_vs_full_depth") is not None else "")
                + " (ratios: median of the repeats' paired ratios, min-max).")
    return ["## Energy per token", "", head + " Tokens/s: " + ", ".join(
        f"{n} {fmt(e['tokens_per_s'][n], '.0f')}" for n in systems) + ".", "", "![energy](bench/energy.png)", ""]


def projection_md(p: dict[str, Any]) -> list[str]:
    """The projection to real shapes (`make bench-projection`), one line per shape."""
    shapes = {k: v for k, v in p.items() if isinstance(v, dict)}
    return ["## Exit decisions at real model shapes (a projection: `make bench-projection`)", "",
            "Random float32 weights at each shape, the run's exit depths replayed at the same relative depth, "
            "fused ONNX Runtime graphs on this CPU; no quality follows from it (bench/projection.md).", ""] + [
        f"- {name}: exits {s.get('exit_layers')}, a layer {fmt(s.get('layer_ms'), '.2f')} ms, a candidate check "
        f"{fmt(s.get('decision_cost_layers'), '.3f')} layers, a boundary {fmt(s.get('boundary_layers'), '.3f')} "
        f"layers, projected speed-up at batch 1 x{fmt(s.get('speedup_exit_vs_full_b1'), '.3f')}"
        for name, s in shapes.items()] + [""]


def jetson_md(j: dict[str, Any]) -> list[str]:
    """On the Jetson (`make jetson-bench`): the device, the engines' parity, decode tokens/s, joules per token."""
    d, dec, en = j.get("device") or {}, j.get("decode") or {}, j.get("energy") or {}
    lines = ["## On the Jetson", "", f"{d.get('model') or 'Jetson'}: L4T {d.get('l4t')} (JetPack {d.get('jetpack')}), "
             f"TensorRT {d.get('tensorrt')}, power mode {d.get('power_mode')}; TensorRT engines match ONNX Runtime: "
             f"**{j.get('engine_parity_passed')}**. Results: `jetson/bench/` (device check: `jetson/device/`).", ""]
    rows = [(b, s, v) for b, row in (dec.get("batches") or {}).items() for s, v in row["systems"].items()]
    if rows:
        lines += ["| batch | system | tokens/s |", "| ---: | --- | ---: |"]
        lines += [f"| {b} | {s} | {fmt(v.get('tokens_per_s'), '.1f')} |" for b, s, v in rows] + [""]
    if en:
        speed = ", ".join(f"{n} {fmt(v, '.1f')}" for n, v in (en.get("tokens_per_s") or {}).items())
        lines += [f"Served backend `{en.get('backend', 'onnxruntime')}` (full: {en.get('full_is', 'see bench/energy.md')}): "
                  f"tokens/s {speed}; exits / full {fmt(en.get('speed_ratio_shipped_vs_full'), '.3f')}; false exits "
                  f"{fmt(en.get('false_exit_rate'), '.4f')} of {en.get('false_exit_tokens')} tokens (against "
                  f"{en.get('false_exits_judged_against')}).", ""]
    if en.get("meter_available"):
        lines += [f"Energy (`{en.get('meter')}`): joules per token " + ", ".join(
            f"{n} {fmt(v, '.4g')}" for n, v in (en.get("joules_per_token") or {}).items())
            + f"; exits / full {fmt(en.get('ratio_shipped_vs_full'), '.3f')}.", ""]
    elif en:
        lines += [f"No power reading on the device: {en.get('meter_reason')}.", ""]
    return lines
