"""``smartexit serve``: the serving stack until Ctrl-C / SIGTERM.

``smartexit serve run_dir=R`` starts Ray Serve (OpenAI-compatible HTTP on ``serve.host:serve.port``,
127.0.0.1:8000 by default) in front of one tritonserver per worker replica, each serving the run's
Triton repository (``smartexit repo``). ``triton_only=true`` starts only a tritonserver on the
repository (gRPC / HTTP / metrics ports printed), for a client that speaks Triton's protocol.
Both stop everything they started on Ctrl-C or SIGTERM: no process outlives the command.
"""
from __future__ import annotations

import signal
import threading
from dataclasses import dataclass, field
from typing import Any

from edge.core.configio import apply
from scheduler.serving.config import ServeConfig
from scheduler.serving.stack import repository, serving_stack


@dataclass
class ServeStackConfig:
    run_dir: str = "artifacts/demo"
    triton_only: bool = False
    ray_address: str | None = None  # "auto": join a running Ray cluster (several devices)
    serve: dict[str, Any] = field(default_factory=dict)  # ServeConfig fields (host, port, api_key, replicas, policy, ...)
    policy: str | None = None       # `--policy ppo`: shorthand for serve.policy

    def __post_init__(self) -> None:
        if self.policy is not None:
            self.serve = {**self.serve, "policy": self.policy}
        apply(ServeConfig(), dict(self.serve))  # validates the keys and values now, with their names


def _wait_for_signal() -> int:
    stop = threading.Event()
    received: list[int] = []

    def handler(signum, _frame):
        received.append(signum)
        stop.set()

    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        stop.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return received[0] if received else 0


def main(cfg: ServeStackConfig) -> int:
    if cfg.triton_only:
        from scheduler.serving.tritonserver import TritonProcess

        with TritonProcess(repository(cfg.run_dir)) as tp:
            print(f"tritonserver ready: gRPC {tp.grpc_url}, HTTP {tp.http_url}, metrics "
                  f"http://{tp.host}:{tp.ports.metrics}/metrics ({tp.install.source}); Ctrl-C stops it", flush=True)
            _wait_for_signal()
        print("tritonserver stopped")
        return 0
    serve_cfg = apply(ServeConfig(), dict(cfg.serve))
    with serving_stack(cfg.run_dir, serve_cfg, ray_address=cfg.ray_address) as url:
        print(f"SmartExit serving at {url} (model {serve_cfg.model_name!r}, {serve_cfg.replicas} replica(s), "
              f"policy {serve_cfg.policy.value}); try:\n  curl -N {url}/v1/completions -H 'Content-Type: "
              f"application/json' -d '{{\"model\": \"{serve_cfg.model_name}\", \"prompt\": \"def \", "
              f"\"max_tokens\": 32, \"stream\": true}}'\nCtrl-C stops it", flush=True)
        _wait_for_signal()
    print("serving stack stopped")
    return 0
