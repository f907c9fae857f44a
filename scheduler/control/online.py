"""The learned policy on a live server: online PPO fine-tuning and the guard that falls back to a heuristic.

- :func:`live_reward`: the training reward (scheduler/control/env.py ``reward_of``) from two consecutive engine-host
  ``stats`` answers (edge/runtime/host.py ``_stats``), so live transitions are scored as simulated ones were.
- :class:`OnlineTuner`: collects live transitions (the value, log-probability and LSTM state come from
  the policy's remembered step) and, every ``n_steps``, runs ``RecurrentPPO.train()`` on them: on a copy
  of the network, swapped in when done, so the serving loop keeps acting while a thread trains.
- :class:`FallbackGuard`: per window of ``window_s``, the active policy's SLA attainment (requests
  finished within their SLA / finished). The heuristic runs one probe window every ``probe_every``
  windows to keep a fresh reference; a learned window below the reference hands control to the
  heuristic for ``cooldown_windows`` windows. Pure: time is an argument.
- :class:`GuardedPolicy`: a Policy that acts with whichever the guard says, and feeds the tuner.

Library only: scheduler/serving/worker.py wires it (``observe_stats`` every tick, ``tuner.update`` through
``asyncio.to_thread`` when ``tuner.ready``).
"""
from __future__ import annotations

import copy
import io
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edge.core.errors import ConfigError
from scheduler.control.env import RewardConfig, reward_of
from scheduler.control.learned import LearnedPolicy, Step
from scheduler.control.policies import ControlAction, ControlObservation, Policy
from scheduler.control.sim import TickCounts

log = logging.getLogger(__name__)

REWARD_KEYS = ("tokens_on_time_total", "violations_total", "rejected_total")


def live_reward(prev_stats: dict[str, Any], stats: dict[str, Any], reward_cfg: RewardConfig,
                busy_s: float = 0.0) -> float:
    """The reward of the tick between two ``stats`` answers: (on-time tokens - violation_tokens x (requests
    turned late + requests refused) - energy_tokens_per_s x ``busy_s``) / reward_scale, as ``env.reward_of``
    (the host counts refusals apart from violations; the simulator counts them as violations).

    A counter that went down means the host restarted: the new totals are the tick's counts.

    Raises:
        ConfigError: a counter is missing (a host of another version).
    """
    try:
        now = [int(stats[k]) for k in REWARD_KEYS]
        before = [int(prev_stats[k]) for k in REWARD_KEYS]
    except KeyError as exc:
        raise ConfigError(f"engine stats lack {exc.args[0]!r}: the Triton model and the front end are of "
                          "different versions") from None
    if any(n < b for n, b in zip(now, before)):
        before = [0, 0, 0]
    on_time, late, refused = (n - b for n, b in zip(now, before))
    return reward_of(TickCounts(tokens_on_time=on_time, violations=late + refused, busy_s=busy_s), reward_cfg)


# ---------------------------------------------------------------------------------------------- tuning

@dataclass(frozen=True)
class TuneStats:
    updates: int            # updates done so far, this one included
    transitions: int        # used by this one
    policy_loss: float
    value_loss: float
    approx_kl: float
    clip_fraction: float
    seconds: float


@dataclass(frozen=True)
class _Transition:
    step: Step
    reward: float
    episode_start: bool


class OnlineTuner:
    """PPO on live transitions of a :class:`~scheduler.control.learned.LearnedPolicy`.

    ``record`` after each acted tick's reward is known; ``update`` (from any one thread at a time) once
    ``ready``. The update trains a copy of the network with ``RecurrentPPO.train()`` on a
    ``RecurrentRolloutBuffer`` filled with the transitions, its returns bootstrapped with the value of
    the observation after the last one, then swaps the copy in (``LearnedPolicy.swap``).
    Small steps by default (learning rate 1e-4, clip 0.1, stop past ``target_kl``): the policy arrives
    trained, and a few hundred live ticks are a noisy estimate.
    """

    def __init__(self, policy: LearnedPolicy, n_steps: int = 128, batch_size: int = 64, n_epochs: int = 4,
                 learning_rate: float = 1e-4, clip_range: float = 0.1, gamma: float = 0.99,
                 gae_lambda: float = 0.95, target_kl: float | None = 0.02) -> None:
        if n_steps < 2 or not 1 <= batch_size <= n_steps or n_epochs < 1:
            raise ConfigError("online tuner: n_steps >= 2, 1 <= batch_size <= n_steps and n_epochs >= 1")
        if learning_rate <= 0 or not 0 < clip_range < 1 or not 0 < gamma <= 1 or not 0 < gae_lambda <= 1:
            raise ConfigError("online tuner: learning_rate > 0, clip_range in (0, 1), gamma and gae_lambda in (0, 1]")
        from sb3_contrib import RecurrentPPO
        from stable_baselines3.common.logger import Logger
        from stable_baselines3.common.utils import FloatSchedule

        self.policy, self.n_steps, self.gamma, self.gae_lambda = policy, n_steps, gamma, gae_lambda
        # the trainer is a copy with its own optimizer (the live network is never trained in place), made
        # through save/load: a network that just trained holds graph tensors deepcopy refuses
        blob = io.BytesIO()
        policy.model.save(blob)
        blob.seek(0)
        trainer = RecurrentPPO.load(blob, device="cpu")
        trainer.batch_size, trainer.n_epochs, trainer.target_kl = batch_size, n_epochs, target_kl
        trainer.clip_range, trainer.clip_range_vf = FloatSchedule(clip_range), None
        trainer.learning_rate = learning_rate
        trainer._setup_lr_schedule()
        # values kept in memory, nothing printed (configure(None, []) would make an empty /tmp/SB3-<time> per tuner)
        trainer.set_logger(Logger(None, []))
        self._trainer = trainer
        self._template = copy.deepcopy(trainer.policy)  # never run: each trained network is a copy of it
        self._store: list[_Transition] = []
        self._lock = threading.Lock()           # the store (record vs update)
        self._training = threading.Lock()       # one update at a time
        self.updates = 0

    @property
    def ready(self) -> bool:
        return len(self._store) >= self.n_steps

    def record(self, obs_vector: np.ndarray, action_index: int, reward: float, episode_start: bool,
               step: Step | None = None) -> None:
        """Append one transition: the policy acted ``action_index`` on ``obs_vector`` and then earned
        ``reward``. Its value, log-probability and LSTM state are ``step``'s (default: the policy's
        last step, which must be this one).

        Raises:
            ValueError: the step does not match ``obs_vector`` / ``action_index``.
        """
        step = step if step is not None else self.policy.last_step
        if step is None or step.action != int(action_index) or not np.array_equal(step.obs, np.asarray(
                obs_vector, np.float32)):
            raise ValueError("online tuner: record() names an observation and action the policy's step did "
                             "not act on (record each tick before the next act, or pass its step)")
        with self._lock:
            self._store.append(_Transition(step, float(reward), bool(episode_start)))

    def update(self, last_value: float | None = None) -> TuneStats | None:
        """One PPO update on the oldest ``n_steps`` transitions; None when fewer are stored or another
        update is running.

        ``last_value``: the value of the observation after the last transition (default: the
        policy's remembered step when it is that observation, else the last transition's value).
        """
        if not self._training.acquire(blocking=False):
            return None
        try:
            with self._lock:
                if len(self._store) < self.n_steps:
                    return None
                batch, self._store = self._store[:self.n_steps], self._store[self.n_steps:]
            return self._train(batch, self._bootstrap(batch, last_value))
        finally:
            self._training.release()

    def _bootstrap(self, batch: list[_Transition], last_value: float | None) -> float:
        if last_value is not None:
            return float(last_value)
        nxt = self.policy.last_step
        if nxt is not None and nxt.index == batch[-1].step.index + 1:
            return nxt.value
        return batch[-1].step.value

    def _train(self, batch: list[_Transition], last_value: float) -> TuneStats:
        import torch as th
        from sb3_contrib.common.recurrent.buffers import RecurrentRolloutBuffer

        t0 = time.perf_counter()
        tr = self._trainer
        live = self.policy.model.policy
        tr.policy.load_state_dict(live.state_dict())  # the network that acted (in place: Adam keeps its moments)
        lstm = tr.policy.lstm_actor
        buf = RecurrentRolloutBuffer(self.n_steps, tr.observation_space, tr.action_space,
                                     (self.n_steps, lstm.num_layers, 1, lstm.hidden_size), device="cpu",
                                     gamma=self.gamma, gae_lambda=self.gae_lambda, n_envs=1)
        for t in batch:
            s = t.step
            buf.add(s.obs[None], np.array([[s.action]]), np.array([t.reward], np.float32),
                    np.array([t.episode_start], np.float32), th.tensor([[s.value]]), th.tensor([s.log_prob]),
                    lstm_states=s.lstm_states)
        buf.compute_returns_and_advantage(last_values=th.tensor([[last_value]]), dones=np.array([False]))
        tr.rollout_buffer = buf
        tr.train()
        logged = dict(tr.logger.name_to_value)
        tr.logger.dump()
        trained = copy.deepcopy(self._template)
        trained.load_state_dict(tr.policy.state_dict())
        self.policy.swap(trained)
        self.updates += 1
        return TuneStats(self.updates, len(batch), float(logged.get("train/policy_gradient_loss", np.nan)),
                         float(logged.get("train/value_loss", np.nan)), float(logged.get("train/approx_kl", np.nan)),
                         float(logged.get("train/clip_fraction", np.nan)), time.perf_counter() - t0)


# ---------------------------------------------------------------------------------------------- the guard

LEARNED, HEURISTIC = "learned", "heuristic"


@dataclass
class FallbackGuard:
    """Which policy controls the engine: ``observe(stats, now)`` once per control tick.

    Windows of ``window_s`` follow one another; each runs in one mode: ``probe`` (the heuristic, to
    measure the reference), ``learned``, or ``fallback`` (the heuristic after the learned policy fell
    short). The first window is a probe (no reference yet) unless ``first="learned"`` (a benchmark of
    the learned policy alone: no fallback before the first probe); then the heuristic probes once
    every ``probe_every`` windows. A window's attainment counts only with ``min_requests`` finished in it.
    Any heuristic window with an attainment refreshes the reference; a learned window whose
    attainment is below the reference starts a fallback of ``cooldown_windows`` windows (logged at
    WARNING with both numbers, counted in ``fallbacks``, recorded in ``events``), after which
    the learned policy returns.
    """

    window_s: float = 30.0
    min_requests: int = 20
    probe_every: int = 10
    cooldown_windows: int = 4
    first: str = "probe"                                         # the first window's mode: probe | learned
    fallbacks: int = field(default=0, init=False)
    events: list[dict[str, Any]] = field(default_factory=list, init=False)
    reference: float | None = field(default=None, init=False)  # the heuristic's latest window attainment
    mode: str = field(default="probe", init=False)             # of the current window: probe | learned | fallback
    windows: int = field(default=0, init=False)                # closed so far

    def __post_init__(self) -> None:
        if self.window_s <= 0 or self.min_requests < 1 or self.probe_every < 2 or self.cooldown_windows < 1:
            raise ConfigError("fallback guard: window_s > 0, min_requests >= 1, probe_every >= 2 and "
                              "cooldown_windows >= 1")
        if self.first not in ("probe", "learned"):
            raise ConfigError(f"fallback guard: first must be 'probe' or 'learned', got {self.first!r}")
        self.mode = self.first
        self._start: float | None = None
        self._base = (0, 0)             # finished_total, sla_met_total at the window's start
        self._since_probe = 0           # learned windows since the last heuristic one
        self._cooldown = 0              # fallback windows left, the current one included

    @property
    def active(self) -> str:
        return LEARNED if self.mode == "learned" else HEURISTIC

    def observe(self, stats: dict[str, Any], now: float) -> str:
        """Feed one tick's counters (``finished_total``, ``sla_met_total``) at time ``now`` (seconds);
        returns the active policy, ``"learned"`` or ``"heuristic"``."""
        counters = (int(stats["finished_total"]), int(stats["sla_met_total"]))
        if self._start is None or counters[0] < self._base[0] or counters[1] < self._base[1]:
            self._start, self._base = now, counters  # the first tick, or the host restarted: a new window
            return self.active
        if now - self._start >= self.window_s:
            finished, met = counters[0] - self._base[0], counters[1] - self._base[1]
            self._close(finished, met, now)
            self._start, self._base = now, counters
        return self.active

    def _close(self, finished: int, met: int, now: float) -> None:
        attainment = met / finished if finished >= self.min_requests else None
        self.windows += 1
        mode = self.mode
        if mode != "learned":
            if attainment is not None:
                self.reference = attainment
            if mode == "fallback":
                self._cooldown -= 1
                if self._cooldown > 0:
                    return
                self.events.append({"kind": "return", "time": now, "window": self.windows})
                log.info("scheduler guard: the learned policy takes control again after %d windows",
                         self.cooldown_windows)
            self.mode, self._since_probe = "learned", 0
            return
        self._since_probe += 1
        if attainment is not None and self.reference is not None and attainment < self.reference:
            self.fallbacks += 1
            self.events.append({"kind": "fallback", "time": now, "window": self.windows, "requests": finished,
                                "learned_attainment": attainment, "heuristic_attainment": self.reference})
            log.warning("scheduler guard: the learned policy's SLA attainment %.3f over the last %.0f s (%d requests) "
                        "is below the heuristic's %.3f; the heuristic controls for the next %d windows",
                        attainment, self.window_s, finished, self.reference, self.cooldown_windows)
            self.mode, self._cooldown = "fallback", self.cooldown_windows
        elif self._since_probe >= self.probe_every - 1:
            self.mode = "probe"


class GuardedPolicy:
    """Acts with the learned policy or the heuristic, as ``guard`` says; with a ``tuner``, each learned
    tick becomes a transition once the next ``observe_stats`` tells its reward."""

    name = "guarded"

    def __init__(self, learned: LearnedPolicy, heuristic: Policy, guard: FallbackGuard,
                 tuner: OnlineTuner | None = None, reward_cfg: RewardConfig | None = None) -> None:
        self.learned, self.heuristic, self.guard, self.tuner = learned, heuristic, guard, tuner
        # default: the reward the policy was trained with (policy.json's env.reward), so the tuner's returns
        # are in its critic's units
        self.reward_cfg = reward_cfg or RewardConfig(**learned.meta.get("env", {}).get("reward", {}))
        self._prev: dict[str, Any] | None = None
        self._pending: Step | None = None
        self._last_active = HEURISTIC

    def observe_stats(self, stats: dict[str, Any], now: float) -> None:
        """Feed the guard (and the tuner: the reward of the tick since the last call)."""
        self.guard.observe(stats, now)
        if self._pending is not None and self._prev is not None and self.tuner is not None:
            s = self._pending
            self.tuner.record(s.obs, s.action, live_reward(self._prev, stats, self.reward_cfg), s.episode_start, s)
        self._pending = None
        self._prev = stats

    def act(self, obs: ControlObservation) -> ControlAction:
        active = self.guard.active
        if active == LEARNED and self._last_active != LEARNED:
            self.learned.reset()  # its LSTM state is stale after the heuristic's windows
        self._last_active = active
        if active != LEARNED:
            self._pending = None
            return self.heuristic.act(obs)
        action = self.learned.act(obs)
        self._pending = self.learned.last_step if self.tuner is not None else None
        return action
