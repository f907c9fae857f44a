"""The serving path's own cost, measured on the real stack, for the simulator (``smartexit profile
serving=true``; ``<run>/scheduler/serving.json``).

The engine's latency model prices engine steps; between the engine and a client sit the Triton
python backend's IPC, the worker, the Ray Serve ingress and proxy, HTTP and SSE. Two numbers describe
them for the simulator (scheduler/sim.py ``SimConfig``):

- latency: requests sent one at a time; the measured TTFT and time per later token minus the
  simulator's for the same request alone (``ttft_overhead_ms``, ``token_overhead_ms``);
- load: an open-loop Poisson run of its own (seed and rate unlike any evaluation's); the served
  engine's slowdown (``engine_slowdown``: the step time under the stack / the profiled one; Triton's
  python backend, Ray Serve and the client share the CPU and the GIL with the engine thread: on 2
  cores the stub's engine thread got ~80% of a core), found by bisection so that the simulated mean
  time per output token equals the measured one.

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
    engine_slowdown: float = 1.0
    probes: int = 0
    load: int = 0
    measured: dict[str, float] | None = None

    def sim_fields(self) -> dict[str, float]:
        """The SimConfig fields."""
        return {"ttft_overhead_ms": self.ttft_overhead_ms, "token_overhead_ms": self.token_overhead_ms,
                "serve_chunk_ms": self.serve_chunk_ms, "engine_slowdown": self.engine_slowdown}

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
                     load: Sequence[Any], budget: int) -> ServingPath:
    """The serving path from probe results (one at a time) and an open-loop run's results, both on a
    stack whose policy held ``budget`` (loadgen ``RequestResult``s; arrivals as scheduled).

    Raises:
        ConfigError: no successful probe or load request.
    """
    probes = [r for r in probes if r.ok and r.tokens >= 2]
    load = [r for r in load if r.ok and r.tokens >= 2]
    if not probes or len(load) < 4:
        raise ConfigError(f"serving path: {len(probes)} probes and {len(load)} load requests succeeded with "
                          ">= 2 tokens; need 1 and 4")
    measured = float(np.mean([r.tpot_s for r in load])) * 1e3
    wl = _workload(load, [r.arrival_s for r in load])
    wp = _workload(probes, np.arange(len(probes)) * 60.0)

    def overheads(k: float) -> tuple[float, float]:
        """The probes' latency beyond the simulator's for each request alone, its steps slowed by k."""
        alone = _sim(latency, exits, SimConfig(**{**base.__dict__, "ttft_overhead_ms": 0.0, "token_overhead_ms": 0.0,
                                                  "engine_slowdown": k}), wp, budget)
        return (max(0.0, float(np.median([(r.ttft_s - s.ttft_s) * 1e3 for r, s in zip(probes, alone)]))),
                # the last token's delay: every later token carries the per-token overhead
                max(0.0, float(np.median([(r.e2e_s - s.e2e_s) * 1e3 for r, s in zip(probes, alone)]))))

    def tpot(k: float, o: tuple[float, float]) -> float:
        cfg = SimConfig(**{**base.__dict__, "ttft_overhead_ms": o[0], "token_overhead_ms": o[1], "engine_slowdown": k})
        return float(np.mean([s.tpot_s for s in _sim(latency, exits, cfg, wl, budget) if s.tpot_s is not None])) * 1e3

    # the slowdown stretches a lone request's steps too: fit it and the overheads in turn
    hi, o = 1.0, overheads(1.0)
    for _ in range(3):
        lo, hi = 1.0, 8.0
        if tpot(lo, o) >= measured:
            hi = 1.0
        else:
            for _ in range(25):
                mid = (lo + hi) / 2
                lo, hi = (mid, hi) if tpot(mid, o) < measured else (lo, mid)
        o = overheads(hi)
    o_ttft, o_tok = o
    return ServingPath(o_ttft, o_tok, 0.0, hi, len(probes), len(load),
                       {"probe_ttft_p50_ms": float(np.median([r.ttft_s for r in probes])) * 1e3,
                        "probe_tpot_p50_ms": float(np.median([r.tpot_s for r in probes])) * 1e3,
                        "load_tpot_mean_ms": measured, "load_tpot_mean_sim_ms": tpot(hi, o),
                        "load_tpot_mean_sim_unslowed_ms": tpot(1.0, o)})


def measure(run_dir: str | Path, probes: Sequence[Any], load: Sequence[Any], budget: int, max_seqs: int,
            sla: tuple[float, float], warmup: int = 2) -> tuple[list, list]:
    """(probe results, load results) on a stack started for ``run_dir`` with a fixed ``budget``: the
    open-loop ``load`` schedule, then ``probes`` one at a time."""
    from scheduler.bench_serve import BenchServeConfig, http_run
    from scheduler.serve.config import ServeConfig
    from scheduler.serve.stack import serving_stack

    scfg = ServeConfig(policy="fixed", policy_kwargs={"prefill_budget": budget, "max_running": max_seqs},
                       default_sla_ttft_ms=sla[0], default_sla_tpot_ms=sla[1])
    bcfg = BenchServeConfig(run_dir=str(run_dir), sla_ttft_ms=sla[0], sla_tpot_ms=sla[1], warmup_requests=warmup,
                            capacity_concurrency=[1], capacity_requests=len(probes))
    with serving_stack(run_dir, scfg, graceful=False) as url:
        load_res, cap = asyncio.run(http_run(url, list(load), bcfg, list(probes)))
    return cap.get(1, []), load_res
