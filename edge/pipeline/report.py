"""``smartexit report``: assemble ``report.json`` / ``report.md`` from the run's manifest.

Every number in the report is a metric a stage recorded in ``manifest.json``;
the report adds nothing of its own. Later stages add sections by adding a
builder to ``SECTIONS`` (report_sections.py). The Markdown of the longer
sections is in report_model_md.py, report_decode_md.py and report_serving_md.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edge.core.artifacts import Manifest, atomic_write_json, atomic_write_text
from edge.core.errors import ConfigError
from edge.pipeline.report_decode_md import bench_md, energy_md, jetson_md, projection_md
from edge.pipeline.report_format import fmt
from edge.pipeline.report_model_md import calibration_md, compression_md
from edge.pipeline.report_sections import SECTIONS, stage_times
from edge.pipeline.report_serving_md import scheduler_md, serve_md


@dataclass
class ReportConfig:
    run_dir: str = "artifacts/demo"


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
    if m.data["stages"]:
        report["stages"] = stage_times(m)
    return report


def _clock(seconds: float) -> str:
    return f"{int(seconds) // 60}:{int(seconds) % 60:02d}"


def time_md(t: dict[str, Any]) -> list[str]:
    """The pipeline's time: each stage's seconds, their sum and the span of the run against the demo's budget."""
    lines = ["## Pipeline time", "", "| stage | seconds |", "| --- | ---: |"]
    lines += [f"| {k} | {v:.0f} |" for k, v in t["seconds"].items()]
    span = t.get("span_s")
    budget = t["demo_budget_s"]
    lines += ["", f"The stages took {t['sum_s']:.0f} s ({_clock(t['sum_s'])}); "
              + ("" if span is None else f"from the first one's start to the last one's end {span:.0f} s "
                 f"({_clock(span)}), process start-ups between them included (a stage re-run later stretches "
                 f"this). ")
              + f"`make demo` on a fresh clone is held to {_clock(budget)} on two cores, the venv excluded"
              + ("" if span is None else f": this run's span is {span / budget:.0%} of it") + ".", ""]
    return lines


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
        lines += calibration_md(report["calibration"])
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
        lines += compression_md(report["compression"])
    if "energy" in report:
        lines += energy_md(report["energy"])
    if "decode_bench" in report:
        lines += bench_md(report["decode_bench"])
    if "serve_bench" in report:
        lines += serve_md(report["serve_bench"])
    if "crosscheck" in report:
        r = report["crosscheck"]["ours_over_aiperf"]
        lines += ["## Load client cross-checked against NVIDIA aiperf (`make aiperf-check`)", "",
                  "Ours / aiperf on the same stack, one after the other (bench/crosscheck/crosscheck.md has both "
                  "clients against the server's own histograms): " + ", ".join(
                      f"{k} {fmt(v, '.3f')}" for k, v in r.items()) + ". Each client's mean minus the server's "
                  "own for the same requests (ms; equal gaps: both time the same events): " + ", ".join(
                      f"{k} {fmt(v, '.1f')}" for k, v in report["crosscheck"].get("server_agreement", {}).items()),
                  ""]
    if "scheduler" in report:
        lines += scheduler_md(report["scheduler"])
    if "projection" in report:
        lines += projection_md(report["projection"])
    if "jetson" in report:
        lines += jetson_md(report["jetson"])
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
    if "stages" in report:
        lines += time_md(report["stages"])
    return "\n".join(lines)


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
        lines.append(f"compression ({c.get('recipe')}): accuracy loss {fmt(c.get('accuracy_loss_rel'))}, weights "
                     f"x{fmt(c.get('model_bytes_ratio'), '.3f')}, exits b1 vs fp32 x{fmt(c.get('speedup_vs_fp32_b1'), '.2f')}, "
                     + (f"vs llama.cpp {c['llamacpp_same_bits']} x{fmt(c.get('speedup_vs_llamacpp_same_bits_b1'), '.2f')}, "
                        if c.get("llamacpp_same_bits") else "llama.cpp not built, ")
                     + f"false-exit bound {fmt(c.get('false_exit_bound'))}")
    if "energy" in report:
        e = report["energy"]
        lines.append(f"energy ({e['meter']}): " + (
            f"J/token shipped / full depth x{fmt(e.get('ratio_shipped_vs_full'), '.3f')}" if e["meter_available"]
            else f"no sensor; CPU-s/token (proxy) shipped / full depth x{fmt(e.get('cpu_ratio_shipped_vs_full'), '.3f')}"))
    if "decode_bench" in report:
        b = report["decode_bench"]
        ratios = [(k, b.get(k)) for k in ("speedup_exit_vs_full_b1", "speedup_exit_vs_full_b16",
                                          "speedup_full_vs_llamacpp_b1", "speedup_exit_vs_llamacpp_b1",
                                          "speedup_speculative_vs_full_b1")]
        lines.append("decode: " + ", ".join(f"{k.removeprefix('speedup_')} {fmt(v, '.2f')}" for k, v in ratios))
    if "serve_bench" in report:
        b = report["serve_bench"]
        lines.append(f"served ({b['policy']}): {b['requests']} requests, {b['errors']} errors, TTFT p95 "
                     f"{fmt(b['ttft_p95_ms'], '.1f')} ms, SLA attainment {b['sla_attainment']:.3f}; served / in "
                     f"process tokens/s {fmt(b.get('served_vs_inprocess_tokens_ratio_c1'), '.3f')} / "
                     f"{fmt(b.get('served_vs_inprocess_tokens_ratio'), '.3f')} (concurrency "
                     f"{b.get('ttft_overhead_concurrency', 'n/a')} / {b.get('served_vs_inprocess_concurrency', 'n/a')}), "
                     f"TTFT p50 overhead {fmt(b.get('ttft_p50_overhead_ms'), '.1f')} ms")
    if "stages" in report:
        t = report["stages"]
        lines.append(f"time: stages {t['sum_s']:.0f} s" + ("" if t.get("span_s") is None else
                     f", first start to last end {t['span_s']:.0f} s") + f" (`make demo`'s budget {t['demo_budget_s']:.0f} s)")
    if "scheduler" in report:
        s = report["scheduler"]
        lines.append(f"scheduler: learned / best fixed goodput, min over held-out workloads and loads (sim) "
                     f"{fmt(s['goodput_ratio_vs_best_fixed_min'], '.3f')}; at the SLA edge on the real stack "
                     f"{fmt(s.get('goodput_ratio_vs_best_fixed_at_sla_edge'), '.3f')}; sim vs real max rel err "
                     f"{fmt(s.get('sim_validation_max_rel_err'), '.3f')}")
    return lines
