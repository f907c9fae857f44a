"""The Triton-facing side of the Ray Serve application: ``Worker`` (one replica per device) and ``Hub``.

- ``Worker``: one replica per ``smartexit_device`` resource; owns (launches, supervises) one
  tritonserver or connects to ``triton_url``; runs the control loop every ``control_tick_s``
  (``scheduler.control.policies``) and pushes the engine's stats (and its device's power, with
  ``serve.power_meter``) to the hub; streams generations.
- ``Hub``: one replica; the latest stats each worker pushed, for ``/metrics`` and ``/health``, and
  its tritonserver's gRPC address, the route the ingress streams by (scheduler/serving/routes.py).

No ``from __future__ import annotations`` here or in app.py: Serve rewrites deployment methods and
needs their annotations evaluated.
"""

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from pathlib import Path
from typing import Any

import ray
from ray import serve
from ray.exceptions import RayError
from ray.serve.exceptions import RayServeException
from ray.serve.handle import DeploymentHandle

from edge.core.errors import ConfigError
from scheduler.serving.config import DEVICE_RESOURCE, ServeConfig  # noqa: F401 - app.py imports it from here
from scheduler.serving.dashboard import open_power
from scheduler.serving.loopback import replica_grpc_on_loopback
from scheduler.serving.triton_client import TritonClient, TritonError, TritonUnavailable, error_to_dict

log = logging.getLogger(__name__)
# the serving settings a running worker's policy can be switched to (Worker.set_policy)
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


@serve.deployment(num_replicas=1, max_ongoing_requests=1000, ray_actor_options={"num_cpus": 0})
class Hub:
    """The latest ``(ready, stats, url)`` each worker replica pushed; entries older than ``ttl_s`` expire."""

    def __init__(self, ttl_s: float) -> None:
        replica_grpc_on_loopback()
        self._ttl_s = ttl_s
        self._entries: dict[str, tuple[float, bool, dict | None, tuple[str, str] | None]] = {}

    async def push(self, replica: str, ready: bool, stats: dict | None, route: tuple[str, str] | None = None) -> None:
        """A worker's state; ``route``: its tritonserver's gRPC address and the Ray node it runs on."""
        self._entries[replica] = (time.monotonic(), ready, stats, route)

    def _fresh(self) -> dict[str, tuple[float, bool, dict | None, tuple[str, str] | None]]:
        horizon = time.monotonic() - self._ttl_s
        self._entries = {k: v for k, v in self._entries.items() if v[0] >= horizon}
        return self._entries

    async def snapshot(self) -> dict[str, dict]:
        """Replica id -> its latest stats (replicas that pushed stats within ``ttl_s``)."""
        return {k: stats for k, (_, _, stats, _) in self._fresh().items() if stats}

    async def routes(self) -> dict[str, tuple[str, str]]:
        """Replica id -> (gRPC address of its tritonserver, its Ray node), for the workers whose server
        answered their last control tick (the ingress streams from these: scheduler/serving/routes.py)."""
        return {k: route for k, (_, ready, _, route) in self._fresh().items() if ready and route}

    async def health(self) -> dict[str, Any]:
        """``ready`` when at least one worker's Triton answered its last control tick."""
        now, entries = time.monotonic(), self._fresh()
        replicas = {k: {"ready": ready, "age_s": round(now - t, 3)} for k, (t, ready, _, _) in entries.items()}
        return {"ready": any(r["ready"] for r in replicas.values()), "replicas": replicas}


@serve.deployment(ray_actor_options={"resources": {DEVICE_RESOURCE: 1}, "num_cpus": 0})
class Worker:
    """The Triton-facing deployment: one tritonserver per replica (device)."""

    _power = None  # the device's LivePower with serve.power_meter (set in __init__)

    async def __init__(self, cfg: ServeConfig, repo_dir: Path | None, hub: DeploymentHandle) -> None:
        from scheduler.control.policies import observation_from_stats

        replica_grpc_on_loopback()
        self._cfg, self._hub = cfg, hub
        self._policy = build_policy(cfg)
        self._tuning: asyncio.Task | None = None
        self._observe = observation_from_stats
        self._replica = serve.get_replica_context().replica_tag
        self._node = ray.get_runtime_context().get_node_id()
        self._proc = None
        self._restarting = False
        self._backoff_s = cfg.restart_backoff_s
        self._stats: dict | None = None
        # the policy's generation (set_policy counts them) and the last one a control tick ran: set_policy waits for it
        self._generation = self._acted = 0
        # read once a control tick: sampling the meter faster would buy the live view nothing
        self._power = open_power(cfg.power_meter, cfg.control_tick_s)
        if cfg.triton_url is not None:
            url = cfg.triton_url
        else:
            from scheduler.serving.tritonserver import TritonProcess
            if repo_dir is None:
                raise ConfigError("a worker needs the Triton model repository (repo_dir) or serve.triton_url")
            env = {"SMARTEXIT_STEP_LOG": cfg.step_log} if cfg.step_log else {}
            if cfg.stream_interval_ms is not None:  # read by the Triton model (triton_model.INTERVAL_ENV)
                env["SMARTEXIT_STREAM_INTERVAL_MS"] = str(cfg.stream_interval_ms)
            self._proc = TritonProcess(Path(repo_dir), env=env)  # its threads are the repository's (bundle.json)
            try:
                await asyncio.to_thread(self._proc.start, timeout_s=cfg.triton_start_timeout_s)
            except BaseException:
                await asyncio.to_thread(self._proc.stop)
                raise
            url = self._proc.grpc_url
        self._client = TritonClient(url, timeout_s=cfg.triton_timeout_s)
        self._answered = time.monotonic()  # when tritonserver last answered a control op, or came up (started: ready)
        self._ready = await self._client.ready()
        self._loop = asyncio.create_task(self._run(), name="smartexit-control")

    async def generate(self, payload: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Stream a generation: ``{"token_ids", "exit_layers", "finish_reason"}`` per engine step,
        or one ``{"error": error_to_dict(...)}`` (errors travel as data, not across actors).

        ``payload``: the keyword arguments of ``TritonClient.generate`` (``GenerationRequest.payload``).
        """
        if self._restarting:
            exc = TritonUnavailable("tritonserver is restarting", self._cfg.retry_after_s)
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
        policies on one stack instead of one stack each), and return once that tick has run (or a timeout). ``changes``: values of :data:`POLICY_FIELDS` for
        the serving config; the policy fields it leaves out take their defaults (a switch names a whole
        policy, nothing of the previous one's carries over). An online update in flight finishes on the
        old policy's tuner. Returns the new scheduler state.

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
        log.info("worker %s: control policy now %s", self._replica, cfg.policy.value)
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

    def __del__(self) -> None:
        """Serve calls this on shutdown (and the GC may again): stop the loop and our tritonserver."""
        loop, proc, power = getattr(self, "_loop", None), getattr(self, "_proc", None), self._power
        if loop is not None:
            loop.cancel()
        if power is not None:
            self._power = None
            power.close()
        if proc is not None:
            self._proc = None
            proc.stop()

    async def _run(self) -> None:
        """Supervise tritonserver and run the control loop (one task, so they never overlap)."""
        while True:
            if self._proc is not None and not self._proc.alive:
                await self._relaunch()
                continue
            if self._proc is not None and (self._stats or {}).get("engine_alive") is False:
                # tritonserver answers, but the engine thread in its model has died: only a restart brings it back
                log.error("worker %s: the engine in tritonserver at %s has stopped; restarting it", self._replica,
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
                    log.info("worker %s: tritonserver at %s ready", self._replica, self._client.url)
                self._ready, self._backoff_s = True, self._cfg.restart_backoff_s
            except TritonError as exc:
                if self._ready:
                    log.warning("worker %s: tritonserver at %s not answering: %s", self._replica,
                                self._client.url, exc)
                self._ready = False
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
            log.exception("worker %s: power meter %s failed; no power readings from now on", self._replica,
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
                    log.info("worker %s: online update %d (%d transitions, kl %.4f, %.2f s)", self._replica,
                             st.updates, st.transitions, st.approx_kl, st.seconds)
            except Exception:  # a failed update leaves the acting network as it was; serving goes on
                log.exception("worker %s: online update failed", self._replica)
        self._tuning = asyncio.create_task(run(), name="smartexit-online-update")

    def _hung(self) -> bool:
        """Whether our tritonserver is running but has answered nothing for ``hang_restart_s``: a stopped or
        deadlocked server never exits, and the streams sent to it would wait for their clients' timeouts."""
        limit = self._cfg.hang_restart_s
        silent = time.monotonic() - self._answered
        if self._proc is None or limit is None or silent < limit:
            return False
        log.error("worker %s: tritonserver at %s has answered nothing for %.0f s; killing and restarting it",
                  self._replica, self._client.url, silent)
        return True

    async def _relaunch(self, kill: bool = False) -> None:
        """Restart a dead tritonserver after the current backoff (doubling until a tick succeeds); ``kill``: a
        hung one, SIGKILLed first (its streams end with an error at once; it would not heed a SIGTERM)."""
        self._ready, self._restarting = False, True
        if kill:
            await asyncio.to_thread(self._proc.kill)
        await self._push()
        log.warning("worker %s: restarting tritonserver in %.1f s", self._replica, self._backoff_s)
        await asyncio.sleep(self._backoff_s)
        self._backoff_s = min(2 * self._backoff_s, self._cfg.restart_backoff_max_s)
        try:
            await asyncio.to_thread(self._proc.restart, self._cfg.triton_start_timeout_s)
        except Exception:  # any launch failure: log it and try again after the (longer) backoff
            log.exception("worker %s: tritonserver restart failed", self._replica)
            return
        self._answered = time.monotonic()
        if self._proc.grpc_url != self._client.url:
            old, self._client = self._client, TritonClient(self._proc.grpc_url, timeout_s=self._cfg.triton_timeout_s)
            await old.close()
        self._restarting = False

    async def _push(self) -> None:
        try:
            route = None if self._restarting else (self._client.url, self._node)
            await asyncio.wait_for(self._hub.push.remote(self._replica, self._ready, self._stats, route),
                                   HUB_TIMEOUT_S)
        except (RayError, RayServeException, asyncio.TimeoutError) as exc:
            log.warning("worker %s: stats not pushed to the hub: %r", self._replica, exc)
