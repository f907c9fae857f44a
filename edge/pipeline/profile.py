"""``smartexit profile``: the stage. The work is :mod:`scheduler.loadtest.profile`'s and its ``profile_*``
modules'; this module reads the run, calls it and records what it made."""
from __future__ import annotations

import gc
import json
import numpy as np
import time
from dataclasses import asdict
from pathlib import Path

from edge.core.artifacts import Manifest, atomic_path, atomic_write_json, atomic_write_text
from scheduler.control.latency import FEATURES, fit_latency
from scheduler.loadtest.profile import STAGE, bundle_path, machine_info, prompt_pool
from scheduler.loadtest.profile_config import ProfileConfig, check_scenarios, generate_scenarios
from scheduler.loadtest.profile_driver import run_profile
from scheduler.loadtest.profile_fit import design, held_out_groups, per_scenario


def main(cfg: ProfileConfig) -> int:
    """Profile, fit, write the outputs and record the stage; 0 on success.

    Raises:
        ConfigError: no bundle, a scenario the bundle cannot run, or a profile too small to fit
            (fit_latency's message); nothing is written then.
    """
    from scheduler.serving.bundle import open_bundle
    from scheduler.loadtest.profile_report import render_markdown
    from scheduler.control.engine_model import SERVING_JSON
    from scheduler.loadtest.serving_path import RUNS_JSON, calibrate

    t0 = time.perf_counter()
    bundle = bundle_path(cfg)
    engine = open_bundle(bundle, threads=cfg.threads).engine  # stepped here: the host's thread never starts
    ecfg = engine.cfg
    scenarios = cfg.scenario_list or generate_scenarios(cfg.scenarios, cfg.seed, ecfg.max_seqs, ecfg.max_len,
                                                        cfg.budgets, cfg.max_output)
    check_scenarios(scenarios, ecfg.max_seqs, ecfg.max_len)
    pool, stop = prompt_pool(bundle)
    exits = list(engine.backend.exit_layers)
    print(f"profile: {len(scenarios)} scenarios x {cfg.steps_per_scenario} steps on {bundle}", flush=True)
    prof = run_profile(engine, pool, stop, scenarios, cfg.steps_per_scenario, cfg.warmup_steps, cfg.seed,
                       cfg.trace_steps)
    X, y, groups = design(prof.steps)
    model = fit_latency(X, y, engine.backend.num_layers, exits, groups=groups, holdout=cfg.holdout, seed=cfg.seed)
    held = held_out_groups(groups, cfg.holdout, cfg.seed)
    if int(np.isin(groups, list(held)).sum()) != model.fit["test_points"]:
        held = None  # fit_latency drew another way: the table leaves the column unknown
    asked = cfg.threads if cfg.threads is not None else \
        json.loads((bundle / "bundle.json").read_text()).get("host", {}).get("threads")
    machine = machine_info(engine, asked)
    model.fit.update({"source": "smartexit profile", "machine": machine})
    report = {"config": asdict(cfg), "bundle": str(bundle), "machine": machine, "coef": model.coef,
              "fit": model.fit, "features": list(FEATURES), "scenarios": [asdict(s) for s in scenarios],
              "per_scenario": per_scenario(model, X, y, groups, held, scenarios),
              "exit_fractions": prof.exit_fractions(exits),
              "exit_fractions_exits_allowed": prof.exit_fractions(exits, only_allowed=True),
              "bounded_decode_tokens": sum(len(t["exit_layers"]) for t in prof.traces.values()), "steps": prof.steps}
    out = Path(cfg.run_dir) / "scheduler"
    paths = {"latency": out / "latency.json", "profile": out / "profile.json", "profile_md": out / "profile.md",
             "exit_traces": out / "exit_traces.json"}
    with atomic_path(paths["latency"]) as tmp:
        model.save(tmp)
    atomic_write_json(paths["exit_traces"], [t for t in prof.traces.values() if t["exit_layers"]])
    fit = model.fit
    print(f"profile: {fit['points']} steps in {time.perf_counter() - t0:.1f} s; held-out relative error median "
          f"{fit['test_rel_err_median']:.3f}, p90 {fit['test_rel_err_p90']:.3f}; wrote {out}", flush=True)
    metrics = {k: fit[k] for k in ("test_rel_err_median", "test_rel_err_p90", "test_scenario_mean_rel_err_median",
                                   "test_scenario_mean_rel_err_max", "points", "scenarios")}
    if cfg.serving:
        del engine  # its ONNX Runtime sessions: the stack's engine gets the CPU to itself
        gc.collect()
        sp = calibrate(cfg.run_dir, model, pool, ecfg.max_seqs, cfg.serving_runs, cfg.serving_duration_s, cfg.seed,
                       cfg.serving_warmup_requests, cfg.serving_edge_run, cfg.serving_starts)
        paths["serving"], paths["serving_runs"] = out / SERVING_JSON, out / RUNS_JSON
        report["serving"] = asdict(sp)
        metrics.update({k: v for k, v in sp.sim_fields().items() if not isinstance(v, dict)})
        rounds = (sp.decode_rounds or {}).get("1")
        if rounds:  # at batch 1: the share of a sequence's steps that were draft rounds, and its tokens per step
            from scheduler.control.sim_config import round_summary

            metrics["draft_round_share_b1"], metrics["tokens_per_step_b1"] = round_summary(rounds)
        metrics["serving_fit_max_rel_err"] = sp.fit["max_rel_err"]
    atomic_write_text(paths["profile_md"], render_markdown(report))
    atomic_write_json(paths["profile"], report)
    Manifest(cfg.run_dir).record(STAGE, inputs={"bundle": bundle}, config=asdict(cfg), outputs=paths,
                                 metrics=metrics, seconds=time.perf_counter() - t0)
    return 0
