"""The decode benchmark's summary: headline numbers, goals, Markdown table and chart.

Pure functions of the results dict that :func:`edge.pipeline.bench.decode.main` assembles.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

SYSTEMS = ("hf", "layerskip", "engine_full", "engine_exit_propagate", "engine_exit_defer", "engine_exit_gated",
           "engine_speculative",
           "llamacpp", "hf_lookup", "llamacpp_lookup")
LABELS = {"hf": "(a) transformers generate", "layerskip": "(b) transformers LayerSkip self-speculation",
          "engine_full": "(c) SmartExit engine, ORT, full depth",
          "engine_exit_propagate": "SmartExit engine, ORT, exits, K/V by propagation",
          "engine_exit_defer": "SmartExit engine, ORT, exits, K/V by deferred recomputation",
          "engine_exit_gated": "(d) as served: exits only where they measured cheaper (step gate), lossless drafts where they pay",
          "engine_speculative": "(e) SmartExit engine, ORT, speculative (exact: lookup and exit drafts)",
          "hf_lookup": "transformers generate, prompt-lookup decoding",
          "llamacpp_lookup": "llama.cpp (llama-cpp-python), prompt-lookup drafts, GGUF at the served model's precision",
          "llamacpp": "(f) llama.cpp (llama-cpp-python), GGUF at the served model's precision, full depth"}

# Issue 8's goals, then issue 10's (self-speculative decoding, (e)): (headline key, ">=" or "<=", target).
# A key ending in _b<N> is about batch size N: its row
# says "not run" when the benchmark did not run that batch size; other rows whose value was not measured
# (llama.cpp absent) say "not measured". The false-exit target is the epsilon the run's threshold table
# was certified for (None here: read from the run).
GOALS = [
    # issue 27: a candidate check costs at most 0.15 layers; layers skipped at the certified eps; the speed-ups
    ("decision_cost_layers_b1", "<=", 0.15),
    ("decision_cost_layers_b16", "<=", 0.15),
    ("segment_call_overhead", "<=", 1.05),
    ("efficiency_vs_ceiling_b1", ">=", 0.95),
    ("efficiency_vs_ceiling_b16", ">=", 0.95),
    ("layers_skipped_frac", ">=", 0.35),
    ("speedup_exit_vs_full_b1", ">=", 1.35),
    ("speedup_exit_vs_full_b16", ">=", 1.25),
    ("speedup_full_vs_llamacpp_b1", ">=", 1.0),
    ("speedup_exit_vs_llamacpp_b1", ">=", 1.35),
    ("speedup_exit_vs_hf_b1", ">=", 3.0),
    ("false_exit_rate", "<=", None),
    ("accuracy_loss_rel", "<=", 0.01),
    ("bookkeeping_share_b1", "<=", 0.10),
    ("peak_rss_exit_vs_hf", "<", 1.0),
    ("peak_rss_exit_vs_full", "<", 1.0),
    ("speedup_speculative_vs_full_b1", ">=", 1.6),
    ("speedup_speculative_vs_layerskip_b1", ">=", 2.0),
    ("speedup_speculative_vs_full_b16", ">=", 1.2),
    ("speculative_mismatches", "<=", 0),  # lossless: (e) emits exactly (c)'s tokens
    # issue 28: the same graph at full depth; a verification of 4 rows against one; the peers
    ("speculative_mismatches_same_graph", "<=", 0),
    ("verify_cost_ratio_k4_b1", "<=", 1.15),
    ("speedup_speculative_vs_hf_lookup_b1", ">=", 4.0),
    ("speedup_speculative_vs_llamacpp_lookup_b1", ">=", 1.3),
    ("speedup_speculative_vs_llamacpp_b1", ">=", 1.6),
    # the calibrated draft-length rule against the best fixed length and the best top-1 threshold
    ("speculative_calibrated_vs_best_other_b1", ">=", 1.0),
]


def goal_batch(key: str) -> int | None:
    """The batch size a goal is about (``..._b16`` -> 16), or None."""
    m = re.search(r"_b(\d+)$", key)
    return int(m.group(1)) if m else None


def goals(summary: dict[str, Any], epsilon: float | None, batch_sizes: list[int]) -> dict[str, dict[str, Any]]:
    """Each goal with the measured value, whether it is met and by how much it is missed.

    Args:
        summary: :func:`headline`'s numbers.
        epsilon: the false-exit rate the run's threshold table was certified for (the false-exit goal).
        batch_sizes: the batch sizes the benchmark ran; a goal about another one is marked ``not_run``.
    """
    out = {}
    for key, op, target in GOALS:
        target = epsilon if target is None else target
        v = summary.get(key)
        if v is None or target is None:
            out[key] = {"goal": f"{op} {target}", "measured": None, "met": None, "shortfall": None}
            if goal_batch(key) is not None and goal_batch(key) not in batch_sizes:
                out[key]["not_run"] = True
            continue
        met = v >= target if op == ">=" else (v <= target if op == "<=" else v < target)
        short = max(0.0, target - v) if op == ">=" else max(0.0, v - target)
        out[key] = {"goal": f"{op} {target}", "measured": v, "met": bool(met), "shortfall": short}
    return out


def goals_table(goals_: dict[str, dict[str, Any]]) -> list[str]:
    """Markdown rows of :func:`goals` (the benchmark's page and the run report show the same table)."""
    def row(k: str, g: dict[str, Any]) -> str:
        if g.get("not_run"):
            return f"| {k} | {g['goal']} | not run (batch {goal_batch(k)}) | n/a | n/a |"
        if g["measured"] is None:
            return f"| {k} | {g['goal']} | not measured | n/a | n/a |"
        return f"| {k} | {g['goal']} | {g['measured']:.3f} | {'yes' if g['met'] else 'no'} | {g['shortfall']:.3f} |"

    return ["| goal | target | measured | met | missed by |", "| --- | ---: | ---: | --- | ---: |",
            *(row(k, g) for k, g in goals_.items())]


def headline(results: dict[str, Any]) -> dict[str, Any]:
    """The numbers the goals and the report read. Keys ending in _b1 are about batch 1 (None when it
    was not run); _b<first> / _b<last> name the smallest and largest batch size run."""
    bs = results["batches"]
    first, last = str(min(map(int, bs))), str(max(map(int, bs)))
    b1 = bs.get("1", {})
    prof = results.get("profile_b1", {})
    mem = results.get("peak_rss_mib") or {}
    d_sys = f"engine_exit_{results['kv_mode']}"
    cal = results.get("calibration", {})
    spec_b1 = b1.get("speculative") or {}

    def mem_ratio(other: str) -> float | None:
        return mem[d_sys] / mem[other] if mem.get(d_sys) and mem.get(other) else None

    dc = results.get("decision_cost") or {}
    return {
        # a candidate check, in layers: its nodes inside a call (decision.py), at batch 1 and the largest batch
        "decision_cost_layers_b1": (dc.get("1") or {}).get("check_layers"),
        f"decision_cost_layers_b{last}": (dc.get(last) or {}).get("check_layers"),
        "boundary_cost_layers_b1": (dc.get("1") or {}).get("boundary_layers"),
        # what a check point costs a token that does not leave, in the engine (boundary, check, host work)
        "check_point_cost_layers_b1": (dc.get("engine_b1") or {}).get("layers"),
        f"efficiency_vs_ceiling_b{first}": bs[first].get("efficiency_vs_ceiling"),
        f"efficiency_vs_ceiling_b{last}": bs[last].get("efficiency_vs_ceiling"),
        "segment_call_overhead": (results.get("segment_call_overhead", {}).get("1") or {}).get("ratio"),
        "speedup_full_vs_llamacpp_b1": b1.get("speedup_full_vs_llamacpp"),
        "speedup_exit_vs_llamacpp_b1": b1.get("speedup_exit_vs_llamacpp"),
        "bookkeeping_share_b1": prof["engine_other"] / prof["total"] if prof.get("total") else None,
        "layers_skipped_frac": cal.get("layers_skipped_frac"),
        "accuracy_loss_rel": cal.get("accuracy_loss_rel"),
        "peak_rss_exit_vs_hf": mem_ratio("hf"),
        "peak_rss_exit_vs_full": mem_ratio("engine_full"),
        "speedup_exit_vs_full_b1": b1.get("speedup_exit_vs_full"),
        f"speedup_exit_vs_full_b{last}": bs[last]["speedup_exit_vs_full"],
        # as served: the step gate runs checks only at batch sizes where they measured cheaper than full depth
        "speedup_exit_gated_vs_full_b1": b1.get("speedup_exit_gated_vs_full"),
        f"speedup_exit_gated_vs_full_b{last}": bs[last].get("speedup_exit_gated_vs_full"),
        "gate_share_checked_b1": b1.get("gate_share_checked"),
        f"gate_share_checked_b{last}": bs[last].get("gate_share_checked"),
        "speedup_exit_vs_hf_b1": b1.get("speedup_exit_vs_hf"),
        "speedup_exit_vs_layerskip_b1": b1.get("speedup_exit_vs_layerskip"),
        "exit_depth_ceiling_b1": b1.get("exit_depth_ceiling"),
        "false_exit_rate": results["false_exit_rate"],
        "kv_mode": results["kv_mode"],
        "speedup_vs_full_b1_by_mode": b1.get("speedup_vs_full_by_mode"),
        f"speedup_vs_full_b{last}_by_mode": bs[last]["speedup_vs_full_by_mode"],
        "false_exit_rate_by_mode": results["false_exit_rate_by_mode"],
        "token_match_vs_full_engine": results["token_match_vs_full_engine"],
        "speedup_speculative_vs_full_b1": b1.get("speedup_speculative_vs_full"),
        f"speedup_speculative_vs_full_b{last}": bs[last].get("speedup_speculative_vs_full"),
        "speedup_speculative_vs_layerskip_b1": b1.get("speedup_speculative_vs_layerskip"),
        "speculative_mismatches": results.get("speculative_mismatches"),
        "speculative_tokens_compared": results.get("speculative_tokens_compared"),
        "speculative_mismatches_same_graph": results.get("speculative_mismatches_same_graph"),
        "speculative_tokens_compared_same_graph": results.get("speculative_tokens_compared_same_graph"),
        "verify_cost_ratio_k4_b1": (results.get("verify_cost_ratio_b1") or {}).get("4"),
        # rho(4) where the export verifies several sequences in one call (verify graphs), by batch size
        "verify_cost_ratio_k4_by_batch": {b: r.get("4") for b, r in (results.get("verify_cost_ratio_by_batch") or {}).items()},
        # (e)/(c) at every batch measured: the batch rows and the verify-graph batch sizes
        "speedup_speculative_vs_full_by_batch": {
            **{b: row.get("speedup_speculative_vs_full") for b, row in bs.items()},
            **{b: row["speedup_speculative_vs_full"] for b, row in (results.get("speculative_by_verify_batch") or {}).items()}},
        "speedup_speculative_vs_hf_lookup_b1": b1.get("speedup_speculative_vs_hf_lookup"),
        "speedup_speculative_vs_llamacpp_lookup_b1": b1.get("speedup_speculative_vs_llamacpp_lookup"),
        "speedup_speculative_vs_llamacpp_b1": b1.get("speedup_speculative_vs_llamacpp"),
        # tokens a verification call emitted (accepted drafts + 1), by draft source, at batch 1 and the largest
        "speculative_tokens_per_call_b1": {src: (st or {}).get("tokens_per_round")
                                           for src, st in (b1.get("speculative_by_source") or {}).items()
                                           if src != "plain_steps"},
        f"speculative_tokens_per_call_b{last}": {src: (st or {}).get("tokens_per_round")
                                                 for src, st in (bs[last].get("speculative_by_source") or {}).items()
                                                 if src != "plain_steps"},
        "speculative_acceptance_rate": spec_b1.get("acceptance_rate"),
        "speculative_mean_accepted_length_b1": spec_b1.get("mean_accepted_length"),
        "speculative_tokens_per_round_b1": spec_b1.get("tokens_per_round"),
        "speculative_calibrated_vs_best_other_b1": results.get("speculative_calibrated_vs_best_other_b1"),
        # what the draft exit allows on this machine (spec_ceiling.py): an oracle stop rule, every draft agreeing
        "speculative_oracle_ceiling_b1": (results.get("speculative_ceiling") or {}).get("oracle_ceiling"),
        "speculative_perfect_draft_ceiling_b1": (results.get("speculative_ceiling") or {}).get("perfect_draft_ceiling"),
    }


def render_markdown(results: dict[str, Any], summary: dict[str, Any]) -> str:
    cfg = results["config"]
    mem = results.get("peak_rss_mib", {})
    lines = ["# Decode benchmark", "",
             f"{cfg['prompt_tokens']}-token held-out prompts, {cfg['new_tokens']} new tokens, greedy; "
             f"{cfg['warmup']} warm-up + {cfg['repeats']} interleaved repeats"
             + (f" (then {cfg['spec_extra_pairs']} more of (e) and (c) alone, paired, pooled into (e)/(c); the systems' "
                f"table reads the interleaved repeats only)"
                if cfg.get("spec_extra_pairs") else "") + f"; medians; {cfg['threads']} threads "
             f"(ONNX Runtime: one shared pool of {results['ort_pool_threads']}); (d) = exits with K/V by "
             f"{results['kv_mode']}; "
             f"batch 1 runs {cfg['batch1_prompts']} prompts one after another. Peak RSS: a fresh process per system at the largest batch "
             f"(batch 1 for LayerSkip), counted from the RSS after the libraries are imported (`baseline`, "
             f"{mem.get('baseline', float('nan')):.0f} MiB): loading and running the system.", "",
             "| batch | system | tokens/s | token latency p50 (ms) | p95 (ms) | peak RSS over baseline (MiB) | mean exit layer |",
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    f = lambda v, s=".2f": "n/a" if v is None else format(v, s)  # noqa: E731
    for b, row in results["batches"].items():
        for s, v in row["systems"].items():
            lines.append(f"| {b} | {LABELS[s]} | {v['tokens_per_s']:.1f} | {f(v['token_latency_p50_ms'])} | "
                         f"{f(v['token_latency_p95_ms'])} | {f(mem.get(s), '.0f')} | {f(v['mean_exit_layer'])} |")
    lines += ["", "Token latency: the time between consecutive generated tokens of a sequence, each token "
              "timestamped when it arrives (the engine's per-token callback; a transformers streamer for (a) and "
              "(b); llama.cpp's token iterator for (f)). (b) LayerSkip self-speculation emits the tokens a "
              "verification step accepts together: the first of them arrives after the step's time, the others "
              "0 ms after it, so its percentiles describe those bursts, measured, not a per-token cost."]
    modes = list(results["false_exit_rate_by_mode"])
    lines += ["", "| batch | (d)/(c) | ceiling: layers computed | efficiency | ceiling: exit depth | (d)/(a) | "
              "(d)/(b) | (c)/(f) | (d)/(f) | " + " | ".join(f"{m}/(c) | false exits, {m}" for m in modes) + " |",
              "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | "
              + " | ".join("---: | ---:" for _ in modes) + " |"]
    for b, row in results["batches"].items():
        lines.append(f"| {b} | {f(row['speedup_exit_vs_full'])} | {f(row.get('compute_ceiling'))} | "
                     f"{f(row.get('efficiency_vs_ceiling'))} | {f(row['exit_depth_ceiling'])} | "
                     f"{f(row['speedup_exit_vs_hf'])} | {f(row['speedup_exit_vs_layerskip'])} | "
                     f"{f(row.get('speedup_full_vs_llamacpp'))} | {f(row.get('speedup_exit_vs_llamacpp'))} | "
                     + " | ".join(f"{f(row['speedup_vs_full_by_mode'][m])} | {row['false_exit_rate_by_mode'][m]:.4f}"
                                  for m in modes) + " |")
    epsilon = results.get("calibration", {}).get("epsilon")
    lines += ["", f"False exits: generated tokens (the first, from the prefill, excepted) that differ from the full "
              f"model's greedy token on the same prefix, checked as calibration checks them, on the first repeat "
              f"({results.get('false_exit_tokens', 'n/a')} tokens of (d)); the threshold table was certified for "
              f"epsilon = {f(epsilon, 'g')}."]
    if results.get("llamacpp_skipped"):
        lines += ["", f"(f) llama.cpp not measured: {results['llamacpp_skipped']}"]
    lc = results.get("llamacpp")
    if lc and not results.get("llamacpp_skipped"):
        plain = (", its weights as stored: its repacked kernels failed on this machine "
                 "(llamacpp_repack.repack_runs)" if lc.get("repack") is False else "")
        lines += ["", f"(f) llama.cpp on a {lc['gguf_type']} GGUF (the served model's precision{plain}), batch 1, decode "
                      f"and prefill apart; the speed-ups over it compare decode alone against the `{lc['used']}` row"
                      + (f" (llama-bench: {lc['llama_bench_skipped']})" if lc.get("llama_bench_skipped") else "") + ":", "",
                  "| row | decode tokens/s | prefill tokens/s |", "| --- | ---: | ---: |",
                  *(f"| {k} | {r['decode_tokens_per_s']:.1f} (sd {r['decode_stddev']:.1f}) | "
                    f"{r['prefill_tokens_per_s']:.1f} (sd {r['prefill_stddev']:.1f}) |" for k, r in lc["rows"].items())]
    lines += ["", *goals_table(summary.get("goals", {}))]
    seg = results.get("segment_call_overhead", {})
    if seg:
        lines += ["", "Segment calls against one call (the same layers, no exit heads, buffers bound once, "
                  "nothing between the calls): " + "; ".join(
                      f"batch {b}: {r['spans']} calls {r['ms_split']:.3f} ms vs one call {r['ms_one_call']:.3f} ms "
                      f"= {r['ratio']:.3f}x" for b, r in seg.items())]
    prof = results["profile_b1"]
    lines += ["", "Ceilings of (d)/(c) if time were proportional to work and exit decisions were free: "
              "*layers computed* = layers / mean layers computed per token with recomputation counted "
              "(propagation: the skipped layers' K/V projections; deferral: every skipped layer, run later "
              "with the next token, so its ceiling is 1); *exit depth* = layers / mean exit layer, what a "
              "step costs where reading the weights sets the time (batch 1: deferred rows ride along with "
              "the next token's call). Efficiency = (d)/(c) / layers-computed ceiling.",
              "", "Where one decode step of (d) goes at batch 1 (ms per step; engine_other is the engine's "
              "own bookkeeping): " + ", ".join(f"{k} {v:.3f}" for k, v in prof.items()), ""]
    return "\n".join(lines + speculative_markdown(results) + [""])


def speculative_markdown(results: dict[str, Any]) -> list[str]:
    """(e)'s section: per batch its ratios and rounds, then the batch-1 sweep (stop rules, draft exits)."""
    f = lambda v, s=".2f": "n/a" if v is None else format(v, s)  # noqa: E731
    sc = results.get("speculative_config") or {}
    rho = results.get("verify_cost_ratio_b1") or {}
    lines = ["## (e) Speculative decoding (mode exact)", "",
             "Drafts from context lookups (verified in one call of the graph of every layer) wherever the measured "
             "costs say a draft pays, at any batch size; otherwise from exit layer "
             f"{sc.get('draft_exit')} with draft-length rule {sc.get('stop')} (at most "
             f"{sc.get('max_draft')} drafts a round) while the decode batch holds at most "
             f"{results['config'].get('speculate_max_batch', 'any')} sequences and exit rounds measure cheaper per token "
             "than plain steps; else a plain step. Mismatches: tokens of (e) that differ from (c)'s on the same "
             "prompts, every measured repeat and every sweep run: "
             f"**{results.get('speculative_mismatches')}** of {results.get('speculative_tokens_compared')} tokens; "
             "against mode full on (e)'s own graphs (the graph lookup rounds verify with): "
             f"**{results.get('speculative_mismatches_same_graph')}** of "
             f"{results.get('speculative_tokens_compared_same_graph')}.", "",
             "rho(k), a call of the graph of every layer with k new rows of one sequence over a call with 1, batch 1: "
             + ", ".join(f"k={k} {v:.2f}" for k, v in rho.items()) + "."
             + "".join(f" Batch {b} (k new rows of each of {b} sequences in one call of the verify graph, over a plain "
                       f"step): " + ", ".join(f"k={k} {v:.2f}" for k, v in r.items()) + "."
                       for b, r in (results.get("verify_cost_ratio_by_batch") or {}).items()), ""]
    for b, row in (results.get("speculative_by_verify_batch") or {}).items():
        src = row.get("speculative_by_source") or {}
        parts = [f"{k}: {v['rounds']} rounds, {v['tokens_per_round']:.2f} tokens per round, acceptance "
                 f"{v['acceptance_rate']:.2f}" for k, v in src.items() if k != "plain_steps" and v]
        how = "verify graph" if row.get("verify_graph") else "no verify graph: per-row calls"
        lines.append(f"- batch {b} ({how}; (e) and (c) only): (e)/(c) {f(row['speedup_speculative_vs_full'])}, "
                     f"{row['speculative_mismatches']} of {row['speculative_tokens_compared']} tokens differ; "
                     + "; ".join(parts + [f"plain steps {src.get('plain_steps')}"]))
    for b, row in results["batches"].items():
        for d in row.get("speculative_divergences_same_graph") or []:
            lines.append(f"- batch {b}, sequence {d['sequence']}: first differs at output {d['index']} ((e) {d['exact']}, "
                         f"full {d['full']}), the full model's top-2 logit gap there {d['top2_gap']:.4f}")
        src = row.get("speculative_by_source") or {}
        parts = [f"{k}: {v['rounds']} rounds, {v['tokens_per_round']:.2f} tokens per call, acceptance "
                 f"{v['acceptance_rate']:.2f}" for k, v in src.items() if k != "plain_steps" and v]
        lines.append(f"- batch {b}: " + "; ".join(parts + [f"plain steps {src.get('plain_steps')}"]))
    lines += ["",
             "| batch | (e)/(c) | (e)/(c), decode only | (e)/(b) | acceptance rate | mean accepted length | tokens per round "
             "| mismatches |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for b, row in results["batches"].items():
        st = row.get("speculative") or {}
        rounds = ((f"{f(st.get('acceptance_rate'), '.3f')} | {f(st.get('mean_accepted_length'))} | "
                   f"{f(st.get('tokens_per_round'))}") if st.get("rounds") else
                  "full depth (batch above speculate_max_batch) | - | -")
        lines.append(f"| {b} | {f(row.get('speedup_speculative_vs_full'))} | "
                     f"{f(row.get('speedup_speculative_vs_full_decode_only'))} | "
                     f"{f(row.get('speedup_speculative_vs_layerskip'))} | {rounds} | "
                     f"{row.get('speculative_mismatches')} of {row.get('speculative_tokens_compared')} |")
    for title, key, what in (("Stop rules", "speculative_stop_rules", "rule"),
                             ("Draft exits (calibrated rule)", "speculative_by_draft_exit", "draft exit")):
        rows = results.get(key)
        if not rows:
            continue
        c = results["config"]
        lines += ["", f"{title} at batch 1 ({c['batch1_prompts']} prompts one after another, each run next to a run "
                  f"of (c); median of {c.get('spec_sweep_repeats')} paired repeats):", "",
                  f"| {what} | (e)/(c) | acceptance rate | mean accepted length | tokens per round | mismatches |",
                  "| --- | ---: | ---: | ---: | ---: | ---: |"]
        lines += [f"| {k} | {f(r['speedup_vs_full'])} | {f(r['acceptance_rate'], '.3f')} | "
                  f"{f(r['mean_accepted_length'])} | {f(r['tokens_per_round'])} | {r['mismatches']} |"
                  for k, r in rows.items()]
    if results.get("speculative_calibrated_vs_best_other_b1") is not None:
        lines += ["", f"Calibrated rule / best other rule (fixed or top-1): "
                  f"{results['speculative_calibrated_vs_best_other_b1']:.3f}."]
    if results.get("speculative_ceiling_skipped"):
        lines += ["", f"The self-speculation ceiling was not measured: {results['speculative_ceiling_skipped']}."]
    return lines + ceiling_markdown(results.get("speculative_ceiling"))


def ceiling_markdown(ce: dict[str, Any] | None) -> list[str]:
    """The self-speculation ceiling (edge/pipeline/bench/spec_ceiling.py): measured costs, every rule
    simulated on the agreement trace, the oracle and perfect-draft bounds."""
    if not ce:
        return []
    c = ce["costs"]
    verify = ", ".join(f"{k} rows {v:.3f}" for k, v in c["verify_ms_by_rows"].items())
    lines = ["", f"### Where (e)'s time goes, and its ceiling (draft exit {ce['draft_exit']}, batch 1)", "",
             f"Measured costs (ms, medians): full-depth step of (c) {c['full_step_ms']:.3f}; draft step "
             f"{c['draft_step_ms']:.3f} ({c['draft_step_no_head_ms']:.3f} without the head); verification {verify}.",
             f"Along the full model's greedy path ({ce['positions']} positions) the draft exit agrees with it at "
             f"{ce['agreement']:.3f} of positions (mean calibrated agreement {ce['calibrated_p_mean']:.3f}). "
             f"Rounds simulated from that trace and those costs, the engine's bookkeeping left out:", "",
             "| rule | (e)/(c) | tokens per round | acceptance rate |", "| --- | ---: | ---: | ---: |"]
    lines += [f"| {k} | {r['speedup_vs_full']:.2f} | {r['tokens_per_round']:.2f} | {r['acceptance_rate']:.3f} |"
              for k, r in ce["rules"].items()]
    lines += ["", f"Oracle ceiling (drafts exactly the tokens that will be accepted): **{ce['oracle_ceiling']:.2f}x**; "
              f"every draft agreeing: {ce['perfect_draft_ceiling']:.2f}x. A goal above the oracle ceiling needs a draft "
              f"that agrees more often or costs less, not a better stop rule."]
    return lines


def summary_lines(results: dict[str, Any], summary: dict[str, Any], report: Path, seconds: float) -> list[str]:
    """The few numbers the benchmark ends with, and where its report is."""
    f = lambda v, s=".2f": "n/a" if v is None else format(v, s)  # noqa: E731
    d = f"engine_exit_{results['kv_mode']}"
    goals_ = summary.get("goals", {})
    met = sum(g["met"] is True for g in goals_.values())
    not_run = sum(bool(g.get("not_run")) for g in goals_.values())
    unmeasured = sum(g["met"] is None for g in goals_.values()) - not_run
    return [
        f"bench decode: done in {seconds:.0f} s; (d) = exits, K/V by {results['kv_mode']}",
        *(f"  batch {b}: (d) {row['systems'][d]['tokens_per_s']:.1f} tok/s, (d)/(c) {f(row['speedup_exit_vs_full'])}x, "
          f"(d)/(a) {f(row['speedup_exit_vs_hf'])}x, (e)/(c) {f(row.get('speedup_speculative_vs_full'))}x"
          for b, row in results["batches"].items()),
        f"  false exits of (d): {results['false_exit_rate']:.4f} on {results.get('false_exit_tokens')} tokens "
        f"(certified eps {f(results.get('calibration', {}).get('epsilon'), 'g')})",
        f"  (e) self-speculative: acceptance {f(summary.get('speculative_acceptance_rate'), '.3f')} at batch 1, "
        f"{results.get('speculative_mismatches')} tokens differ from (c) of "
        f"{results.get('speculative_tokens_compared')}",
        f"  goals: {met} of {len(goals_)} met, {unmeasured} not measured, {not_run} not run",
        f"  report: {report}",
    ]


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = list(results["batches"])
    fig, ax = plt.subplots(figsize=(7, 3.8))
    width = 0.8 / len(SYSTEMS)
    for k, s in enumerate(SYSTEMS):
        vals = [results["batches"][b]["systems"].get(s, {}).get("tokens_per_s", 0.0) for b in batches]
        ax.bar(np.arange(len(batches)) + (k - (len(SYSTEMS) - 1) / 2) * width, vals, width, label=LABELS[s])
    ax.set_xticks(np.arange(len(batches)), [f"batch {b}" for b in batches])
    ax.set_ylabel("tokens / s")
    ax.set_title("Decode throughput (higher is better)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=110)
    plt.close(fig)
