"""The serving path's own cost, measured on the real stack, for the simulator (``smartexit profile
serving=true``; ``<run>/scheduler/serving.json``).

The engine's latency model prices engine steps; between the engine and a client sit the Triton
python backend's IPC and responder thread, the worker, the Ray Serve ingress and proxy, HTTP and SSE.
On 2 cores they share the CPU, and the stub's threads share the GIL, with the engine thread. These
numbers describe them for the simulator (scheduler/control/sim.py ``SimConfig``):

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
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import multiprocessing
import os
import time
from concurrent.futures import Executor, ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from edge.core.errors import ConfigError
from scheduler.control.engine_model import OVERHEADS, PARAMS, SERVING_JSON, STEP_PARAMS, ServingPath
from scheduler.control.latency import LatencyModel
from scheduler.control.policies import FixedBudget
from scheduler.control.sim import BUCKET_KEYS, MAX_ROUND_TOKENS, ExitModel, SimConfig, batch_bucket, simulate
from scheduler.control.workload import Workload

STEP_LOG = "serving_steps.jsonl"  # the served engine's step log of the calibration runs
RUNS_JSON = "serving_runs.json"  # the calibration runs' requests (save_runs)

BOUNDS = ((0.0, 1000.0), (0.0, 100.0), (0.0, 200.0))  # the overheads' (ms): first token, later tokens, ingress
START = (20.0, 2.0, 2.0)
METRICS = ("ttft_p50_ms", "ttft_p95_ms", "tpot_p50_ms", "tpot_p95_ms")  # what the evaluation validates
# what the fit matches: the p95 of a 20-second run is its 2nd to 5th largest value, so the fit leans on
# steadier statistics of the same distributions (the median, p90 and the mean)
FITTED = ("ttft_p50_ms", "ttft_p90_ms", "ttft_mean_ms", "tpot_p50_ms", "tpot_p90_ms", "tpot_mean_ms")
MIN_REQUESTS = 8
# the simulator's draws (exit depths, draft rounds) each replay of the fit averages: with two, one draw's luck
# (seed 0's, the most pessimistic of ten on each of three calibration runs: TPOT p50 up to 18% above the ten's
# mean) was half of every replay (2026-12-05)
FIT_SEEDS = (0, 1, 2, 3)


def latency_stats(results: Sequence[Any]) -> dict[str, float | None]:
    """TTFT and time per output token of the successful requests: p50, p90, p95 and mean, in ms."""
    out: dict[str, float | None] = {}
    for name in ("ttft", "tpot"):
        v = np.array([getattr(r, f"{name}_s") for r in results if r.ok and getattr(r, f"{name}_s") is not None]) * 1e3
        for q in (50, 90, 95):
            out[f"{name}_p{q}_ms"] = float(np.percentile(v, q)) if v.size else None
        out[f"{name}_mean_ms"] = float(v.mean()) if v.size else None
    return out


def _workload(results: Sequence[Any]) -> Workload:
    return Workload(np.array([r.arrival_s for r in results], np.float64),
                    np.array([r.prompt_tokens for r in results], np.int64),
                    np.array([r.tokens for r in results], np.int64), "calibration")


def _replay(task: tuple[LatencyModel, ExitModel, SimConfig, Workload, int, int]) -> dict[str, float | None]:
    """``latency_stats`` of one replay: (latency, exits, cfg, workload, budget, seed); a module-level function, so
    that a process pool can run it."""
    latency, exits, cfg, w, budget, seed = task
    return latency_stats(simulate(latency, exits, SimConfig(**{**cfg.__dict__, "seed": seed}), w,
                                  FixedBudget(budget, cfg.max_seqs), 0.25).results())


def _mean_stats(runs: Sequence[dict[str, float | None]]) -> dict[str, float]:
    return {k: float(np.mean([r[k] for r in runs if r[k] is not None] or [np.nan])) for k in runs[0]}


def _replay_all(tasks: Sequence[tuple]) -> list[dict[str, float | None]]:
    return [_replay(t) for t in tasks]


@dataclass
class ReplayPool:
    """Processes for the fit's replays (:func:`replay_pool`): each call hands every worker one share of the
    replays, interleaved (a run's seeds spread over the workers, so long and short runs mix), in one message."""

    executor: Executor
    workers: int

    def replay(self, tasks: Sequence[tuple]) -> list[dict[str, float | None]]:
        parts = [self.executor.submit(_replay_all, tasks[i::self.workers]) for i in range(self.workers)]
        done = [f.result() for f in parts]
        return [done[i % self.workers][i // self.workers] for i in range(len(tasks))]


@contextlib.contextmanager
def replay_pool(workers: int | None = None) -> Iterator[ReplayPool | None]:
    """Processes for the fit's replays (:func:`fit_serving_path` ``pool``): ``workers`` (None: the machine's
    cores), started by spawn (the caller may hold a Ray session, ONNX Runtime threads: nothing of them is forked);
    None on one core. A replay is seeded and computes the same wherever it runs, so the fit is the same with a
    pool as without, only sooner: the profile's two fits replay each calibration run with four seeds about a
    hundred times (25 s and ~8 s of the demo's profile on one core of the 2-core VM, 12 s and ~4 s on two;
    2026-12-06, stop 56)."""
    n = workers if workers is not None else (os.cpu_count() or 1)
    if n < 2:
        yield None
        return
    with ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn")) as executor:
        for f in [executor.submit(_replay_all, ()) for _ in range(n)]:  # started (and this module imported) now
            f.result()
        yield ReplayPool(executor, n)


def read_step_log(path: str | Path, keep: Sequence[tuple[int, int]] | None = None) -> list[dict[str, Any]]:
    """The step log's lines (edge/runtime/host_steplog.py ``step_line``); with ``keep``, only those whose 0-based
    line number lies in one of its ranges [start, end). Raises ConfigError: missing or malformed."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"serving path: no step log at {path} (the served engine did not write one)")
    out = []
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines, 1):
        if not line.strip() or (keep is not None and not any(a < i <= b for a, b in keep)):
            continue
        try:
            rec = json.loads(line)
            d = [(int(a), int(b)) for a, b in rec["d"]]
            out.append({"s": float(rec["s"]) + float(rec.get("e", 0.0)), "c": int(rec["c"]), "d": d,
                        "p": [(int(a), int(b)) for a, b in rec["p"]],
                        "a": int(rec.get("a", 0)), "n": int(rec.get("n", 0)),  # both 0 in logs written before them
                        # per decoding sequence (tokens, 1 for a draft round): in logs written before rounds were
                        # logged, a plain step per row
                        "k": [(int(n), int(r)) for n, r in rec["k"]] if "k" in rec else [(1, 0)] * len(d),
                        # the request ids of ``k``'s sequences, in its order (None in logs written before them)
                        "i": [int(x) if isinstance(x, int) else str(x) for x in rec["i"]] if "i" in rec else None})
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            if i == len(lines):
                break  # the last line of a stack stopped mid-write
            raise ConfigError(f"serving path: step log {path} line {i}: {exc!r}") from None
    return out


def step_terms(latency: LatencyModel, steps: Sequence[dict[str, Any]]) -> np.ndarray:
    """[N, 6 + len(BUCKET_KEYS)]: each logged step's profiled decode part (with the per-step constant; the rows
    of its plain steps), its profiled prefill part, the chunks it sent (in ms: the coefficients are serve_chunk_ms
    and _sq_ms), their square, the two profiled parts times the requests that reached the engine in the last
    FRONT_WINDOW_S seconds (the log's ``a``; 0 in logs written before it), in STEP_PARAMS' order, then its draft
    rounds (in ms: verification calls outside the batched step) in the column of its decode batch's bucket
    (scheduler/control/sim.py BUCKET_KEYS: round_ms_by_batch)."""
    from scheduler.control.latency import FEATURES, combine, decode_features, prefill_features

    w = np.array([latency.coef[f] for f in FEATURES])
    pre = np.array([f.startswith("prefill_") for f in FEATURES])
    out = np.zeros((len(steps), 6 + len(BUCKET_KEYS)))
    for i, st in enumerate(steps):
        f = combine(decode_features([e for _, e in st["d"]], [c for c, _ in st["d"]], latency.exit_layers),
                    prefill_features(st["p"], latency.num_layers)).vector()
        d, p, a = w[~pre] @ f[~pre], w[pre] @ f[pre], st.get("a", 0)
        out[i, :6] = (d, p, st["c"] / 1e3, st["c"] ** 2 / 1e3, d * a, p * a)
        rounds = sum(r for _, r in st.get("k", ()))
        if rounds:
            out[i, 6 + BUCKET_KEYS.index(batch_bucket(len(st["k"])))] = rounds / 1e3
    return out


MIN_STEPS = 50


def fit_steps(latency: LatencyModel, steps: Sequence[dict[str, Any]]) -> tuple[dict[str, float], dict[str, Any]]:
    """(STEP_PARAMS' values; the fit's quality) from the served steps: non-negative least squares,
    unweighted, so that the mean step time (what sets the simulator's throughput) comes out right. (Weighted by 1/sqrt(time), as the profile's own fit,
    it followed the typical step and left the mean ~10% short: a simulator optimistic under load.)

    Raises:
        ConfigError: fewer than MIN_STEPS busy steps.
    """
    from scipy.optimize import nnls

    T = step_terms(latency, steps)
    y = np.array([st["s"] for st in steps])
    # a step that only verified rounds has no profiled part but is engine work (before 2026-12-05 such steps,
    # most of a lone sequence's, were left out, and round_ms came from the steps that mixed both)
    busy = (T[:, 0] + T[:, 1] + T[:, 6:].sum(axis=1)) > 0
    T, y = T[busy], y[busy]
    if len(y) < MIN_STEPS:
        raise ConfigError(f"serving path: {len(y)} busy steps in the step log, at least {MIN_STEPS} needed")
    # the served decode step is never faster than the engine alone: fit what it takes beyond the profiled
    # time (decode factor >= 1). Unbounded, the fit traded the base factor for the per-arrival one (x0.17 +
    # x0.088 per arrival on a demo's log: step error median 0.31 against 0.38 bounded), which prices a
    # lightly loaded stack's decode at a fifth of the engine's own time
    scale = np.maximum(T.max(axis=0), 1e-12)
    coef, _ = nnls(T / scale, y - T[:, 0])
    coef = coef / scale
    coef[0] += 1.0
    if coef[1] == 0:  # no prefill in the log: prefill as decode
        coef[1] = coef[0]
    fields: dict[str, Any] = dict(zip(STEP_PARAMS[:6], map(float, coef[:6])))
    counts = T[:, 6:].sum(axis=0)  # rounds per bucket (/1e3)
    fields["round_ms_by_batch"] = {k: float(c) for k, c, n in zip(BUCKET_KEYS, coef[6:], counts) if n > 0} or None
    # one price for files and readers that know no buckets: the rounds' mean
    fields["round_ms"] = float(coef[6:] @ counts / counts.sum()) if counts.sum() > 0 else 0.0
    pred = T @ coef
    rel = np.abs(pred - y) / np.maximum(y, 1e-9)
    kept = [st for st, b in zip(steps, busy) if b]
    only_decode = T[:, 1] == 0

    def buckets(values: np.ndarray, edges: Sequence[int]) -> dict[str, dict[str, float]]:
        """Decode-only steps by ``values`` in [edges[k], edges[k + 1]) (the last open): served, fitted, profiled."""
        out = {}
        for lo, hi in zip(edges, [*edges[1:], None]):
            m = only_decode & (values >= lo) & (values < (hi if hi is not None else np.inf))
            if m.sum():
                out[f"{lo}-{hi - 1}" if hi is not None else f"{lo}+"] = {
                    "steps": int(m.sum()), "measured_ms": float(y[m].mean() * 1e3),
                    "fitted_ms": float(pred[m].mean() * 1e3), "profiled_ms": float(T[m, 0].mean() * 1e3)}
        return out

    # by decoding sequences, those that verified rounds too (steps without ``k``: their plain rows)
    batches = buckets(np.array([len(st.get("k", st["d"])) for st in kept]), (1, 2, 4, 8))
    # by the requests that reached the engine in the last FRONT_WINDOW_S seconds
    by_arrivals = buckets(np.array([st.get("a", 0) for st in kept]), (0, 3, 6, 10))
    return fields, {"steps": int(len(y)), "rel_err_median": float(np.median(rel)),
                    "rel_err_p90": float(np.quantile(rel, 0.9)), "total_ratio": float(pred.sum() / y.sum()),
                    "profiled_total_ratio": float((T[:, 0] + T[:, 1]).sum() / y.sum()),
                    "mean_step_ms": float(y.mean() * 1e3), "decode_batches": batches,
                    "decode_by_recent_arrivals": by_arrivals}


def decode_rounds(steps: Sequence[dict[str, Any]]) -> dict[str, list[float]] | None:
    """SimConfig.decode_rounds from the served steps: per decode batch bucket, the share of decoding sequences
    that took a plain step, and that verified a draft round emitting 1, 2, ... MAX_ROUND_TOKENS tokens; None
    without decode steps. Where the log names the requests (``i``), only the steps of a sequence with more than
    MAX_ROUND_TOKENS tokens still to go are counted: there max_tokens cannot have cut a round, and the simulator
    cuts its own draws at a request's end (counted, the cut rounds were cut twice). On two profiles' runs
    (2026-12-05) the simulator's heaviest run then put TTFT p50 at 115 and 137 ms instead of 124 and 148 (served
    105 and 73), its lighter runs within 0.4 ms of before."""
    total: dict[Any, int] = collections.Counter()
    for st in steps:
        for (n, _), rid in zip(st.get("k", ()), st.get("i") or ()):
            total[rid] += n
    done: dict[Any, int] = collections.Counter()
    counts: dict[str, np.ndarray] = {}
    for st in steps:
        ks, ids = st.get("k", [(1, 0)] * len(st["d"])), st.get("i")
        if ks:
            c = counts.setdefault(batch_bucket(len(ks)), np.zeros(MAX_ROUND_TOKENS + 1))
            for q, (n, r) in enumerate(ks):
                if ids is not None:
                    rid = ids[q]
                    left, done[rid] = total[rid] - done[rid], done[rid] + n
                    if left <= MAX_ROUND_TOKENS:
                        continue
                c[min(max(n, 1), MAX_ROUND_TOKENS) if r else 0] += 1
    counts = {key: c for key, c in counts.items() if c.sum() > 0}
    if not counts:
        return None
    return {key: [float(x) for x in c[:int(np.flatnonzero(c).max()) + 1] / c.sum()] for key, c in counts.items()}


def fit_serving_path(latency: LatencyModel, exits: ExitModel, base: SimConfig, runs: Sequence[Sequence[Any]],
                     budgets: int | Sequence[int], steps: Sequence[dict[str, Any]], seeds: Sequence[int] = FIT_SEEDS,
                     max_evals: int = 150, pool: ReplayPool | None = None) -> ServingPath:
    """The serving path from open-loop runs on a stack whose policy held a fixed budget (``budgets``:
    one for all runs or one per run; loadgen ``RequestResult``s, arrivals as scheduled; best at two or
    more loads and budgets) and the served engine's step log over them (:func:`read_step_log`).

    A run the stack did not hold within ``base``'s SLA at p95 (TTFT or time per output token) is past the stack's
    knee, where two runs of one schedule differ by up to 2x: it is replayed and reported, not fitted, unless every
    run is (demo 64, 2026-12-05: a run at 14.5 req/s, TTFT p95 594 ms against the SLA's 500, fitted with two
    others, left the simulator's TTFT p50 there at 1195 ms against 196, and its time per output token p50 at the
    validation's load at 7.6 ms against 3.9-5.2 served).

    ``pool`` (:func:`replay_pool`): where the replays run; the same fit, sooner.

    Raises:
        ConfigError: a run with fewer than MIN_REQUESTS successful requests of >= 2 tokens; as fit_steps.
    """
    from scipy.optimize import minimize

    runs = [[r for r in run if r.ok and r.tokens >= 2] for run in runs]
    if not runs or min(len(r) for r in runs) < MIN_REQUESTS:
        raise ConfigError(f"serving path: {[len(r) for r in runs]} requests succeeded with >= 2 tokens per run; "
                          f"need {MIN_REQUESTS} in each of at least one run")
    budgets = [budgets] * len(runs) if isinstance(budgets, int) else list(budgets)
    if len(budgets) != len(runs):
        raise ConfigError(f"serving path: {len(budgets)} budgets for {len(runs)} runs")
    engine, step_fit = fit_steps(latency, steps)
    engine["decode_rounds"] = decode_rounds(steps)
    works = [_workload(r) for r in runs]
    real = [latency_stats(r) for r in runs]
    held = [held_sla(m, base) for m in real]
    fitted = held if any(held) else [True] * len(runs)

    def cfg_of(x: Sequence[float]) -> SimConfig:
        x = [min(max(v, lo), hi) for v, (lo, hi) in zip(x, BOUNDS)]
        return SimConfig(**{**base.__dict__, **engine, **dict(zip(OVERHEADS, x))})

    def replays(cfg: SimConfig, which: Sequence[bool]) -> list[dict[str, float] | None]:
        """Each run's replay statistics where ``which`` says so (None elsewhere), every (run, seed) at once."""
        tasks = [(latency, exits, cfg, w, budget, s) for w, budget, on in zip(works, budgets, which) if on for s in seeds]
        done = iter(pool.replay(tasks) if pool is not None else _replay_all(tasks))
        return [_mean_stats([next(done) for _ in seeds]) if on else None for on in which]

    def loss(x: Sequence[float]) -> float:
        total = 0.0
        for sim, m in zip(replays(cfg_of(x), fitted), real):
            if sim is not None:
                total += sum(np.log(max(sim[k], 1e-6) / m[k]) ** 2 for k in FITTED if m[k])
        return float(total)

    best = minimize(loss, START, method="Nelder-Mead", bounds=BOUNDS,
                    options={"maxfev": max_evals, "xatol": 1e-2, "fatol": 1e-5})
    cfg = cfg_of(best.x)
    table = []
    for run, w, m, budget, f, h, sim in zip(runs, works, real, budgets, fitted, held, replays(cfg, [True] * len(runs))):
        rel = {k: abs(sim[k] - m[k]) / m[k] for k in METRICS if m[k]}
        span = max(float(w.arrival_s[-1] - w.arrival_s[0]), 1e-9)
        table.append({"requests": len(run), "budget": budget, "fitted": f, "held_sla": h, "rate_rps": len(run) / span,
                      "measured": {k: m[k] for k in METRICS}, "simulated": {k: sim[k] for k in METRICS}, "rel_err": rel,
                      "max_rel_err": max(rel.values()) if rel else None})
    fields = {k: getattr(cfg, k) for k in PARAMS}
    return ServingPath(**fields, rates=[t["rate_rps"] for t in table], requests=sum(len(r) for r in runs),
                       fit={"steps": step_fit, "runs": table, "loss": float(best.fun), "evaluations": int(best.nfev),
                            "max_rel_err": max((t["max_rel_err"] or 0.0) for t in table if t["fitted"])})


def held_sla(stats: dict[str, float | None], cfg: SimConfig) -> bool:
    """Whether a run's p95 TTFT and time per output token (``latency_stats``) are within ``cfg``'s SLA."""
    return all(v is not None and v <= limit for v, limit in ((stats["ttft_p95_ms"], cfg.sla_ttft_ms),
                                                              (stats["tpot_p95_ms"], cfg.sla_tpot_ms)))


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
    from scheduler.loadtest.bench_serve import BenchServeConfig, http_run
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


def count_lines(path: Path) -> int:
    """The complete lines of a step log written so far (0 before it exists)."""
    return path.read_text().count("\n") if path.is_file() else 0


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
