"""``smartexit profile``'s settings (:class:`ProfileConfig`) and its scenarios: one operating point of the
engine (:class:`Scenario`: prefill budget, decode batch, prompt lengths, exit mix), the scenarios generated
from a seed, and a list checked against what the bundle can run."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from edge.core.errors import ConfigError
from edge.runtime.settings import PREFILL_BUDGET, PREFILL_BUDGETS

BATCHES = (1, 2, 3, 4, 6, 8, 12, 16)
FULL_SHARES = (0.0, 0.5, 1.0)
PROMPT_RANGES = ((8, 64), (16, 384), (128, 448))  # short, mixed, long


@dataclass
class Scenario:
    """One operating point: prefill budget, decode batch (admission limit), prompt lengths, exit mix."""
    prefill_budget: int = PREFILL_BUDGET.default
    batch: int = 8
    prompt_min: int = 16
    prompt_max: int = 256
    full_share: float = 0.0  # share of requests in mode full; the rest bounded
    max_tokens_min: int = 8
    max_tokens_max: int = 64

    def __post_init__(self) -> None:
        bad = [k for k in ("prefill_budget", "batch", "prompt_min", "max_tokens_min") if getattr(self, k) < 1]
        if bad:
            raise ConfigError(f"profile scenario: {', '.join(bad)} must be >= 1")
        if self.prompt_max < self.prompt_min or self.max_tokens_max < self.max_tokens_min:
            raise ConfigError("profile scenario: prompt_max >= prompt_min and max_tokens_max >= max_tokens_min "
                              "are required")
        if not 0.0 <= self.full_share <= 1.0:
            raise ConfigError(f"profile scenario: full_share must be in [0, 1], got {self.full_share}")


@dataclass
class ProfileConfig:
    run_dir: str = "artifacts/demo"
    bundle: str | None = None  # None: <run_dir>/triton/smartexit/1/bundle (`smartexit repo`)
    threads: int | None = None  # ONNX Runtime threads; None: the bundle's, as served
    # 24 x 50 steps: ~35 s on 2 cores at 1 thread (steps of 1 to 200 ms); the held-out error is the
    # VM's drift more than the sample size (0.13-0.26 at the median with 100 steps a scenario, 0.09 with 60)
    scenarios: int = 24  # generated from seed; ignored when scenario_list is given
    steps_per_scenario: int = 30  # steps recorded per scenario (30 for the demo's time; more fit better)
    scenario_list: list[Scenario] = field(default_factory=list)
    seed: int = 0
    warmup_steps: int = 10  # unrecorded steps first (ONNX Runtime's first calls allocate)
    trace_steps: int = 400  # last, bounded requests at a batch that may exit: exit traces only, not fitted
    holdout: float = 0.25  # share of scenarios held out to score the fit
    budgets: list[int] = field(default_factory=lambda: list(PREFILL_BUDGETS))
    max_output: int = 64  # generated scenarios: output tokens per request, max_output / 8 .. max_output
    # the serving path (scheduler/loadtest/serving_path.py): start the stack once, one open-loop Poisson run
    # (seed 7 + seed + i) per load (~1 min in all); false: the engine alone (the simulator adds nothing)
    serving: bool = True
    # the runs' rates, as shares of the rate the engine alone holds the SLA at (simulated): light and moderate,
    # below the knee (past it, two runs of one schedule differ by 2x: nothing to fit; on 2 cores the stack held
    # the SLA to ~0.45 of it in 2026-11, and beyond 0.6 with the engine of 2026-12-05)
    # [budget, load] per run, on one stack (the budget switched between runs): the budget the shipped policy
    # holds (its behaviour-cloned fixed budget, 512) light, and 128 (the evaluation's usual best fixed budget at
    # the edge) moderate (and, placed by the fit, heavy: serving_edge_run). A run at budget 64 was tried (2026-11-30): budget-64 steps had run 10% slower
    # than a 512-only fit predicts, but with them in the fit the per-chunk cost went to 3.3 ms, the
    # simulator then ranked budget 64 far above 512 (the real stack did not) and its validation error
    # grew from 0.22-0.28 to 0.43 (docs/scheduler.md)
    # Two light runs instead ([0.1, 0.2], tried 2026-12-03 on an Intel 2-core VM, before the step model had its
    # per-arrival term) fit the light-load steps well but put the simulator's SLA edge at 5.8 req/s where the
    # real stack collapsed at 4.6: the heavier run is what shows the front end's CPU load under traffic.
    # Both runs at 512 until 2026-12-05: the simulator then priced budget-128 runs (the evaluation's best fixed
    # budget at the edge) with time per output token p50 6.2-6.4 ms where the served runs measured 3.2-4.9, in
    # three fresh-clone demos (the overheads fitted at 512 carried a bias of the 128-token prefill steps); with
    # one run at each, on a demo's artifacts: 4.3 ms against 3.8-5.4 served (docs/scheduler.md). A third, heavier
    # run at 128 (0.6: 15.4 req/s, TTFT p50 68 ms, still within the SLA on this engine): without it the simulator
    # reached its knee before the stack (at 13.1 req/s TPOT p50 7.7 ms simulated against 3.0-3.3 served), with it
    # 3.7 against 3.9-4.2 at 13.3 req/s (the same demo's artifacts, 2026-12-05). But 0.6 of the engine alone's
    # capacity is past the stack's knee on some starts (the next fresh-clone demo: 14.5 req/s, TTFT p95 594 ms):
    # the heavy run is now placed by the serving path fitted on these two (serving_edge_run)
    serving_runs: list[list[float]] = field(default_factory=lambda: [[512, 0.2], [128, 0.4]])
    # [budget, share]: a last run at share x the rate the simulator, with the serving path fitted on serving_runs,
    # holds the SLA at with that budget: near the SLA edge where bench scheduler validates the simulator (at 0.8 of
    # its edge), measured on this stack's start; null: none
    serving_edge_run: list[float] | None = field(default_factory=lambda: [128, 0.8])
    # seconds of each open-loop run: 12 (10 in stop 56, for the demo's time). The simulator's error at 0.8x the edge
    # (bench scheduler; mean over its four cells) was 0.17-0.29 in six fresh-clone demos with 10-s runs and 0.065-0.10
    # in three runs with 12-s ones, two of them profiles of one demo's artifacts (docs/scheduler.md)
    serving_duration_s: float = 12.0
    # served first and not measured: a served engine measures per batch size whether drafting pays, its calls'
    # costs and its drafts' acceptance as it runs (a fresh stack's first 144 requests measured 0.47-0.56 of
    # decoding sequences' steps as draft rounds, the next 288 0.67-0.73, 2026-12-05; in process at batch 1, where
    # no gate decides, a fresh engine was 7% slower per token than a warm one), and bench scheduler serves a warm one
    serving_warmup_requests: int = 192
    # stacks the serving runs are served on, each started and warmed afresh, all fitted together: two starts of one
    # stack differed by more than prefill budgets 16-128 did (at 9.6 req/s and budget 32: TTFT p50 116 ms on the
    # profile's start, 41 on the validation's; docs/scheduler.md, stop 53); each start adds ~1.5 minutes
    serving_starts: int = 2

    def __post_init__(self) -> None:
        self.scenario_list = [Scenario(**s) if isinstance(s, dict) else s for s in self.scenario_list]
        if self.scenarios < 1 or self.steps_per_scenario < 1 or self.max_output < 1:
            raise ConfigError("profile: scenarios, steps_per_scenario and max_output must be >= 1")
        if self.warmup_steps < 0 or self.trace_steps < 0:
            raise ConfigError(f"profile: warmup_steps and trace_steps must be >= 0, got {self.warmup_steps} and "
                              f"{self.trace_steps}")
        if not 0.0 < self.holdout < 1.0:
            raise ConfigError(f"profile: holdout must be in (0, 1), got {self.holdout}")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"profile: threads must be >= 1 or None, got {self.threads}")
        if not self.budgets or any(b < 1 for b in self.budgets):
            raise ConfigError(f"profile: budgets must be a non-empty list of values >= 1, got {self.budgets}")
        if self.serving:
            try:
                self.serving_runs = [(int(b), float(f)) for b, f in self.serving_runs]
            except (TypeError, ValueError):
                raise ConfigError(f"profile: serving_runs must be [budget, load] pairs, got {self.serving_runs!r}") \
                    from None
            if self.serving_edge_run is not None:
                try:
                    b, f = int(self.serving_edge_run[0]), float(self.serving_edge_run[1])
                    ok = len(self.serving_edge_run) == 2 and b >= 1 and 0 < f <= 2
                except (TypeError, ValueError, IndexError):
                    ok = False
                if not ok:
                    raise ConfigError(f"profile: serving_edge_run must be [budget >= 1, share in (0, 2]] or null, "
                                      f"got {self.serving_edge_run!r}")
                self.serving_edge_run = (b, f)
            if not self.serving_runs or any(b < 1 or not 0 < f <= 2 for b, f in self.serving_runs) \
                    or self.serving_duration_s <= 0 or self.serving_warmup_requests < 0 or self.serving_starts < 1:
                raise ConfigError(f"profile: serving_runs must be non-empty [budget >= 1, load in (0, 2]] pairs "
                                  f"(load: a share of the engine's capacity), serving_duration_s > 0 and "
                                  f"serving_warmup_requests >= 0, serving_starts >= 1; got {self.serving_runs}, "
                                  f"{self.serving_duration_s}, {self.serving_warmup_requests}, {self.serving_starts}")


# --------------------------------------------------------------------------- scenarios

def generate_scenarios(n: int, seed: int, max_seqs: int, max_len: int, budgets: Sequence[int],
                       max_output: int) -> list[Scenario]:
    """``n`` scenarios, each factor cycling through its levels in its own shuffled order (a Latin-hypercube
    style design: every level appears about equally often, and levels are not paired the same way twice).
    Batches are capped at ``max_seqs``, prompts and outputs fit ``max_len``."""
    rng = np.random.default_rng(seed)
    batches = sorted({min(b, max_seqs) for b in BATCHES})

    def levels(values: Sequence[Any]) -> list[Any]:
        out: list[Any] = []
        while len(out) < n:
            out += [values[i] for i in rng.permutation(len(values))]
        return out[:n]

    b, k, f, p = levels(list(budgets)), levels(batches), levels(FULL_SHARES), levels(PROMPT_RANGES)
    out = max(1, min(max_output, max_len // 2))
    lo = max(1, out // 8)
    cap = max_len - lo
    return [Scenario(int(b[i]), int(k[i]), min(p[i][0], cap), min(p[i][1], cap), float(f[i]), lo, out)
            for i in range(n)]


def check_scenarios(scenarios: Sequence[Scenario], max_seqs: int, max_len: int) -> None:
    """Raises ConfigError for a scenario the engine cannot run (batch over the cache slots, requests over
    the context window)."""
    for i, s in enumerate(scenarios):
        if s.batch > max_seqs:
            raise ConfigError(f"profile: scenario_list[{i}].batch {s.batch} exceeds the bundle's {max_seqs} slots")
        if s.prompt_min + s.max_tokens_min > max_len:
            raise ConfigError(f"profile: scenario_list[{i}]: prompt_min + max_tokens_min exceeds the context "
                              f"window of {max_len} tokens")
