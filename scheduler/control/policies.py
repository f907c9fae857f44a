"""Control policies: every tick the serving worker reads the engine's statistics and sets the prefill
micro-batch budget (prompt tokens per engine step) and the admission limit (sequences holding a slot).

The knob is Sarathi-Serve's token budget (Agrawal et al., OSDI 2024): a larger budget finishes
prompts sooner (TTFT) and lengthens the steps the running sequences decode in (time per output
token). Sarathi sets it once, offline, from the TPOT SLO; dynamic control is its stated future work.

- ``fixed``: a constant budget and limit (the Sarathi baseline).
- ``aimd``: additive increase, multiplicative decrease on SLA slack (Chiu & Jain, 1989; TCP's rule):
  while every running request is ahead of its SLA by a margin and prompts are waiting, grow the
  budget by a step and admit one more sequence; as soon as one falls behind, halve the budget and
  admit one fewer.

- ``maxdelay``: Triton-style dynamic batching of prefill (a queue delay and a preferred size).

The learned policy (recurrent PPO, scheduler/control/learned.py) implements the same ``act``. Every
policy's action stays within the engine's limits (:func:`within_limits`): the budget within the
backend's largest chunk (``max_chunk`` in the host's stats: a TensorRT profile's), the admission limit
within the cache slots. Defaults and grids are edge/runtime/settings.py's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

from edge.core.errors import ConfigError
from edge.runtime.settings import (MAX_RUNNING, PREFILL_BUDGET, PREFILL_BUDGETS, SLA_TPOT_MS, SLA_TTFT_MS,
                                   clamp_budget)


@dataclass(frozen=True)
class ControlObservation:
    """What a policy sees each tick (from the engine host's ``stats``: docs/serving.md)."""

    waiting: int                   # requests queued for admission
    prefill_backlog_tokens: int    # prompt tokens not yet in the cache
    running: int                   # sequences holding a slot
    free_slots: int
    prefill_budget: int            # the current knob values
    max_running: int
    max_seqs: int
    num_layers: int
    predicted_exit_layer: float    # mean predicted exit depth of the running sequences
    min_slack_ms: float | None     # the most-behind request's time to its next token's due time (None: idle)
    oldest_waiting_slack_ms: float | None = None  # the oldest queued request's time to its TTFT due time
    recent_ttft_p95_ms: float | None = None       # over the last finished requests
    recent_tpot_p95_ms: float | None = None
    arrival_rate_rps: float = 0.0                 # over the last few seconds
    sla_ttft_ms: float = SLA_TTFT_MS.default      # the newest request's SLA, for scale
    sla_tpot_ms: float = SLA_TPOT_MS.default
    max_chunk: int | None = None                  # the backend's largest chunk: no budget above it (None: no limit)


@dataclass(frozen=True)
class ControlAction:
    prefill_budget: int
    max_running: int


def within_limits(action: ControlAction, obs: ControlObservation) -> ControlAction:
    """``action`` with its budget within the backend's largest chunk and its admission limit within the
    cache slots (what the engine would clamp it to anyway: a policy's next step starts from what applies)."""
    return ControlAction(clamp_budget(action.prefill_budget, obs.max_chunk),
                         max(1, min(int(action.max_running), obs.max_seqs)))


def observation_from_stats(stats: dict[str, Any]) -> ControlObservation:
    """The observation in an engine host's ``stats`` answer.

    Raises:
        ConfigError: a key is missing (a host of another version).
    """
    try:
        return ControlObservation(
            waiting=int(stats["waiting"]), prefill_backlog_tokens=int(stats["prefill_backlog_tokens"]),
            running=int(stats["running"]), free_slots=int(stats["free_slots"]),
            prefill_budget=int(stats["prefill_budget"]), max_running=int(stats["max_running"]),
            max_seqs=int(stats["max_seqs"]), num_layers=int(stats["num_layers"]),
            predicted_exit_layer=float(stats["predicted_exit_layer"]),
            min_slack_ms=_opt(stats.get("min_slack_ms")),
            oldest_waiting_slack_ms=_opt(stats.get("oldest_waiting_slack_ms")),
            recent_ttft_p95_ms=_opt(stats.get("recent_ttft_p95_ms")),
            recent_tpot_p95_ms=_opt(stats.get("recent_tpot_p95_ms")),
            arrival_rate_rps=float(stats.get("arrival_rate_rps") or 0.0),
            sla_ttft_ms=float(stats["sla_ttft_ms"]), sla_tpot_ms=float(stats["sla_tpot_ms"]),
            max_chunk=None if stats["max_chunk"] is None else int(stats["max_chunk"]))
    except KeyError as exc:
        raise ConfigError(f"engine stats lack {exc.args[0]!r}: the Triton model and the front end are of "
                          "different versions") from None


def _opt(v: Any) -> float | None:
    return None if v is None else float(v)


class Policy(Protocol):
    name: str

    def act(self, obs: ControlObservation) -> ControlAction: ...


@dataclass
class FixedBudget:
    """A constant prefill budget and admission limit (Sarathi-Serve's offline choice), within the
    engine's limits."""

    prefill_budget: int = PREFILL_BUDGET.default
    max_running: int = MAX_RUNNING.default
    name: str = "fixed"

    def __post_init__(self) -> None:
        PREFILL_BUDGET.check(self.prefill_budget, "fixed")
        MAX_RUNNING.check(self.max_running, "fixed")

    def act(self, obs: ControlObservation) -> ControlAction:
        return within_limits(ControlAction(self.prefill_budget, self.max_running), obs)


@dataclass
class AIMD:
    """Additive increase / multiplicative decrease of the budget and the limit on SLA slack."""

    step_tokens: int = 32          # additive increase of the budget per comfortable tick
    decrease: float = 0.5          # multiplicative decrease when a request is behind its SLA
    margin_ms: float = 20.0        # slack above which the engine counts as comfortable
    min_budget: int = PREFILL_BUDGETS[0]
    max_budget: int = PREFILL_BUDGETS[-1]  # and never above the backend's largest chunk
    min_running: int = 1
    name: str = "aimd"

    def __post_init__(self) -> None:
        if not 0 < self.decrease < 1:
            raise ConfigError(f"aimd.decrease must be in (0, 1), got {self.decrease}")
        if self.step_tokens < 1 or not 1 <= self.min_budget <= self.max_budget or self.min_running < 1:
            raise ConfigError("aimd: step_tokens >= 1, 1 <= min_budget <= max_budget and min_running >= 1")

    def act(self, obs: ControlObservation) -> ControlAction:
        budget, limit = obs.prefill_budget, obs.max_running
        if obs.min_slack_ms is not None and obs.min_slack_ms < 0:
            budget = max(self.min_budget, int(math.floor(budget * self.decrease)))
            limit = max(self.min_running, limit - 1)
        elif obs.waiting > 0 or obs.prefill_backlog_tokens > 0:
            if obs.min_slack_ms is None or obs.min_slack_ms > self.margin_ms:
                budget = min(self.max_budget, budget + self.step_tokens)
                limit = min(obs.max_seqs, limit + 1)
        return within_limits(ControlAction(budget, limit), obs)


@dataclass
class MaxDelay:
    """Triton-style dynamic batching (``max_queue_delay_microseconds``, ``preferred_batch_size``)
    applied to prefill: while the queued prompt tokens are fewer than ``preferred_tokens`` and the
    oldest queued request has waited less than ``max_delay_ms``, prefill trickles at ``min_budget``
    (the decode batch keeps its pace); once either holds, the whole backlog goes at ``max_budget``."""

    max_delay_ms: float = 100.0
    preferred_tokens: int = 256
    min_budget: int = PREFILL_BUDGETS[0]
    max_budget: int = PREFILL_BUDGETS[-1]  # and never above the backend's largest chunk
    max_running: int = MAX_RUNNING.default
    name: str = "maxdelay"

    def __post_init__(self) -> None:
        if self.max_delay_ms < 0 or self.preferred_tokens < 1 or not 1 <= self.min_budget <= self.max_budget:
            raise ConfigError("maxdelay: max_delay_ms >= 0, preferred_tokens >= 1, 1 <= min_budget <= max_budget")
        if self.max_running < 1:
            raise ConfigError("maxdelay: max_running must be >= 1")

    def act(self, obs: ControlObservation) -> ControlAction:
        waited_ms = (None if obs.oldest_waiting_slack_ms is None
                     else obs.sla_ttft_ms - obs.oldest_waiting_slack_ms)  # slack = due - now, due = arrival + ttft
        release = (obs.prefill_backlog_tokens >= self.preferred_tokens
                   or (waited_ms is not None and waited_ms >= self.max_delay_ms))
        return within_limits(ControlAction(self.max_budget if release else self.min_budget, self.max_running), obs)
