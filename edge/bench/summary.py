"""The decode benchmark's summary: headline numbers, goals, Markdown table and chart.

Pure functions of the results dict that :func:`edge.bench.decode.main` assembles.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

SYSTEMS = ("hf", "layerskip", "engine_full", "engine_exit_propagate", "engine_exit_defer")
LABELS = {"hf": "(a) transformers generate", "layerskip": "(b) transformers LayerSkip self-speculation",
          "engine_full": "(c) SmartExit engine, ORT, full depth",
          "engine_exit_propagate": "SmartExit engine, ORT, exits, K/V by propagation",
          "engine_exit_defer": "SmartExit engine, ORT, exits, K/V by deferred recomputation"}


# The engine issue's targets: (metric in the headline, at least this); false exits at most 0.009.
GOALS = {"speedup_exit_vs_full_b1": 1.5, "speedup_exit_vs_full_b16": 1.35, "speedup_exit_vs_hf_b1": 3.0,
         "speedup_exit_vs_layerskip_b1": 1.0}
MAX_FALSE_EXIT_RATE = 0.009


def goals(summary: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each goal with the measured value, whether it is met and by how much it is missed."""
    out = {}
    for key, target in GOALS.items():
        v = summary.get(key)
        if v is not None:
            out[key] = {"goal": f">= {target}", "measured": v, "met": v >= target, "shortfall": max(0.0, target - v)}
    fe = summary["false_exit_rate"]
    out["false_exit_rate"] = {"goal": f"<= {MAX_FALSE_EXIT_RATE}", "measured": fe, "met": fe <= MAX_FALSE_EXIT_RATE,
                              "shortfall": max(0.0, fe - MAX_FALSE_EXIT_RATE)}
    return out


def goals_table(goals_: dict[str, dict[str, Any]]) -> list[str]:
    """Markdown rows of :func:`goals` (the benchmark's page and the run report show the same table)."""
    return ["| goal | target | measured | met | missed by |", "| --- | ---: | ---: | --- | ---: |",
            *(f"| {k} | {g['goal']} | {g['measured']:.3f} | {'yes' if g['met'] else 'no'} | {g['shortfall']:.3f} |"
              for k, g in goals_.items())]


def headline(results: dict[str, Any]) -> dict[str, Any]:
    bs = results["batches"]
    first, last = str(min(map(int, bs))), str(max(map(int, bs)))
    return {
        "speedup_exit_vs_full_b1": bs[first]["speedup_exit_vs_full"],
        f"speedup_exit_vs_full_b{last}": bs[last]["speedup_exit_vs_full"],
        "speedup_exit_vs_hf_b1": bs[first]["speedup_exit_vs_hf"],
        "speedup_exit_vs_layerskip_b1": bs[first]["speedup_exit_vs_layerskip"],
        "exit_depth_ceiling_b1": bs[first]["exit_depth_ceiling"],
        "false_exit_rate": results["false_exit_rate"],
        "kv_mode": results["kv_mode"],
        "speedup_vs_full_b1_by_mode": bs[first]["speedup_vs_full_by_mode"],
        f"speedup_vs_full_b{last}_by_mode": bs[last]["speedup_vs_full_by_mode"],
        "false_exit_rate_by_mode": results["false_exit_rate_by_mode"],
        "token_match_vs_full_engine": results["token_match_vs_full_engine"],
    }


def render_markdown(results: dict[str, Any], summary: dict[str, Any]) -> str:
    cfg = results["config"]
    mem = results.get("peak_rss_mib", {})
    lines = ["# Decode benchmark", "",
             f"{cfg['prompt_tokens']}-token held-out prompts, {cfg['new_tokens']} new tokens, greedy; "
             f"{cfg['warmup']} warm-up + {cfg['repeats']} interleaved repeats; medians; {cfg['threads']} threads "
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
    modes = list(results["false_exit_rate_by_mode"])
    lines += ["", "| batch | (d)/(c) | ceiling from exit depth | (d)/(a) | (d)/(b) | "
              + " | ".join(f"{m}/(c) | false exits, {m}" for m in modes) + " |",
              "| ---: | ---: | ---: | ---: | ---: | " + " | ".join("---: | ---:" for _ in modes) + " |"]
    for b, row in results["batches"].items():
        lines.append(f"| {b} | {f(row['speedup_exit_vs_full'])} | {f(row['exit_depth_ceiling'])} | "
                     f"{f(row['speedup_exit_vs_hf'])} | "
                     f"{f(row['speedup_exit_vs_layerskip'])} | "
                     + " | ".join(f"{f(row['speedup_vs_full_by_mode'][m])} | {row['false_exit_rate_by_mode'][m]:.4f}"
                                  for m in modes) + " |")
    lines += ["", *goals_table(summary.get("goals", {}))]
    prof = results["profile_b1"]
    lines += ["", "The ceiling is layers / mean exit layer of (d): its (d)/(c) if time were proportional to "
              "the layers a token runs and exit decisions were free. With deferred K/V the skipped layers "
              "still run for each exited token (with the next token), so at batch sizes where compute, not "
              "dispatch, sets the time, deferral cannot approach it.",
              "", "Where one decode step of (d) goes at batch 1 (ms per step): "
              + ", ".join(f"{k} {v:.3f}" for k, v in prof.items()), ""]
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = list(results["batches"])
    fig, ax = plt.subplots(figsize=(7, 3.8))
    width = 0.16
    for k, s in enumerate(SYSTEMS):
        vals = [results["batches"][b]["systems"].get(s, {}).get("tokens_per_s", 0.0) for b in batches]
        ax.bar(np.arange(len(batches)) + (k - 2) * width, vals, width, label=LABELS[s])
    ax.set_xticks(np.arange(len(batches)), [f"batch {b}" for b in batches])
    ax.set_ylabel("tokens / s")
    ax.set_title("Decode throughput (higher is better)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=110)
    plt.close(fig)
