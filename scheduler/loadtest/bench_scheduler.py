"""``smartexit bench scheduler``: the learned scheduler against the heuristics, in the simulator and
on the real served stack, and the simulator against the real stack.

1. Simulator grid (:mod:`scheduler.control.evaluate`): held-out workloads (Poisson and bursty arrivals on
   seeds never drawn in training, diurnal arrivals never used in training at all, and the Azure code
   trace or any file with its columns, ``--trace FILE``) x loads from light to past saturation
   (multiples of the capacity estimated for this engine's latency model) x policies (every fixed
   budget of the sweep, AIMD, max-delay batching, the learned policy).
2. Real stack: at the load where the best fixed budget just holds the SLA on the real-stack workload,
   a served run (Ray Serve -> Triton -> engine) with that fixed budget and one with the learned policy.
3. Validation: served runs of the same workload family at loads below that edge (``validation_loads``,
   shares of its rate; the same stack as the fixed budget's run, before it) and the two runs at the
   edge, each replayed in the simulator (same arrivals, prompt lengths and the output lengths the
   server produced) with the serving path ``smartexit profile`` fitted on its own requests
   (scheduler/loadtest/serving_path.py), never on these runs: simulated vs measured TTFT and time per output
   token, p50 and p95. ``sim_validation_max_rel_err`` is the largest error of the runs below the
   edge; at the edge itself the stack sits at its knee, where on a 2-core machine two runs of one
   schedule differ by up to 2x (docs/scheduler.md), and its errors are reported apart.
4. The simulator against the stack's own noise: each validation load's schedule is served
   ``validation_repeats`` times, interleaved with the other loads, ``validation_fresh_stacks`` of them on
   a stack started for each (warmed first, as the first stack is by the edge runs); per load and metric
   the simulator's error is divided by the served runs' spread
   (:func:`~scheduler.loadtest.bench_scheduler_validation.noise_check`: between runs on different starts of
   the stack, as the simulator's serving path was fitted on another start, the profile's; the spread on one
   stack and the ratio against it reported beside it);
   ``sim_error_vs_repeat_spread_max`` is the largest ratio (goal <= 1.5). The served runs at
   ``sla_check_share`` (0.8) of the edge must hold p95 TTFT and TPOT within the SLA
   (``p95_within_sla_at_0_8_edge``).
5. Past the edge (``overload``, a multiple of the edge's rate): there the edge's ceiling (~1 / 0.95) no longer
   binds, and what a policy adds shows. The learned policy, the best fixed budget of that load in the simulator
   and the heuristics of ``overload_heuristics`` serve one schedule each, ``overload_repeats`` times, interleaved
   (every repeat runs every policy, the order rotated), with the same shedding rule, on the first stack started
   for a validation repeat, which they warm for its validation runs (else on the edge's stack, last): goodput ratios
   per repeat, their median and range (:func:`~scheduler.loadtest.bench_scheduler_overload.overload_report`).
   The best constant action of the learned policy's own grid (budget x admission limit,
   :func:`~scheduler.loadtest.bench_scheduler_overload.constant_actions`) serves beside them: a policy that only
   learned a better constant is worth that constant.

Writes ``<run>/bench/scheduler.json`` (the report's ``scheduler`` section) and ``scheduler.md`` (and, with the
real stack, ``scheduler_runs.json``: its fixed-budget runs' requests, for replays without a stack);
records stage ``bench_scheduler`` in the manifest.
"""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from edge.core.artifacts import atomic_write_json, atomic_write_text
from edge.core.errors import ConfigError
from scheduler.control.outcomes import summarize
from scheduler.control.engine_model import PARAMS
from scheduler.control.env import EnvConfig
from scheduler.control.evaluate import FIXED_PREFIX, WorkloadSpec, best_fixed, workload_for
from scheduler.control.exit_model import ExitModel
from scheduler.control.latency import LatencyModel
from scheduler.control.policies import FixedBudget
from scheduler.control.registry import make_policy
from scheduler.control.sim_config import SimConfig
from scheduler.control.workload import SHARED_TRACE, read_workload_file
from scheduler.loadtest.bench_scheduler_config import ABLATED, LEARNED, BenchSchedulerConfig
from scheduler.loadtest.bench_scheduler_overload import by_policy, constant_actions, goodput_ceiling, overload_report, overload_setup
from scheduler.loadtest.bench_scheduler_served import real_schedule, served
from scheduler.loadtest.bench_scheduler_validation import noise_check, repeat_spread, sla_check, validate
from scheduler.loadtest.serving_runs import save_runs

RUNS_FILE = "scheduler_runs.json"  # the real stack's fixed-budget runs, as serving_runs.save_runs writes them


# --------------------------------------------------------------------------- inputs

def load_inputs(cfg: BenchSchedulerConfig) -> tuple[LatencyModel, ExitModel, Any, dict[str, Any]]:
    """(latency model, exit model, learned policy, its policy.json)."""
    from scheduler.control.learned import DEFAULT_DIR, LearnedPolicy

    from scheduler.control.engine_model import from_run

    latency, exits, _ = from_run(cfg.run_dir, cfg.latency)
    cfg.policy = str(cfg.policy or DEFAULT_DIR)
    learned = LearnedPolicy.load(cfg.policy)
    return latency, exits, learned, learned.meta


def env_config(cfg: BenchSchedulerConfig, info: dict[str, Any]) -> EnvConfig:
    """The environment the policy was trained in, with this run's measured serving path (where
    ``smartexit profile`` measured one) and the SLA overridden where the config says."""
    from scheduler.control.engine_model import serving_fields

    env = dict(info.get("env") or {})
    env.pop("capacity_rps", None)
    sim = {k: v for k, v in dict(env.get("sim") or {}).items() if k in SimConfig.__dataclass_fields__}
    env["sim"] = {**sim, **serving_fields(cfg.run_dir)}
    e = EnvConfig(**{k: v for k, v in env.items() if k in EnvConfig.__dataclass_fields__})
    if cfg.sla_ttft_ms is not None:
        e.sim.sla_ttft_ms = cfg.sla_ttft_ms
    if cfg.sla_tpot_ms is not None:
        e.sim.sla_tpot_ms = cfg.sla_tpot_ms
    if cfg.shed_late is not None:
        e.sim.shed_late = cfg.shed_late
    return e


def capacity_policy(info: dict[str, Any], env: EnvConfig) -> FixedBudget:
    """The fixed budget whose capacity set the policy's training loads (policy.json's recorded
    ``config.capacity_budget``), at the full admission limit.

    Raises:
        ConfigError: policy.json records no capacity budget.
    """
    try:
        budget = int(info["config"]["capacity_budget"])
    except (KeyError, TypeError, ValueError):
        raise ConfigError("learned policy: policy.json records no config.capacity_budget (the fixed budget its "
                          "loads were scaled by); retrain with `make train-scheduler`") from None
    return FixedBudget(budget, env.sim.max_seqs)


def workload_specs(cfg: BenchSchedulerConfig) -> tuple[list[WorkloadSpec], str]:
    """The held-out families; the trace (``cfg.trace`` must exist; the shared one where present)."""
    specs = [WorkloadSpec(f"{p}-s{s}", p, s) for p in cfg.patterns for s in cfg.seeds]
    if cfg.trace is not None or SHARED_TRACE.is_file():
        path = Path(cfg.trace) if cfg.trace is not None else SHARED_TRACE
        specs.append(WorkloadSpec("trace", "trace", cfg.seed, read_workload_file(path)))
        note = f"trace {path}"
    else:
        note = f"no trace (none named, none at {SHARED_TRACE}): synthetic workloads only"
    return specs, note


def policy_factories(cfg: BenchSchedulerConfig, learned: Any, ablated: Any = None) -> dict[str, Any]:
    out: dict[str, Any] = {f"{FIXED_PREFIX}{b}": (lambda b=b: FixedBudget(b)) for b in cfg.budgets}
    for h in cfg.heuristics:
        make_policy(h)  # an unknown name fails here, before the grid runs
        out[h] = lambda h=h: make_policy(h)
    out[LEARNED] = lambda: learned
    if ablated is not None:
        out[ABLATED] = lambda: ablated
    return out


# --------------------------------------------------------------------------- main


def predictor_report(run: Path) -> dict[str, Any] | None:
    """The exit-depth predictors' held-out error on the profile's per-request exit traces (None without them)."""
    from scheduler.control.engine_model import exit_traces
    from scheduler.control.predictor import evaluate_predictors

    traces = exit_traces(run / "scheduler" / "exit_traces.json")
    if traces is None:
        return None
    traces = [{k: t[k] for k in ("prompt_len", "prompt_ids_head", "exit_layers")} for t in traces
              if len(t["exit_layers"]) >= 2]
    try:
        r = evaluate_predictors(traces)
    except ConfigError as exc:
        return {"error": str(exc)}
    return {k: r[k] for k in ("requests", "tokens", "token_mae", "request_mae", "global_mean") if k in r} | {
        "train_requests": len(r["train_ids"]), "test_requests": len(r["test_ids"]),
        "traces": "the profile's exit traces, tokens decoded where rows may exit"}


def _env_dict(env: EnvConfig) -> dict[str, Any]:
    d = asdict(env)
    d["patterns"] = list(d["patterns"])
    return d


def real_runs(cfg: BenchSchedulerConfig, env: EnvConfig, latency: LatencyModel, exits: ExitModel, learned: Any,
              spec: WorkloadSpec, cells: dict, capacity: float) -> dict[str, Any]:
    from scheduler.control.evaluate import sla_edge

    load = cfg.real_load or sla_edge(cells, spec.name, cfg.loads) or cfg.loads[0]
    name, _ = best_fixed(cells, spec.name, load)
    budget = int(name[len(FIXED_PREFIX):])
    w = workload_for(spec, load * capacity, cfg.real_duration_s, env)
    schedule = real_schedule(cfg, w)
    print(f"bench scheduler: real stack, {spec.name} at x{load:g} ({len(schedule)} requests): {LEARNED} then {name}",
          flush=True)
    # one stack, the learned policy and the best fixed budget back to back on the same schedule, then the
    # validation runs (the fixed budget). With a stack per policy, the second, started right after the
    # first, ran slower on this 2-core VM (the same actions: 0.86 and 0.78 goodput), biasing the ratio.
    # One schedule per validation load, served validation_repeats times, interleaved: every repeat runs
    # every load in turn, so a slow minute of the machine does not land on one load's repeats only
    schedules = {f: real_schedule(cfg, workload_for(spec, f * load * capacity, cfg.validation_duration_s, env))
                 for f in cfg.validation_loads}
    # the repeats on the first stack, then one stack per fresh repeat, warmed by the edge's schedule as the first
    # was (on a fresh stack the first run measured TPOT p50 4.7-7.2 ms where the next ones measured 2.8-3.9: the
    # engine measures per batch size whether drafting pays, and its drafts' acceptance, as it runs)
    fixed_kw = {"prefill_budget": budget, "max_running": env.sim.max_seqs}
    first = cfg.validation_repeats - cfg.validation_fresh_stacks
    below = [(f, schedules[f], 0) for _ in range(first) for f in cfg.validation_loads]
    # past the edge: every policy serves one schedule, interleaved. Where a stack is started for a validation repeat,
    # on that one, first: they warm it for its validation runs in place of the edge's schedule (after one unmeasured
    # run of their own schedule, so that no policy's first run meets a cold engine); else after the first stack's
    consts = (constant_actions(latency, exits, env, spec, [load, load * cfg.overload], capacity, cfg.duration_s,
                               cfg.sim_seeds, learned) if cfg.overload else None)
    over = overload_setup(cfg, env, spec, cells, load, capacity, consts) if consts and cfg.overload_repeats else None
    over_runs = [] if over is None else [(*over["settings"][p], over["schedule"]) for _, p in over["plan"]]
    if over is not None:
        print(f"bench scheduler: past the edge, x{cfg.overload:g} of it ({len(over['schedule'])} requests): "
              f"{', '.join(over['policies'])}, {cfg.overload_repeats} repeats interleaved", flush=True)
    on_first = over_runs if cfg.validation_fresh_stacks == 0 else []
    learned_res, fixed_res, *rest = served(
        cfg, env, [(LEARNED, {"path": cfg.policy}, schedule), ("fixed", fixed_kw, schedule)]
        + [("fixed", fixed_kw, s) for _, s, _ in below] + on_first)
    below_res, over_res = rest[:len(below)], rest[len(below):]
    for k in range(1, cfg.validation_fresh_stacks + 1):
        print(f"bench scheduler: validation repeat on a stack of its own ({k} of {cfg.validation_fresh_stacks})",
              flush=True)
        more = [(f, schedules[f], k) for f in cfg.validation_loads]
        below += more
        head = [("fixed", fixed_kw, schedule)]
        if k == 1 and over_runs:
            head = [over["settings"][over["best_fixed"]] + (over["schedule"],)] + over_runs
        res = served(cfg, env, head + [("fixed", fixed_kw, s) for _, s, _ in more])
        if k == 1 and over_runs:
            over_res = res[1:len(head)]
        below_res += res[len(head):]
    sla = (env.sim.sla_ttft_ms, env.sim.sla_tpot_ms)
    runs = {name: summarize(fixed_res, *sla), LEARNED: summarize(learned_res, *sla)}
    fixed = FixedBudget(budget, env.sim.max_seqs)
    val = {name: validate(latency, exits, env, fixed_res, fixed, cfg.validation_seeds),
           LEARNED: validate(latency, exits, env, learned_res, learned, cfg.validation_seeds)}
    below_val = [{"share_of_edge": f, "rate_rps": f * load * capacity, "policy": name, "stack": k,
                  **validate(latency, exits, env, res, fixed, cfg.validation_seeds)}
                 for (f, _, k), res in zip(below, below_res)]
    # the fixed budget's served runs as the simulator replays them (a replay or a refit needs no stack)
    save_runs(Path(cfg.run_dir) / "bench" / RUNS_FILE, [fixed_res] + below_res, [budget] * (1 + len(below_res)),
              [{"share_of_edge": 1.0, "stack": 0}] + [{"share_of_edge": f, "stack": k} for f, _, k in below])
    ratio = runs[LEARNED]["goodput_rps"] / runs[name]["goodput_rps"] if runs[name]["goodput_rps"] else None
    at_check = [summarize(res, *sla) for (f, _, _), res in zip(below, below_res) if f == cfg.sla_check_share]
    return {"workload": spec.name, "load": load, "rate_rps": load * capacity, "best_fixed": name,
            "runs": runs, "serving_path": {k: getattr(env.sim, k) for k in PARAMS},
            "validation": val, "validation_below_edge": below_val, "repeat_spread": repeat_spread(below_val),
            "noise_check": noise_check(below_val), "sla_check": sla_check(at_check, cfg.sla_check_share, name),
            "goodput_ratio": ratio, "goodput_ceiling": goodput_ceiling(runs[name]),
            "constant_actions_sim": consts,
            "overload": None if over is None else overload_report(
                by_policy(over["plan"], [summarize(r, *sla) for r in over_res]), LEARNED, over["best_fixed"],
                cfg.overload, load * cfg.overload * capacity, over["best_fixed_from"], over["best_constant"],
                "the edge's stack, after its validation runs" if on_first else
                "the stack started for the validation's fresh repeat, after one unmeasured run of their schedule")}


def summary(report: dict[str, Any], cells: dict, real_w: str) -> dict[str, Any]:
    sim = report["sim"]
    attain: dict[str, dict[str, float]] = {}
    for (w, _, p), c in cells.items():
        attain.setdefault(p, {}).setdefault(w, []).append(c["sla_attainment"])
    out: dict[str, Any] = {
        "goodput_ratio_vs_best_fixed": sim["goodput_ratio_vs_best_fixed"],
        "goodput_ratio_vs_best_fixed_min": sim["goodput_ratio_vs_best_fixed_min"],
        "goodput_ratio_vs_best_fixed_at_sla_edge_sim": {w: v["ratio"] for w, v in sim["at_sla_edge"].items()},
        "sla_capacity_ratio_sim": {w: v["ratio"] for w, v in sim["sla_capacity"].items()},
        "sla_attainment": {p: float(np.mean([x for v in ws.values() for x in v])) for p, ws in attain.items()},
        "capacity_rps": report["capacity_rps"], "capacities_rps": report["capacities_rps"],
        # the grid and the served repeats this run had (the demo's reduced form or make bench-scheduler's full one)
        "loads": (report.get("config") or {}).get("loads"),
        "validation_repeats": (report.get("config") or {}).get("validation_repeats"),
    }
    abl = sim.get("exit_features_ablation")
    if abl:
        out["goodput_ratio_exit_features_ablation"] = abl["median"]
        out["goodput_ratio_exit_features_ablation_min"] = abl["min"]
    pred = report.get("predictor") or {}
    if "token_mae" in pred:
        out["exit_depth_predictor_mae_layers"] = pred["token_mae"]
    real = report.get("real")
    if real:
        out["goodput_ratio_vs_best_fixed_at_sla_edge"] = real["goodput_ratio"]
        out["goodput_ceiling_vs_best_fixed_at_sla_edge"] = real.get("goodput_ceiling")
        out["sla_attainment_real"] = {p: s["sla_attainment"] for p, s in real["runs"].items()}
        below = [v["max_rel_err"] for v in real["validation_below_edge"] if v["max_rel_err"] is not None]
        edge = [v["max_rel_err"] for v in real["validation"].values() if v["max_rel_err"] is not None]
        out["sim_validation_max_rel_err"] = max(below) if below else None
        out["sim_validation_loads_rps"] = [v["rate_rps"] for v in real["validation_below_edge"]]
        out["sim_validation_at_edge_max_rel_err"] = max(edge) if edge else None
        spread = real.get("repeat_spread")
        out["real_repeat_max_rel_diff"] = spread["max_rel_diff"] if spread else None
        noise = real.get("noise_check")
        out["sim_error_vs_repeat_spread_max"] = noise["max_ratio"] if noise else None
        if noise:  # which spread the ratio reads, and the ratio against the runs on one stack beside it
            out["sim_repeat_spread"] = noise.get("spread", "one stack")
            out["sim_error_vs_one_stack_spread_max"] = noise.get("max_ratio_one_stack")
        check = real.get("sla_check")
        out["p95_within_sla_at_0_8_edge"] = check["held"] if check and check["share_of_edge"] == 0.8 else None
        over = real.get("overload")
        if over:
            out["overload_factor"] = over["factor"]
            out["overload_repeats"] = over["repeats"]
            vs = over["ratio_vs"]
            fixed = vs.get(over["best_fixed"], {})
            out["goodput_ratio_vs_best_fixed_overload"] = fixed.get("median")
            out["goodput_ratio_vs_best_fixed_overload_range"] = [fixed.get("min"), fixed.get("max")]
            for h, r in vs.items():
                key = "best_constant" if h == over.get("best_constant") else h
                if h != over["best_fixed"] or key == "best_constant":
                    out[f"goodput_ratio_vs_{key}_overload"] = r["median"]
                    out[f"goodput_ratio_vs_{key}_overload_range"] = [r["min"], r["max"]]
            out["best_constant_overload"] = over.get("best_constant")
            out["sla_attainment_overload"] = {p: v["median"] for p, v in over["sla_attainment"].items()}
        consts = real.get("constant_actions_sim")
        if consts:  # the simulator's learned policy over the best constant action of its own grid, at the edge and past
            edge, past = sorted(consts.values(), key=lambda c: c["load"])[:2]
            out["goodput_ratio_vs_best_constant_sim_at_sla_edge"] = edge["ratio"]
            out["goodput_ratio_vs_best_constant_sim_overload"] = past["ratio"]
    return out


def render_headline(s: dict[str, Any]) -> str:
    lines = [f"  goodput vs best fixed (sim, min over loads): {s['goodput_ratio_vs_best_fixed']}"]
    if "goodput_ratio_exit_features_ablation" in s:
        lines.append(f"  learned / learned without exit-depth features (sim, median over cells): "
                     f"{s['goodput_ratio_exit_features_ablation']:.3f} (smallest "
                     f"{s['goodput_ratio_exit_features_ablation_min']:.3f})")
    if "goodput_ratio_vs_best_fixed_at_sla_edge" in s:
        lines.append(f"  real stack at the SLA edge: goodput ratio {s['goodput_ratio_vs_best_fixed_at_sla_edge']} "
                     f"(ceiling {s.get('goodput_ceiling_vs_best_fixed_at_sla_edge')}: every request within the SLA, the "
                     f"runs' lengths aside), "
                     f"sim validation max rel err {s['sim_validation_max_rel_err']} below the edge, "
                     f"{s['sim_validation_at_edge_max_rel_err']} at it; sim error / served repeat spread, largest "
                     f"{s.get('sim_error_vs_repeat_spread_max')} (spread {s.get('sim_repeat_spread')}; against runs on "
                     f"one stack {s.get('sim_error_vs_one_stack_spread_max')}); p95 within the SLA at 0.8x the edge: "
                     f"{s.get('p95_within_sla_at_0_8_edge')}")
    if s.get("overload_factor"):
        others = "".join(f", / {k[len('goodput_ratio_vs_'):-len('_overload')]} {s[k]} (range {s[k + '_range']})"
                         for k in s if k.startswith("goodput_ratio_vs_") and f"{k}_range" in s
                         and k != "goodput_ratio_vs_best_fixed_overload")
        lines.append(f"  real stack at x{s['overload_factor']:g} the edge ({s['overload_repeats']} repeats, medians): "
                     f"goodput learned / best fixed {s['goodput_ratio_vs_best_fixed_overload']} (range "
                     f"{s['goodput_ratio_vs_best_fixed_overload_range']}){others}")
    return "\n".join(lines)


def write_outputs(cfg: BenchSchedulerConfig, report: dict[str, Any]) -> dict[str, Path]:
    from scheduler.loadtest.bench_scheduler_report import render_markdown

    out = Path(cfg.run_dir) / "bench"
    paths = {"json": out / "scheduler.json", "md": out / "scheduler.md"}
    atomic_write_text(paths["md"], render_markdown(report))
    atomic_write_json(paths["json"], report)
    return paths
