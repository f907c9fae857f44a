"""``smartexit report``: assemble ``report.json`` / ``report.md`` from the run's manifest.

Every number in the report is a metric a stage recorded in ``manifest.json``;
the report adds nothing of its own. Later stages add sections by adding a
builder to ``SECTIONS``.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from edge.core.artifacts import Manifest, atomic_write_json, atomic_write_text
from edge.core.errors import ArtifactError, ConfigError


@dataclass
class ReportConfig:
    run_dir: str = "artifacts/demo"


def _model(m: Manifest) -> dict[str, Any]:
    d = m.stage("distill")["metrics"]
    return {"params": d["params"], "layers": d["layers"], "exits": d["exits"],
            "heldout_top1": d["heldout_top1"], "heldout_ppl": d["heldout_ppl"], "heldout_tokens": d["tokens"],
            "heldout_window": m.stage("distill")["config"]["seq_len"]}


def _distill(m: Manifest) -> dict[str, Any]:
    st = m.stage("distill")
    d = st["metrics"]
    return {"exit_agreement": d["exit_agreement"], "exit_accuracy": d["exit_accuracy"],
            "steps": st["config"]["steps"], "freeze_backbone": st["config"]["freeze_backbone"],
            "adapter_rank": st["config"]["exits"]["adapter_rank"], "seconds": st["seconds"],
            **{k: d[k] for k in ("base_heldout_ppl", "base_heldout_top1", "heldout_ppl", "heldout_top1") if k in d}}


def _generate(m: Manifest) -> dict[str, Any]:
    return dict(m.stage("generate")["metrics"])


def _calibration(m: Manifest) -> dict[str, Any]:
    return dict(m.stage("calibrate")["metrics"])


def _export(m: Manifest) -> dict[str, Any]:
    d = m.stage("export")["metrics"]
    p = d["parity"]
    fused = d.get("parity_fused")
    return {"graphs": d["graphs"], "graphs_full_depth": d["graphs_full"], "opset": d["opset"],
            "parity_passed": p["passed"] and d["parity_full"]["passed"] and (fused is None or fused["passed"]),
            "argmax_agreement": p["argmax_agreement"], "atol": p["atol"],
            "max_abs_diff": max(v for outs in p["max_abs_diff"].values() for v in outs.values()),
            "fused": None if fused is None else {
                "argmax_agreement": fused["argmax_agreement"], "rtol": fused["rtol"],
                "max_abs_diff": max(v for outs in fused["max_abs_diff"].values() for v in outs.values())},
            "fused_skipped": d.get("fused_skipped")}


def _bench(m: Manifest) -> dict[str, Any]:
    return dict(m.stage("bench_decode")["metrics"])


def _serve(m: Manifest) -> dict[str, Any]:
    return dict(m.stage("bench_serve")["metrics"])


def _crosscheck(m: Manifest) -> dict[str, Any]:
    return dict(m.stage("bench_crosscheck")["metrics"])


def _scheduler(m: Manifest) -> dict[str, Any]:
    return dict(m.stage("bench_scheduler")["metrics"])


def _audit(m: Manifest) -> dict[str, Any]:
    out = dict(m.stage("bench_audit")["metrics"])
    if "epsilon" not in out:
        raise ArtifactError(f"{m.path}: the bench_audit stage's metrics lack 'epsilon' (recorded before it was the "
                            f"audit's key); re-run `smartexit bench audit run_dir=...`")
    return out


def _compression(m: Manifest) -> dict[str, Any]:
    """The shipped recipe (stage compress) and the recipes side by side (stage bench_compress)."""
    out = dict(m.stage("bench_compress")["metrics"])
    if "compress" in m.data["stages"]:
        c = m.stage("compress")["metrics"]
        out["recipe"] = c["recipe"]
        out["pruned"] = c.get("pruned", False)
        out["perplexity_ratio_heldout"] = c.get("perplexity_ratio")
    return out


def _energy(m: Manifest) -> dict[str, Any]:
    return dict(m.stage("bench_energy")["metrics"])


def _projection(m: Manifest) -> dict[str, Any]:
    """`make bench-projection`: the run's exits replayed at real model shapes (edge/pipeline/bench/projection.py)."""
    return dict(m.stage("bench_projection")["metrics"])


def _jetson(m: Manifest) -> dict[str, Any]:
    """The device's own bench metrics, pulled into <run>/jetson/ by `make jetson-bench` (edge/jetson/bench.py)."""
    return dict(m.stage("jetson_bench")["metrics"])


SECTIONS: dict[str, tuple[str, Callable[[Manifest], dict[str, Any]]]] = {
    "model": ("distill", _model),
    "distill": ("distill", _distill),
    "calibration": ("calibrate", _calibration),
    "generate": ("generate", _generate),
    "export": ("export", _export),
    "compression": ("bench_compress", _compression),
    "energy": ("bench_energy", _energy),
    "decode_bench": ("bench_decode", _bench),
    "serve_bench": ("bench_serve", _serve),
    "audit_bench": ("bench_audit", _audit),
    "crosscheck": ("bench_crosscheck", _crosscheck),
    "scheduler": ("bench_scheduler", _scheduler),
    "projection": ("bench_projection", _projection),
    "jetson": ("jetson_bench", _jetson),
}


def build(run_dir: str | Path) -> dict[str, Any]:
    """The report of the run in ``run_dir``: every recorded stage's section.

    Raises:
        ConfigError: ``run_dir`` is not a folder holding a ``manifest.json`` (no run to report on).
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        what = "is not a folder" if run_dir.exists() else "does not exist"
        raise ConfigError(f"report.run_dir {run_dir} {what}: give the folder of a run (`smartexit distill` makes one)")
    if not (run_dir / "manifest.json").is_file():
        raise ConfigError(f"report.run_dir {run_dir} holds no manifest.json: no stage has run there")
    m = Manifest(run_dir)
    report: dict[str, Any] = {"run": m.data.get("run")}
    for name, (stage, fn) in SECTIONS.items():
        if stage in m.data["stages"]:
            report[name] = fn(m)
    return report


def render_markdown(report: dict[str, Any]) -> str:
    lines = [f"# SmartExit report: run `{report.get('run')}`", ""]
    if "model" in report:
        mo = report["model"]
        lines += ["## Model", "",
                  f"- parameters: {mo['params']:,}; layers: {mo['layers']}; exits after layers {mo['exits']}",
                  f"- held-out (test split, {mo['heldout_tokens']:,} tokens in windows of {mo['heldout_window']}; "
                  f"the model card uses windows of 512): perplexity {mo['heldout_ppl']:.3f}, "
                  f"top-1 next-token accuracy {mo['heldout_top1']:.4f}", ""]
    if "distill" in report:
        di = report["distill"]
        lines += ["## Multi-exit distillation", "",
                  f"{di['steps']} steps, backbone {'frozen' if di['freeze_backbone'] else 'fine-tuned'}, "
                  f"adapter rank {di['adapter_rank']}, {di['seconds']:.0f} s.", "",
                  "| exit layer | agreement with final layer | top-1 accuracy |", "| ---: | ---: | ---: |"]
        for k, a in di["exit_agreement"].items():
            lines.append(f"| {k} | {a:.4f} | {di['exit_accuracy'][k]:.4f} |")
        if "base_heldout_ppl" in di:
            when = ("before this run (the model's lineage.json names its base); this run kept it frozen"
                    if di["freeze_backbone"] else "in this run")
            lines += ["", f"The decoder was fine-tuned with the exit losses (LayerSkip-style early-exit training "
                      f"against the frozen base model) {when}. Full depth, same held-out windows: perplexity "
                      f"{di['base_heldout_ppl']:.3f} (base) -> {di['heldout_ppl']:.3f}, top-1 "
                      f"{di['base_heldout_top1']:.4f} -> {di['heldout_top1']:.4f}."]
        lines.append("")
    if "calibration" in report:
        lines += _calibration_md(report["calibration"])
    if "generate" in report:
        g = report["generate"]
        lines += ["## Reference early-exit generator", "",
                  f"- {g['prompts']} held-out prompts, {g['max_new_tokens']} new tokens each, greedy.",
                  f"- exits disabled reproduces full-model greedy decoding: **{g['disabled_equals_full_greedy']}**",
                  (f"- fixed max-probability threshold {g['threshold']} (uncalibrated)" if g.get("rule", "fixed") == "fixed"
                   else "- the calibrated rule (a shortlist model has no probability for a fixed threshold)")
                  + f": mean exit layer "
                  f"{g['mean_exit_layer']:.2f}, position-wise token match with full depth {g['token_match_vs_full']:.4f}",
                  "- exit fractions: " + ", ".join(f"layer {k}: {v:.3f}" for k, v in g["exit_fraction"].items()),
                  ""]
    if "export" in report:
        e = report["export"]
        f = e.get("fused")
        lines += ["## ONNX export", "", f"{e['graphs']} graphs (+ {e['graphs_full_depth']} for the full-depth "
                  f"baseline without exit heads) at opset {e['opset']}: the portable graphs (standard ops, for "
                  f"TensorRT) and the fused ONNX Runtime graphs the engine runs; parity with torch: "
                  f"**{e['parity_passed']}** (portable: max abs diff {e['max_abs_diff']:.2e} <= atol {e['atol']}, "
                  f"argmax agreement {e['argmax_agreement']:.2%}"
                  + (f"; fused: max abs diff {f['max_abs_diff']:.2e} within {f['rtol']:g} of each output's scale, "
                     f"argmax agreement {f['argmax_agreement']:.2%}" if f else
                     f"; no fused graphs: {e.get('fused_skipped')}") + ").", ""]
    if "compression" in report:
        lines += _compression_md(report["compression"])
    if "energy" in report:
        lines += _energy_md(report["energy"])
    if "decode_bench" in report:
        lines += _bench_md(report["decode_bench"])
    if "serve_bench" in report:
        lines += _serve_md(report["serve_bench"])
    if "crosscheck" in report:
        r = report["crosscheck"]["ours_over_aiperf"]
        lines += ["## Load client cross-checked against NVIDIA aiperf (`make aiperf-check`)", "",
                  "Ours / aiperf on the same stack, one after the other (bench/crosscheck/crosscheck.md has both "
                  "clients against the server's own histograms): " + ", ".join(
                      f"{k} {_fmt(v, '.3f')}" for k, v in r.items()) + ". Each client's mean minus the server's "
                  "own for the same requests (ms; equal gaps: both time the same events): " + ", ".join(
                      f"{k} {_fmt(v, '.1f')}" for k, v in report["crosscheck"].get("server_agreement", {}).items()),
                  ""]
    if "scheduler" in report:
        lines += _scheduler_md(report["scheduler"])
    if "projection" in report:
        lines += _projection_md(report["projection"])
    if "jetson" in report:
        lines += _jetson_md(report["jetson"])
    if "audit_bench" in report:
        a = report["audit_bench"]
        served = ""
        if "heldout_code_as_served_request_p_value" in a:
            served = (f" Requests as units of the certificate's own test (betting p-value of H0: mean per-request "
                      f"rate > eps): exits as the rule decides p {a['heldout_code_request_p_value']:.3g} (bound "
                      f"{a['heldout_code_request_bound']:.4f}); the engine as served p "
                      f"{a['heldout_code_as_served_request_p_value']:.3g} (bound "
                      f"{a['heldout_code_as_served_request_bound']:.4f}, rate {a['heldout_code_as_served_rate']:.4f}).")
        broken = ("" if a.get("caught_broken_rule") is None else
                  f" The rule with its thresholds dropped (every check exiting): false exits "
                  f"{a['broken_rule_rate']:.4f}, "
                  + (f"fallback to full depth after {a['broken_rule_fired_after']} audited tokens"
                     if a.get("broken_rule_fired_after") is not None else "no fallback")
                  + f": caught {a['caught_broken_rule']}.")
        lines += ["## Online false-exit audit", "",
                  f"Every served token audited (bench/audit.md; with deferral the engine judges its exits itself): "
                  f"held-out code {a['heldout_code_rate']:.4f} "
                  f"false exits (fallback: {a['false_alarm']}); another domain (its tokens shuffled) "
                  f"{a['word_salad_rate']:.4f}, "
                  + ("no fallback" if a['word_salad_fired_after'] is None else
                     f"fallback to full depth after {a['word_salad_fired_after']} audited tokens")
                  + f": caught {a['caught']} (eps {a['epsilon']})." + served + broken, ""]
    return "\n".join(lines)


def _compression_md(c: dict[str, Any]) -> list[str]:
    """The shipped compression recipe against the float model (bench/compress.md has every row)."""
    lines = ["## Compression", "",
             f"Shipped recipe `{c.get('recipe')}`{' + pruning near exits' if c.get('pruned') else ''} (distill -> "
             "compress -> export -> calibrate: the thresholds are certified on the served ONNX Runtime engine, every "
             "token judged against that engine at full depth). Against the distilled "
             f"float model, held out: accuracy loss {_fmt(c.get('accuracy_loss_rel'))} (relative top-1, float full depth vs "
             f"compressed with exits; {_fmt(c.get('accuracy_loss_rel_full_depth'))} at full depth), weights "
             f"x{_fmt(c.get('model_bytes_ratio'), '.3f')}, decode with exits on ONNX Runtime CPU "
             f"x{_fmt(c.get('speedup_vs_fp32_b1'), '.3f')} at batch 1 and x{_fmt(c.get('speedup_vs_fp32_b16'), '.3f')} "
             f"at batch 16; false-exit bound {_fmt(c.get('false_exit_bound'))} (certified), held-out rate "
             f"{_fmt(c.get('false_exit_rate_heldout'))}. At full depth the served engine and the torch model with "
             f"fake quantization pick different tokens on {_fmt(c.get('full_depth_mismatch_vs_torch'))} of tokens "
             "(near ties rounded to adjacent INT8 codes; docs/compression.md): the reason the certificate is "
             "computed on the engine, not on torch."]
    if c.get("llamacpp_same_bits"):
        lines.append(f"Against llama.cpp at the same bit-width ({c['llamacpp_same_bits']}, same weights, batch 1, "
                     f"measured side by side): x{_fmt(c.get('speedup_vs_llamacpp_same_bits_b1'), '.3f')} tokens/s, "
                     f"perplexity ratio {_fmt(c.get('perplexity_vs_llamacpp_same_bits'), '.4f')} (ours / theirs).")
    ti = (c.get("token_importance") or {})
    for score, r in ti.items():
        lines.append(f"Token importance ({score}, torch, prefill only): {r['flops_saved_frac']:.1%} of prefill FLOPs "
                     f"saved, perplexity x{r['ppl_ratio']:.4f} on the continuation.")
    return lines + ["", "![compression](bench/compress.png)", ""]


def _range(r: list[float] | None) -> str:
    """`` (lo-hi)`` of a ratio's per-repeat min-max, or nothing."""
    return "" if not r else f" ({r[0]:.3f}-{r[1]:.3f})"


def _energy_md(e: dict[str, Any]) -> list[str]:
    """Energy (or, without a sensor, the CPU-time proxy) per token per system (bench/energy.md has the spread)."""
    systems = list(e["cpu_seconds_per_token"])
    if e["meter_available"]:
        head = (f"Meter `{e['meter']}` (rails: {', '.join(e['rails']) or '-'}). Joules per token: " + ", ".join(
            f"{n} {_fmt(e['joules_per_token'][n], '.4g')}" for n in systems) + f"; exits / full depth "
            f"x{_fmt(e.get('ratio_exit_vs_full'), '.3f')}, shipped ({e['shipped_system']}) / full depth "
            f"x{_fmt(e.get('ratio_shipped_vs_full'), '.3f')}.")
    else:
        head = (f"**No power sensor on this machine** ({e['meter_reason']}): no joules. As a proxy, CPU-seconds "
                "per token (process user + system time; not energy): " + ", ".join(
                    f"{n} {_fmt(1e3 * e['cpu_seconds_per_token'][n], '.3g')} ms" for n in systems)
                + f"; shipped ({e['shipped_system']}) / full depth x{_fmt(e.get('cpu_ratio_shipped_vs_full'), '.3f')}"
                + f"; exits / full depth x{_fmt(e.get('cpu_ratio_exit_vs_full'), '.3f')}"
                + _range(e.get("cpu_ratio_exit_vs_full_range"))
                + (f", the compressed model's x{_fmt(e['cpu_ratio_compressed_exit_vs_compressed_full'], '.3f')}"
                   + _range(e.get("cpu_ratio_compressed_exit_vs_compressed_full_range"))
                   if e.get("cpu_ratio_compressed_exit_vs_compressed_full") is not None else "")
                + (f"; as served (step gate, lossless drafts) / its own full depth "
                   f"x{_fmt(e['cpu_ratio_served_vs_full_depth'], '.3f')}"
                   + _range(e.get("cpu_ratio_served_vs_full_depth_range"))
                   if e.get("cpu_ratio_served_vs_full_depth") is not None else "")
                + " (ratios: median of the repeats' paired ratios, min-max).")
    return ["## Energy per token", "", head + " Tokens/s: " + ", ".join(
        f"{n} {_fmt(e['tokens_per_s'][n], '.0f')}" for n in systems) + ".", "", "![energy](bench/energy.png)", ""]


def _projection_md(p: dict[str, Any]) -> list[str]:
    """The projection to real shapes (`make bench-projection`), one line per shape."""
    shapes = {k: v for k, v in p.items() if isinstance(v, dict)}
    return ["## Exit decisions at real model shapes (a projection: `make bench-projection`)", "",
            "Random float32 weights at each shape, the run's exit depths replayed at the same relative depth, "
            "fused ONNX Runtime graphs on this CPU; no quality follows from it (bench/projection.md).", ""] + [
        f"- {name}: exits {s.get('exit_layers')}, a layer {_fmt(s.get('layer_ms'), '.2f')} ms, a candidate check "
        f"{_fmt(s.get('decision_cost_layers'), '.3f')} layers, a boundary {_fmt(s.get('boundary_layers'), '.3f')} "
        f"layers, projected speed-up at batch 1 x{_fmt(s.get('speedup_exit_vs_full_b1'), '.3f')}"
        for name, s in shapes.items()] + [""]


def _jetson_md(j: dict[str, Any]) -> list[str]:
    """On the Jetson (`make jetson-bench`): the device, the engines' parity, decode tokens/s, joules per token."""
    d, dec, en = j.get("device") or {}, j.get("decode") or {}, j.get("energy") or {}
    lines = ["## On the Jetson", "", f"{d.get('model') or 'Jetson'}: L4T {d.get('l4t')} (JetPack {d.get('jetpack')}), "
             f"TensorRT {d.get('tensorrt')}, power mode {d.get('power_mode')}; TensorRT engines match ONNX Runtime: "
             f"**{j.get('engine_parity_passed')}**. Results: `jetson/bench/` (device check: `jetson/device/`).", ""]
    rows = [(b, s, v) for b, row in (dec.get("batches") or {}).items() for s, v in row["systems"].items()]
    if rows:
        lines += ["| batch | system | tokens/s |", "| ---: | --- | ---: |"]
        lines += [f"| {b} | {s} | {_fmt(v.get('tokens_per_s'), '.1f')} |" for b, s, v in rows] + [""]
    if en:
        speed = ", ".join(f"{n} {_fmt(v, '.1f')}" for n, v in (en.get("tokens_per_s") or {}).items())
        lines += [f"Served backend `{en.get('backend', 'onnxruntime')}` (full: {en.get('full_is', 'see bench/energy.md')}): "
                  f"tokens/s {speed}; exits / full {_fmt(en.get('speed_ratio_shipped_vs_full'), '.3f')}; false exits "
                  f"{_fmt(en.get('false_exit_rate'), '.4f')} of {en.get('false_exit_tokens')} tokens (against "
                  f"{en.get('false_exits_judged_against')}).", ""]
    if en.get("meter_available"):
        lines += [f"Energy (`{en.get('meter')}`): joules per token " + ", ".join(
            f"{n} {_fmt(v, '.4g')}" for n, v in (en.get("joules_per_token") or {}).items())
            + f"; exits / full {_fmt(en.get('ratio_shipped_vs_full'), '.3f')}.", ""]
    elif en:
        lines += [f"No power reading on the device: {en.get('meter_reason')}.", ""]
    return lines


def _loads(loads: list[float] | None) -> str:
    return "n/a" if not loads else ", ".join(f"x{x:g}" for x in loads)


def _sweep(s: dict[str, Any]) -> str:
    """Which form of the benchmark ran: the demo's reduced grid or `make bench-scheduler`'s full one."""
    full = len(s.get("loads") or []) >= 5 and (s.get("validation_repeats") or 0) >= 3
    return ("the full sweep of `make bench-scheduler`" if full else
            "the demo's reduced form; `make bench-scheduler` runs the full sweep")


def _scheduler_md(s: dict[str, Any]) -> list[str]:
    """The learned scheduler against the heuristics (bench/scheduler.md has every table)."""
    ratios = ", ".join(f"{w} {_fmt(v, '.3f')}" for w, v in s["goodput_ratio_vs_best_fixed"].items())
    att = ", ".join(f"{p} {_fmt(v, '.3f')}" for p, v in sorted(s["sla_attainment"].items()))
    lines = ["## SLA scheduler (learned vs fixed budgets and heuristics)", "",
             f"Simulator, held-out workloads, loads {_loads(s.get('loads'))} of each workload's capacity "
             f"({_sweep(s)}; reference capacity {s['capacity_rps']:.2f} req/s): "
             f"goodput of the learned policy / the best fixed budget, the smallest over loads per workload: {ratios} "
             f"(min {_fmt(s['goodput_ratio_vs_best_fixed_min'], '.3f')}). Mean SLA attainment over the grid: {att}."]
    if s.get("goodput_ratio_exit_features_ablation") is not None:
        lines.append(f"What predicted exit depth buys (the same training without it, `ppo-noexit`): goodput of the "
                     f"learned policy / the ablated one, median over the grid's cells "
                     f"{_fmt(s['goodput_ratio_exit_features_ablation'], '.3f')}, smallest "
                     f"{_fmt(s.get('goodput_ratio_exit_features_ablation_min'), '.3f')} (goal > 1).")
    if "goodput_ratio_vs_best_fixed_at_sla_edge" in s:
        real = ", ".join(f"{p} {_fmt(v, '.3f')}" for p, v in s["sla_attainment_real"].items())
        lines.append(f"Real served stack at the best fixed budget's SLA edge: goodput ratio "
                     f"{_fmt(s['goodput_ratio_vs_best_fixed_at_sla_edge'], '.3f')}; SLA attainment {real}. The "
                     f"simulator against the real stack: largest relative error of TTFT / TPOT p50 / p95 "
                     f"{_fmt(s['sim_validation_max_rel_err'], '.3f')} on held-out runs below the edge, "
                     f"{_fmt(s.get('sim_validation_at_edge_max_rel_err'), '.3f')} at the edge, where the stack "
                     f"is at its knee; two served runs of one schedule differ by up to "
                     f"{_fmt(s.get('real_repeat_max_rel_diff'), '.3f')} (bench/scheduler.md). The simulator's error "
                     f"over the served runs' own spread, largest over loads and metrics: "
                     f"{_fmt(s.get('sim_error_vs_repeat_spread_max'), '.2f')} (goal <= 1.5); p95 TTFT and TPOT "
                     f"within the SLA at 0.8x the edge: {_fmt(s.get('p95_within_sla_at_0_8_edge'), '')}.")
    if s.get("overload_factor"):
        rng = s.get("goodput_ratio_vs_best_fixed_overload_range") or [None, None]
        att = ", ".join(f"{p} {_fmt(v, '.3f')}" for p, v in (s.get("sla_attainment_overload") or {}).items())
        aimd = s.get("goodput_ratio_vs_aimd_overload")
        lines.append(f"Past the edge, at x{s['overload_factor']:g} of its rate on the real stack ({s.get('overload_repeats')} "
                     f"interleaved repeats, medians), where the edge's ceiling no longer binds: goodput of the learned "
                     f"policy / the best fixed budget {_fmt(s.get('goodput_ratio_vs_best_fixed_overload'), '.2f')} "
                     f"(range {_fmt(rng[0], '.2f')}-{_fmt(rng[1], '.2f')})"
                     + (f", / AIMD {_fmt(aimd, '.2f')}" if aimd is not None else "")
                     + (f", / the best constant action of its own grid ({s.get('best_constant_overload')}) "
                        f"{_fmt(s.get('goodput_ratio_vs_best_constant_overload'), '.2f')}"
                        if s.get("goodput_ratio_vs_best_constant_overload") is not None else "")
                     + f"; SLA attainment {att}. In the simulator the learned policy / the best constant action of its "
                     f"grid: {_fmt(s.get('goodput_ratio_vs_best_constant_sim_at_sla_edge'), '.3f')} at the edge, "
                     f"{_fmt(s.get('goodput_ratio_vs_best_constant_sim_overload'), '.3f')} past it.")
    return lines + [""]


def _serve_md(b: dict[str, Any]) -> list[str]:
    lines = ["## Served (Ray Serve + Triton)", "",
             f"Open-loop arrivals ({b.get('workload_source')}); SLA attainment and goodput against the "
             "requests' TTFT / TPOT targets; details, CDFs and throughput in bench/serve.md.", "",
             "| run | requests | errors | TTFT p95 ms | TPOT p95 ms | SLA attainment | goodput req/s | tokens/s |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    runs = dict(b.get("policies", {}))
    if "inprocess" in b:
        runs["in process"] = b["inprocess"]
    for name, r in runs.items():
        lines.append(f"| {name} | {r['requests']} | {r['errors']} | {_fmt(r['ttft_p95_ms'], '.1f')} | "
                     f"{_fmt(r['tpot_p95_ms'], '.1f')} | {r['sla_attainment']:.3f} | {r['goodput_rps']:.2f} | "
                     f"{r['tokens_per_s']:.1f} |")
    spread = b.get("spread") or {}

    def rng(key: str, spec: str) -> str:  # median (min-max over the interleaved repeats), where measured
        r = spread.get(key)
        return (f"{_fmt(r['median'], spec)} ({_fmt(r['min'], spec)}-{_fmt(r['max'], spec)})" if r
                else _fmt(b.get(key), spec))
    lines += ["", f"The price of serving (closed loop, interleaved with the engine in process, "
              f"{b.get('capacity_repeats', 1)} repeats; median (range)): served / in-process tokens/s "
              f"{rng('served_vs_inprocess_tokens_ratio_c1', '.3f')} at concurrency "
              f"{b.get('ttft_overhead_concurrency', 'n/a')} and {rng('served_vs_inprocess_tokens_ratio', '.3f')} at "
              f"{b.get('served_vs_inprocess_concurrency', 'n/a')}; TTFT p50 overhead "
              f"{rng('ttft_p50_overhead_ms', '.1f')} ms at concurrency {b.get('ttft_overhead_concurrency', 'n/a')}; "
              f"machine CPU per token added by serving {rng('serving_cpu_ms_per_token', '.2f')} ms at "
              f"{b.get('served_vs_inprocess_concurrency', 'n/a')} (bench/serve.md: every system and level).",
              "", "![latency CDFs against the SLA](bench/serve_latency_cdf.png)", "",
              "![served throughput](bench/serve_throughput.png)", ""]
    if b.get("dashboard_png"):
        lines += ["The live dashboard (`/dashboard`) during the load, in headless Chromium:", "",
                  f"![dashboard]({b['dashboard_png']})", ""]
    elif b.get("dashboard_skipped"):
        lines += [f"Dashboard screenshot not taken: {b['dashboard_skipped']}.", ""]
    return lines


def _bench_md(b: dict[str, Any]) -> list[str]:
    lines = ["## Decode benchmark", "", "| batch | system | tokens/s | p50 ms | p95 ms | mean exit layer |",
             "| ---: | --- | ---: | ---: | ---: | ---: |"]
    for batch, row in b["batches"].items():
        for s, v in row["systems"].items():
            lines.append(f"| {batch} | {s} | {v['tokens_per_s']:.1f} | {_fmt(v['token_latency_p50_ms'], '.2f')} | "
                         f"{_fmt(v['token_latency_p95_ms'], '.2f')} | {_fmt(v['mean_exit_layer'], '.2f')} |")
    if b.get("goals"):
        from edge.pipeline.bench.summary import goals_table

        lines += ["", *goals_table(b["goals"])]
    scalars = {k: v for k, v in b.items() if not isinstance(v, dict)
               and (k.startswith("speedup") and "speculative" not in k or k == "false_exit_rate")}
    by_mode = {k: v for k, v in b.items() if k.endswith("_by_mode")}
    lines += ["", f"- (d) = exits with skipped layers' K/V by {b.get('kv_mode')}: "
              + ", ".join(f"{k} {_fmt(v, '.3f')}" for k, v in scalars.items()),
              "- both K/V modes: " + "; ".join(
                  f"{k} " + ", ".join(f"{m} {_fmt(x, '.3f')}" for m, x in v.items()) for k, v in by_mode.items()),
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
        f"batch {k} (d)/(c) {_fmt(b.get(f'speedup_exit_gated_vs_full_b{k}'), '.3f')}, steps checked "
        f"{_fmt(b.get(f'gate_share_checked_b{k}'), '.2f')}" for k in sorted(keys, key=int))]


def _decision_md(b: dict[str, Any]) -> list[str]:
    """What a candidate check costs, in layers (edge/pipeline/bench/decision.py), when the run measured it."""
    if b.get("decision_cost_layers_b1") is None:
        return []
    big = next((k for k in b if k.startswith("decision_cost_layers_b") and k != "decision_cost_layers_b1"), None)
    return [f"- a candidate check, in layers (its nodes inside a call): batch 1 {_fmt(b['decision_cost_layers_b1'], '.3f')}"
            + (f", batch {big.rsplit('_b', 1)[1]} {_fmt(b[big], '.3f')}" if big else "")
            + f"; cutting a call in two at batch 1 {_fmt(b.get('boundary_cost_layers_b1'), '.3f')}; a check point in "
            f"the engine at batch 1, host work included, {_fmt(b.get('check_point_cost_layers_b1'), '.3f')}"]


def _speculative_md(b: dict[str, Any]) -> list[str]:
    """(e) self-speculative decoding: ratios, acceptance, the batch-1 sweep of draft exits and stop rules."""
    if b.get("speculative_mismatches") is None:  # a run benchmarked before (e) existed
        return []
    sc = b.get("speculative_config") or {}
    spec = {k: (row.get("speculative") or {}) for k, row in b["batches"].items()}
    lines = ["", f"**(e) self-speculative decoding** (mode exact, draft exit {sc.get('draft_exit')}, rule "
             f"{sc.get('stop')}): tokens differing from full depth (c) "
             f"**{_fmt(b.get('speculative_mismatches'), 'd')}** of "
             f"{_fmt(b.get('speculative_tokens_compared'), 'd')}; (e)/(c) "
             + ", ".join(f"batch {k} {_fmt(row.get('speedup_speculative_vs_full'), '.3f')}"
                         for k, row in b["batches"].items())
             + f"; (e)/(b) LayerSkip at batch 1 {_fmt(b.get('speedup_speculative_vs_layerskip_b1'), '.3f')}; "
             "acceptance rate / mean accepted length / tokens per round: "
             + ", ".join(f"batch {k} {_fmt(st.get('acceptance_rate'), '.3f')} / "
                         f"{_fmt(st.get('mean_accepted_length'), '.2f')} / {_fmt(st.get('tokens_per_round'), '.2f')}"
                         for k, st in spec.items())]
    by_exit, stops = b.get("speculative_by_draft_exit"), b.get("speculative_stop_rules")
    if by_exit:
        lines += ["", "| draft exit (batch 1, calibrated rule) | (e)/(c) | acceptance rate | mean accepted length |",
                  "| ---: | ---: | ---: | ---: |"]
        lines += [f"| {k} | {_fmt(r['speedup_vs_full'], '.3f')} | {_fmt(r['acceptance_rate'], '.3f')} | "
                  f"{_fmt(r['mean_accepted_length'], '.2f')} |" for k, r in by_exit.items()]
    if stops:
        lines += ["", "| stop rule (batch 1) | (e)/(c) | acceptance rate | tokens per round |",
                  "| --- | ---: | ---: | ---: |"]
        lines += [f"| {k} | {_fmt(r['speedup_vs_full'], '.3f')} | {_fmt(r['acceptance_rate'], '.3f')} | "
                  f"{_fmt(r['tokens_per_round'], '.2f')} |" for k, r in stops.items()]
        lines += ["", f"Calibrated rule / best fixed-or-top-1 rule: "
                  f"{_fmt(b.get('speculative_calibrated_vs_best_other_b1'), '.3f')}."]
    return lines


def main(cfg: ReportConfig) -> int:
    report = build(cfg.run_dir)
    run_dir = Path(cfg.run_dir)
    atomic_write_json(run_dir / "report.json", report)
    atomic_write_text(run_dir / "report.md", render_markdown(report))
    for line in summary_lines(report):
        print(line)
    print(f"report: {run_dir / 'report.md'} (all numbers: {run_dir / 'report.json'})")
    return 0


def summary_lines(report: dict[str, Any]) -> list[str]:
    """The few numbers a run ends with (the report has the rest, with how each was measured)."""
    lines = []
    if "model" in report:
        m = report["model"]
        lines.append(f"model: {m['layers']} layers, exits {m['exits']}, held-out perplexity {m['heldout_ppl']:.2f}")
    if "calibration" in report:
        c = report["calibration"]
        lines.append(f"exit rule: certified {c['certified']} (bound {c['bound']:.4f} <= eps {c['epsilon']}); held out, "
                     f"free-running: false exits {c['free_run_false_exit_rate_test']:.4f}, accuracy loss "
                     f"{c['accuracy_loss_rel']:.4f}, layers skipped {c['layers_skipped_frac']:.3f}")
    if "compression" in report:
        c = report["compression"]
        lines.append(f"compression ({c.get('recipe')}): accuracy loss {_fmt(c.get('accuracy_loss_rel'))}, weights "
                     f"x{_fmt(c.get('model_bytes_ratio'), '.3f')}, exits b1 vs fp32 x{_fmt(c.get('speedup_vs_fp32_b1'), '.2f')}, "
                     + (f"vs llama.cpp {c['llamacpp_same_bits']} x{_fmt(c.get('speedup_vs_llamacpp_same_bits_b1'), '.2f')}, "
                        if c.get("llamacpp_same_bits") else "llama.cpp not built, ")
                     + f"false-exit bound {_fmt(c.get('false_exit_bound'))}")
    if "energy" in report:
        e = report["energy"]
        lines.append(f"energy ({e['meter']}): " + (
            f"J/token shipped / full depth x{_fmt(e.get('ratio_shipped_vs_full'), '.3f')}" if e["meter_available"]
            else f"no sensor; CPU-s/token (proxy) shipped / full depth x{_fmt(e.get('cpu_ratio_shipped_vs_full'), '.3f')}"))
    if "decode_bench" in report:
        b = report["decode_bench"]
        ratios = [(k, b.get(k)) for k in ("speedup_exit_vs_full_b1", "speedup_exit_vs_full_b16",
                                          "speedup_full_vs_llamacpp_b1", "speedup_exit_vs_llamacpp_b1",
                                          "speedup_speculative_vs_full_b1")]
        lines.append("decode: " + ", ".join(f"{k.removeprefix('speedup_')} {_fmt(v, '.2f')}" for k, v in ratios))
    if "serve_bench" in report:
        b = report["serve_bench"]
        lines.append(f"served ({b['policy']}): {b['requests']} requests, {b['errors']} errors, TTFT p95 "
                     f"{_fmt(b['ttft_p95_ms'], '.1f')} ms, SLA attainment {b['sla_attainment']:.3f}; served / in "
                     f"process tokens/s {_fmt(b.get('served_vs_inprocess_tokens_ratio_c1'), '.3f')} / "
                     f"{_fmt(b.get('served_vs_inprocess_tokens_ratio'), '.3f')} (concurrency "
                     f"{b.get('ttft_overhead_concurrency', 'n/a')} / {b.get('served_vs_inprocess_concurrency', 'n/a')}), "
                     f"TTFT p50 overhead {_fmt(b.get('ttft_p50_overhead_ms'), '.1f')} ms")
    if "scheduler" in report:
        s = report["scheduler"]
        lines.append(f"scheduler: learned / best fixed goodput, min over held-out workloads and loads (sim) "
                     f"{_fmt(s['goodput_ratio_vs_best_fixed_min'], '.3f')}; at the SLA edge on the real stack "
                     f"{_fmt(s.get('goodput_ratio_vs_best_fixed_at_sla_edge'), '.3f')}; sim vs real max rel err "
                     f"{_fmt(s.get('sim_validation_max_rel_err'), '.3f')}")
    return lines


def _fmt(v: Any, spec: str = ".4f") -> str:
    return "n/a" if v is None else format(v, spec)


def _calibration_md(c: dict[str, Any]) -> list[str]:
    fr = c["free_run"]
    pt = c.get("propagate_test")
    lines = [
        "## Calibrated exit rule", "",
        f"{c['calibrator']} calibration of the exit signals; Learn-then-Test with the {c['pvalue']} p-value on "
        f"**{c['n_units']} certify prompts** ({c['tokens_per_unit']} judged tokens each; at least {c['min_units']} "
        f"prompts are needed) drawn from {c['calibration_corpus']}, independent of the {c['n_fit_units']} prompts "
        f"the calibrators were fitted on. Evaluated on {c['n_eval_units']} prompts of {c['eval_data']}, "
        "never seen by calibration.", "",
        f"> {c['certificate_statement']}", "",
        f"- certified: **{c['certified']}** (exact for the regime that ships: {c['certificate_exact']}); threshold "
        f"lambda = {c['lambda']:.3f} on the calibrated probability (provisional {c['lambda_provisional']:.3f})",
        f"- mean per-prompt false-exit rate: bound {c['bound']:.4f} (eps {c['epsilon']}, delta {c['delta']}); "
        f"certify prompts {c['false_exit_rate_calib']:.4f}; held out, free-running in the shipped K/V mode "
        f"({c['kv_mode']}) **{c['free_run_false_exit_rate_test']:.4f}** ({fr['tokens']} decoded tokens, "
        f"{fr['false_exits']} false exits, {fr['full_depth_mismatches']} full-depth tokens changed by approximate "
        f"K/V); teacher-forced on natural text **{c['false_exit_rate_test']:.4f}**",
        f"- K/V mode: {c['kv_mode_reason']}" + (
            f" (propagation, {pt['n_units']} prompts: {pt['false_exit_rate']:.4f}, bound {pt['bound']:.4f})"
            if pt else ""),
        f"- accuracy: full {c['accuracy_full']:.4f}, with exits {c['accuracy_exit']:.4f}, relative loss "
        f"**{c['accuracy_loss_rel']:.4f}**" + (
            f"; against the base model before fine-tuning ({c['accuracy_base_model']:.4f}): "
            f"**{c['accuracy_loss_rel_vs_base_model']:.4f}**" if "accuracy_base_model" in c else "")
        + (f"; against the float model it was compressed from ({c['accuracy_float_model']:.4f}): "
           f"**{c['accuracy_loss_rel_vs_float_model']:.4f}**" if "accuracy_float_model" in c else "")
        + (f" (the reference models on {c['reference_units']} of the {c['n_eval_units']} prompts, the rule's "
           f"accuracy there {c['accuracy_exit_reference_units']:.4f})"
           if "reference_units" in c and c["reference_units"] < c["n_eval_units"] else ""),
        f"- layers skipped, free-running in the shipped mode: **{c['layers_skipped_frac']:.3f}** "
        f"(teacher-forced {c.get('layers_skipped_frac_teacher_forced', float('nan')):.3f}); exit fractions, teacher-forced: "
        + ", ".join(f"layer {k}: {v:.3f}" for k, v in c["exit_fraction"].items()),
        "", "| system | certified | lambda | false exits (certify) | bound | false exits (test) | layers skipped | "
        "accuracy loss |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in c["comparison"]:
        lines.append(f"| {r['system']} | {r['certified']} | {r['lambda']:.3f} | {r['false_exit_rate_calib']:.4f} | "
                     f"{_fmt(r['bound'])} | {r['false_exit_rate_test']:.4f} | {r['layers_skipped_frac']:.3f} | "
                     f"{r['accuracy_loss_rel']:.4f} |")
    lines += ["", "The systems compared are judged teacher-forced on the test split's natural text (false exits (test), "
              "layers skipped, accuracy loss); the shipped rule's free-running numbers are above."]
    lines += ["", "| exit | ECE (test) | Brier (test) |", "| ---: | ---: | ---: |"]
    for k, q in (c.get("calibration_quality") or {}).items():
        lines.append(f"| {k} | {q['ece']:.4f} | {q['brier']:.4f} |")
    lines += ["", "![exit depth](calibration/exit_depth.png)", "", "![reliability](calibration/reliability.png)", ""]
    return lines
