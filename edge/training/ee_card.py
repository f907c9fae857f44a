"""Model card and exit-depth plot of ``bundled-ee``, written from its ``lineage.json``.

Everything in the card is read from the lineage (the recipe the run was given and
what the run measured), so ``make train-tiny-ee`` rewrites a card that matches
the weights beside it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from edge.core.artifacts import atomic_path, atomic_write_text

CARD = "MODEL_CARD.md"
LOSS_PNG = "exit_losses.png"
DEPTH_PNG = "exit_depth.png"


def plot_exit_depth(metrics: dict[str, Any], path: str | Path) -> Path:
    """Two panels, base vs fine-tuned: agreement with the final layer per layer, and the oracle
    exit-depth histogram (fraction of tokens whose earliest always-agreeing exit is each layer)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    layers = [int(k) for k in metrics["exit_agreement"]]
    x = np.arange(len(layers))
    fig, (a, b) = plt.subplots(1, 2, figsize=(8.0, 3.2))
    for ax, key, title in ((a, "exit_agreement", "agreement with the last layer"),
                           (b, "oracle_exit_hist", "oracle exit depth (fraction of tokens)")):
        ax.bar(x - 0.2, [metrics[f"base_{key}"][str(k)] for k in layers], 0.4, label="base (bundled)",
               color="#9aa5b1")
        ax.bar(x + 0.2, [metrics[key][str(k)] for k in layers], 0.4, label="bundled-ee", color="#2a6f97")
        ax.set_xticks(x, [str(k) for k in layers], fontsize=8)
        ax.set_xlabel("layer")
        ax.set_title(title, fontsize=9)
    a.legend(fontsize=7)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=80)
    plt.close(fig)
    return Path(path)


def _recipe_text(cfg: dict[str, Any], recipe: dict[str, Any]) -> str:
    exits = cfg["exits"]["layers"]
    base = (f"`smartexit distill --config configs/tiny_ee.yaml` (`make train-tiny-ee`): the whole decoder trained "
            f"for {cfg['steps']} steps ({cfg['batch_size']} x {cfg['seq_len']} tokens each, AdamW, lr {cfg['lr']} "
            f"with 20 warm-up steps and cosine decay to 0, grad clip 1.0, seed {cfg['seed']}) against the frozen base "
            f"model `{cfg['model']}` as teacher. Each exit's loss is {cfg['kl_weight']} x T^2 x KL to the teacher's "
            f"final-layer distribution at T = {cfg['temperature']} plus {1 - cfg['kl_weight']:.1f} x cross-entropy on "
            f"the next token")
    ls = cfg.get("layerskip", {})
    if not ls.get("enabled"):
        return base + f", at exits {exits} through exit heads of rank {cfg['exits']['adapter_rank']}."
    rates = recipe.get("layer_dropout_rates", [])
    curriculum = {
        "rotational": (f"rotational: the early exits split into {ls['rotation_groups']} interleaved groups, one "
                       f"group on at a time, the next every {ls['rotation_period']} step(s)"),
        "gradual": (f"gradual: early exits switched on from the deepest downwards, all on after "
                    f"{ls['gradual_frac']:.0%} of training"),
        "none": "none: every exit on at every step",
    }[ls["curriculum"]]
    weighting = (f"each early exit weighted {ls['exit_loss_scale']} against the final layer's 1"
                 if ls["exit_weighting"] == "uniform" else
                 f"LayerSkip's depth-increasing exit weights (e_scale {ls['exit_loss_scale']})")
    return (f"**LayerSkip** early-exit training (Elhoushi et al., ACL 2024; `edge/training/layerskip.py`): {base}, "
            f"read after layers {exits} through the model's *own* final norm and LM head (no exit heads), "
            f"{weighting}; the final layer keeps its own loss so that full depth stays at the base's quality.\n\n"
            f"- **Layer dropout** rising with depth, p_l = (exp(l ln2 / (L-1)) - 1) x p_max with p_max = "
            f"{ls['p_max']}: " + ", ".join(f"{r:.3f}" for r in rates) + f" for layers 1..{len(rates)} (a dropped layer "
            f"passes its input through for that sample); {recipe.get('mean_layers_kept', 1.0):.1%} of layer "
            f"computations ran.\n"
            f"- **Curriculum** {curriculum}.")


def write_ee_card(folder: str | Path, lineage: dict[str, Any]) -> Path:
    """Write ``folder/MODEL_CARD.md`` from ``lineage`` (see module docstring)."""
    folder = Path(folder)
    recipe, m = lineage["recipe"], lineage["metrics"]
    cfg = recipe["config"]
    gate = m["quality_gate"]
    train_s = recipe.get("train_seconds") or recipe["seconds"]
    lines = [
        "# SmartExit tiny-ee: model card", "",
        "The bundled tiny model (`edge/assets/tiny`, see its card for architecture, data and training) after "
        "early-exit training, so that its early layers already predict what its last layer will. "
        "`lineage.json` records the base model, the full recipe and every number below; only the decoder ships "
        "(same format as the base: float16 safetensors, HF Llama layout, same tokenizer). `make demo` distils "
        "exit heads on top of it with the decoder frozen.", "",
        "## Recipe", "", _recipe_text(cfg, recipe), "",
        f"Training took {train_s / 60:.0f} minutes of wall time ({recipe['seconds'] / 60:.0f} minutes for the "
        f"whole stage with the evaluations) on {cfg['threads']} CPU cores shared with other work.", "",
        "## Full depth against the base", "",
        f"Held-out test split, {m['tokens']:,} tokens ({cfg['eval_windows']} windows of {cfg['seq_len']} tokens, "
        f"teacher-forced; the base card's 512-token windows give other absolute values).", "",
        "| | base (`bundled`) | `bundled-ee` | relative change |", "| --- | ---: | ---: | ---: |",
        f"| perplexity | {m['base_heldout_ppl']:.3f} | {m['heldout_ppl']:.3f} | {gate['ppl_rel_change']:+.2%} |",
        f"| top-1 next-token accuracy | {m['base_heldout_top1']:.4f} | {m['heldout_top1']:.4f} | "
        f"{gate['top1_rel_change']:+.2%} |", "",
        f"Quality gate (perplexity at most {gate['max_rel_loss']:.0%} higher, top-1 at most "
        f"{gate['max_rel_loss']:.0%} lower than the base, relative): **{'passed' if gate['passed'] else 'FAILED'}**.",
        "",
    ]
    if "base_exit_agreement" in m:
        layers = list(m["exit_agreement"])
        cum_b = cum_n = 0.0
        lines += [
            "## Where tokens could leave", "",
            "Per layer, read through the model's own final norm and LM head (no exit heads, no training of them), "
            "on the same tokens: how often its argmax equals the last layer's, and the *oracle exit depth*: the "
            "fraction of tokens whose first layer from which every later layer agrees with the last is this one "
            "(the earliest a rule that never exits falsely could let the token go; cumulated: the share that could "
            "have left by this layer).", "",
            "| layer | agreement, base | agreement, `bundled-ee` | oracle exit, base | oracle exit, `bundled-ee` "
            "| left by here, base | left by here, `bundled-ee` |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for k in layers:
            cum_b += m["base_oracle_exit_hist"][k]
            cum_n += m["oracle_exit_hist"][k]
            lines.append(f"| {k} | {m['base_exit_agreement'][k]:.3f} | {m['exit_agreement'][k]:.3f} | "
                         f"{m['base_oracle_exit_hist'][k]:.3f} | {m['oracle_exit_hist'][k]:.3f} | {cum_b:.3f} | "
                         f"{cum_n:.3f} |")
        n_layers = int(layers[-1])
        lines += ["", f"Mean oracle exit layer: {m['base_oracle_mean_exit_layer']:.2f} (base) -> "
                  f"{m['oracle_mean_exit_layer']:.2f}, i.e. at most {1 - m['base_oracle_mean_exit_layer'] / n_layers:.1%}"
                  f" -> {1 - m['oracle_mean_exit_layer'] / n_layers:.1%} of layer computations could be skipped "
                  f"without a single false exit, with every layer an exit and a perfect rule. A real rule at a "
                  f"certified false-exit rate, with a few exits, skips less.", ""]
        if (folder / DEPTH_PNG).is_file():
            lines += [f"![agreement and oracle exit depth]({DEPTH_PNG})", ""]
    if "exit_loss_summary" in m:
        summ = m["exit_loss_summary"]
        worst = max((abs(v["rel_change"]) for v in summ.values() if v["rel_change"] is not None), default=None)
        lines += ["## Training curves", "",
                  "Loss per exit over training (moving mean over the steps where that exit was on):", "",
                  f"![exit losses]({LOSS_PNG})", "",
                  "| exit | mean loss, last 20% of steps | change from the 20% before |", "| ---: | ---: | ---: |"]
        lines += [f"| {k} | {v['last']:.3f} | " + ("-" if v["rel_change"] is None else f"{v['rel_change']:+.1%}")
                  + " |" for k, v in summ.items()]
        if worst is not None:
            lines += ["", f"The largest change of any exit's loss between the last two fifths of training is "
                      f"{worst:.1%} (the learning rate decays to 0 over the last of them)."]
        lines.append("")
    lines += ["Reproduce: `make train-tiny-ee` (seeded; resumes from `runs/tiny-ee/layerskip/checkpoint.pt` after "
              "an interruption)."]
    return atomic_write_text(folder / CARD, "\n".join(lines) + "\n")
