"""``smartexit bench audit``: does the online false-exit audit catch traffic the certificate does not cover?

The engine host that Triton's model.py runs (opened from the same bundle), with the audit counting
every token (``audit.fraction`` 1; with deferral the engine judges its exits itself, and only those it
could not judge are re-decoded): first held-out code, the distribution the table was certified
on; then another domain, a word salad (the same held-out code with its tokens shuffled), on which
early exits are confidently wrong more often. Requests run one at a time (the deferred-K/V table
exits only at decode batch 1), with exits as the rule decides them (the step gate and bounded drafts off:
where checks do not pay, as on a 2-core CPU, the served engine leaves no exit to audit). Reported per run: audited tokens, false exits, rate and bounds per
exit and pooled, and whether (and after how many audited tokens) the fallback to full depth fired.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

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

    # exits as the rule decides them: the step gate and bounded drafts off (as served on a CPU where checks do not
    # pay, the gate keeps bounded requests at full depth and drafts take the tokens the rule would let leave, so
    # there would be no exit to audit: measured 5 exits in 1,152 tokens, and none on the word salad)
    host = open_bundle(bundle, threads=cfg.threads, exit_gate=False, bounded_drafts=False,
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
