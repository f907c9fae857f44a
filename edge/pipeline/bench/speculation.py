"""System (e) of the decode benchmark: the engine's lossless self-speculative decoding (mode ``exact``).

What the benchmark reads from it besides its speed (:mod:`edge.pipeline.bench.decode` runs it):
  * mismatches: (e) must emit exactly the tokens of full-depth greedy decoding, so every run of it is
    compared token by token with the full-depth engine (c) on the same prompts;
  * the engine's round counts (``Engine.spec_stats``), pooled over runs: acceptance rate, mean
    accepted length, tokens per round;
  * a sweep at batch 1: the calibrated draft-length rule against fixed draft lengths and top-1
    thresholds (Kangaroo, Liu et al. 2024), and every decision exit as the draft exit. Each variant's
    run sits next to a run of (c) on the same prompts, so its speedup is paired repeat by repeat.
"""
from __future__ import annotations

import time

from dataclasses import replace
from typing import Any, Callable, Protocol

import numpy as np

from edge.runtime.speculative import Source, SpecConfig, SpecStats, StopRule

from edge.runtime.batch import RunResult


class Systems(Protocol):
    """What the sweep needs of the decode benchmark's systems (edge.pipeline.bench.decode_systems.Systems)."""

    def run(self, name: str, prompts: list[list[int]], n: int, group: int | None = None,
            spec: SpecConfig | None = None) -> RunResult: ...

FIXED_LENGTHS = (1, 2, 3, 4)  # draft tokens per round, rule ``fixed``
TOP1_THRESHOLDS = (0.3, 0.5, 0.7, 0.9)  # top-1 probability to keep drafting, rule ``top1``
COUNTS = ("rounds", "drafted", "accepted", "emitted", "draft_steps")


def stop_rule_variants(base: SpecConfig) -> dict[str, SpecConfig]:
    """The stop rules compared at ``base``'s draft exit: calibrated, fixed k, top-1 thresholds."""
    return {"calibrated": replace(base, stop=StopRule.CALIBRATED),
            **{f"fixed_{k}": replace(base, stop=StopRule.FIXED, fixed=k) for k in FIXED_LENGTHS
               if k <= base.max_draft},
            **{f"top1_{t}": replace(base, stop=StopRule.TOP1, top1=t) for t in TOP1_THRESHOLDS}}


def draft_exit_variants(base: SpecConfig, decision_exits: list[int]) -> dict[str, SpecConfig]:
    """The calibrated rule drafting from each decision exit (keyed by the exit layer)."""
    return {str(layer): replace(base, draft_exit=layer, stop=StopRule.CALIBRATED) for layer in decision_exits}


def token_mismatches(a: list[list[int]], b: list[list[int]]) -> tuple[int, int]:
    """(differing tokens, tokens compared) of two systems' outputs [B][N] on the same prompts.

    A position one sequence has and the other lacks counts as differing (and as compared): a lossless
    system emits as many tokens as the reference.
    """
    if len(a) != len(b):
        raise ValueError(f"outputs of {len(a)} and {len(b)} sequences compared")
    bad = total = 0
    for x, y in zip(a, b):
        n = max(len(x), len(y))
        bad += sum(p != q for p, q in zip(x, y)) + n - min(len(x), len(y))
        total += n
    return bad, total


def divergences(backend, prompts: list[list[int]], exact: list[list[int]], reference: list[list[int]]
                ) -> list[dict[str, Any]]:
    """Where mode exact's greedy output first differs from the reference's (mode full on the same
    backend, the same graph one row a call), per sequence that differs: the output index and the full
    model's top-2 logit gap there, read by one prefill call of the prompt and the common output
    (a lossless decoder can differ only where the two paths' rounding decides a near-tie)."""
    from edge.runtime.cache import KVCache

    out = []
    for i, (p, x, y) in enumerate(zip(prompts, exact, reference)):
        j = next((j for j, (a, b) in enumerate(zip(x, y)) if a != b), None)
        if j is None:
            continue
        ids = list(p) + list(y[:j])
        backend.attach(KVCache(backend.num_layers, backend.num_kv_heads, backend.head_dim, 1, len(ids) + 1))
        logits = backend.full(np.array([ids], np.int64), np.array([0]), np.array([0])).logits[0]
        top = np.sort(logits)[-2:]
        out.append({"sequence": i, "index": j, "exact": int(x[j]), "full": int(y[j]),
                    "top2_gap": float(top[1] - top[0])})
    return out


def verify_cost_ratios(backend, past: int, rows=(1, 2, 4, 8), repeats: int = 30, batch: int = 1) -> dict[str, float]:
    """rho(k): the median time of a call of the graph of every layer carrying k new tokens of each of
    ``batch`` sequences, over the median of a call carrying 1 (a plain step), the shapes called in
    turn. Above batch 1 the k > 1 calls are the backend's ``verify`` (a batch size it has a verify
    graph for: ONNX Runtime's CPU attention takes several new rows with a past only sequence by
    sequence), the k = 1 call its graph of every layer, as the engine runs them."""
    from edge.runtime.cache import KVCache

    backend.attach(KVCache(backend.num_layers, backend.num_kv_heads, backend.head_dim, batch, past + max(rows)))
    rng = np.random.default_rng(0)
    slots, start = np.arange(batch), np.full(batch, past)
    times: dict[int, list[float]] = {k: [] for k in rows}
    for rep in range(repeats + 2):
        for k in rows:
            x = rng.integers(0, backend.vocab_size, (batch, k))
            t0 = time.perf_counter()
            if batch == 1 or k == 1:
                backend.full(x, slots, start, rows=k)
            else:
                backend.verify(x, slots, start)
            if rep >= 2:  # the first calls of a shape build its bindings
                times[k].append(time.perf_counter() - t0)
    one = float(np.median(times[1]))
    return {str(k): float(np.median(v)) / one for k, v in times.items()}


def pool_stats(stats: list[dict[str, Any]]) -> dict[str, float] | None:
    """Round counts of several engines (``SpecStats.as_dict()`` each) added up, and the rates recomputed
    from the sums by :class:`SpecStats` (a mean of per-engine rates would weigh a short run like a long
    one). None for none."""
    if not stats:
        return None
    pooled = SpecStats(**{k: int(sum(d[k] for d in stats)) for k in COUNTS},
                       predicted=sum(d.get("predicted_acceptance", 0.0) * d["drafted"] for d in stats))
    return pooled.as_dict()


def distinct(variants: dict[str, SpecConfig]) -> dict[str, SpecConfig]:
    """The variants with distinct settings, each under the first name that has them."""
    out: dict[str, SpecConfig] = {}
    for name, spec in variants.items():
        if spec not in out.values():
            out[name] = spec
    return out


def run_paired(run_full: Callable[[], RunResult], run_spec: Callable[[SpecConfig], RunResult],
               variants: dict[str, SpecConfig], warmup: int, repeats: int,
               tick: Callable[[str], None] = lambda _: None) -> dict[str, tuple[list[RunResult], list[RunResult]]]:
    """Run every variant next to its own run of (c): per repeat, the variants in rotated order, each
    right after (odd repeats: before) a run of (c), so the two share the machine's state.

    Variants with equal settings run once (their names share the runs). Returns, per variant name,
    (the runs of (c), the variant's runs) of the measured repeats, paired by index.
    """
    unique = distinct(variants)
    names = list(unique)
    runs: dict[str, tuple[list[RunResult], list[RunResult]]] = {s: ([], []) for s in names}
    for rep in range(warmup + repeats):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            tick(f"{'warm-up' if rep < warmup else 'repeat'} {rep + 1}, {name}")
            if rep % 2:
                spec = run_spec(unique[name])
                full = run_full()
            else:
                full = run_full()
                spec = run_spec(unique[name])
            if rep >= warmup:
                runs[name][0].append(full)
                runs[name][1].append(spec)
    return {name: runs[next(u for u in names if unique[u] == spec)] for name, spec in variants.items()}


def variant_row(full: list[RunResult], spec: list[RunResult]) -> dict[str, Any]:
    """A variant's paired speedup over (c) (median over repeats of (c)'s seconds / the variant's, the
    pairing of :func:`edge.pipeline.bench.decode_measure.paired_ratio`), its pooled round counts and its
    mismatches against (c)."""
    stats = pool_stats([d for r in spec for d in r.spec_stats]) or {}
    bad = [token_mismatches(s.tokens, f.tokens) for f, s in zip(full, spec)]
    return {"speedup_vs_full": float(np.median([f.seconds / s.seconds for f, s in zip(full, spec)])),
            "acceptance_rate": stats.get("acceptance_rate"), "mean_accepted_length": stats.get("mean_accepted_length"),
            "tokens_per_round": stats.get("tokens_per_round"), "rounds": stats.get("rounds"),
            "mismatches": sum(m for m, _ in bad), "tokens_compared": sum(t for _, t in bad)}


def calibrated_vs_best_other(rows: dict[str, dict[str, Any]]) -> float | None:
    """The calibrated rule's speedup over (c) / the best fixed length's or top-1 threshold's, whichever
    is higher (>= 1: the calibrated rule is at least as fast as both families tuned after the fact)."""
    cal = (rows.get("calibrated") or {}).get("speedup_vs_full")
    others = [r["speedup_vs_full"] for k, r in rows.items() if k.startswith(("fixed_", "top1_"))]
    return cal / max(others) if cal is not None and others else None


def sweep_variants(base: SpecConfig, decision_exits: list[int]) -> dict[str, SpecConfig]:
    """The sweep's variants: ``stop:<rule>`` at the draft exit of ``base``, ``exit:<layer>`` calibrated; each
    drafts from the exit only (the sweep compares the exit drafts' stop rules and draft exits)."""
    base = replace(base, sources=(Source.EXIT,))
    return {**{f"stop:{k}": v for k, v in stop_rule_variants(base).items()},
            **{f"exit:{k}": v for k, v in draft_exit_variants(base, decision_exits).items()}}


def speculative_sweep(systems: Systems, prompts: list[list[int]], n: int, warmup: int, repeats: int,
                      base: SpecConfig, decision_exits: list[int], tick: Callable[[str], None] = lambda _: None
                      ) -> tuple[dict[str, Any], dict[str, Any], list[int]]:
    """(e)'s stop rules at ``base``'s draft exit and the calibrated rule at every decision exit, at batch 1
    (the prompts one after another, as the benchmark runs batch 1), each paired with (c).

    Returns:
        (rows by stop rule, rows by draft exit, [differing tokens, tokens compared] over the runs made:
        a variant with another's settings shares its runs and is counted once).
    """
    variants = sweep_variants(base, decision_exits)
    runs = run_paired(lambda: systems.run("engine_full", prompts, n, group=1),
                      lambda spec: systems.run("engine_speculative", prompts, n, group=1, spec=spec),
                      variants, warmup, repeats, tick)
    rows = {k: variant_row(*r) for k, r in runs.items()}
    ran = [rows[k] for k in distinct(variants)]
    bad = [sum(r["mismatches"] for r in ran), sum(r["tokens_compared"] for r in ran)]
    return ({k.removeprefix("stop:"): r for k, r in rows.items() if k.startswith("stop:")},
            {k.removeprefix("exit:"): r for k, r in rows.items() if k.startswith("exit:")}, bad)
