"""``smartexit train-scheduler``: the learned control policy (scheduler/control/learned.py), trained in the simulator.

1. The engine: the latency model ``smartexit profile`` fitted (``<run>/scheduler/latency.json``) and the
   exit model (the profile's per-request exit traces where there are enough, else the threshold
   table's expected exit fractions: scheduler/control/exit_model.py ``ExitModel``).
2. Capacity: the highest Poisson rate at which a fixed budget keeps 95% of requests within the SLA
   (env.estimate_capacity); episode loads are multiples of it.
3. The best heuristic on training episodes, Poisson and bursty arrivals only (the evaluation,
   scheduler/loadtest/bench_scheduler.py, holds out diurnal arrivals and the Azure trace): every fixed budget
   of the grid at the full admission limit, AIMD, max-delay batching; best = highest mean reward.
4. Behaviour cloning: whole ordered episodes of that heuristic (its actions mapped onto the grid,
   ``env.index_of``, and applied so), the recurrent policy trained by cross-entropy over each whole
   sequence from zero LSTM states (``evaluate_actions``; the `imitation` library's BC cannot train a
   recurrent policy), the value head fitted to the discounted returns alongside so PPO starts with a critic.
5. PPO fine-tuning in the simulator (RecurrentPPO, ``n_envs`` environments), scored on validation
   episodes every ``total_timesteps / checkpoints`` steps.
6. The best of the BC policy and the PPO checkpoints on validation is kept, compared with the heuristic
   on held-out seeds, and saved with its numbers (policy.zip, policy.json, training.md).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Callable

import numpy as np

from edge.core.errors import ConfigError
from edge.runtime.settings import PREFILL_BUDGET, PREFILL_BUDGETS
from scheduler.control.outcomes import summarize
from scheduler.control.env import (EnvConfig, RewardConfig, SchedulerEnv, action_of, index_of, make_workload, obs_vector, reward_of)
from scheduler.control.exit_model import ExitModel
from scheduler.control.latency import LatencyModel
from scheduler.control.learned import zero_states
from scheduler.control.policies import AIMD, FixedBudget, MaxDelay, Policy, observation_from_stats
from scheduler.control.sim import Simulator
from scheduler.control.sim_config import SimConfig
from scheduler.control.workload import Workload

STAGE = "train_scheduler"
HELD_OUT = ("diurnal",)   # arrival patterns only the evaluation sees (the Azure trace is not a pattern at all)
SEEDS = {"select": 10_000, "bc": 20_000, "bc_holdout": 30_000, "val": 40_000, "test": 50_000}


@dataclass
class TrainSchedulerConfig:
    run_dir: str = "artifacts/demo"
    latency: str | None = None       # None: <run_dir>/scheduler/latency.json (`smartexit profile`)
    thresholds: str | None = None    # None: <run_dir>/calibration/thresholds.json
    exit_traces: str | None = None   # None: <run_dir>/scheduler/exit_traces.json where it exists
    out: str | None = None           # None: the shipped scheduler/assets/ppo
    # capacity_rps is replaced by the estimate; rewards / 1000 (not the env's 100): episode returns of
    # about +-10, so the value loss does not swamp the gradient norm sb3 clips actor and critic under together
    # The SLA: a deliberate override of the server's default (edge/runtime/settings.py, 1000 / 100 ms), half
    # of it, so the simulated engine is pushed to its knee at the training loads; the shipped policy was
    # trained for it (scheduler/assets/ppo/policy.json env.sim), and configs/train_scheduler.yaml spells it out
    env: EnvConfig = field(default_factory=lambda: EnvConfig(sim=SimConfig(sla_ttft_ms=500.0, sla_tpot_ms=50.0),
                                                             reward=RewardConfig(reward_scale=1000.0)))
    capacity_budget: int = PREFILL_BUDGET.default  # the fixed budget whose capacity sets the loads
    loads: list[float] = field(default_factory=lambda: [0.5, 0.8, 1.1, 1.4])  # x capacity: selection, validation, test
    select_seeds: int = 1            # episodes per (pattern, load) to pick the heuristic
    val_seeds: int = 1
    test_seeds: int = 2
    bc_episodes: int = 32            # heuristic episodes drawn as the environment draws them
    bc_holdout: int = 8
    bc_epochs: int = 150             # full-batch Adam steps
    bc_lr: float = 3e-3
    bc_value_coef: float = 0.5
    bc_smoothing: float = 0.1        # label smoothing: the clone keeps ~10% off the expert's action for PPO to explore
    total_timesteps: int = 150_000
    checkpoints: int = 4
    n_envs: int = 4
    n_steps: int = 256
    batch_size: int = 256
    n_epochs: int = 4
    learning_rate: float = 3e-4
    clip_range: float = 0.2
    ent_coef: float = 0.01           # keeps exploring around the clone
    gamma: float = 0.98              # a horizon of ~50 ticks (12 s): bursts and the queues they leave
    gae_lambda: float = 0.95
    lstm_hidden: int = 64
    net_arch: list[int] = field(default_factory=lambda: [64])
    seed: int = 0
    threads: int = 1                 # torch threads (2 thrash when the 2 cores are shared)
    quick: bool = False              # a smoke run (tests): a few episodes, a few PPO updates

    def __post_init__(self) -> None:
        if isinstance(self.env, dict):
            self.env = EnvConfig(**self.env)
        if self.quick:
            self.bc_episodes, self.bc_holdout = min(self.bc_episodes, 4), min(self.bc_holdout, 2)
            self.bc_epochs, self.total_timesteps = min(self.bc_epochs, 20), min(self.total_timesteps, 2048)
            self.checkpoints, self.n_steps, self.batch_size = 1, min(self.n_steps, 128), min(self.batch_size, 128)
            self.n_envs, self.loads, self.test_seeds = min(self.n_envs, 2), self.loads[:2], 1
            self.env.episode_s = min(self.env.episode_s, 15.0)
        held = [p for p in self.env.patterns if p in HELD_OUT]
        if held:
            raise ConfigError(f"train-scheduler: env.patterns includes {held}, which the evaluation holds out "
                              "(scheduler/loadtest/bench_scheduler.py); train on poisson and bursty")
        ints = ("capacity_budget", "select_seeds", "val_seeds", "test_seeds", "bc_episodes", "bc_holdout",
                "bc_epochs", "total_timesteps", "checkpoints", "n_envs", "n_steps", "batch_size", "n_epochs",
                "lstm_hidden", "threads")
        bad = [k for k in ints if getattr(self, k) < 1]
        if bad:
            raise ConfigError(f"train-scheduler: {', '.join(bad)} must be >= 1")
        if not self.loads or any(x <= 0 for x in self.loads):
            raise ConfigError(f"train-scheduler: loads must be a non-empty list of values > 0, got {self.loads}")
        if self.bc_lr <= 0 or self.learning_rate <= 0 or self.bc_value_coef < 0 or self.ent_coef < 0:
            raise ConfigError("train-scheduler: bc_lr and learning_rate must be > 0, bc_value_coef and ent_coef >= 0")
        if not 0 <= self.bc_smoothing < 1:
            raise ConfigError(f"train-scheduler: bc_smoothing must be in [0, 1), got {self.bc_smoothing}")
        if not 0 < self.clip_range < 1 or not 0 < self.gamma <= 1 or not 0 < self.gae_lambda <= 1:
            raise ConfigError("train-scheduler: clip_range must be in (0, 1), gamma and gae_lambda in (0, 1]")
        if not self.net_arch or any(n < 1 for n in self.net_arch):
            raise ConfigError(f"train-scheduler: net_arch must list layer widths >= 1, got {self.net_arch}")


# ------------------------------------------------------------------------------------------- inputs

def engine_models(cfg: TrainSchedulerConfig) -> tuple[LatencyModel, ExitModel, dict[str, Any]]:
    """(latency model, exit model, where each came from).

    Raises:
        ConfigError: no latency model; no exit traces and no threshold table; layers that disagree.
    """
    from scheduler.control.engine_model import from_run

    try:
        return from_run(cfg.run_dir, cfg.latency, cfg.thresholds, cfg.exit_traces)
    except ConfigError as exc:
        raise ConfigError(f"train-scheduler: {exc}") from None


def baselines(env: EnvConfig) -> dict[str, Callable[[], Policy]]:
    """name -> a fresh heuristic: every fixed budget of the grid at the full admission limit, AIMD, max-delay."""
    out: dict[str, Callable[[], Policy]] = {f"fixed-{b}": partial(FixedBudget, b, env.sim.max_seqs)
                                         for b in PREFILL_BUDGETS}
    out.update({"aimd": AIMD, "maxdelay": partial(MaxDelay, max_running=env.sim.max_seqs)})
    return out


# ------------------------------------------------------------------------------------------- episodes

@dataclass(frozen=True)
class Episode:
    pattern: str
    load: float         # x capacity
    workload: Workload
    sim_seed: int       # the exit-depth draws


@dataclass
class Rollout:
    episode: Episode
    reward: float
    attainment: float
    obs: list[np.ndarray] = field(default_factory=list)    # each [len(OBS_LAYOUT)], when recorded
    actions: list[int] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)


def grid_episodes(env: EnvConfig, loads: list[float], seeds: int, base: int) -> list[Episode]:
    """Every (training pattern, load, seed): evaluation sets that cover the loads evenly."""
    out = []
    for i, (p, load, s) in enumerate((p, x, s) for p in env.patterns for x in loads for s in range(seeds)):
        w = make_workload(p, load * env.capacity_rps, env.episode_s, base + 97 * i + s, env)
        out.append(Episode(p, load, w, base + i))
    return out


def drawn_episodes(env: EnvConfig, n: int, seed: int) -> list[Episode]:
    """``n`` episodes drawn as ``SchedulerEnv.reset`` draws them (pattern, log-uniform load, seeds)."""
    rng = np.random.default_rng(seed)
    lo, hi = env.load_range
    out = []
    for _ in range(n):
        p, load = str(rng.choice(list(env.patterns))), float(math.exp(rng.uniform(math.log(lo), math.log(hi))))
        w = make_workload(p, load * env.capacity_rps, env.episode_s, int(rng.integers(2 ** 31)), env)
        out.append(Episode(p, load, w, int(rng.integers(2 ** 31))))
    return out


def run_episode(policy: Policy, latency: LatencyModel, exits: ExitModel, env: EnvConfig, ep: Episode,
                quantize: bool = False, record: bool = False) -> Rollout:
    """One episode as ``SchedulerEnv`` steps it (a tick per act, the same reward), ``policy`` acting on the
    simulator's observation; ``quantize``: its action mapped onto the grid first (as the learned policy
    could act); ``record``: keep the observation vectors, grid actions and rewards."""
    sim = Simulator(latency, exits, replace(env.sim, seed=ep.sim_seed), ep.workload)
    if hasattr(policy, "reset"):
        policy.reset()
    out = Rollout(ep, 0.0, 0.0)
    while not sim.done and sim.t < env.episode_s:
        o = observation_from_stats(sim.observe())
        a = policy.act(o)
        idx = index_of(a) if quantize or record else -1
        if quantize:
            a = action_of(idx, o.max_seqs)
        sim.set(a.prefill_budget, a.max_running)
        sim.take_counts()
        sim.advance(sim.t + env.tick_s)
        r = reward_of(sim.take_counts(), env.reward)
        out.reward += r
        if record:
            out.obs.append(obs_vector(o, env.masked))
            out.actions.append(idx)
            out.rewards.append(r)
    out.attainment = summarize(sim.results(), env.sim.sla_ttft_ms, env.sim.sla_tpot_ms)["sla_attainment"]
    return out


def evaluate(make: Callable[[], Policy], latency: LatencyModel, exits: ExitModel, env: EnvConfig,
             episodes: list[Episode]) -> list[Rollout]:
    return [run_episode(make(), latency, exits, env, ep) for ep in episodes]


def mean_reward(rollouts: list[Rollout]) -> float:
    return float(np.mean([r.reward for r in rollouts]))


# ------------------------------------------------------------------------------------------- learning

def behaviour_clone(net: Any, train: list[Rollout], held: list[Rollout], epochs: int, lr: float, gamma: float,
                    value_coef: float, smoothing: float = 0.0) -> dict[str, Any]:
    """Fit ``net`` (a RecurrentActorCriticPolicy) to the recorded actions of whole ordered episodes: full-batch
    Adam on the cross-entropy of every step of every sequence, run from zero LSTM states, against the
    recorded action smoothed by ``smoothing`` (Szegedy et al., 2016: the clone keeps that much probability
    off the expert's action, so PPO still explores from it) + ``value_coef`` x the squared error of the
    value against the discounted return. Returns losses and accuracies (held-out: ``held``)."""
    import torch as th

    obs, act, ret, mask = _sequences(train, gamma)
    n, steps = mask.shape
    flat, m = obs.reshape(n * steps, -1), mask.reshape(-1)
    starts = th.zeros(n * steps)  # zero initial states: no reset inside a sequence
    opt = th.optim.Adam(net.parameters(), lr=lr)
    net.set_training_mode(True)
    losses = []
    for _ in range(epochs):
        states = zero_states(net, n)
        dist, _ = net.get_distribution(flat, states.pi, starts)
        logp = th.log_softmax(dist.distribution.logits, -1)                        # [N*T, A]
        nll = -logp.gather(1, act.reshape(-1, 1))[:, 0]
        ce = (1 - smoothing) * nll - smoothing * logp.mean(-1)
        values = net.predict_values(flat, states.vf, starts).reshape(-1)
        v_loss = (((values - ret.reshape(-1)) ** 2) * m).sum() / m.sum()
        opt.zero_grad()
        ((ce * m).sum() / m.sum() + value_coef * v_loss).backward()
        opt.step()
        losses.append((float(((nll * m).sum() / m.sum()).item()), v_loss.item()))
    net.set_training_mode(False)
    acts = np.concatenate([r.actions for r in held])
    majority = float(np.mean(acts == np.bincount(np.concatenate([r.actions for r in train])).argmax()))
    return {"episodes": len(train), "held_out_episodes": len(held), "steps": int(m.sum()), "epochs": epochs,
            "smoothing": smoothing, "nll_first": losses[0][0], "nll_last": losses[-1][0],
            "value_mse_first": losses[0][1], "value_mse_last": losses[-1][1], "accuracy_train": accuracy(net, train),
            "accuracy_held_out": accuracy(net, held), "majority_action_accuracy_held_out": majority}


def accuracy(net: Any, rollouts: list[Rollout]) -> float:
    """Share of steps where the policy's most likely action is the recorded one (teacher-forced sequences)."""
    import torch as th

    obs, act, _, mask = _sequences(rollouts, 1.0)
    n, steps = mask.shape
    with th.no_grad():
        dist, _ = net.get_distribution(obs.reshape(n * steps, -1), zero_states(net, n).pi, th.zeros(n * steps))
        pred = dist.get_actions(deterministic=True).reshape(n, steps)
    return float(((pred == act).float() * mask).sum() / mask.sum())


def _sequences(rollouts: list[Rollout], gamma: float) -> tuple[Any, Any, Any, Any]:
    """Padded obs [N, T, D], actions [N, T], discounted returns [N, T], mask [N, T]."""
    import torch as th

    n, steps, d = len(rollouts), max(len(r.actions) for r in rollouts), len(rollouts[0].obs[0])
    obs, act, ret, mask = np.zeros((n, steps, d), np.float32), np.zeros((n, steps), np.int64), \
        np.zeros((n, steps), np.float32), np.zeros((n, steps), np.float32)
    for i, r in enumerate(rollouts):
        k = len(r.actions)
        obs[i, :k], act[i, :k], mask[i, :k] = np.stack(r.obs), r.actions, 1.0
        g = 0.0
        for t in reversed(range(k)):
            g = r.rewards[t] + gamma * g
            ret[i, t] = g
    return th.from_numpy(obs), th.from_numpy(act), th.from_numpy(ret), th.from_numpy(mask)


def make_model(cfg: TrainSchedulerConfig, latency: LatencyModel, exits: ExitModel, env: EnvConfig) -> Any:
    from sb3_contrib import RecurrentPPO
    from stable_baselines3.common.vec_env import DummyVecEnv, VecMonitor

    from stable_baselines3.common.logger import Logger

    venv = VecMonitor(DummyVecEnv([partial(SchedulerEnv, latency, exits, env) for _ in range(cfg.n_envs)]))
    model = RecurrentPPO("MlpLstmPolicy", venv, learning_rate=cfg.learning_rate, n_steps=cfg.n_steps,
                        batch_size=cfg.batch_size, n_epochs=cfg.n_epochs, gamma=cfg.gamma, gae_lambda=cfg.gae_lambda,
                        clip_range=cfg.clip_range, ent_coef=cfg.ent_coef, seed=cfg.seed, device="cpu",
                        policy_kwargs={"lstm_hidden_size": cfg.lstm_hidden, "net_arch": list(cfg.net_arch)})
    # learn() would otherwise configure its own logger, which makes an empty /tmp/SB3-<time> per call
    model.set_logger(Logger(None, []))
    return model


# ------------------------------------------------------------------------------------------- the stage


def _stats(rollouts: list[Rollout]) -> dict[str, float]:
    return {"reward": mean_reward(rollouts), "attainment": float(np.mean([r.attainment for r in rollouts]))}


def _test_rows(test: dict[str, list[Rollout]], best: str) -> list[dict[str, Any]]:
    keys = sorted({(r.episode.pattern, r.episode.load) for r in test[best]})
    rows = []
    for p, load in [*keys, ("all", None)]:
        pick = {k: [r for r in v if p == "all" or (r.episode.pattern, r.episode.load) == (p, load)]
                for k, v in test.items()}
        rows.append({"pattern": p, "load": load, "episodes": len(pick[best]),
                     **{f"{k}_{s}": v for k in ("baseline", "learned")
                        for s, v in _stats(pick[best if k == "baseline" else "learned"]).items()}})
    return rows


def render_markdown(meta: dict[str, Any]) -> str:
    t, bc = meta["training"], meta["training"]["bc"]
    env, lat = meta["env"], meta["latency"]
    lines = ["# Learned scheduler: training", "",
             f"Latency model {lat['path']} (held-out step-time error median "
             f"{lat['fit'].get('test_rel_err_median', float('nan')):.3f}); exit model from "
             f"{meta['exit_model']['source']} (mean exit layer "
             f"{np.dot(meta['exit_model']['layers'], meta['exit_model']['fractions']):.2f} of {lat['num_layers']}).",
             f"SLA {env['sim']['sla_ttft_ms']:g} ms TTFT, {env['sim']['sla_tpot_ms']:g} ms per output token; "
             f"capacity (fixed budget, 95% attainment, Poisson): {t['capacity_rps']:.2f} req/s; training patterns "
             f"{', '.join(env['patterns'])} at {env['load_range'][0]:g}-{env['load_range'][1]:g} x capacity.", "",
             "## Heuristics on training episodes", "", "| policy | mean episode reward | SLA attainment |",
             "|---|---|---|"]
    lines += [f"| {k}{' (best)' if k == t['best_baseline'] else ''} | {v['reward']:.1f} | {v['attainment']:.3f} |"
              for k, v in t["baselines"].items()]
    lines += ["", "## Behaviour cloning", "",
              f"{bc['episodes']} episodes of {t['best_baseline']} ({bc['steps']} steps), {bc['epochs']} epochs, label "
              f"smoothing {bc['smoothing']:g}: "
              f"NLL {bc['nll_first']:.3f} -> {bc['nll_last']:.3f}, value MSE {bc['value_mse_first']:.2f} -> "
              f"{bc['value_mse_last']:.2f}. Accuracy: train {bc['accuracy_train']:.3f}, held-out "
              f"({bc['held_out_episodes']} episodes) {bc['accuracy_held_out']:.3f}; always the most common action: "
              f"{bc['majority_action_accuracy_held_out']:.3f}.", "",
              "## PPO fine-tuning", "",
              "| timesteps | seconds | training episode reward (last 100) | validation reward |", "|---|---|---|---|"]
    lines += [f"| {c['timesteps']} | {c['seconds']:.0f} | "
              f"{'-' if c['train_episode_reward'] is None else format(c['train_episode_reward'], '.1f')} | "
              f"{c['val_reward']:.1f} |" for c in t["ppo"]["curve"]]
    scores = ", ".join(f"{k} {x:.1f}" for k, x in t["validation"].items() if k != "selected")
    lines += ["", f"Validation (mean episode reward): {scores}. Kept: **{t['selected_checkpoint']}** "
              f"({t['selected']}).", "",
              f"## Held-out seeds (test): learned vs {t['best_baseline']}", "",
              "| pattern | load | episodes | reward baseline | reward learned | attainment baseline | attainment "
              "learned |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['pattern']} | {'' if r['load'] is None else format(r['load'], 'g')} | {r['episodes']} | "
              f"{r['baseline_reward']:.1f} | {r['learned_reward']:.1f} | {r['baseline_attainment']:.3f} | "
              f"{r['learned_attainment']:.3f} |" for r in t["test"]["rows"]]
    w = t["wall_s"]
    lines += ["", f"Wall time: {w['total_s']:.0f} s ({t['threads']} torch threads): capacity and heuristics "
              f"{w['capacity_and_heuristics_s']:.0f} s, behaviour cloning {w['bc_s']:.0f} s, PPO {w['ppo_s']:.0f} s, "
              f"test {w['test_s']:.0f} s.", ""]
    return "\n".join(lines)
