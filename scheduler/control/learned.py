"""The learned control policy: a recurrent PPO network (sb3-contrib ``RecurrentPPO``, ``MlpLstmPolicy``)
trained in the simulator by ``smartexit train-scheduler`` (scheduler/control/train.py), acting through the same
``act(ControlObservation) -> ControlAction`` as the heuristics in scheduler/control/policies.py.

It ships as a folder (``scheduler/assets/ppo/``):

- ``policy.zip``: ``RecurrentPPO.save`` (weights; the optimizer's moments are dropped: online
  fine-tuning starts Adam afresh, and the file stays small);
- ``policy.json``: format, ``layout_id`` (scheduler/control/env.py: observation layout + action grid), the
  layout and grid spelled out, the sha256 of policy.zip, the latency model and environment it was
  trained on, the training summary, ``trained_at``.

:meth:`LearnedPolicy.load` refuses a folder with a file missing, a policy.zip that is not the one
policy.json describes, a policy trained for another observation layout, or an unreadable zip.

torch and sb3_contrib are imported inside functions: importing this module (and scheduler.control.policies,
which registers ``ppo`` lazily) costs nothing on the serving path until a learned policy is loaded.
"""
from __future__ import annotations

import json
import pickle
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edge.core.artifacts import atomic_dir, atomic_write_json, atomic_write_text, sha256_file
from edge.core.errors import ConfigError
from scheduler.control.env import ACTIONS, OBS_LAYOUT, action_of, layout_id, obs_vector
from scheduler.control.policies import ControlAction, ControlObservation, within_limits

FORMAT = 1
ZIP, META = "policy.zip", "policy.json"
DEFAULT_DIR = Path(__file__).parents[1] / "assets" / "ppo"


def _sb3():
    try:
        from sb3_contrib import RecurrentPPO
    except ImportError as exc:  # pragma: no cover - pinned in requirements/lock.txt
        raise ConfigError(f"the learned scheduler needs sb3-contrib and torch (requirements/lock.txt): {exc}") from exc
    return RecurrentPPO


@dataclass
class Step:
    """One ``act``: what an online tuner needs to turn it into a transition once its reward is known."""

    index: int               # acts since the policy was built (reset() does not restart it)
    obs: np.ndarray          # [len(OBS_LAYOUT)] float32, the observation acted on
    action: int              # index into env.ACTIONS
    value: float             # the critic's value of obs
    log_prob: float          # of action under the acting network
    episode_start: bool      # the first act after reset(): the LSTM started from zeros
    lstm_states: Any         # RNNStates before the step: pi (h, c) and vf (h, c), each [layers, 1, hidden]


class LearnedPolicy:
    """A trained ``RecurrentPPO`` acting as a control :class:`~scheduler.control.policies.Policy`.

    The LSTM state is carried from one ``act`` to the next (the policy sees the history of the
    ticks, not only the last one); ``reset()`` starts a new episode. Each ``act`` runs the
    network's forward pass as ``RecurrentPPO.collect_rollouts`` does (actor and critic), so the
    step's value and log-probability are at hand for :class:`scheduler.control.online.OnlineTuner`; its
    action equals ``model.predict(obs, state, episode_start, deterministic)``'s.
    """

    name = "ppo"

    def __init__(self, model: Any, meta: dict[str, Any] | None = None, deterministic: bool = True) -> None:
        self.model = model
        self.meta = dict(meta or {})
        # the observation features the policy was trained without (the exit-depth ablation), held at 0 here too
        self.masked = tuple((self.meta.get("env") or {}).get("masked") or ())
        self.deterministic = deterministic
        self.steps = 0
        self.last_step: Step | None = None
        self.reset()

    @classmethod
    def load(cls, folder: str | Path = DEFAULT_DIR, expected_layout: str | None = None,
             deterministic: bool = True) -> LearnedPolicy:
        """The policy saved in ``folder`` (policy.zip + policy.json).

        Raises:
            ConfigError: a file is missing; policy.json is unreadable or of another format;
                policy.zip's sha256 differs from policy.json's; the policy was trained for another
                observation layout than ``expected_layout`` (default: this build's
                ``env.layout_id()``); policy.zip cannot be loaded or has other spaces.
        """
        expected_layout = expected_layout or layout_id()
        folder = Path(folder)
        zp, jp = folder / ZIP, folder / META
        missing = [p.name for p in (zp, jp) if not p.is_file()]
        if missing:
            raise ConfigError(f"learned policy {folder}: {' and '.join(missing)} missing; train one with "
                              "`make train-scheduler`")
        try:
            meta = json.loads(jp.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"learned policy {jp}: not JSON ({exc})") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            got = meta.get("format") if isinstance(meta, dict) else None
            raise ConfigError(f"learned policy {jp}: format {got!r}, expected {FORMAT}")
        sha = sha256_file(zp)
        if sha != meta.get("sha256"):
            raise ConfigError(f"learned policy {folder}: policy.zip's sha256 {sha[:16]}... differs from policy.json's "
                              f"{str(meta.get('sha256'))[:16]}...: the artifact was changed or mismatched")
        if meta.get("layout_id") != expected_layout:
            raise ConfigError(f"learned policy {folder}: trained for observation layout {meta.get('layout_id')}, "
                              f"this build's is {expected_layout}: retrain with `make train-scheduler`")
        model = _load_zip(zp)
        n_obs, n_act = model.observation_space.shape, getattr(model.action_space, "n", None)
        if n_obs != (len(OBS_LAYOUT),) or n_act != len(ACTIONS):
            raise ConfigError(f"learned policy {zp}: observation shape {n_obs} and {n_act} actions, expected "
                              f"({len(OBS_LAYOUT)},) and {len(ACTIONS)}: retrain with `make train-scheduler`")
        return cls(model, meta, deterministic)

    # ------------------------------------------------------------------ acting
    def reset(self) -> None:
        """Start a new episode: the next act starts the LSTM from zeros."""
        self._states = None
        self._start = True

    def act(self, obs: ControlObservation) -> ControlAction:
        """The network's grid action for ``obs``, within the engine's limits: a budget above the backend's
        largest chunk (``obs.max_chunk``, which the observation vector does not carry: the shipped network's
        layout predates it) is clamped to it."""
        return within_limits(action_of(self.act_vector(obs_vector(obs, self.masked)), obs.max_seqs), obs)

    def act_vector(self, v: np.ndarray) -> int:
        """The action index for observation vector ``v`` [len(OBS_LAYOUT)]; remembers the step."""
        import torch as th

        net = self.model.policy  # read once: a swap() by another thread takes effect at the next call
        states = self._states if self._states is not None else zero_states(net)
        obs = th.as_tensor(np.asarray(v, np.float32).reshape(1, -1))
        start = th.tensor([float(self._start)])
        net.set_training_mode(False)
        with th.no_grad():
            action, value, log_prob, new_states = net(obs, states, start, deterministic=self.deterministic)
        a = int(action.reshape(-1)[0].item())
        self.last_step = Step(self.steps, obs.numpy()[0].copy(), a, float(value.reshape(-1)[0].item()),
                              float(log_prob.reshape(-1)[0].item()), self._start, states)
        self._states, self._start = new_states, False
        self.steps += 1
        return a

    def swap(self, network: Any) -> None:
        """Act with ``network`` (a trained copy of ``model.policy``) from the next call on; one
        attribute assignment, so a thread may call it while another acts."""
        self.model.policy = network


def zero_states(net: Any, n: int = 1) -> Any:
    """RNNStates of zeros for ``n`` sequences of ``net``'s actor and critic LSTMs."""
    import torch as th
    from sb3_contrib.common.recurrent.type_aliases import RNNStates

    lstm = net.lstm_actor
    shape = (lstm.num_layers, n, lstm.hidden_size)
    return RNNStates((th.zeros(shape), th.zeros(shape)), (th.zeros(shape), th.zeros(shape)))


def _load_zip(path: Path) -> Any:
    RecurrentPPO = _sb3()
    try:
        return RecurrentPPO.load(path, device="cpu")
    except (ValueError, KeyError, RuntimeError, EOFError, OSError, zipfile.BadZipFile,
            pickle.UnpicklingError) as exc:
        raise ConfigError(f"learned policy {path}: cannot be loaded as a RecurrentPPO policy "
                          f"({type(exc).__name__}: {exc}); the file is corrupt: retrain with "
                          "`make train-scheduler`") from None


def save_artifact(model: Any, folder: str | Path, meta: dict[str, Any],
                  texts: dict[str, str] | None = None) -> Path:
    """Write ``model`` as a policy folder (policy.zip, policy.json with ``meta`` added, and ``texts``:
    file name -> content, e.g. training.md); the folder is replaced as a whole, or not at all.

    The optimizer's state is cleared first (it would triple the file; nothing needs it to act).
    """
    folder = Path(folder)
    model.policy.optimizer.state.clear()
    with atomic_dir(folder) as tmp:
        model.save(tmp / ZIP)
        full = {"format": FORMAT, "layout_id": layout_id(), "obs_layout": list(OBS_LAYOUT),
                "actions": [list(a) for a in ACTIONS], "sha256": sha256_file(tmp / ZIP), **meta,
                "trained_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        atomic_write_json(tmp / META, full)
        for name, text in (texts or {}).items():
            atomic_write_text(tmp / name, text)
    return folder


def load_policy(path: str | Path | None = None, deterministic: bool = True) -> LearnedPolicy:
    """``make_policy("ppo", path=...)``: the policy in ``path`` (default: the shipped scheduler/assets/ppo)."""
    return LearnedPolicy.load(DEFAULT_DIR if path is None else path, deterministic=deterministic)
