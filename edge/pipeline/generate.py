"""``smartexit generate``: the reference early-exit generator on held-out prompts.

Checks, on the run's multi-exit checkpoint, that generation with exits disabled
is token-for-token the full model's greedy output, and measures what a fixed
confidence threshold does (exit depths, agreement with full-depth greedy).
Calibrated thresholds replace the fixed one in ``smartexit calibrate``.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import asdict, dataclass

import torch


from edge.core.data import Split, heldout_prompts, load_split
from edge.core.errors import ConfigError
from edge.pipeline.run_checkpoint import open_run
from edge.model.reference import reference_generate
from edge.runtime.rules import ConfidenceRule

STAGE = "generate"


@dataclass
class GenerateConfig:
    run_dir: str = "artifacts/demo"
    prompts: int = 8
    prompt_tokens: int = 64
    max_new_tokens: int = 32
    threshold: float = 0.9
    seed: int = 0
    threads: int = 2

    def __post_init__(self) -> None:
        if not 0.0 < self.threshold <= 1.0:
            raise ConfigError(f"generate.threshold must be in (0, 1], got {self.threshold}")
        if self.prompts < 1 or self.prompt_tokens < 1 or self.max_new_tokens < 1:
            raise ConfigError("generate: prompts, prompt_tokens and max_new_tokens must be >= 1")


def main(cfg: GenerateConfig) -> int:
    t0 = time.time()
    run = open_run(cfg.run_dir, cfg.threads)
    manifest, ckpt, model, tok = run.manifest, run.path, run.model, run.tokenizer
    prompts = heldout_prompts(tok, load_split(Split.TEST), cfg.prompts, cfg.prompt_tokens, cfg.seed)
    rule = ConfidenceRule(cfg.threshold)
    identical, matched, total, exits = 0, 0, 0, Counter()
    t_full = t_exit = 0.0
    for p in prompts:
        s = time.perf_counter()
        full = reference_generate(model, p, cfg.max_new_tokens)
        t_full += time.perf_counter() - s
        reference = _greedy_no_cache(model, p, cfg.max_new_tokens)
        identical += full.tokens == reference
        s = time.perf_counter()
        early = reference_generate(model, p, cfg.max_new_tokens, rule=rule)
        t_exit += time.perf_counter() - s
        matched += sum(a == b for a, b in zip(early.tokens, full.tokens))
        total += len(full.tokens)
        exits.update(early.exit_layers)
    n_tok = sum(exits.values())
    metrics = {
        "prompts": len(prompts),
        "max_new_tokens": cfg.max_new_tokens,
        "disabled_equals_full_greedy": identical == len(prompts),
        "threshold": cfg.threshold,
        "token_match_vs_full": matched / total,
        "mean_exit_layer": sum(k * v for k, v in exits.items()) / n_tok,
        "exit_fraction": {str(k): exits[k] / n_tok for k in model.exit_layers},
        "seconds_full": t_full,
        "seconds_exit": t_exit,
    }
    manifest.record(STAGE, inputs={"checkpoint": ckpt}, config=asdict(cfg), outputs={}, metrics=metrics,
                    seconds=time.time() - t0)
    print(f"exits disabled == full greedy on {identical}/{len(prompts)} prompts; "
          f"threshold {cfg.threshold}: mean exit layer {metrics['mean_exit_layer']:.2f}, "
          f"token match {metrics['token_match_vs_full']:.3f}")
    return 0 if metrics["disabled_equals_full_greedy"] else 1


@torch.no_grad()
def _greedy_no_cache(model, prompt: list[int], n: int) -> list[int]:
    """Full-model greedy decoding recomputing the whole prefix each step (no KV cache)."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model.backbone(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]
