"""What a request got, sent to a server or simulated, and a run's SLA numbers.

:class:`RequestResult` is one request as its client saw it; the load-test drivers
(:mod:`scheduler.loadtest.loadgen`) and the simulator (:mod:`scheduler.control.sim`) both produce them, so
:func:`summarize` gives served and simulated runs one definition of attainment, goodput and percentiles.

Definitions (per run):
* duration: first submit to last response, seconds;
* SLA met: the request succeeded, its TTFT is within ``sla_ttft_ms`` and (more than one token) its
  mean time per later token, (e2e - ttft) / (n - 1), within ``sla_tpot_ms`` (:func:`edge.core.stats.sla_met`);
* sla_attainment: requests meeting the SLA / all requests sent (errors count as misses);
* goodput_rps: requests meeting the SLA per second of the run (DistServe's goodput, Zhong et al., OSDI
  2024);
* tokens_per_s: generated tokens of successful requests per second of the run.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from edge.core.stats import percentiles, sla_met

# finish reasons that end a request normally; the engine's others (cancelled, deadline) are errors
NORMAL_FINISH = ("length", "stop")



@dataclass
class RequestResult:
    """One request as the client saw it. Times are seconds after the run started (the driver's t0)."""
    request_id: str
    arrival_s: float                     # when it was scheduled
    prompt_tokens: int
    max_tokens: int
    t_submit: float | None = None        # when it was sent
    t_first_token: float | None = None   # when the first generated token arrived
    t_end: float | None = None           # when the last response (or the error) arrived
    tokens: int = 0                      # generated tokens (the server's usage count where it sends one)
    token_times: list[float] = field(default_factory=list)  # arrival time of each token received
    exit_layers: list[int] = field(default_factory=list)    # the layer each token left at, where reported
    finish_reason: str | None = None
    http_status: int | None = None       # None in process
    error_kind: str | None = None        # None = success; e.g. http_429, http_503, overloaded, timeout
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error_kind is None and self.t_end is not None

    @property
    def ttft_s(self) -> float | None:
        if self.t_first_token is None or self.t_submit is None:
            return None
        return self.t_first_token - self.t_submit

    @property
    def e2e_s(self) -> float | None:
        if self.t_end is None or self.t_submit is None:
            return None
        return self.t_end - self.t_submit

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first: (e2e - ttft) / (n - 1); None for n <= 1."""
        if not self.ok or self.tokens <= 1 or self.ttft_s is None:
            return None
        return (self.e2e_s - self.ttft_s) / (self.tokens - 1)

    def sla_met(self, ttft_ms: float, tpot_ms: float) -> bool:
        """Succeeded, first token within ``ttft_ms``, and (n > 1) mean later-token time within ``tpot_ms``."""
        if not self.ok or self.ttft_s is None:
            return False
        return sla_met(self.ttft_s, self.tpot_s, ttft_ms / 1e3, tpot_ms / 1e3)

    def _shift(self, t0: float) -> None:
        for name in ("t_submit", "t_first_token", "t_end"):
            v = getattr(self, name)
            if v is not None:
                setattr(self, name, v - t0)
        self.token_times = [t - t0 for t in self.token_times]


def run_duration(results: Sequence[RequestResult]) -> float:
    starts = [r.t_submit for r in results if r.t_submit is not None]
    ends = [r.t_end for r in results if r.t_end is not None]
    return max(ends) - min(starts) if starts and ends else 0.0


def summarize(results: Sequence[RequestResult], sla_ttft_ms: float, sla_tpot_ms: float) -> dict[str, Any]:
    """One run's numbers (definitions in the module docstring); latencies in ms."""
    ok = [r for r in results if r.ok]
    duration = run_duration(results)
    met = sum(r.sla_met(sla_ttft_ms, sla_tpot_ms) for r in results)
    tokens = sum(r.tokens for r in ok)
    ms = lambda xs: [x * 1e3 for x in xs if x is not None]  # noqa: E731
    out: dict[str, Any] = {
        "requests": len(results),
        "completed": len(ok),
        "errors": sum(not r.ok for r in results),
        "errors_by_kind": dict(sorted(Counter(r.error_kind or "unfinished" for r in results if not r.ok).items())),
        "duration_s": duration,
        "tokens": tokens,
        "tokens_per_s": tokens / duration if duration > 0 else 0.0,
        "sla": {"ttft_ms": sla_ttft_ms, "tpot_ms": sla_tpot_ms},
        "sla_met": met,
        "sla_attainment": met / len(results) if results else 0.0,
        "goodput_rps": met / duration if duration > 0 else 0.0,
        "offered_rps": _offered_rps(results),
    }
    for name, vals in (("ttft", ms(r.ttft_s for r in ok)), ("tpot", ms(r.tpot_s for r in ok)),
                       ("e2e", ms(r.e2e_s for r in ok))):
        for k, v in percentiles(vals).items():
            out[f"{name}_{k}_ms"] = v
        out[f"{name}_mean_ms"] = float(np.mean(vals)) if vals else None
    # how late the client fired requests (an overloaded client would understate the server's queue)
    lag = ms(r.t_submit - r.arrival_s for r in results if r.t_submit is not None)
    out["send_lag_p99_ms"] = percentiles(lag, (99,))["p99"]
    layers = [layer for r in ok for layer in r.exit_layers]
    out["mean_exit_layer"] = float(np.mean(layers)) if layers else None
    return out


def _offered_rps(results: Sequence[RequestResult]) -> float:
    arr = sorted(r.arrival_s for r in results)
    return (len(arr) - 1) / (arr[-1] - arr[0]) if len(arr) > 1 and arr[-1] > arr[0] else 0.0
