"""The serving path's calibration runs (scheduler/loadtest/serving_path.py): open-loop schedules served one
after another on one stack started with a step log (:func:`measure`), the same runs served on several starts merged
(:func:`merge_starts`), and the runs stored as the fit reads them (:func:`save_runs`, :func:`load_runs`), so that a
refit, a replay or a diagnosis needs no stack."""
from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from edge.core.errors import ConfigError
from scheduler.loadtest.serving_steps import count_lines, read_step_log


def measure(run_dir: str | Path, runs: Sequence[tuple[int, Sequence[Any]]], max_seqs: int,
            sla: tuple[float, float], step_log: str | Path, warmup: int = 2,
            warm: Sequence[Any] = (), serve: dict[str, Any] | None = None,
            more: Callable[[list[list], list[dict]], Sequence[tuple[int, Sequence[Any]]]] | None = None,
            ) -> tuple[list[list], list[dict]]:
    """(the results of each open-loop schedule of ``runs``, one after another, each drained before the
    next; the served engine's steps over all of them): ``(budget, schedule)`` pairs, served on one stack started
    for ``run_dir``, its fixed budget switched between runs where it changes
    (:func:`scheduler.serving.stack.set_policy`), its step log at ``step_log`` (replaced). ``warm``: a schedule
    served first at the first run's budget, neither its results nor its steps kept (a served engine measures
    whether drafting pays, its calls' costs and its drafts' acceptance as it runs: what is measured is a server
    that has run a while).
    ``serve``: other ServeConfig fields of the stack. ``more``: called once after ``runs`` with their results and
    steps; the runs it returns are served next on the same stack (a run placed by what the earlier ones measured)."""
    from scheduler.loadtest.bench_serve_config import BenchServeConfig
    from scheduler.loadtest.bench_serve_runs import http_run
    from scheduler.serving.config import ServeConfig
    from scheduler.serving.stack import free_port, serving_stack, set_policy

    step_log = Path(step_log).resolve()
    step_log.unlink(missing_ok=True)
    bcfg = BenchServeConfig(run_dir=str(run_dir), sla_ttft_ms=sla[0], sla_tpot_ms=sla[1], warmup_requests=warmup)

    def policy(budget: int) -> dict[str, Any]:
        return {"policy": "fixed", "policy_kwargs": {"prefill_budget": budget, "max_running": max_seqs}}

    out: list[list] = []
    current = runs[0][0]
    scfg = ServeConfig(**policy(current), default_sla_ttft_ms=sla[0], default_sla_tpot_ms=sla[1],
                       step_log=str(step_log), port=free_port(), **(serve or {}))
    with serving_stack(run_dir, scfg, graceful=False) as url:
        if warm:
            asyncio.run(http_run(url, list(warm), bcfg))
            time.sleep(0.5)  # the engine, idle, flushes its log
        start = count_lines(step_log)

        def serve_runs(todo: Sequence[tuple[int, Sequence[Any]]]) -> None:
            nonlocal current
            for budget, schedule in todo:
                if budget != current:
                    set_policy(policy(budget))
                    current = budget
                out.append(asyncio.run(http_run(url, list(schedule), bcfg)))
            time.sleep(0.5)  # the engine, idle, flushes its log

        serve_runs(runs)
        if more is not None:
            serve_runs(more(list(out), read_step_log(step_log, [(start, count_lines(step_log))])))
        kept = [(start, count_lines(step_log))]
    return out, read_step_log(step_log, kept)


def save_runs(path: str | Path, results: Sequence[Sequence[Any]], budgets: Sequence[int],
              labels: Sequence[dict[str, Any]] | None = None) -> None:
    """Served runs as the fit reads them (:func:`load_runs`): per run its budget (and ``labels``' fields, if
    given) and per request its arrival, prompt and output lengths, submit, first-token and end times and outcome;
    a refit, a replay or a diagnosis needs no stack."""
    from edge.core.artifacts import atomic_write_json

    labels = list(labels) if labels is not None else [{}] * len(results)
    runs = [{**label, "budget": int(b), "requests": [{
        "request_id": r.request_id, "arrival_s": r.arrival_s, "prompt_tokens": r.prompt_tokens,
        "max_tokens": r.max_tokens, "t_submit": r.t_submit, "t_first_token": r.t_first_token, "t_end": r.t_end,
        "tokens": r.tokens, "error_kind": r.error_kind} for r in run]} for run, b, label in zip(results, budgets, labels)]
    atomic_write_json(Path(path), {"runs": runs})


def load_runs(path: str | Path) -> tuple[list[list[Any]], list[int]]:
    """(the runs' RequestResults, their budgets) as :func:`save_runs` wrote them. Raises ConfigError."""
    from scheduler.control.outcomes import RequestResult

    try:
        runs = json.loads(Path(path).read_text())["runs"]
        return ([[RequestResult(**r) for r in run["requests"]] for run in runs], [int(run["budget"]) for run in runs])
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"serving path: calibration runs {path}: {exc!r}") from None


def merge_starts(measured: Sequence[tuple[list[list], list[dict]]], budgets: Sequence[int]
                 ) -> tuple[list[list], list[dict], list[int], list[dict[str, int]]]:
    """(runs, steps, their budgets, a ``{"start": k}`` label per run) of the same runs (``budgets``) served on
    several stacks (``measure``'s results and steps, one pair per start). Each stack numbers its requests from 0:
    a later start's step-log ids become ``"k:id"``."""
    runs: list[list] = []
    steps: list[dict] = []
    for k, (res, st) in enumerate(measured):
        if len(res) != len(budgets):
            raise ConfigError(f"serving path: start {k} served {len(res)} runs, {len(budgets)} expected")
        runs += res
        for line in st:
            if k and line.get("i") is not None:
                line = {**line, "i": [f"{k}:{i}" for i in line["i"]]}
            steps.append(line)
    return runs, steps, list(budgets) * len(measured), [{"start": k} for k in range(len(measured)) for _ in budgets]
