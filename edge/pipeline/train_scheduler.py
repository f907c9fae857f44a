"""``smartexit train-scheduler``: the stage. The work is :mod:`scheduler.control.train`'s; this module reads the run, calls it and
records what it made."""
from __future__ import annotations

import copy
import math
import numpy as np
import time
from dataclasses import asdict
from functools import partial
from pathlib import Path

from edge.core.artifacts import Manifest
from scheduler.control.env import estimate_capacity
from scheduler.control.learned import DEFAULT_DIR, LearnedPolicy, save_artifact
from scheduler.control.policies import FixedBudget
from scheduler.control.train import SEEDS, STAGE, TrainSchedulerConfig, _stats, _test_rows, baselines, behaviour_clone, drawn_episodes, engine_models, evaluate, grid_episodes, make_model, mean_reward, render_markdown, run_episode


def main(cfg: TrainSchedulerConfig) -> int:
    """Train, select, evaluate, save the policy folder and record the stage; 0 on success.

    Raises:
        ConfigError: missing or malformed inputs (nothing is written then).
    """
    import torch as th

    t0, wall = time.perf_counter(), {}
    th.set_num_threads(cfg.threads)
    from dataclasses import replace

    from scheduler.control.engine_model import serving_fields

    latency, exits, sources = engine_models(cfg)
    env = cfg.env
    # the served engine: the bundle's audit and limits, the serving path the profile measured
    env.sim = replace(env.sim, **{k: v for k, v in serving_fields(cfg.run_dir).items()
                                  if k in env.sim.__dataclass_fields__})
    env.capacity_rps = estimate_capacity(latency, exits, env, FixedBudget(cfg.capacity_budget, env.sim.max_seqs))
    say = partial(print, flush=True)
    say(f"train-scheduler: capacity {env.capacity_rps:.2f} req/s (fixed {cfg.capacity_budget}, SLA "
        f"{env.sim.sla_ttft_ms:g} ms TTFT / {env.sim.sla_tpot_ms:g} ms per token)")
    sets = {k: grid_episodes(env, cfg.loads, n, SEEDS[k])
            for k, n in (("select", cfg.select_seeds), ("val", cfg.val_seeds), ("test", cfg.test_seeds))}
    heur = baselines(env)
    scores = {name: evaluate(make, latency, exits, env, sets["select"]) for name, make in heur.items()}
    best = max(scores, key=lambda k: mean_reward(scores[k]))
    say("train-scheduler: heuristics on training episodes: " + ", ".join(
        f"{k} {mean_reward(v):.1f}" for k, v in scores.items()) + f"; best {best}")
    wall["capacity_and_heuristics_s"] = time.perf_counter() - t0

    t1 = time.perf_counter()
    expert = [run_episode(heur[best](), latency, exits, env, ep, quantize=True, record=True)
              for ep in drawn_episodes(env, cfg.bc_episodes + cfg.bc_holdout, cfg.seed + SEEDS["bc"])]
    model = make_model(cfg, latency, exits, env)
    bc = behaviour_clone(model.policy, expert[:cfg.bc_episodes], expert[cfg.bc_episodes:], cfg.bc_epochs,
                         cfg.bc_lr, cfg.gamma, cfg.bc_value_coef, cfg.bc_smoothing)
    learned = LearnedPolicy(model)
    candidates = [("bc", 0, copy.deepcopy(model.policy.state_dict()),
                   mean_reward(evaluate(lambda: learned, latency, exits, env, sets["val"])))]
    wall["bc_s"] = time.perf_counter() - t1
    say(f"train-scheduler: behaviour cloning of {best}: held-out accuracy {bc['accuracy_held_out']:.3f} (majority "
        f"action {bc['majority_action_accuracy_held_out']:.3f}); validation reward {candidates[0][3]:.1f}")

    t2 = time.perf_counter()
    unit = cfg.n_steps * cfg.n_envs
    chunk = max(1, math.ceil(cfg.total_timesteps / cfg.checkpoints / unit)) * unit
    curve = []
    for k in range(cfg.checkpoints):
        model.learn(chunk, reset_num_timesteps=k == 0)
        val = mean_reward(evaluate(lambda: learned, latency, exits, env, sets["val"]))
        train_r = [e["r"] for e in model.ep_info_buffer]
        curve.append({"timesteps": int(model.num_timesteps), "seconds": time.perf_counter() - t2,
                      "train_episode_reward": float(np.mean(train_r)) if train_r else None, "val_reward": val})
        candidates.append((f"ppo@{model.num_timesteps}", int(model.num_timesteps),
                           copy.deepcopy(model.policy.state_dict()), val))
        say(f"train-scheduler: PPO {model.num_timesteps} steps ({time.perf_counter() - t2:.0f} s): validation "
            f"reward {val:.1f}")
    wall["ppo_s"] = time.perf_counter() - t2
    name, steps, state, val = max(candidates, key=lambda c: c[3])
    model.policy.load_state_dict(state)

    t3 = time.perf_counter()
    base_val = mean_reward(evaluate(heur[best], latency, exits, env, sets["val"]))
    test = {best: evaluate(heur[best], latency, exits, env, sets["test"]),
            "learned": evaluate(lambda: learned, latency, exits, env, sets["test"])}
    wall["test_s"] = time.perf_counter() - t3
    wall["total_s"] = time.perf_counter() - t0
    summary = {"capacity_rps": env.capacity_rps, "best_baseline": best,
               "baselines": {k: _stats(v) for k, v in scores.items()}, "bc": bc, "ppo": {"curve": curve},
               "selected": "bc" if name == "bc" else "ppo", "selected_checkpoint": name, "selected_timesteps": steps,
               "validation": {"selected": val, best: base_val, **{c[0]: c[3] for c in candidates}},
               "test": {"baseline": best, "rows": _test_rows(test, best)}, "wall_s": wall,
               "threads": cfg.threads}
    meta = {"latency": {"path": sources["latency"], "coef": latency.coef, "fit": latency.fit,
                        "num_layers": latency.num_layers, "exit_layers": latency.exit_layers},
            "exit_model": {"source": sources["exits"], **asdict(exits)}, "env": asdict(env),
            "policy_kwargs": {"lstm_hidden_size": cfg.lstm_hidden, "net_arch": list(cfg.net_arch)},
            "training": summary, "config": asdict(cfg)}
    out = Path(cfg.out) if cfg.out else DEFAULT_DIR
    save_artifact(model, out, meta, {"training.md": render_markdown(meta)})
    say(f"train-scheduler: kept {name} (validation {val:.1f} vs {best} {base_val:.1f}); test reward "
        f"{mean_reward(test['learned']):.1f} vs {mean_reward(test[best]):.1f}; {wall['total_s']:.0f} s; wrote {out}")
    inputs = {k: p for k, p in sources.items() if k != "exits"}  # files, hashed by the manifest
    Manifest(cfg.run_dir).record(STAGE, inputs=inputs, config=asdict(cfg), outputs={"policy": out},
                                 metrics={"capacity_rps": env.capacity_rps, "bc_accuracy": bc["accuracy_held_out"],
                                          "selected": name, "val_reward": val, "val_reward_baseline": base_val},
                                 seconds=wall["total_s"])
    return 0
