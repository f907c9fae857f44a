"""``profile.md``: the engine's step-time model and the serving path (``smartexit profile``)."""
from __future__ import annotations

from typing import Any

from edge.runtime.host_steplog import FRONT_WINDOW_S
from scheduler.control.latency import FEATURES

UNITS = {"one": "per busy step", "decode_calls": "per decode segment call", "decode_rows": "per decode row",
         "decode_layer_rows": "per decode row-layer", "decode_attn": "per 1k context x layers",
         "prefill_calls": "per prefill chunk", "prefill_tokens": "per prefill token",
         "prefill_attn": "per 1k token pairs x layers"}


def _time(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.2f} µs"


def render_markdown(report: dict[str, Any]) -> str:
    fit, m = report["fit"], report["machine"]
    lines = ["# Engine step-time profile", "",
             f"{fit['points']} steps in {fit['scenarios']} scenarios; fitted on {fit['train_points']}, scored on "
             f"{fit['test_points']} steps of {fit['test_scenarios']} held-out scenarios.", "",
             f"Machine: {m['processor']}, {m['cpus']} CPUs; ONNX Runtime threads {m['threads']}; kv_mode "
             f"{m['kv_mode']}.", "",
             "| feature | coefficient | unit |", "|---|---|---|"]
    lines += [f"| {f} | {_time(report['coef'][f])} | {UNITS[f]} |" for f in FEATURES]
    lines += ["", "Held-out error of the step time, relative: "
              f"median {fit['test_rel_err_median']:.3f}, p90 {fit['test_rel_err_p90']:.3f}; of the mean step "
              f"per held-out scenario: median {fit['test_scenario_mean_rel_err_median']:.3f}, max "
              f"{fit['test_scenario_mean_rel_err_max']:.3f}.", "",
              "| scenario | budget | batch | prompt | full share | steps | measured ms | predicted ms | rel err | "
              "held out |", "|---|---|---|---|---|---|---|---|---|---|"]
    for s in report["per_scenario"]:
        held = "?" if s["held_out"] is None else ("yes" if s["held_out"] else "")
        lines.append(f"| {s['group']} | {s['prefill_budget']} | {s['batch']} | {s['prompt_min']}-{s['prompt_max']} | "
                     f"{s['full_share']:.2f} | {s['steps']} | {s['measured_ms']:.2f} | {s['predicted_ms']:.2f} | "
                     f"{s['mean_rel_err']:.3f} | {held} |")
    ef = ", ".join(f"{k}: {v:.3f}" for k, v in report["exit_fractions"].items())
    free = ", ".join(f"{k}: {v:.3f}" for k, v in report["exit_fractions_exits_allowed"].items())
    lines += ["", f"Exit layers of bounded decode tokens: {ef}; in steps where the engine let rows exit: {free}.", ""]
    if report.get("serving"):
        lines += render_serving(report["serving"])
    return "\n".join(lines)


def render_serving(sp: dict[str, Any]) -> list[str]:
    """The serving path (scheduler/loadtest/serving_path.py): the served steps against the profiled model, and
    the calibration runs against their replay in the simulator."""
    st = sp["fit"]["steps"]
    lines = ["## The serving path", "",
             f"{st['steps']} steps of the served engine (step log): decode x{sp['engine_slowdown']:.3f} and prefill "
             f"x{sp['prefill_slowdown']:.3f} the profiled time, each plus x{sp.get('front_decode_per_arrival') or 0:.3f} "
             f"and x{sp.get('front_prefill_per_arrival') or 0:.3f} per request that reached the engine in the last "
             f"{FRONT_WINDOW_S:.0f} s, {sp['serve_chunk_ms']:.3f} ms per chunk sent + "
             f"{sp['serve_chunk_sq_ms']:.4f} ms x chunks^2; the profiled model alone gives "
             f"{st['profiled_total_ratio']:.3f} of the served engine time, the fit {st['total_ratio']:.3f}; step "
             f"error median {st['rel_err_median']:.3f}, p90 {st['rel_err_p90']:.3f}. Overheads: "
             f"+{sp['ttft_overhead_ms']:.1f} ms to the first token, +{sp['token_overhead_ms']:.2f} ms per later token; "
             f"front end {sp.get('ingress_ms') or 0:.2f} ms per request, one at a time. Draft rounds (verification calls "
             f"outside the batched step): {sp.get('round_ms') or 0:.2f} ms each on average"
             + "".join(f"; batch {k}: {v:.2f} ms" for k, v in (sp.get("round_ms_by_batch") or {}).items()) + ".",
             "", "| decoding sequences (no prefill) | steps | served ms | fitted ms | profiled ms |", "|---|---|---|---|---|"]
    lines += [f"| {b} | {v['steps']} | {v['measured_ms']:.2f} | {v['fitted_ms']:.2f} | {v['profiled_ms']:.2f} |"
              for b, v in st["decode_batches"].items()]
    if st.get("decode_by_recent_arrivals"):
        lines += ["", f"| requests reached the engine in the last {FRONT_WINDOW_S:.0f} s (decode only) | steps | served ms "
                      "| fitted ms | profiled ms |", "|---|---|---|---|---|"]
        lines += [f"| {a} | {v['steps']} | {v['measured_ms']:.2f} | {v['fitted_ms']:.2f} | {v['profiled_ms']:.2f} |"
                  for a, v in st["decode_by_recent_arrivals"].items()]
    lines += ["", "| calibration run | requests | metric | measured ms | simulated ms | rel err |",
              "|---|---|---|---|---|---|"]
    for r in sp["fit"]["runs"]:
        tag = "" if r.get("fitted", True) else " (past the SLA at p95: not fitted)"
        lines += [f"| {r['rate_rps']:.2f} req/s, budget {r.get('budget')}{tag} | {r['requests']} | {k} | "
                  f"{r['measured'][k]:.1f} | {r['simulated'][k]:.1f} | {r['rel_err'].get(k, float('nan')):.3f} |"
                  for k in r["measured"]]
    return lines + [""]
