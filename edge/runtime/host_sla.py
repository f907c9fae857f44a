"""The host's SLA arithmetic, pure: a request's predicted exit depth (an EMA of its exit layers), its
slack against its token schedule (token i due at arrival + TTFT + i x TPOT), the tokens handed over
late, a finished request's TTFT and TPOT, and when an overloaded queue will have room
(:class:`edge.runtime.host.EngineHost` keeps the state; docs/serving.md has the ``stats`` keys).
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from edge.core.stats import due_time, on_time
from edge.runtime.host_types import LiveRequest

EMA = 0.3  # weight of the newest exit layer in a request's predicted exit depth


def predict_exit_layer(predicted: float | None, exit_layer: int) -> float:
    """A request's predicted exit depth after a token that exited at ``exit_layer`` (None: its first)."""
    return exit_layer if predicted is None else EMA * exit_layer + (1 - EMA) * predicted


def slack_ms(live: LiveRequest, now: float) -> float:
    """Milliseconds until ``live``'s next token is due (negative: it is late)."""
    return (due_time(live.arrival, live.sla_ttft_s, live.sla_tpot_s, live.n_tokens) - now) * 1e3


def late_tokens(live: LiveRequest, n: int, now: float) -> int:
    """How many of ``live``'s last ``n`` tokens, handed over at ``now``, are past their due time."""
    return sum(not on_time(now, live.arrival, live.sla_ttft_s, live.sla_tpot_s, i)
               for i in range(live.n_tokens - n, live.n_tokens))


def ttft_tpot(arrival: float, first: float, now: float, n_tokens: int) -> tuple[float, float | None]:
    """A request that arrived at ``arrival``, had its first token handed over at ``first`` and finished at
    ``now`` with ``n_tokens``: its time to first token and mean time per output token after the first
    (None for a single token)."""
    ttft = first - arrival
    tpot = (now - first) / (n_tokens - 1) if n_tokens > 1 else None
    return ttft, tpot


def finish_rate(times: Sequence[float]) -> float:
    """Requests finished per second over ``times``, the recent finishing times in order."""
    if len(times) < 2 or times[-1] <= times[0]:
        return 0.0
    return (len(times) - 1) / (times[-1] - times[0])


def retry_after(waiting: int, rate: float) -> float:
    """Seconds until the queue has room, from its length and the engine's recent rate of finishing."""
    return float(max(1.0, min(60.0, np.ceil(waiting / rate)))) if rate > 0 else 1.0


def outlook(lives: Iterable[LiveRequest], recent_exit_layers: dict[int, list[int]], now: float,
            expected_exit_layer: float | None, num_layers: int) -> dict[str, Any]:
    """The live requests as a scheduler reads them: each one's tokens, recent and predicted exit depth and
    slack; the mean recent and predicted exit depth (before any token: ``expected_exit_layer``, the threshold
    table's mean, else full depth), the least slack, and the slack of the oldest TTFT deadline among those
    without a token yet."""
    fallback_pred = expected_exit_layer if expected_exit_layer is not None else float(num_layers)
    reqs, slacks, preds, recent = [], [], [], []
    lives = list(lives)
    for live in lives:
        slack = slack_ms(live, now)
        slacks.append(slack)
        layers = recent_exit_layers.get(live.engine_id, [])
        recent += layers
        if live.predicted is not None:
            preds.append(live.predicted)
        reqs.append({"id": live.req.request_id, "tokens": live.n_tokens, "recent_exit_layers": layers,
                     "predicted_exit_layer": live.predicted, "slack_ms": slack})
    oldest = min((v.arrival + v.sla_ttft_s for v in lives if v.n_tokens == 0), default=None)
    return {
        "requests": reqs,
        "mean_recent_exit_layer": float(np.mean(recent)) if recent else None,
        "predicted_exit_layer": float(np.mean(preds)) if preds else fallback_pred,
        "min_slack_ms": min(slacks) if slacks else None,
        "oldest_waiting_slack_ms": None if oldest is None else (oldest - now) * 1e3,
    }
