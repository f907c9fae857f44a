"""The serving path's own cost, measured on the real stack, for the simulator (``smartexit profile
serving=true``; ``<run>/scheduler/serving.json``).

The engine's latency model prices engine steps; between the engine and a client sit the Triton
python backend's IPC, the worker, the Ray Serve ingress and proxy, HTTP and SSE. Two numbers describe
them for the simulator (scheduler/sim.py ``SimConfig``):

- latency: requests sent one at a time; the measured TTFT and time per later token minus the
  simulator's for the same request alone (``ttft_overhead_ms``, ``token_overhead_ms``);
- throughput: a burst of ``max_seqs`` requests at once; the per-chunk service time of the serving
  path as a FIFO behind the engine (``serve_chunk_ms``), found by bisection so that the simulated
  mean time per output token of the burst equals the measured one. On a small machine the stack's
  processes share the CPU with the engine; under load that, not the engine, bounds the stack.

The calibration requests are the profile's own (cut from the held-out split): the evaluation's
workloads (scheduler/bench_scheduler.py) never enter the fit.
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from edge.core.errors import ConfigError
from scheduler.latency import LatencyModel
from scheduler.policies import FixedBudget
from scheduler.sim import ExitModel, SimConfig, simulate
from scheduler.workload import Workload

SERVING_JSON = "serving.json"


@dataclass
class ServingPath:
    ttft_overhead_ms: float = 0.0
    token_overhead_ms: float = 0.0
    serve_chunk_ms: float = 0.0
    probes: int = 0
    burst: int = 0
    measured: dict[str, float] | None = None

    def sim_fields(self) -> dict[str, float]:
        """The SimConfig fields."""
        return {"ttft_overhead_ms": self.ttft_overhead_ms, "token_overhead_ms": self.token_overhead_ms,
                "serve_chunk_ms": self.serve_chunk_ms}

    def save(self, path: str | Path) -> None:
        from edge.core.artifacts import atomic_write_json

        atomic_write_json(Path(path), asdict(self))

    @classmethod
    def load(cls, path: str | Path) -> ServingPath | None:
        """None without the file. Raises ConfigError: malformed."""
        path = Path(path)
        if not path.is_file():
            return None
        try:
            d = json.loads(path.read_text())
            return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})
        except (json.JSONDecodeError, TypeError) as exc:
            raise ConfigError(f"serving path {path}: {exc}") from None


def _workload(results: Sequence[Any], arrivals: Sequence[float]) -> Workload:
    return Workload(np.asarray(arrivals, np.float64), np.array([r.prompt_tokens for r in results], np.int64),
                    np.array([r.tokens for r in results], np.int64), "calibration")


def _sim(latency: LatencyModel, exits: ExitModel, cfg: SimConfig, w: Workload, budget: int) -> list:
    return simulate(latency, exits, cfg, w, FixedBudget(budget, cfg.max_seqs), 0.25).results()


def fit_serving_path(latency: LatencyModel, exits: ExitModel, base: SimConfig, probes: Sequence[Any],
                     burst: Sequence[Any], budget: int) -> ServingPath:
    """The three numbers from probe results (one at a time) and a burst's results (sent at once),
    both run on a stack whose policy held ``budget`` (loadgen ``RequestResult``s).

    Raises:
        ConfigError: no successful probe or burst request.
    """
    probes = [r for r in probes if r.ok and r.tokens >= 2]
    burst = [r for r in burst if r.ok and r.tokens >= 2]
    if not probes or not burst:
        raise ConfigError(f"serving path: {len(probes)} probes and {len(burst)} burst requests succeeded with "
                          ">= 2 tokens; need one of each")
    alone = _sim(latency, exits, SimConfig(**{**base.__dict__, "ttft_overhead_ms": 0.0, "token_overhead_ms": 0.0,
                                               "serve_chunk_ms": 0.0}),
                 _workload(probes, np.arange(len(probes)) * 60.0), budget)
    o_ttft = max(0.0, float(np.median([(r.ttft_s - s.ttft_s) * 1e3 for r, s in zip(probes, alone)])))
    o_tok = max(0.0, float(np.median([(r.tpot_s - s.tpot_s) * 1e3 for r, s in zip(probes, alone)])))
    measured = float(np.mean([r.tpot_s for r in burst])) * 1e3
    t0 = min(r.t_submit for r in burst)
    wb = _workload(burst, [r.t_submit - t0 for r in burst])

    def tpot(chunk_ms: float) -> float:
        # a chunk's service is part of what the probes measured one at a time: counted once
        cfg = SimConfig(**{**base.__dict__, "ttft_overhead_ms": max(0.0, o_ttft - chunk_ms),
                           "token_overhead_ms": max(0.0, o_tok - chunk_ms), "serve_chunk_ms": chunk_ms})
        return float(np.mean([s.tpot_s for s in _sim(latency, exits, cfg, wb, budget)])) * 1e3

    lo, hi = 0.0, 50.0
    if tpot(lo) >= measured:
        hi = 0.0
    else:
        for _ in range(30):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if tpot(mid) < measured else (lo, mid)
    chunk = hi
    return ServingPath(max(0.0, o_ttft - chunk), max(0.0, o_tok - chunk), chunk, len(probes), len(burst),
                       {"probe_ttft_p50_ms": float(np.median([r.ttft_s for r in probes])) * 1e3,
                        "probe_tpot_p50_ms": float(np.median([r.tpot_s for r in probes])) * 1e3,
                        "burst_tpot_mean_ms": measured, "burst_tpot_mean_sim_ms": tpot(chunk)})


def measure(run_dir: str | Path, requests: Sequence[Any], budget: int, max_seqs: int, sla: tuple[float, float],
            warmup: int = 2) -> tuple[list, list]:
    """(probe results, burst results) on a stack started for ``run_dir`` with a fixed ``budget``:
    ``requests`` one at a time, then the first ``max_seqs`` of them at once."""
    from scheduler.bench_serve import BenchServeConfig, http_run
    from scheduler.serve.config import ServeConfig
    from scheduler.serve.stack import serving_stack

    scfg = ServeConfig(policy="fixed", policy_kwargs={"prefill_budget": budget, "max_running": max_seqs},
                       default_sla_ttft_ms=sla[0], default_sla_tpot_ms=sla[1])
    bcfg = BenchServeConfig(run_dir=str(run_dir), sla_ttft_ms=sla[0], sla_tpot_ms=sla[1], warmup_requests=warmup,
                            capacity_concurrency=[1], capacity_requests=len(requests))
    burst = list(requests[:max_seqs])
    with serving_stack(run_dir, scfg, graceful=False) as url:
        burst_res, cap = asyncio.run(http_run(url, burst, bcfg, list(requests)))
    return cap.get(1, []), burst_res
