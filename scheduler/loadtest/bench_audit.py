"""``smartexit bench audit``: does the online false-exit audit catch traffic the certificate does not cover?

The engine host that Triton's model.py runs (opened from the same bundle), with the audit sampling
every token (``audit.fraction`` 1): first held-out code, the distribution the table was certified
on; then another domain, a word salad (the same held-out code with its tokens shuffled), on which
early exits are confidently wrong more often. Requests run one at a time (the deferred-K/V table
exits only at decode batch 1). Reported per run: audited tokens, false exits, rate and bounds per
exit and pooled, and whether (and after how many audited tokens) the fallback to full depth fired.
"""
from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edge.core.artifacts import Manifest, atomic_write_json, atomic_write_text
from edge.core.errors import ConfigError, SmartExitError

STAGE = "bench_audit"


@dataclass
class BenchAuditConfig:
    run_dir: str = "artifacts/demo"
    prompts: int = 24
    prompt_tokens: int = 64
    max_tokens: int = 48
    min_tokens: int = 100          # audited tokens before the trigger may fire
    seed: int = 0
    threads: int | None = None     # the bundle's when None

    def __post_init__(self) -> None:
        if min(self.prompts, self.prompt_tokens, self.max_tokens, self.min_tokens) < 1:
            raise ConfigError("bench audit: prompts, prompt_tokens, max_tokens and min_tokens must be >= 1")


def word_salad(prompts: list[list[int]], seed: int) -> list[list[int]]:
    """Each prompt's tokens in a random order (same tokens, no syntax): the other domain."""
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.permutation(p)] for p in prompts]


def audit_run(bundle: Path, prompts: list[list[int]], cfg: BenchAuditConfig, tag: str) -> dict[str, Any]:
    """Serve ``prompts`` one at a time on a fresh host with every token audited; the audit's estimate."""
    from scheduler.serving.bundle import open_bundle
    from edge.runtime.host import GenRequest

    host = open_bundle(bundle, threads=cfg.threads,
                       audit={"fraction": 1.0, "min_tokens": cfg.min_tokens, "max_pending": 100_000, "seed": cfg.seed})
    host.start()
    t0 = time.perf_counter()
    try:
        for i, p in enumerate(prompts):
            done = threading.Event()
            host.submit(GenRequest(f"{tag}-{i}", p, cfg.max_tokens), lambda c, d=done: c.finish_reason and d.set())
            if not done.wait(300):
                raise SmartExitError(f"bench audit: request {tag}-{i} did not finish in 300 s")
        deadline = time.monotonic() + 600
        while True:  # the audits run in the spare capacity after the requests
            st = host.stats()["audit"]
            if (st["pending"] == 0 and not host.engine.has_work) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    finally:
        host.stop()
    return {**st, "seconds": time.perf_counter() - t0}


def main(cfg: BenchAuditConfig) -> int:
    from edge.core.data import Split, heldout_prompts, load_split
    from edge.model.tokenizer import load_tokenizer

    t0 = time.perf_counter()
    from scheduler.serving.stack import bundle as run_bundle

    bundle = run_bundle(cfg.run_dir)  # ConfigError naming `smartexit repo` when there is none
    tok = load_tokenizer(bundle / "tokenizer.json")
    code = heldout_prompts(tok, load_split(Split.TEST), cfg.prompts, cfg.prompt_tokens, cfg.seed)
    runs = {"heldout_code": audit_run(bundle, code, cfg, "code"),
            "word_salad": audit_run(bundle, word_salad(code, cfg.seed), cfg, "salad")}
    epsilon = runs["heldout_code"]["epsilon"]  # the threshold table's, as the host audits it
    report = {"stage": STAGE, "config": asdict(cfg), "epsilon": epsilon, "runs": runs,
              "caught": bool(runs["word_salad"]["fallback"]), "false_alarm": bool(runs["heldout_code"]["fallback"])}
    out = Path(cfg.run_dir) / "bench"
    md = ["# Online false-exit audit: in domain vs another domain", "",
          f"Every token of {cfg.prompts} requests ({cfg.prompt_tokens} prompt tokens, up to {cfg.max_tokens} new, "
          f"greedy, mode bounded) re-decoded at full depth; epsilon {epsilon} (the table's), one-sided "
          f"Clopper-Pearson bounds at delta {runs['heldout_code']['delta']}, fallback when the lower bound exceeds "
          f"epsilon.", "",
          "| traffic | audited tokens | false exits | rate | lower | upper | fallback (after tokens) | per exit (audited / false) |",
          "| --- | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    for name, r in runs.items():
        per = ", ".join(f"{k}: {v['audited']} / {v['false']}" for k, v in r["exits"].items())
        md.append(f"| {name} | {r['audited']} | {r['false']} | {r['rate']:.4f} | {r['lower']:.4f} | {r['upper']:.4f} | "
                  f"{r['fallback']} ({r['fired_after']}) | {per} |")
    paths = {"json": out / "audit.json", "md": out / "audit.md"}
    atomic_write_text(paths["md"], "\n".join(md) + "\n")
    atomic_write_json(paths["json"], report)
    metrics = {"epsilon": epsilon, "caught": report["caught"], "false_alarm": report["false_alarm"],
               **{f"{n}_rate": r["rate"] for n, r in runs.items()},
               **{f"{n}_fired_after": r["fired_after"] for n, r in runs.items()}}
    Manifest(cfg.run_dir).record(STAGE, inputs={"bundle": bundle}, config=asdict(cfg), outputs=paths,
                                 metrics=metrics, seconds=time.perf_counter() - t0)
    print("\n".join(md[4:]))
    return 0
