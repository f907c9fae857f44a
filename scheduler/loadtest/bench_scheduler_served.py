"""The real stack's served runs of ``smartexit bench scheduler``: a workload's schedule with held-out prompts
(:func:`real_schedule`) and runs of several policies one after another on one stack (:func:`served`)."""
from __future__ import annotations

import asyncio
from typing import Any

from scheduler.control.env import EnvConfig
from scheduler.control.workload import Workload
from scheduler.loadtest.bench_scheduler_config import LEARNED, BenchSchedulerConfig


def real_schedule(cfg: BenchSchedulerConfig, w: Workload) -> list:
    """The workload's arrivals and lengths with prompts cut from the held-out split (bench serve's pool)."""
    from scheduler.loadtest.bench_serve_config import BenchServeConfig
    from scheduler.loadtest.bench_serve_inputs import prompt_pool
    from scheduler.loadtest.loadgen import requests_of

    return requests_of(w, prompt_pool(BenchServeConfig(run_dir=cfg.run_dir)), cfg.seed)


def _policy_settings(policy: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The serving settings of ``policy``. The learned policy runs alone: in control from the first tick
    (the guard's first window is otherwise the heuristic's probe), no fallback, no online updates: what
    is measured is the shipped policy."""
    alone = {"guard": {"first": "learned", "window_s": 1e9}, "online_finetune": False} if policy == LEARNED else {}
    return {"policy": policy, "policy_kwargs": kwargs, **alone}


def served(cfg: BenchSchedulerConfig, env: EnvConfig, runs: list[tuple[str, dict[str, Any], list]]) -> list[list]:
    """Served runs, one after another on one stack: ``runs`` = (policy, its kwargs, schedule) each, the
    worker's policy switched between runs where it changes (:func:`scheduler.serving.stack.set_policy`).
    One stack for every policy: no stack start between them (~15-25 s each on 2 cores), and no policy is
    measured on a second stack started right after the first (on this 2-core VM that one ran slower)."""
    from scheduler.loadtest.bench_serve_config import BenchServeConfig
    from scheduler.loadtest.bench_serve_runs import http_run
    from scheduler.serving.config import ServeConfig
    from scheduler.serving.stack import free_port, serving_stack, set_policy

    sla = {"default_sla_ttft_ms": env.sim.sla_ttft_ms, "default_sla_tpot_ms": env.sim.sla_tpot_ms}
    first = _policy_settings(*runs[0][:2])
    scfg = ServeConfig(shed_late=env.sim.shed_late, port=free_port(), **sla, **first)
    bcfg = BenchServeConfig(run_dir=cfg.run_dir, sla_ttft_ms=env.sim.sla_ttft_ms, sla_tpot_ms=env.sim.sla_tpot_ms,
                            warmup_requests=cfg.warmup_requests)
    out, current = [], first
    with serving_stack(cfg.run_dir, scfg, graceful=False) as url:
        for policy, kwargs, schedule in runs:
            wanted = _policy_settings(policy, kwargs)
            if wanted != current:
                set_policy(wanted)
                current = wanted
            out.append(asyncio.run(http_run(url, schedule, bcfg)))
    return out
