"""``smartexit bench audit``: does the online false-exit audit catch traffic the certificate does not cover?

The engine host that Triton's model.py runs (opened from the same bundle), with the audit counting
every token (``audit.fraction`` 1; with deferral the engine judges its exits itself, and only those it
could not judge are re-decoded): first held-out code, the distribution the table was certified
on; then another domain, a word salad (the same held-out code with its tokens shuffled), on which
early exits are confidently wrong more often; then the held-out code again with the engine as the
bundle serves it (step gate and bounded drafts on). With deferral every token of a request is judged,
so each request is a unit of the per-request test (the certificate's betting test on served traffic).
Requests run one at a time (the deferred-K/V table exits only at decode batch 1), with exits as the rule
decides them in the first two runs (the step gate and bounded drafts off: where checks do not pay, as
on a 2-core CPU, the served engine leaves few exits to audit). Reported per run: audited tokens, false
exits, rate and bounds per exit and pooled, whether (and after how many audited tokens) the fallback to
full depth fired, and the per-request test.
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
    # held-out requests (windows of the test split drawn i.i.d., as calibration draws its units): enough for the
    # per-request test to be able to certify (it needs ~ln(1/delta)/epsilon requests, 333 at the demo's eps)
    prompts: int = 400
    salad_prompts: int = 48        # requests of word salad: another domain, its tokens shuffled
    # requests served under the rule with its thresholds dropped (every routed row exits at its first check),
    # certificate and epsilon kept: a rule that breaks its certificate, which the audit must catch
    broken_prompts: int = 48
    prompt_tokens: int = 64
    max_tokens: int = 32            # new tokens per request: the certificate's unit (calibrate.new_tokens)
    min_tokens: int = 100          # audited tokens before the trigger may fire
    seed: int = 0
    threads: int | None = None     # the bundle's when None
    # processes serving the traffics side by side, each with its model (audit_runs; 0: one per core on the default
    # ONNX Runtime CPU backend, one where $SMARTEXIT_BACKEND_CONFIG chooses another)
    workers: int = 0

    def __post_init__(self) -> None:
        if min(self.prompts, self.salad_prompts, self.broken_prompts, self.prompt_tokens, self.max_tokens,
               self.min_tokens) < 1 or self.workers < 0:
            raise ConfigError("bench audit: prompts, salad_prompts, broken_prompts, prompt_tokens, max_tokens and "
                              "min_tokens must be >= 1, workers >= 0 (0: one per core)")


def word_salad(prompts: list[list[int]], seed: int) -> list[list[int]]:
    """Each prompt's tokens in a random order (same tokens, no syntax): the other domain."""
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.permutation(p)] for p in prompts]


def broken(table):
    """The table with its thresholds dropped and routing off: every row checked, every check exiting (the
    certificate, and so the epsilon the audit tests, kept)."""
    from dataclasses import replace

    return replace(table, score_thresholds={k: float("-inf") for k in table.score_thresholds}, route_min_lookup=0)


@dataclass
class AuditJob:
    """One traffic of the audit (:func:`audit_run`'s arguments after the bundle and config)."""

    prompts: list[list[int]]
    tag: str
    as_served: bool = False
    rule_edit: Any = None  # a module-level function (it travels to a process), or None


def audit_runs(bundle: Path, jobs: dict[str, AuditJob], cfg: BenchAuditConfig,
               workers: int | None = None) -> dict[str, dict[str, Any]]:
    """:func:`audit_run` of every job, each on a host of its own in a process of its own, as many at once as
    ``workers`` (spawned; one at a time here when 1), the jobs in the order given (the longest first keeps the
    processes even). A host serves its requests one at a time on one engine thread (the bundle's ``threads``), so
    two hosts on two cores keep out of each other's way: the demo's four traffics took 71 s one after the other
    and 44 s side by side on the 2-core Intel VM (stop 68). Each process holds a copy of the model, so ``workers``
    None is the machine's cores on the default ONNX Runtime CPU backend and one where ``$SMARTEXIT_BACKEND_CONFIG``
    chooses another (a GPU's engines, whose memory is sized for one). Results keyed as ``jobs``."""
    import multiprocessing
    import os
    from concurrent.futures import ProcessPoolExecutor

    from edge.runtime.served import BACKEND_ENV

    if workers is None:
        workers = 1 if os.environ.get(BACKEND_ENV) else (os.cpu_count() or 1)
    n = min(len(jobs), workers)
    if n < 2:
        return {name: audit_run(bundle, j.prompts, cfg, j.tag, j.as_served, j.rule_edit) for name, j in jobs.items()}
    with ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {name: pool.submit(audit_run, bundle, j.prompts, cfg, j.tag, j.as_served, j.rule_edit)
                   for name, j in jobs.items()}
        return {name: f.result() for name, f in futures.items()}


def audit_run(bundle: Path, prompts: list[list[int]], cfg: BenchAuditConfig, tag: str,
              as_served: bool = False, rule_edit=None) -> dict[str, Any]:
    """Serve ``prompts`` one at a time on a fresh host with every token audited; the audit's estimate, and the
    per-request rates of the requests audited whole (``unit_losses``, in completion order).

    ``as_served``: the engine as the bundle serves (step gate and bounded drafts as recorded). Otherwise exits as
    the rule decides them, the gate and drafts off: as served on a CPU where checks do not pay, the gate keeps
    bounded requests at full depth and drafts take the tokens the rule would let leave, so there would be little
    to audit (measured: 5 exits in 1,152 tokens, none on the word salad)."""
    from scheduler.serving.bundle import open_bundle
    from edge.runtime.host_types import GenRequest

    rule_alone = {} if as_served else {"exit_gate": False, "bounded_drafts": False}
    host = open_bundle(bundle, threads=cfg.threads, rule_edit=rule_edit, **rule_alone,
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
    return {**st, "seconds": time.perf_counter() - t0, "unit_losses": list(host.audit.unit_losses),
            "exits_as_served": as_served}
