"""Where self-speculative decoding's time goes, and its ceiling on this machine, from measured costs.

Two measurements, then arithmetic:

1. a trace along the full model's greedy path: at every decode position, whether the draft exit's
   token is the full model's (``agree``), the calibrated agreement the threshold table gives it
   (``p``) and the draft's top-1 probability;
2. the costs, timed on the backends of the benchmark: a draft step (the segments up to the draft
   exit and the LM head), the same step without the head (the last row of a round at the hard
   maximum), a verification of m rows (the remaining segments, the head on every row), and one
   full-depth step of the baseline engine (c).

A stop rule then fixes every round from the trace (a draft is accepted exactly when it agrees; a
round ends at the first rejection, the next starts after the full model's token), so its throughput
against (c) follows from the costs. That is each rule with the engine's bookkeeping taken out, and,
with the oracle rule (it drafts exactly the tokens that will be accepted), the ceiling of
self-speculation from this draft exit on this machine: a goal above it needs a better draft (more
agreement) or cheaper draft steps, not a better stop rule. ``perfect_draft`` is the ceiling if every
draft agreed (rounds at the hard maximum).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from calibration.signals import signals_from_stats
from calibration.table import TableRule
from edge.core.errors import ConfigError
from edge.runtime.backend import Backend
from edge.runtime.cache import KVCache
from edge.runtime.engine import Engine
from edge.runtime.engine_config import EngineConfig
from edge.runtime.request import Mode, Request
from edge.pipeline.bench.speculation import stop_rule_variants
from edge.runtime.spec_costs import DraftCosts
from edge.runtime.spec_length import include_next
from edge.runtime.speculative import SpecConfig, StopRule


@dataclass
class AgreementTrace:
    agree: np.ndarray  # [N] bool: the draft exit's greedy token is the full model's
    p: np.ndarray  # [N] calibrated agreement
    top1: np.ndarray  # [N] the draft's top-1 probability
    lengths: list[int]  # positions per prompt (the trace is their concatenation)


class _Recorder:
    """An exit rule that never exits and records the draft exit's decision inputs (batch 1)."""

    def __init__(self, layer: int, num_exits: int) -> None:
        self.layer, self.m = layer, num_exits
        self.rows: list[tuple[np.ndarray, int]] = []

    def decide(self, layer, stats, tokens, hidden):
        if layer == self.layer:
            self.rows.append((signals_from_stats(stats, tokens, hidden, num_exits=self.m)[0], int(tokens[layer][0])))
        return np.zeros(tokens[layer].shape[0], bool)


def agreement_trace(backend: Backend, rule: TableRule, prompts: list[list[int]], n: int, draft_exit: int
                    ) -> AgreementTrace:
    """Greedy full-depth decoding of each prompt on ``backend`` (the exits export), recording at every
    position what the draft exit would have drafted."""
    if backend.spec.candidates:
        raise ConfigError("speculation ceiling: a model with a candidate shortlist decides in its graphs; the "
                          "trace records host-side decision inputs, which it has not")
    agree, feats, lengths = [], [], []
    for prompt in prompts:
        rec = _Recorder(draft_exit, len(backend.exit_layers))
        engine = Engine(backend, EngineConfig(max_seqs=1, max_running=1, max_len=len(prompt) + n,
                                              prefill_budget=len(prompt)), rec)
        engine.submit(Request(prompt, n, mode=Mode.BOUNDED))  # the recorder never lets a token exit
        tokens = [e.token for e in _drain(engine)]
        # decode step i drafts the token after output token i (the first output token comes from the prefill)
        agree += [t == full for (_, t), full in zip(rec.rows, tokens[1:])]
        feats += [f for f, _ in rec.rows[:len(tokens) - 1]]
        lengths.append(min(len(rec.rows), len(tokens) - 1))
    f = np.array(feats, np.float32)
    return AgreementTrace(np.array(agree, bool), rule.agreement(draft_exit, f), f[:, 0].astype(np.float64), lengths)


def _drain(engine: Engine):
    while engine.has_work:
        yield from engine.step()


@dataclass
class SpecCosts:
    """Milliseconds, batch 1, medians over interleaved repeats."""

    draft_step: float  # segments up to the draft exit + the LM head
    draft_step_no_head: float
    verify: dict[int, float]  # rows -> the remaining segments, the head on every row
    full_step: float  # the baseline engine's full-depth step (c)

    def to_dict(self) -> dict:
        return {"draft_step_ms": self.draft_step, "draft_step_no_head_ms": self.draft_step_no_head,
                "verify_ms_by_rows": {str(k): v for k, v in self.verify.items()}, "full_step_ms": self.full_step}


def measure_costs(backend: Backend, full: Backend, draft_exit: int, max_rows: int, past: int = 96,
                  calls: int = 30, repeats: int = 5) -> SpecCosts:
    """Time the calls a round is made of, on caches of their own (``past`` tokens cached)."""
    d = backend.exit_layers.index(draft_exit)
    nseg = len(backend.segments)
    for b in (backend, full):
        b.attach(KVCache(b.num_layers, b.num_kv_heads, b.head_dim, 1, past + max_rows + 1))
    slot, start = np.array([0]), np.array([past])
    ids = np.array([[1]], np.int64)
    rng = np.random.default_rng(0)
    rows_in = {m: rng.standard_normal((1, m, backend.spec.hidden_size)).astype(np.float32)
               for m in range(1, max_rows + 1)}

    def draft(decide: bool) -> Callable[[], None]:
        def run() -> None:
            x = ids
            for i in range(d + 1):
                x = backend.segment(i, x, slot, start, decide=decide, draft=True).hidden
        return run

    def verify(m: int) -> Callable[[], None]:
        def run() -> None:
            x = rows_in[m]
            for i in range(d + 1, nseg):
                x = backend.segment(i, x, slot, start, decide=False, rows=m if i == nseg - 1 else 1).hidden
        return run

    def full_step() -> None:
        x = ids
        for i in range(len(full.segments)):
            x = full.segment(i, x, slot, start).hidden

    probes = {"draft": draft(True), "draft_no_head": draft(False), "full": full_step,
              **{f"verify_{m}": verify(m) for m in range(1, max_rows + 1)}}
    times: dict[str, list[float]] = {k: [] for k in probes}
    for fn in probes.values():  # warm-up: bindings are made on first use
        for _ in range(3):
            fn()
    for _ in range(repeats):
        for k, fn in probes.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            times[k].append(1e3 * (time.perf_counter() - t0) / calls)
    med = {k: float(np.median(v)) for k, v in times.items()}
    return SpecCosts(med["draft"], med["draft_no_head"], {m: med[f"verify_{m}"] for m in range(1, max_rows + 1)},
                     med["full"])


Stop = Callable[[int, list[float], float, bool], bool]  # (drafts so far, their p + the new one's, top1, agrees)


def simulate(trace: AgreementTrace, costs: SpecCosts, stop: Stop, max_draft: int) -> dict[str, float]:
    """Rounds as ``stop`` would make them on the trace; throughput against the full-depth step."""
    ms = tokens = rounds = drafted = accepted = 0.0
    off = 0
    for n in trace.lengths:
        a, p, t1 = trace.agree[off:off + n], trace.p[off:off + n], trace.top1[off:off + n]
        off += n
        t = 0
        while t < n:
            k, heads, probs = 0, 0, []
            while t + k < n and k < max_draft:
                heads += 1
                probs.append(float(p[t + k]))
                if not stop(k, probs, float(t1[t + k]), bool(a[t + k])):
                    break
                k += 1
            acc = 0
            while acc < k and a[t + acc]:
                acc += 1
            ms += heads * costs.draft_step + (k + 1 - heads) * costs.draft_step_no_head + costs.verify[k + 1]
            tokens, rounds, drafted, accepted = tokens + acc + 1, rounds + 1, drafted + k, accepted + acc
            t += acc + 1
    return {"speedup_vs_full": costs.full_step * tokens / ms, "tokens_per_round": tokens / rounds,
            "acceptance_rate": accepted / drafted if drafted else 0.0}


def stop_rules(costs: SpecCosts, spec: SpecConfig) -> dict[str, tuple[Stop, int]]:
    """The benchmark's stop-rule variants (:func:`edge.pipeline.bench.speculation.stop_rule_variants`) as
    the engine applies them (edge.runtime.spec_length.include_next) with these costs, and the oracle, each
    with the most drafts a round can have (as the engine caps them: a fixed length k never asks for a
    (k+1)-th draft, so its last step runs without the head)."""
    draft_costs = DraftCosts.fixed(costs.draft_step, costs.verify)

    def engine_rule(cfg: SpecConfig) -> tuple[Stop, int]:
        cap = cfg.fixed if cfg.stop is StopRule.FIXED else cfg.max_draft
        return (lambda k, probs, top1, agrees: include_next(cfg, k, probs, top1, draft_costs)), cap

    rules = {name: engine_rule(cfg) for name, cfg in stop_rule_variants(spec).items()}
    rules["oracle"] = (lambda k, probs, top1, agrees: agrees), spec.max_draft
    return rules


def ceiling(trace: AgreementTrace, costs: SpecCosts, spec: SpecConfig) -> dict:
    """Every rule's simulated speedup, the oracle ceiling and the perfect-draft ceiling."""
    rules = {name: simulate(trace, costs, stop, cap) for name, (stop, cap) in stop_rules(costs, spec).items()}
    k = spec.max_draft
    perfect = costs.full_step * (k + 1) / (k * costs.draft_step + costs.draft_step_no_head + costs.verify[k + 1])
    best = lambda prefix: max((v["speedup_vs_full"], n) for n, v in rules.items() if n.startswith(prefix))  # noqa: E731
    return {"costs": costs.to_dict(), "positions": int(trace.agree.size), "agreement": float(trace.agree.mean()),
            "calibrated_p_mean": float(trace.p.mean()), "rules": rules,
            "best_fixed": best("fixed_")[1], "best_top1": best("top1_")[1],
            "oracle_ceiling": rules["oracle"]["speedup_vs_full"], "perfect_draft_ceiling": perfect}
