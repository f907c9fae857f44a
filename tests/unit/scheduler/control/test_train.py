"""``smartexit train-scheduler``: config validation, its inputs, episodes stepped as the environment steps
them, behaviour cloning over whole ordered sequences, and a tiny end-to-end run to a loadable folder."""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch

from edge.core.configio import apply, load_yaml, parse_overrides
from edge.core.errors import ConfigError
from edge.pipeline.cli import main as cli
from scheduler.control.env import EnvConfig, SchedulerEnv, index_of, layout_id
from scheduler.control.learned import LearnedPolicy
from scheduler.control.policies import AIMD, ControlAction
from scheduler.control.train import (Episode, Rollout, TrainSchedulerConfig, accuracy, behaviour_clone, engine_models,
                             run_episode)
from tests.unit.scheduler.control.test_learned import EX, LM, observations, tiny_model

ROOT = Path(__file__).parents[4]


@pytest.fixture(autouse=True)
def one_thread():
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


@pytest.fixture
def run_dir(tmp_path):
    """A run folder as `smartexit profile` and `smartexit calibrate` leave it (latency model, threshold table)."""
    run = tmp_path / "run"
    (run / "scheduler").mkdir(parents=True)
    (run / "calibration").mkdir()
    LM.save(run / "scheduler" / "latency.json")
    (run / "calibration" / "thresholds.json").write_text(json.dumps(
        {"exit_layers": [3, 9, 12], "expected_exit_fraction": {"3": 0.1, "9": 0.23, "12": 0.67}}))
    return run


# ------------------------------------------------------------------------------------------- config

@pytest.mark.parametrize("arg,msg", [
    ("env.patterns=[poisson, diurnal]", r"env.patterns includes \['diurnal'\], which the evaluation holds out"),
    ("n_envs=0", "n_envs must be >= 1"),
    ("loads=[]", "loads must be a non-empty list"),
    ("loads=[0.5, -1]", "loads must be"),
    ("clip_range=1.5", "clip_range must be in"),
    ("bc_smoothing=1", "bc_smoothing must be in"),
    ("net_arch=[]", "net_arch must list"),
    ("learning_rate=0", "learning_rate must be > 0"),
    ("env.patterns=[poissonn]", "env.patterns"),
])
def test_config_errors_name_the_field(arg, msg):
    with pytest.raises(ConfigError, match=msg):
        parse_overrides(TrainSchedulerConfig(), [arg])


def test_shipped_preset_validates():
    path = ROOT / "configs" / "train_scheduler.yaml"
    assert path.read_text().startswith("#")
    cfg = apply(TrainSchedulerConfig(), load_yaml(path))
    assert set(cfg.env.patterns) == {"poisson", "bursty"} and not cfg.quick
    plain = lambda c: json.loads(json.dumps(asdict(c)))  # noqa: E731 (tuples and lists alike)
    assert plain(cfg) == plain(TrainSchedulerConfig()), "the preset spells out the defaults the stage runs"


def test_quick_shrinks_the_run():
    cfg = parse_overrides(TrainSchedulerConfig(), ["quick=true"])
    assert cfg.total_timesteps <= 2048 and cfg.bc_episodes <= 4 and cfg.env.episode_s <= 15


# ------------------------------------------------------------------------------------------- inputs

def test_inputs_latency_and_the_tables_exit_fractions(run_dir):
    latency, exits, src = engine_models(TrainSchedulerConfig(run_dir=str(run_dir)))
    assert latency.coef == LM.coef and exits.layers == [3, 9, 12]
    assert exits.fractions == pytest.approx([0.1, 0.23, 0.67]) and src["exits"].endswith("thresholds.json")


def test_inputs_take_the_tables_fractions_and_the_traces_concentration(run_dir):
    """The fractions are the table's (the deployed batch-1 regime); the traces' exit-allowed tokens
    (a batch > 1 step lets no row exit: those tokens say nothing) give the between-request spread."""
    rng = np.random.default_rng(0)
    traces = [{"exit_layers": [int(x) for x in rng.choice([3, 9, 12], size=20, p=[0.5, 0.3, 0.2])] + [12] * 30,
               "exits_allowed": [True] * 20 + [False] * 30, "prompt_len": 9} for _ in range(12)]
    (run_dir / "scheduler" / "exit_traces.json").write_text(json.dumps(traces))
    table = json.loads((run_dir / "calibration" / "thresholds.json").read_text())
    _, exits, src = engine_models(TrainSchedulerConfig(run_dir=str(run_dir)))
    want = [table["expected_exit_fraction"][str(k)] for k in exits.layers]
    assert np.allclose(exits.fractions, np.asarray(want) / sum(want))
    assert "exit_traces.json (exit-allowed tokens)" in src["exits"] and exits.concentration > 1


@pytest.mark.parametrize("remove,override,msg", [
    ("scheduler/latency.json", [], "no such file \\(run `smartexit profile`\\)"),
    (None, ["exit_traces=/nowhere/traces.json"], "exit_traces /nowhere/traces.json does not exist"),
])
def test_missing_inputs_are_named(run_dir, remove, override, msg):
    if remove:
        (run_dir / remove).unlink()
    with pytest.raises(ConfigError, match=msg):
        engine_models(parse_overrides(TrainSchedulerConfig(run_dir=str(run_dir)), override))


def test_malformed_traces_are_refused(run_dir):
    (run_dir / "scheduler" / "exit_traces.json").write_text(json.dumps([{"layers": [3]}]))
    with pytest.raises(ConfigError, match="expected a JSON list of"):
        engine_models(TrainSchedulerConfig(run_dir=str(run_dir)))


def test_cli_fails_with_code_2_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "ppo"
    assert cli(["train-scheduler", f"run_dir={tmp_path / 'empty'}", f"out={out}", "quick=true"]) == 2
    assert "smartexit profile" in capsys.readouterr().err and not out.exists()


# ------------------------------------------------------------------------------------------- episodes

def test_run_episode_steps_as_the_environment_does():
    """The reference: SchedulerEnv replaying the same workload with the same simulator seed, stepped with
    the grid action of the same heuristic."""
    cfg = EnvConfig(episode_s=8.0, capacity_rps=20.0)
    from scheduler.control.env import make_workload
    from scheduler.control.policies import observation_from_stats

    w = make_workload("bursty", 30.0, cfg.episode_s, 7, cfg)
    env = SchedulerEnv(LM, EX, cfg, workloads=[w])
    obs, _ = env.reset(seed=3)
    aimd, env_obs, env_rewards, done = AIMD(), [obs], [], False
    while not done:
        a = aimd.act(observation_from_stats(env.sim.observe()))
        obs, r, term, trunc, _ = env.step(index_of(a))
        env_obs.append(obs)
        env_rewards.append(r)
        done = term or trunc
    got = run_episode(AIMD(), LM, EX, cfg, Episode("bursty", 1.5, w, env.sim.cfg.seed), quantize=True, record=True)
    assert got.rewards == env_rewards and got.reward == pytest.approx(sum(env_rewards))
    assert all(np.array_equal(a, b) for a, b in zip(got.obs, env_obs))
    assert len(got.actions) == len(env_rewards) and 0.0 <= got.attainment <= 1.0


# ------------------------------------------------------------------------------------------- behaviour cloning

def memory_task(n: int, steps: int, seed: int) -> list[Rollout]:
    """An expert whose action is set by the PREVIOUS tick's observation (its sign): a clone that sees
    steps one at a time, or shuffled, is at chance; one trained over whole ordered sequences is not."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        sign = rng.choice([-1.0, 1.0], size=steps)
        obs = [np.concatenate([[s], rng.uniform(-0.1, 0.1, 11)]).astype(np.float32) for s in sign]
        actions = [2] + [0 if s > 0 else 1 for s in sign[:-1]]
        out.append(Rollout(None, 0.0, 0.0, obs, actions, [1.0] * steps))  # type: ignore[arg-type]
    return out


def test_behaviour_cloning_learns_a_recurrent_expert():
    torch.manual_seed(0)
    net = tiny_model(hidden=16, arch=(16,)).policy
    train, held = memory_task(16, 30, seed=1), memory_task(6, 30, seed=2)
    assert accuracy(net, held) < 0.7
    res = behaviour_clone(net, train, held, epochs=150, lr=1e-2, gamma=0.9, value_coef=0.5, smoothing=0.05)
    assert res["accuracy_held_out"] > 0.9 and res["accuracy_train"] > 0.9
    assert res["majority_action_accuracy_held_out"] < 0.6   # no single action would do
    assert res["nll_last"] < res["nll_first"] and res["value_mse_last"] < res["value_mse_first"]


# ------------------------------------------------------------------------------------------- end to end

@pytest.mark.slow  # ~5 s: a whole (tiny) training run
def test_tiny_run_writes_a_loadable_policy(run_dir, tmp_path):
    out = tmp_path / "ppo"
    assert cli(["train-scheduler", f"run_dir={run_dir}", f"out={out}", "quick=true", "env.episode_s=5",
                "loads=[0.6]", "total_timesteps=256", "n_steps=64", "batch_size=64", "n_envs=1", "bc_epochs=5",
                "lstm_hidden=16", "net_arch=[16]"]) == 0
    p = LearnedPolicy.load(out)
    t = p.meta["training"]
    assert p.meta["layout_id"] == layout_id() and t["selected"] in ("bc", "ppo") and t["capacity_rps"] > 0
    assert t["best_baseline"] in t["baselines"] and 0.0 <= t["bc"]["accuracy_held_out"] <= 1.0
    assert p.meta["env"]["capacity_rps"] == t["capacity_rps"] and p.meta["latency"]["coef"] == LM.coef
    assert [r["pattern"] for r in t["test"]["rows"]] == ["bursty", "poisson", "all"]
    assert "## Behaviour cloning" in (out / "training.md").read_text()
    assert isinstance(p.act(observations(1)[0]), ControlAction)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["stages"]["train_scheduler"]["metrics"]["selected"] == t["selected_checkpoint"]
