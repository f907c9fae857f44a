"""The Triton-facing deployments of the Ray Serve application: ``Worker`` (one replica per device) and ``Hub``.

- ``Worker``: one replica per ``smartexit_device`` resource with ``serve.triton_host: worker`` (the default with
  ``triton_url`` or several replicas):
  an :class:`~scheduler.serving.engine_host.EngineHost` that owns (launches, supervises) one tritonserver or
  connects to ``triton_url``, runs the control loop, pushes the engine's stats to the hub and streams
  generations. With ``triton_host: ingress`` the ingress replica hosts the engine instead and no worker runs.
- ``Hub``: one replica; the latest stats each host pushed, for ``/metrics`` and ``/health``, and
  its tritonserver's gRPC address, the route the ingress streams by (scheduler/serving/routes.py).

No ``from __future__ import annotations`` here or in app.py: Serve rewrites deployment methods and
needs their annotations evaluated.
"""

import time
from pathlib import Path
from typing import Any

import ray
from ray import serve
from ray.serve.handle import DeploymentHandle

from scheduler.serving.config import DEVICE_RESOURCE, ServeConfig  # noqa: F401 - app.py imports it from here
from scheduler.serving.engine_host import EngineHost
from scheduler.serving.loopback import replica_grpc_on_loopback

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
class Worker(EngineHost):
    """The Triton-facing deployment: one tritonserver per replica (device); its methods are
    :class:`~scheduler.serving.engine_host.EngineHost`'s (``generate``, ``stats``, ``set_policy``, ``ready``,
    ``check_health``)."""

    async def __init__(self, cfg: ServeConfig, repo_dir: Path | None, hub: DeploymentHandle) -> None:
        replica_grpc_on_loopback()
        EngineHost.__init__(self, cfg, hub, serve.get_replica_context().replica_tag,
                            ray.get_runtime_context().get_node_id())
        await self.open(repo_dir)
