"""``smartexit generate``: the reference early-exit generator on held-out prompts, or the engine in a mode.

Without ``--mode`` (the pipeline stage): checks, on the run's multi-exit checkpoint, that generation
with exits disabled is token-for-token the full model's greedy output, and measures what a fixed
confidence threshold does (exit depths, agreement with full-depth greedy). Calibrated thresholds
replace the fixed one in ``smartexit calibrate``. A model that decides over a candidate shortlist has no
probability to hold a fixed threshold to (its checks score raw candidate logits): it is run with the
run's calibrated threshold table instead, so calibrate must come first.

With ``--mode exact|bounded|full``: generates with the serving engine on the run's ONNX export and
threshold table, every request in that mode, from ``--prompt TEXT`` or the held-out prompts; prints
the text, tokens/s and, per mode, the exit depths (bounded) or the draft acceptance (exact). For a
greedy run in mode exact or bounded it also decodes at full depth and says how many tokens differ
(exact: must be 0; exits 1 if not).
"""
from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import asdict, dataclass

import torch


from edge.core.data import Split, heldout_prompts, load_split
from edge.core.errors import ConfigError
from edge.pipeline.run import check_threads, open_run
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
    # the engine in a request mode (exact | bounded | full); None: the reference stage above
    mode: str | None = None
    prompt: str | None = None  # text to continue (mode given); None: the held-out prompts
    temperature: float = 0.0
    top_p: float = 1.0
    draft_exit: int | None = None  # mode exact: the exit that drafts (None: the first decision exit)
    spec_stop: str = "calibrated"  # mode exact: calibrated | fixed | top1

    def __post_init__(self) -> None:
        if self.mode is not None and self.mode not in ("exact", "bounded", "full"):
            raise ConfigError(f"generate.mode must be exact, bounded or full, got {self.mode!r}")
        if not 0.0 < self.threshold <= 1.0:
            raise ConfigError(f"generate.threshold must be in (0, 1], got {self.threshold}")
        if self.prompts < 1 or self.prompt_tokens < 1 or self.max_new_tokens < 1:
            raise ConfigError("generate: prompts, prompt_tokens and max_new_tokens must be >= 1")
        check_threads(self.threads, "generate.threads")
        if not (math.isfinite(self.temperature) and self.temperature >= 0.0):
            raise ConfigError(f"generate.temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"generate.top_p must be in (0, 1], got {self.top_p}")
        # None (the default, or the word none / null) means the held-out prompts; "" is a prompt given empty
        if self.prompt == "":
            raise ConfigError("generate.prompt is empty: give text to continue, or leave prompt out for the "
                              "held-out prompts")
        if self.prompt is not None and self.mode is None:
            raise ConfigError("generate.prompt needs a mode (--mode exact|bounded|full); without one the stage "
                              "runs on the held-out prompts")


def main(cfg: GenerateConfig) -> int:
    if cfg.mode is not None:
        return engine_generate(cfg)
    t0 = time.time()
    run = open_run(cfg.run_dir, cfg.threads)
    manifest, ckpt, model, tok = run.manifest, run.path, run.model, run.tokenizer
    prompts = heldout_prompts(tok, load_split(Split.TEST), cfg.prompts, cfg.prompt_tokens, cfg.seed)
    rule, rule_name = _early_rule(cfg, manifest, ckpt, model)
    table = _lookup_table(manifest, rule)
    identical, matched, total, exits = 0, 0, 0, Counter()
    t_full = t_exit = 0.0
    for p in prompts:
        s = time.perf_counter()
        full = reference_generate(model, p, cfg.max_new_tokens)
        t_full += time.perf_counter() - s
        identical += len(full.tokens) == cfg.max_new_tokens and _greedy_without_cache(model, p, full.tokens)
        s = time.perf_counter()
        early = reference_generate(model, p, cfg.max_new_tokens, rule=rule, lookup_table=table)
        t_exit += time.perf_counter() - s
        matched += sum(a == b for a, b in zip(early.tokens, full.tokens))
        total += len(full.tokens)
        exits.update(early.exit_layers)
    n_tok = sum(exits.values())
    metrics = {
        "prompts": len(prompts),
        "max_new_tokens": cfg.max_new_tokens,
        "disabled_equals_full_greedy": identical == len(prompts),
        "threshold": cfg.threshold if rule_name == "fixed" else None,
        "rule": rule_name,
        "token_match_vs_full": matched / total,
        "mean_exit_layer": sum(k * v for k, v in exits.items()) / n_tok,
        "exit_fraction": {str(k): exits[k] / n_tok for k in model.exit_layers},
        "seconds_full": t_full,
        "seconds_exit": t_exit,
    }
    manifest.record(STAGE, inputs={"checkpoint": ckpt}, config=asdict(cfg), outputs={}, metrics=metrics,
                    seconds=time.time() - t0)
    early = f"threshold {cfg.threshold}" if rule_name == "fixed" else "the calibrated rule"
    print(f"exits disabled == full greedy on {identical}/{len(prompts)} prompts; {early}: mean exit layer "
          f"{metrics['mean_exit_layer']:.2f}, token match {metrics['token_match_vs_full']:.3f}")
    return 0 if metrics["disabled_equals_full_greedy"] else 1


def _early_rule(cfg: GenerateConfig, manifest, ckpt, model):
    """The rule of the early-exit run and its name: ``fixed`` (top-1 probability >= ``cfg.threshold``) or, for
    a shortlist model, ``calibrated`` (the run's threshold table).

    Raises:
        ConfigError: a shortlist model in a run that has not been calibrated.
    """
    if not model.has_shortlist:
        return ConfidenceRule(cfg.threshold), "fixed"
    if "calibrate" not in manifest.data["stages"]:
        raise ConfigError("generate: the model decides over a candidate shortlist, whose checks score raw candidate "
                          "logits (no probability for a fixed threshold): run `smartexit calibrate` first")
    from calibration.table import TableRule, load_table

    return TableRule(load_table(manifest.verified_output("calibrate", "thresholds"), ckpt)), "calibrated"


def _lookup_table(manifest, rule):
    """The export's corpus n-gram table where the calibrated rule's context lookup falls back to one, else None
    (reference_generate checks it is the rule's)."""
    if getattr(rule, "lookup_table_sha256", None) is None:
        return None
    from edge.runtime.graphs import load_ngram_table

    return load_ngram_table(manifest.verified_output("export", "graphs"))


@torch.no_grad()
def _greedy_without_cache(model, prompt: list[int], tokens: list[int]) -> bool:
    """Whether ``tokens`` are the full model's greedy decoding of ``prompt`` without a KV cache. One pass over
    the prompt and the tokens but the last, no cache: with causal attention the logits at each position are
    those of a pass over the tokens up to it, so greedy decoding that recomputes the whole prefix every step
    gives exactly ``tokens`` if and only if the argmax at every position from the prompt's last on is the
    next token. (It recomputed the prefix for each token until 2026-12-07: 32 passes a prompt, 10 of the
    stage's 19 s on the 2-core VM.)"""
    ids = torch.tensor([list(prompt) + list(tokens[:-1])])
    return model.backbone(ids).logits[0, len(prompt) - 1:].argmax(-1).tolist() == list(tokens)


def engine_generate(cfg: GenerateConfig) -> int:
    """``smartexit generate --mode M``: the serving engine (ONNX Runtime, the run's export and table)."""
    from calibration.table import TableRule, load_table
    from edge.core.artifacts import Manifest
    from edge.model.tokenizer import load_tokenizer
    from edge.runtime.backend import make_backend
    from edge.runtime.engine import Engine
    from edge.runtime.engine_config import EngineConfig
    from edge.runtime.request import Mode, Request
    from edge.runtime.speculative import SpecConfig

    manifest = Manifest(cfg.run_dir)
    ckpt = manifest.served_checkpoint()
    tok = load_tokenizer(ckpt)
    if cfg.prompt is not None:
        prompts = [tok.encode(cfg.prompt).ids]
        if not prompts[0]:
            raise ConfigError("generate.prompt is empty")
    else:
        prompts = heldout_prompts(tok, load_split(Split.TEST), cfg.prompts, cfg.prompt_tokens, cfg.seed)
    backend = make_backend("onnxruntime", graphs_dir=manifest.run_dir / "onnx", checkpoint=ckpt, threads=cfg.threads)
    rule = TableRule(load_table(manifest.run_dir / "calibration" / "thresholds.json", ckpt))
    mode = Mode(cfg.mode)

    def decode(m: Mode):
        ecfg = EngineConfig(max_seqs=1, max_running=1, max_len=backend.spec.max_positions,
                            prefill_budget=max(len(p) for p in prompts), kv_mode=rule.table.kv_mode,
                            speculative=SpecConfig(draft_exit=cfg.draft_exit, stop=cfg.spec_stop))
        engine = Engine(backend, ecfg, rule)
        outs, seconds = [], 0.0
        for i, p in enumerate(prompts):
            events = []
            s = time.perf_counter()
            engine.submit(Request(p, cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                                  seed=cfg.seed + i, mode=m))
            while engine.has_work:
                events += engine.step()
            seconds += time.perf_counter() - s
            outs.append(([e.token for e in events if e.token >= 0], [e.exit_layer for e in events if e.token >= 0]))
        return outs, seconds, engine

    outs, seconds, engine = decode(mode)
    n = sum(len(t) for t, _ in outs)
    for p, (tokens, _) in zip(prompts, outs):
        print(f"--- prompt: {tok.decode(p)!r}\n+++ {mode.value}: {tok.decode(tokens)!r}")
    line = f"mode {mode.value}: {n} tokens in {seconds:.2f} s ({n / seconds:.1f} tokens/s, prefill included)"
    if mode is Mode.BOUNDED:
        layers = [e for _, ex in outs for e in ex]
        line += f"; mean exit layer {sum(layers) / len(layers):.2f} of {backend.num_layers}"
    if mode is Mode.EXACT:
        st = engine.spec_stats.as_dict()
        line += (f"; draft exit {engine.draft_exit}, {st['rounds']} rounds, acceptance "
                 f"{st['acceptance_rate']:.2f}, {st['tokens_per_round']:.2f} tokens per round")
    print(line)
    if cfg.temperature > 0 or mode is Mode.FULL:
        return 0
    full, full_seconds, _ = decode(Mode.FULL)
    differ = sum(a != b for (x, _), (y, _) in zip(outs, full) for a, b in zip(x, y))
    print(f"full depth: {full_seconds:.2f} s ({n / full_seconds:.1f} tokens/s); tokens differing from full-depth "
          f"greedy: {differ} of {n} ({mode.value} is {full_seconds / seconds:.2f}x full depth)")
    return 1 if mode is Mode.EXACT and differ else 0
