"""Markdown and PNG of ``smartexit bench compress`` (:mod:`edge.pipeline.bench.compress`)."""
from __future__ import annotations

from pathlib import Path
from typing import Any


def _f(x: Any, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def render_markdown(result: dict[str, Any]) -> str:
    rows, s = result["rows"], result["summary"]
    batches = [str(b) for b in result["config"]["batch_sizes"]]
    exits = None
    lines = ["# Compression recipes", "",
             "Held-out (test split) quality teacher-forced against the distilled float model; decode with exits on "
             "ONNX Runtime CPU (the run's exit rule and K/V mode), repeats interleaved; llama.cpp on the same "
             "weights quantized by llama.cpp itself. Only `shipped` was calibrated (certified bound); the other "
             "recipes ran under the same thresholds, their false-exit rates measured on held-out prompts, not "
             "certified.", ""]
    head = ["recipe", "precision", "weights MiB", "ONNX MiB", "top-1", "perplexity", "KL last exit",
            *[f"tok/s b{b}" for b in batches], "peak MiB", "layers skipped", "false exits (held-out)",
            "full depth vs torch", "parity"]
    lines += ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for name, r in rows.items():
        q = r.get("quality", {})
        kl = q.get("kl_vs_reference") or {}
        if kl and exits is None:
            exits = list(kl)
        size = r.get("model_bytes", r.get("gguf_bytes"))
        tps = r.get("tokens_per_s", {})
        lines.append("| " + " | ".join([
            name, r.get("precision", "-"), _f(size / 2**20 if size else None, ".2f"),
            _f(r["onnx_bytes"] / 2**20 if r.get("onnx_bytes") else None, ".2f"),
            _f(q.get("top1"), ".4f"), _f(q.get("perplexity"), ".3f"),
            _f(kl.get(exits[-1]) if kl and exits else None, ".5f"),
            *[_f(tps.get(b), ".0f") for b in batches], _f(r.get("peak_rss_mib"), ".0f"),
            _f(r.get("layers_skipped_frac")), _f(r.get("false_exit_rate_heldout"), ".4f"),
            _f(r.get("full_depth_mismatch_vs_torch"), ".4f"),
            "-" if "parity_passed" not in r else ("passed" if r["parity_passed"] else "FAILED")]) + " |")
    if exits:
        lines += ["", "Exit agreement (exit argmax = the same model's last layer) and KL to the float model's same exit:",
                  "", "| recipe | " + " | ".join(f"agree @{e}" for e in exits) + " | "
                  + " | ".join(f"KL @{e}" for e in exits) + " |", "|" + " --- |" * (1 + 2 * len(exits))]
        for name, r in rows.items():
            q = r.get("quality", {})
            if "exit_agreement" not in q:
                continue
            lines.append(f"| {name} | " + " | ".join(_f(q["exit_agreement"].get(e), ".4f") for e in exits) + " | "
                         + " | ".join(_f(q["kl_vs_reference"].get(e), ".5f") for e in exits) + " |")
    lines += ["", "## Summary", ""]
    for k, v in s.items():
        if k != "token_importance":
            lines.append(f"- `{k}`: {v if not isinstance(v, float) else format(v, '.4f')}")
    ti = s.get("token_importance")
    if ti:
        lines += ["", "## Token importance in prefill (torch, not in the served engine)", "",
                  "| score | FLOPs saved | KL at prompt end | top-1 agreement | perplexity ratio |",
                  "| --- | --- | --- | --- | --- |"]
        for score, r in ti.items():
            lines.append(f"| {score} | {r['flops_saved_frac']:.3f} | {r['kl_mean']:.4f} | {r['top1_agreement']:.3f} "
                         f"| {r['ppl_ratio']:.4f} |")
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    """Weights MiB vs batch-1 tokens/s per recipe (and llama.cpp), one labelled point each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, r in result["rows"].items():
        size = r.get("model_bytes", r.get("gguf_bytes"))
        tps = r.get("tokens_per_s", {}).get("1")
        if size and tps:
            ax.scatter(size / 2**20, tps, marker="s" if name.startswith("llamacpp") else "o")
            ax.annotate(name, (size / 2**20, tps), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("weights (MiB)")
    ax.set_ylabel("decode tokens/s, batch 1")
    ax.set_title("compression recipes (ONNX Runtime CPU) vs llama.cpp")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
