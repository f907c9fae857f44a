"""The learned policy's folder (round trip; refusal of a missing file, a changed zip, another layout, a
corrupt zip) and its recurrent acting (the LSTM state carried from tick to tick, as ``model.predict``)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from edge.core.errors import ConfigError
from scheduler.control.env import ACTIONS, OBS_LAYOUT, EnvConfig, SchedulerEnv, layout_id, obs_vector
from scheduler.control.exit_model import ExitModel
from scheduler.control.latency import FEATURES, LatencyModel
from scheduler.control.learned import META, ZIP, LearnedPolicy, save_artifact
from scheduler.control.policies import ControlAction, ControlObservation
from scheduler.control.registry import make_policy

LM = LatencyModel({f: 0.0 for f in FEATURES} | {"one": 1e-3, "decode_rows": 0.3e-3, "prefill_tokens": 0.15e-3,
                                                 "prefill_calls": 0.5e-3, "decode_layer_rows": 2e-5}, 12, [3, 9, 12])
EX = ExitModel([3, 9, 12], [0.1, 0.23, 0.67])


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny networks: one torch thread is fastest (and two thrash on shared cores)."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


def tiny_model(seed: int = 0, hidden: int = 8, arch: tuple[int, ...] = (8,)):
    """An untrained RecurrentPPO on a short-episode environment (its weights are random, seeded)."""
    from sb3_contrib import RecurrentPPO

    env = SchedulerEnv(LM, EX, EnvConfig(episode_s=5.0, capacity_rps=15.0))
    return RecurrentPPO("MlpLstmPolicy", env, n_steps=16, batch_size=16, seed=seed, device="cpu",
                        policy_kwargs={"lstm_hidden_size": hidden, "net_arch": list(arch)})


def observations(n: int, seed: int = 0) -> list[ControlObservation]:
    """Varied observations, as a busy engine would report them tick after tick."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        running = int(rng.integers(0, 17))
        out.append(ControlObservation(
            waiting=int(rng.integers(0, 40)), prefill_backlog_tokens=int(rng.integers(0, 5000)), running=running,
            free_slots=16 - running, prefill_budget=int(rng.choice([16, 64, 256])), max_running=16, max_seqs=16,
            num_layers=12, predicted_exit_layer=float(rng.uniform(3, 12)),
            min_slack_ms=float(rng.uniform(-100, 200)), oldest_waiting_slack_ms=float(rng.uniform(-500, 500)),
            recent_ttft_p95_ms=float(rng.uniform(0, 1500)), recent_tpot_p95_ms=float(rng.uniform(0, 150)),
            arrival_rate_rps=float(rng.uniform(0, 30)), sla_ttft_ms=500.0, sla_tpot_ms=50.0))
    return out


@pytest.fixture
def saved(tmp_path):
    model = tiny_model()
    folder = save_artifact(model, tmp_path / "ppo", {"training": {"selected": "bc"}}, {"training.md": "# numbers\n"})
    return folder, model


def _rewrite_meta(folder, **changes):
    meta = json.loads((folder / META).read_text())
    meta.update(changes)
    (folder / META).write_text(json.dumps(meta))


# ------------------------------------------------------------------------------------------- the folder

def test_save_load_round_trip(saved):
    folder, model = saved
    p = LearnedPolicy.load(folder)
    meta = p.meta
    assert meta["format"] == 1 and meta["layout_id"] == layout_id() and meta["obs_layout"] == list(OBS_LAYOUT)
    assert meta["actions"] == [list(a) for a in ACTIONS] and meta["training"] == {"selected": "bc"}
    assert meta["trained_at"].endswith("Z") and (folder / "training.md").read_text() == "# numbers\n"
    original, loaded = model.policy.state_dict(), p.model.policy.state_dict()
    assert original.keys() == loaded.keys()
    assert all(torch.equal(original[k], loaded[k]) for k in original)
    fresh = LearnedPolicy(model)
    assert [p.act(o) for o in observations(20)] == [fresh.act(o) for o in observations(20)]


def test_saved_zip_carries_no_optimizer_moments_and_stays_small(tmp_path):
    """The shipped size (LSTM 64, one hidden layer of 64): weights only, well under 1 MB."""
    model = tiny_model(hidden=64, arch=(64,))
    params = sum(p.numel() for p in model.policy.parameters())
    save_artifact(model, tmp_path / "ppo", {})
    size = (tmp_path / "ppo" / ZIP).stat().st_size
    assert size < 4 * params * 1.5 < 1_000_000  # float32 weights plus the zip's small entries


def test_changed_zip_is_refused(saved):
    folder, _ = saved
    with open(folder / ZIP, "ab") as f:
        f.write(b"\0")
    with pytest.raises(ConfigError, match="policy.zip's sha256 .* differs from policy.json's .*: the artifact was "
                                          "changed or mismatched"):
        LearnedPolicy.load(folder)


def test_another_layout_is_refused(saved):
    folder, _ = saved
    _rewrite_meta(folder, layout_id="0123456789abcdef")
    with pytest.raises(ConfigError, match=f"trained for observation layout 0123456789abcdef, this build's is "
                                          f"{layout_id()}: retrain with `make train-scheduler`"):
        LearnedPolicy.load(folder)
    with pytest.raises(ConfigError, match="this build's is ffff"):
        LearnedPolicy.load(folder, expected_layout="ffff")


@pytest.mark.parametrize("gone,msg", [([ZIP], "policy.zip missing"), ([META], "policy.json missing"),
                                      ([ZIP, META], "policy.zip and policy.json missing")])
def test_missing_files_are_refused(saved, gone, msg):
    folder, _ = saved
    for name in gone:
        (folder / name).unlink()
    with pytest.raises(ConfigError, match=f"{msg}; train one with `make train-scheduler`"):
        LearnedPolicy.load(folder)


def test_corrupt_zip_is_refused(saved):
    """A zip that matches its recorded hash but is not a saved policy (written over, hash updated)."""
    from edge.core.artifacts import sha256_file

    folder, _ = saved
    (folder / ZIP).write_bytes(b"not a zip file at all")
    _rewrite_meta(folder, sha256=sha256_file(folder / ZIP))
    with pytest.raises(ConfigError, match="cannot be loaded as a RecurrentPPO policy.*corrupt"):
        LearnedPolicy.load(folder)


@pytest.mark.parametrize("text,msg", [("{", "not JSON"), ('{"format": 7}', "format 7, expected 1"),
                                      ("[1]", "format None")])
def test_unreadable_meta_is_refused(saved, text, msg):
    folder, _ = saved
    (folder / META).write_text(text)
    with pytest.raises(ConfigError, match=msg):
        LearnedPolicy.load(folder)


def test_make_policy_loads_ppo_by_path(saved, tmp_path):
    folder, _ = saved
    p = make_policy("ppo", path=str(folder))
    assert isinstance(p, LearnedPolicy) and p.name == "ppo"
    assert isinstance(p.act(observations(1)[0]), ControlAction)
    with pytest.raises(ConfigError, match="missing"):
        make_policy("ppo", path=str(tmp_path / "nowhere"))
    with pytest.raises(ConfigError, match="policy 'ppo'"):
        make_policy("ppo", budget=3)
    with pytest.raises(ConfigError, match="unknown policy 'ppx'"):
        make_policy("ppx")


# ------------------------------------------------------------------------------------------- acting

def test_act_equals_predict_with_the_state_carried():
    """The reference: sb3's own ``predict`` with the LSTM state passed back in each call."""
    model = tiny_model(seed=3)
    p = LearnedPolicy(model)
    obs = observations(40, seed=1)
    state, start, expected = None, True, []
    for o in obs:
        a, state = model.predict(obs_vector(o)[None], state=state, episode_start=np.array([start]), deterministic=True)
        expected.append(int(a[0]))
        start = False
    assert [p.act_vector(obs_vector(o)) for o in obs] == expected


def test_lstm_state_is_carried_and_reset():
    p, fresh = LearnedPolicy(tiny_model(seed=1)), LearnedPolicy(tiny_model(seed=1))
    o = observations(1)[0]
    first = p.act(o)
    s0 = p.last_step
    p.act(o)
    s1 = p.last_step
    assert first == fresh.act(o)                    # after reset: a fresh policy's first action
    assert s0.episode_start and not s1.episode_start and (s0.index, s1.index) == (0, 1)
    assert all(float(t.abs().sum()) == 0.0 for t in (*s0.lstm_states.pi, *s0.lstm_states.vf))
    assert all(float(t.abs().sum()) > 0.0 for t in (*s1.lstm_states.pi, *s1.lstm_states.vf))
    assert s0.value != s1.value                     # the same observation, another history
    assert s0.log_prob <= 0.0 and np.array_equal(s0.obs, obs_vector(o))
    seq = observations(15, seed=2)
    p.reset()
    before = [p.act(x) for x in seq]
    p.reset()
    assert [p.act(x) for x in seq] == before        # reset() restarts the history
    assert p.last_step.index == 2 + 2 * len(seq) - 1 and p.last_step.episode_start is False


def test_action_respects_the_engine_slots():
    p = LearnedPolicy(tiny_model())
    o = observations(1)[0]
    small = ControlObservation(**{**o.__dict__, "max_seqs": 2, "running": 1, "free_slots": 1, "max_running": 2})
    assert all(p.act(small).max_running <= 2 for _ in range(5))


def test_the_shipped_policy_loads_for_this_layout():
    """scheduler/assets/ppo (`make train-scheduler`): a change to the observation layout or the action
    grid fails here until the policy is retrained."""
    p = make_policy("ppo")
    assert p.meta["layout_id"] == layout_id() and p.meta["training"]["selected"] in ("bc", "ppo")
    assert isinstance(p.act(observations(1)[0]), ControlAction)


def test_a_policy_trained_without_the_exit_depth_features_acts_without_them(tmp_path):
    """policy.json's env.masked (the exit-depth ablation) is applied when it acts: the network never sees the
    predicted exit depth, so observations that differ only there get the same actions."""
    from scheduler.control.env import EXIT_FEATURES

    folder = save_artifact(tiny_model(), tmp_path / "ppo_noexit", {"env": {"masked": list(EXIT_FEATURES)}})
    p = LearnedPolicy.load(folder)
    assert p.masked == EXIT_FEATURES
    i = OBS_LAYOUT.index("predicted_exit_depth")
    acts = {}
    for depth in (3.0, 12.0):
        p.reset()
        obs = [ControlObservation(**{**o.__dict__, "predicted_exit_layer": depth}) for o in observations(6)]
        acts[depth] = [p.act(o) for o in obs]
        assert p.last_step.obs[i] == 0.0
    assert acts[3.0] == acts[12.0]
