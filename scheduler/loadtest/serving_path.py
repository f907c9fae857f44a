"""The serving path's own cost, measured on the real stack, for the simulator (``smartexit profile
serving=true``; ``<run>/scheduler/serving.json``).

The engine's latency model prices engine steps; between the engine and a client sit the Triton
python backend's IPC and responder thread, the worker, the Ray Serve ingress and proxy, HTTP and SSE.
On 2 cores they share the CPU, and the stub's threads share the GIL, with the engine thread. These
numbers describe them for the simulator (scheduler/control/sim_config.py ``SimConfig``):

- ``engine_slowdown``: the served decode step's time / the profiled one (decode is many short ONNX
  Runtime calls with Python between them: each takes the GIL back from the stack's threads);
- ``prefill_slowdown``: the same for prefill (a few large calls that hold no GIL: it slows less);
- ``serve_chunk_ms``: engine time lost per chunk handed to the serving path (the responder's work);
- ``round_ms_by_batch`` (``round_ms``: their mean) and ``decode_rounds``: the served engine's draft rounds (mode
  exact, and bounded requests with ``repo.bounded_drafts``), verification calls outside the batched step: their
  cost per decode batch bucket, and per
  decode batch how often a decoding sequence took a plain step or verified a round of 1, 2, ... tokens (the
  step log's ``k``; without them the simulator priced one token per sequence and step);
- ``ttft_overhead_ms`` and ``token_overhead_ms``: latency added to the first and to each later token;
- ``ingress_ms``: the front end's time per request, one at a time: a queue ahead of the engine's whose
  delay grows with load (the engine's step log cannot see it; the requests' TTFT at several loads can).

The first four (slowdowns and chunk costs) come from the served engine itself: the stack runs with a step log
(``ServeConfig.step_log``: one line per engine step, what it did and how long it took under the
stack), and each step's time is regressed (non-negative least squares, weighted by 1/sqrt(time)) on
the profiled model's decode and prefill parts of that step and the chunks it sent. The two overheads
and the ingress time are then fitted (Nelder-Mead, bounded) so that the simulator, replaying each calibration run (its
arrivals, prompt and output lengths), gives the measured TTFT and time per output token (p50, p90
and mean: squared log ratios summed over the runs; a run the stack did not hold within the SLA at p95 is
replayed, not fitted). The calibration runs are open-loop Poisson runs of the profile's own (seeds and rates
unlike any evaluation's) at loads from light to moderate, at one budget or several
(``ProfileConfig.serving_runs``), then one near the stack's SLA edge as the path fitted on them places it
(``ProfileConfig.serving_edge_run``); the evaluation's workloads (scheduler/loadtest/bench_scheduler.py) never
enter the fit.

This module serves and fits them (:func:`calibrate`); the step log and the step fit are in
scheduler/loadtest/serving_steps.py, the overheads' fit by replay in serving_fit.py, the runs on the stack and
stored for refits in serving_runs.py.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from scheduler.control.engine_model import SERVING_JSON, ServingPath
from scheduler.control.latency import LatencyModel
from scheduler.control.policies import FixedBudget
from scheduler.control.sim_config import SimConfig
from scheduler.loadtest.serving_fit import fit_serving_path, replay_pool
from scheduler.loadtest.serving_runs import measure, merge_starts, save_runs

STEP_LOG = "serving_steps.jsonl"  # the served engine's step log of the calibration runs
RUNS_JSON = "serving_runs.json"  # the calibration runs' requests (save_runs)


def calibrate(run_dir: str | Path, latency: LatencyModel, pool: list[list[int]], max_seqs: int,
              runs: Sequence[tuple[int, float]], duration_s: float, seed: int, warm_requests: int = 0,
              edge_run: tuple[int, float] | None = None, starts: int = 1) -> ServingPath:
    """Measure and fit the serving path for ``run_dir`` (``smartexit profile``): open-loop Poisson runs,
    one per ``(budget, load)`` of ``runs``, at load x the rate the engine alone holds the SLA at with
    that budget (simulated), prompts from ``pool``, after ``warm_requests`` served at the last run's rate and
    not measured; then, with ``edge_run`` ``(budget, share)``, one more at share x the rate the simulator holds
    the SLA at with that budget and the serving path fitted on the runs before it (where the evaluation judges
    the simulator: near the stack's own SLA edge, which the engine alone's capacity does not tell: the stack held
    the SLA to 0.6 of it on one start and not to 0.6 on another of the same VM, 2026-12-05); writes
    ``<run>/scheduler/serving.json`` and the step log beside it. With ``starts`` > 1, the same runs (the placed
    one included, at the rate the first stack placed it) are served again on that many stacks in all, each started
    and warmed afresh, and the path is fitted on all of them: two starts of one stack on one VM differed by more
    than budgets 16-128 did (docs/scheduler.md, stop 53), and a path fitted on one start predicts that start."""
    from scheduler.control.engine_model import exit_model, serving_fields
    from scheduler.control.env import EnvConfig, estimate_capacity, make_workload
    from scheduler.loadtest.loadgen import requests_of

    run = Path(run_dir)
    exits, _ = exit_model(latency, run / "calibration" / "thresholds.json", None)
    engine = {k: v for k, v in serving_fields(run).items() if k in ("audit_fraction", "audit_max_pending",
                                                                   "max_waiting")}
    base = SimConfig(max_seqs=max_seqs, **engine)  # the SLA the requests carry: the measurement ignores it
    env = EnvConfig(sim=base)
    capacity = {b: estimate_capacity(latency, exits, env, FixedBudget(b, max_seqs)) for b in {b for b, _ in runs}}
    rates = [f * capacity[b] for b, f in runs]

    def schedule(i: int, budget: int, rate: float) -> tuple[int, list]:
        return budget, requests_of(make_workload("poisson", rate, duration_s, 7 + seed + i, env), pool, seed + 2 + i,
                                   prefix=f"cal{i}-")

    schedules = [schedule(i, b, r) for i, ((b, _), r) in enumerate(zip(runs, rates))]
    warm = requests_of(make_workload("poisson", rates[-1], warm_requests / rates[-1], 5 + seed, env), pool,
                       seed + 1, prefix="warm-") if warm_requests else []
    print("profile: the serving path: open-loop runs at " + ", ".join(
        f"{r:.2f} req/s, budget {b} ({len(s)} requests)" for (b, s), r in zip(schedules, rates))
        + "; the engine alone holds the SLA to " + ", ".join(f"{v:.2f} (budget {b})" for b, v in capacity.items())
        + (f"; first {len(warm)} requests to warm the stack, not measured" if warm else ""), flush=True)
    budgets = [b for b, _ in runs]

    def at_the_edge(results: list[list], steps: list[dict]) -> list[tuple[int, list]]:
        b, share = edge_run
        sp = fit_serving_path(latency, exits, base, results, budgets, steps, pool=replays)
        served = estimate_capacity(latency, exits, EnvConfig(sim=SimConfig(**{**base.__dict__, **sp.sim_fields()})),
                                   FixedBudget(b, max_seqs))
        out = schedule(len(runs), b, share * served)
        placed.append(out)
        print(f"profile: the serving path fitted on those runs holds the SLA to {served:.2f} req/s at budget {b} "
              f"(simulated); a run at {share:g} x that, {share * served:.2f} req/s ({len(out[1])} requests)",
              flush=True)
        return [out]

    placed: list[tuple[int, list]] = []
    with replay_pool() as replays:  # started before the stacks, so spawned from a process without them
        results, steps = measure(run, schedules, max_seqs, (base.sla_ttft_ms, base.sla_tpot_ms),
                                 run / "scheduler" / STEP_LOG, warm=warm, more=at_the_edge if edge_run else None)
        measured = [(results, steps)]
        for k in range(1, starts):
            print(f"profile: the same runs on a stack of its own ({k + 1} of {starts})", flush=True)
            measured.append(measure(run, schedules + placed, max_seqs, (base.sla_ttft_ms, base.sla_tpot_ms),
                                    run / "scheduler" / f"{Path(STEP_LOG).stem}_{k + 1}.jsonl", warm=warm))
        results, steps, all_budgets, labels = merge_starts(measured, budgets + ([edge_run[0]] if edge_run else []))
        save_runs(run / "scheduler" / RUNS_JSON, results, all_budgets, labels)
        sp = fit_serving_path(latency, exits, base, results, all_budgets, steps, pool=replays)
    sp.save(run / "scheduler" / SERVING_JSON)
    st = sp.fit["steps"]
    past = [f"{t['rate_rps']:.2f} req/s" for t in sp.fit["runs"] if not t["fitted"]]
    print(f"profile: serving path: {st['steps']} served steps: decode {sp.engine_slowdown:.2f}x and prefill "
          f"{sp.prefill_slowdown:.2f}x the profiled time, plus {sp.front_decode_per_arrival:.3f}x and "
          f"{sp.front_prefill_per_arrival:.3f}x per recent arrival, {sp.serve_chunk_ms:.2f} ms per chunk sent + "
          f"{sp.serve_chunk_sq_ms:.3f} ms x chunks^2 (step error median {st['rel_err_median']:.3f}, mean step "
          f"{st['total_ratio']:.3f} of measured); +{sp.ttft_overhead_ms:.1f} ms to the first token, "
          f"+{sp.token_overhead_ms:.2f} ms per later token, {sp.ingress_ms:.2f} ms per request at the front end; TTFT / TPOT p50 / p95 max rel err "
          f"{sp.fit['max_rel_err']:.3f}" + (f"; not fitted, past the stack's SLA at p95: the run at {', '.join(past)}"
                                             if past else ""), flush=True)
    return sp
