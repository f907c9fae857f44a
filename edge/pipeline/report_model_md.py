"""The report's Markdown about the shipped model and its exit rule: the calibrated rule (its certificate, the
systems compared, calibration quality) and the compression recipe against the float model."""
from __future__ import annotations

from typing import Any

from edge.pipeline.report_format import fmt


def calibration_md(c: dict[str, Any]) -> list[str]:
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
                     f"{fmt(r['bound'])} | {r['false_exit_rate_test']:.4f} | {r['layers_skipped_frac']:.3f} | "
                     f"{r['accuracy_loss_rel']:.4f} |")
    lines += ["", "The systems compared are judged teacher-forced on the test split's natural text (false exits (test), "
              "layers skipped, accuracy loss); the shipped rule's free-running numbers are above."]
    lines += ["", "| exit | ECE (test) | Brier (test) |", "| ---: | ---: | ---: |"]
    for k, q in (c.get("calibration_quality") or {}).items():
        lines.append(f"| {k} | {q['ece']:.4f} | {q['brier']:.4f} |")
    lines += ["", "![exit depth](calibration/exit_depth.png)", "", "![reliability](calibration/reliability.png)", ""]
    return lines


def compression_md(c: dict[str, Any]) -> list[str]:
    """The shipped compression recipe against the float model (bench/compress.md has every row)."""
    lines = ["## Compression", "",
             f"Shipped recipe `{c.get('recipe')}`{' + pruning near exits' if c.get('pruned') else ''} (distill -> "
             "compress -> export -> calibrate: the thresholds are certified on the served ONNX Runtime engine, every "
             "token judged against that engine at full depth). Against the distilled "
             f"float model, held out: accuracy loss {fmt(c.get('accuracy_loss_rel'))} (relative top-1, float full depth vs "
             f"compressed with exits; {fmt(c.get('accuracy_loss_rel_full_depth'))} at full depth), weights "
             f"x{fmt(c.get('model_bytes_ratio'), '.3f')}, decode with exits on ONNX Runtime CPU "
             f"x{fmt(c.get('speedup_vs_fp32_b1'), '.3f')} at batch 1 and x{fmt(c.get('speedup_vs_fp32_b16'), '.3f')} "
             f"at batch 16; false-exit bound {fmt(c.get('false_exit_bound'))} (certified), held-out rate "
             f"{fmt(c.get('false_exit_rate_heldout'))}. At full depth the served engine and the torch model with "
             f"fake quantization pick different tokens on {fmt(c.get('full_depth_mismatch_vs_torch'))} of tokens "
             "(near ties rounded to adjacent INT8 codes; docs/compression.md): the reason the certificate is "
             "computed on the engine, not on torch."]
    if c.get("llamacpp_same_bits"):
        lines.append(f"Against llama.cpp at the same bit-width ({c['llamacpp_same_bits']}, same weights, batch 1, "
                     f"measured side by side): x{fmt(c.get('speedup_vs_llamacpp_same_bits_b1'), '.3f')} tokens/s, "
                     f"perplexity ratio {fmt(c.get('perplexity_vs_llamacpp_same_bits'), '.4f')} (ours / theirs).")
    ti = (c.get("token_importance") or {})
    for score, r in ti.items():
        lines.append(f"Token importance ({score}, torch, prefill only): {r['flops_saved_frac']:.1%} of prefill FLOPs "
                     f"saved, perplexity x{r['ppl_ratio']:.4f} on the continuation.")
    return lines + ["", "![compression](bench/compress.png)", ""]
