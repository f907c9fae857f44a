"""One device's Triton and what runs beside it: the control loop, supervision, the stats pushed to the hub.

:class:`EngineHost` is the Triton-facing side of the application, whichever replica hosts it
(``serve.triton_host``):

- ``worker`` (the default): the ``Worker`` replica (scheduler/serving/worker.py) launches a tritonserver
  (:class:`~scheduler.serving.tritonserver.TritonProcess`) or connects to ``serve.triton_url``, and the ingress
  streams from it over gRPC (scheduler/serving/routes.py);
- ``ingress``: the ``Ingress`` replica (scheduler/serving/app.py) runs Triton's core in its own process
  (:class:`~scheduler.serving.triton_core.TritonCore`) and streams from it without gRPC or another Ray actor
  between the HTTP request and the model (docs/serving.md, stop 70).

Either way the host runs the control loop every ``control_tick_s`` (``scheduler.control.policies``),
supervises the engine (restarts a server that died, whose engine thread stopped, or that answers nothing
for ``hang_restart_s``) and pushes the engine's stats (and its device's power, with ``serve.power_meter``)
to the hub.

No ``from __future__ import annotations``: Serve rewrites the methods of the deployments that inherit
these and needs their annotations evaluated.
"""

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from pathlib import Path
from typing import Any

from ray.exceptions import RayError
from ray.serve.exceptions import RayServeException

from edge.core.errors import ConfigError
from scheduler.serving.config import ServeConfig
from scheduler.serving.dashboard import open_power
from scheduler.serving.triton_client import TritonClient, TritonError, TritonUnavailable, error_to_dict, stub_lost
from scheduler.serving.triton_core import TritonCore, TritonCoreClient

log = logging.getLogger(__name__)
# the serving settings a running host's policy can be switched to (EngineHost.set_policy)
POLICY_FIELDS = ("policy", "policy_kwargs", "fallback_policy", "fallback_kwargs", "guard", "online_finetune",
                 "tuner")

HUB_TIMEOUT_S = 5.0


async def control_step(client: Any, policy: Any, observe: Callable[[dict], Any],
                       settings: dict[str, Any] | None = None) -> dict[str, Any]:
    """One control tick: read the engine's stats, ask the policy, apply what changed, and any of the
    fixed host ``settings`` (``shed_late``) the engine does not have (a relaunched server starts from
    its bundle's).

    Returns the stats after the change (``set`` answers with them).
    Raises:
        TritonError: the server did not answer.
    """
    stats = await client.control({"op": "stats"})
    feed = getattr(policy, "observe_stats", None)  # the guarded learned policy: its guard and tuner
    if feed is not None:
        feed(stats, time.monotonic())
    action = policy.act(observe(stats))
    change = {k: int(v) for k, v in (("prefill_budget", action.prefill_budget),
                                     ("max_running", action.max_running))
              if v is not None and v != stats.get(k)}
    change.update({k: v for k, v in (settings or {}).items() if v is not None and stats.get(k) != v})
    if change:
        stats = await client.control({"op": "set", **change})
    return stats


def build_policy(cfg: ServeConfig) -> Any:
    """The worker's control policy: a heuristic, or (ppo) the learned policy behind the fallback
    guard, with online fine-tuning when ``cfg.online_finetune``.

    Raises:
        ConfigError: unknown settings, or a learned policy that is missing, altered or of another layout.
    """
    from scheduler.control.registry import make_policy

    if cfg.policy.value != "ppo":
        return make_policy(cfg.policy.value, **cfg.policy_kwargs)
    import torch

    from scheduler.control.online import FallbackGuard, GuardedPolicy, OnlineTuner

    # the policy's forward pass is tiny; torch's default pool would take every core from the engine
    torch.set_num_threads(1)
    learned = make_policy("ppo", **cfg.policy_kwargs)
    heuristic = make_policy(cfg.fallback_policy.value, **cfg.fallback_kwargs)
    try:
        guard = FallbackGuard(**cfg.guard)
        tuner = OnlineTuner(learned, **cfg.tuner) if cfg.online_finetune else None
    except TypeError as exc:
        raise ConfigError(f"serve.guard / serve.tuner: {exc}") from None
    return GuardedPolicy(learned, heuristic, guard, tuner)




class EngineHost:
    """One device's Triton (a tritonserver, a running server at ``triton_url``, or Triton's core in this
    process), its control loop and its supervision. ``__init__`` sets up; ``open`` starts the engine and the loop;
    ``close`` (Serve's shutdown hook, ``__del__``) stops both."""

    _power = None  # the device's LivePower with serve.power_meter (set in __init__)

    def __init__(self, cfg: ServeConfig, hub: Any, replica: str, node: str) -> None:
        from scheduler.control.policies import observation_from_stats

        self._cfg, self._hub, self._replica, self._node = cfg, hub, replica, node
        self._policy = build_policy(cfg)
        self._tuning: asyncio.Task | None = None
        self._observe = observation_from_stats
        self._proc = None
        self._restarting = False
        self._backoff_s = cfg.restart_backoff_s
        self._stats: dict | None = None
        # the policy's generation (set_policy counts them) and the last one a control tick ran: set_policy waits for it
        self._generation = self._acted = 0
        # read once a control tick: sampling the meter faster would buy the live view nothing
        self._power = open_power(cfg.power_meter, cfg.control_tick_s)

    async def open(self, repo_dir: Path | None, in_process: bool = False) -> None:
        """Start the engine (``in_process``: Triton's core in this process, else a tritonserver, or none with
        ``triton_url``), its client and the control loop.

        Raises:
            ConfigError: no repository and no ``triton_url``; SmartExitError / TritonUnavailable: the engine
                did not start (the log's tail in the message).
        """
        try:
            await self._open(repo_dir, in_process)
        except BaseException:  # nothing of a host that did not start stays running (its meter, its engine)
            self.close()
            raise

    async def _open(self, repo_dir: Path | None, in_process: bool) -> None:
        cfg = self._cfg
        if cfg.triton_url is not None and not in_process:
            self._client = TritonClient(cfg.triton_url, timeout_s=cfg.triton_timeout_s)
        else:
            if repo_dir is None:
                raise ConfigError("serving needs the Triton model repository (repo_dir) or serve.triton_url")
            env = {"SMARTEXIT_STEP_LOG": cfg.step_log} if cfg.step_log else {}
            if cfg.stream_interval_ms is not None:  # read by the Triton model (triton_model.INTERVAL_ENV)
                env["SMARTEXIT_STREAM_INTERVAL_MS"] = str(cfg.stream_interval_ms)
            if in_process:
                self._proc = TritonCore(Path(repo_dir), env=env)
            else:
                from scheduler.serving.tritonserver import TritonProcess
                self._proc = TritonProcess(Path(repo_dir), env=env)  # its threads are the repository's (bundle.json)
            await asyncio.to_thread(self._proc.start, timeout_s=cfg.triton_start_timeout_s)
            self._client = self._client_of(self._proc)
        self._answered = time.monotonic()  # when the engine last answered a control op, or came up (started: ready)
        self._ready = await self._client.ready()
        self._loop = asyncio.create_task(self._run(), name="smartexit-control")

    def _client_of(self, server: Any) -> Any:
        """A client of the engine: over gRPC to a tritonserver, or straight to a core of this process."""
        if isinstance(server, TritonCore):
            return TritonCoreClient(server, timeout_s=self._cfg.triton_timeout_s)
        return TritonClient(server.grpc_url, timeout_s=self._cfg.triton_timeout_s)

    @property
    def client(self) -> Any:
        """The engine's client (the ingress streams through it when it hosts the core)."""
        return self._client

    @property
    def restarting(self) -> bool:
        return self._restarting

    @property
    def in_process(self) -> bool:
        """Whether the engine is Triton's core in this process."""
        return isinstance(self._proc, TritonCore)

    async def generate(self, payload: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Stream a generation: ``{"token_ids", "exit_layers", "finish_reason"}`` per engine step,
        or one ``{"error": error_to_dict(...)}`` (errors travel as data, not across actors).

        ``payload``: the keyword arguments of ``TritonClient.generate`` (``GenerationRequest.payload``).
        """
        if self._restarting:
            exc = TritonUnavailable("Triton is restarting", self._cfg.retry_after_s)
            yield {"error": error_to_dict(exc)}
            return
        try:
            async with aclosing(self._client.generate(**payload)) as chunks:
                async for c in chunks:
                    yield {"token_ids": c.token_ids, "exit_layers": c.exit_layers, "finish_reason": c.finish_reason}
        except TritonError as exc:
            yield {"error": error_to_dict(exc)}

    async def stats(self) -> dict | None:
        """The engine's stats at the last control tick."""
        return self._stats

    async def set_policy(self, changes: dict[str, Any]) -> dict[str, Any]:
        """Run another control policy from the next tick on, on this running stack (a benchmark compares
        policies on one stack instead of one stack each), and return once that tick has run (or a timeout).
        ``changes``: values of :data:`POLICY_FIELDS` for the serving config; the policy fields it leaves out
        take their defaults (a switch names a whole policy, nothing of the previous one's carries over). An
        online update in flight finishes on the old policy's tuner. Returns the new scheduler state.

        Raises:
            ConfigError: a field outside :data:`POLICY_FIELDS`, or settings the policy refuses (a missing or
                mismatched learned policy); the running policy is kept.
        """
        from dataclasses import replace

        unknown = sorted(set(changes) - set(POLICY_FIELDS))
        if unknown:
            raise ConfigError(f"set_policy changes only {', '.join(POLICY_FIELDS)}; got {', '.join(unknown)}")
        defaults = ServeConfig()
        # validated again (ServeConfig.__post_init__)
        cfg = replace(self._cfg, **{**{k: getattr(defaults, k) for k in POLICY_FIELDS}, **changes})
        policy = await asyncio.to_thread(build_policy, cfg)
        self._cfg, self._policy = cfg, policy  # between two ticks: the loop reads both once per tick
        self._generation += 1
        generation = self._generation
        log.info("replica %s: control policy now %s", self._replica, cfg.policy.value)
        # returns once the new policy has set the engine's budget (its first tick): traffic sent right after the
        # switch is scheduled by it (a benchmark's next run began at the old budget for up to a tick otherwise)
        deadline = time.monotonic() + max(2.0, 20 * cfg.control_tick_s)
        while self._acted < generation and time.monotonic() < deadline and not self._loop.done():
            await asyncio.sleep(min(0.01, cfg.control_tick_s))
        return self._scheduler_state()

    async def ready(self) -> bool:
        return self._ready

    def check_health(self) -> None:
        """Serve's health check: fails (the replica is replaced) when the control loop died."""
        if self._loop.done():
            exc = None if self._loop.cancelled() else self._loop.exception()
            raise RuntimeError(f"the worker's control loop stopped: {exc!r}")

    def close(self) -> None:
        """Stop the loop and our engine (Serve calls ``__del__`` on shutdown, and the GC may again)."""
        loop, proc, power = getattr(self, "_loop", None), getattr(self, "_proc", None), self._power
        if loop is not None:
            loop.cancel()
        if power is not None:
            self._power = None
            power.close()
        if proc is not None:
            self._proc = None
            proc.stop()

    def __del__(self) -> None:
        self.close()

    async def _run(self) -> None:
        """Supervise the engine and run the control loop (one task, so they never overlap)."""
        while True:
            if self._proc is not None and not self._proc.alive:
                await self._relaunch()
                continue
            if self._proc is not None and (self._stats or {}).get("engine_alive") is False:
                # tritonserver answers, but the engine thread in its model has died: only a restart brings it back
                log.error("replica %s: the engine in Triton at %s has stopped; restarting it", self._replica,
                          self._client.url)
                self._stats = None
                await self._relaunch()
                continue
            try:
                generation = self._generation  # read with the policy: a switch during the tick waits for the next
                self._stats = await control_step(self._client, self._policy, self._observe,
                                                 {"shed_late": self._cfg.shed_late})
                self._acted = generation
                self._stats["scheduler"] = self._scheduler_state()
                if self._power is not None:
                    self._stats["power"] = self._power.reading()
                    if self._power.roll_due():
                        await self._roll_power()
                self._maybe_tune()
                if not self._ready:
                    log.info("replica %s: Triton at %s ready", self._replica, self._client.url)
                self._ready, self._backoff_s = True, self._cfg.restart_backoff_s
            except TritonError as exc:
                if self._ready:
                    log.warning("replica %s: Triton at %s not answering: %s", self._replica,
                                self._client.url, exc)
                self._ready = False
                if self._proc is not None and stub_lost(exc):
                    log.error("replica %s: the model's stub in Triton at %s is gone; restarting Triton", self._replica,
                              self._client.url)
                    await self._relaunch(kill=True)
                    continue
                if self._hung():
                    await self._relaunch(kill=True)
                    continue
            else:
                self._answered = time.monotonic()
            await self._push()
            await asyncio.sleep(self._cfg.control_tick_s)

    def _scheduler_state(self) -> dict[str, Any]:
        p = self._policy
        guard, tuner = getattr(p, "guard", None), getattr(p, "tuner", None)
        return {"policy": self._cfg.policy.value,
                "active": self._cfg.policy.value if guard is None else
                (self._cfg.policy.value if guard.active == "learned" else self._cfg.fallback_policy.value),
                "fallbacks": 0 if guard is None else guard.fallbacks,
                "updates": 0 if tuner is None else tuner.updates}

    async def _roll_power(self) -> None:
        """Restart the meter's window (joins its thread: off the event loop); a sensor that fails costs
        the power readings from then on, never the serving."""
        try:
            await asyncio.to_thread(self._power.roll)
        except Exception:
            log.exception("replica %s: power meter %s failed; no power readings from now on", self._replica,
                          self._power.meter.name)
            power, self._power = self._power, None
            await asyncio.to_thread(power.close)

    def _maybe_tune(self) -> None:
        """Start an online PPO update in a thread when the tuner has a batch and none is running."""
        tuner = getattr(self._policy, "tuner", None)
        if tuner is None or not tuner.ready or (self._tuning is not None and not self._tuning.done()):
            return

        async def run() -> None:
            try:
                st = await asyncio.to_thread(tuner.update)
                if st is not None:
                    log.info("replica %s: online update %d (%d transitions, kl %.4f, %.2f s)", self._replica,
                             st.updates, st.transitions, st.approx_kl, st.seconds)
            except Exception:  # a failed update leaves the acting network as it was; serving goes on
                log.exception("replica %s: online update failed", self._replica)
        self._tuning = asyncio.create_task(run(), name="smartexit-online-update")

    def _hung(self) -> bool:
        """Whether our tritonserver is running but has answered nothing for ``hang_restart_s``: a stopped or
        deadlocked server never exits, and the streams sent to it would wait for their clients' timeouts."""
        limit = self._cfg.hang_restart_s
        silent = time.monotonic() - self._answered
        if self._proc is None or limit is None or silent < limit:
            return False
        log.error("replica %s: Triton at %s has answered nothing for %.0f s; killing and restarting it",
                  self._replica, self._client.url, silent)
        return True

    async def _relaunch(self, kill: bool = False) -> None:
        """Restart a dead engine after the current backoff (doubling until a tick succeeds); ``kill``: a hung one,
        a tritonserver SIGKILLed first (its streams end with an error at once; it would not heed a SIGTERM), a core
        of this process stopped (its stub with it)."""
        self._ready, self._restarting = False, True
        if kill:
            await asyncio.to_thread(self._proc.kill)
        await self._push()
        log.warning("replica %s: restarting Triton in %.1f s", self._replica, self._backoff_s)
        await asyncio.sleep(self._backoff_s)
        self._backoff_s = min(2 * self._backoff_s, self._cfg.restart_backoff_max_s)
        try:
            await asyncio.to_thread(self._proc.restart, self._cfg.triton_start_timeout_s)
        except Exception:  # any launch failure: log it and try again after the (longer) backoff
            log.exception("replica %s: Triton restart failed", self._replica)
            return
        self._answered = time.monotonic()
        if not self.in_process and self._proc.grpc_url != self._client.url:  # a core's client stays with it
            old, self._client = self._client, self._client_of(self._proc)
            await old.close()
        self._restarting = False

    async def _push(self) -> None:
        try:
            # the route the ingress streams by: a tritonserver's gRPC address (a core of the ingress's own needs none)
            route = None if self._restarting or self.in_process else (self._client.url, self._node)
            await asyncio.wait_for(self._hub.push.remote(self._replica, self._ready, self._stats, route),
                                   HUB_TIMEOUT_S)
        except (RayError, RayServeException, asyncio.TimeoutError) as exc:
            log.warning("replica %s: stats not pushed to the hub: %r", self._replica, exc)
