"""Typed configuration of the serving front end (docs/serving.md) and the bundle it serves.

``ServeConfig`` holds what the Ray Serve application needs; ``BundleInfo`` is what it reads from the
bundle directory (``bundle.json``: the model's context window and exit layers; ``tokenizer.json``).
"""
from __future__ import annotations

import enum
import ipaddress
import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from edge.core.errors import ConfigError
from edge.runtime.request import Mode  # the request modes (bounded, exact, full): the engine's own
from edge.runtime.settings import SLA_TPOT_MS, SLA_TTFT_MS

BUNDLE_JSON = "bundle.json"
DEVICE_RESOURCE = "smartexit_device"  # the Ray custom resource: one unit per device, one worker replica each
REPO_BUNDLE = Path("smartexit") / "1" / "bundle"  # where `smartexit repo` puts it (exporters/triton.py)
TOKENIZER_JSON = "tokenizer.json"
LOOPBACK_NAMES = ("localhost",)
STREAM_VIA = ("triton", "worker")  # ServeConfig.stream_via
INGRESS = ("direct", "proxy")  # ServeConfig.ingress
TRITON_HOST = ("worker", "ingress")  # ServeConfig.triton_host


class PolicyName(str, enum.Enum):
    """The control policy the worker runs every tick (scheduler/control/policies.py; ppo: scheduler/control/learned.py)."""
    AIMD = "aimd"
    FIXED = "fixed"
    MAXDELAY = "maxdelay"
    PPO = "ppo"


def is_loopback(host: str) -> bool:
    """Whether ``host`` only accepts connections from this machine (127.0.0.0/8, ::1, localhost)."""
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name other than localhost: assume it is reachable from outside
        return False


@dataclass
class ServeConfig:
    """The serving application's settings.

    ``bundle_dir`` holds ``tokenizer.json`` and ``bundle.json`` (default: the bundle inside the Triton
    repository, ``<repo>/smartexit/1/bundle``); ``context_window`` comes from the bundle
    (``model.max_positions``) unless set lower. ``triton_url`` (``host:port`` of a running
    tritonserver's gRPC endpoint) makes every worker connect there instead of launching its own.
    """
    bundle_dir: Path | None = None
    triton_url: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None              # required when host is not loopback
    model_name: str = "smartexit-tiny"
    max_tokens_limit: int = 256             # the largest max_tokens a request may ask for
    context_window: int | None = None       # prompt tokens + max_tokens must fit; from the bundle
    default_mode: Mode = Mode.BOUNDED
    default_sla_ttft_ms: float = SLA_TTFT_MS.default  # a request that names no SLA gets these
    default_sla_tpot_ms: float = SLA_TPOT_MS.default
    replicas: int = 1                       # worker replicas, one per `smartexit_device` resource
    control_tick_s: float = 0.25
    policy: PolicyName = PolicyName.AIMD
    policy_kwargs: dict[str, Any] = field(default_factory=dict)  # ppo: {"path": folder} (default: the shipped one)
    # policy ppo only: the heuristic the guard falls back to, the guard's and the online tuner's settings
    # (scheduler/control/online.py FallbackGuard, OnlineTuner)
    fallback_policy: PolicyName = PolicyName.AIMD
    fallback_kwargs: dict[str, Any] = field(default_factory=dict)
    guard: dict[str, Any] = field(default_factory=dict)
    online_finetune: bool = True
    tuner: dict[str, Any] = field(default_factory=dict)
    max_inflight: int = 64                  # per worker replica: the front end answers 429 above it
    retry_after_s: float = 1.0              # Retry-After on the front end's own 429 / 503
    max_body_bytes: int = 8 * 1024 * 1024   # a larger request body is answered 413, unread
    triton_timeout_s: float = 10.0          # control ops and readiness probes (not generation streams)
    triton_start_timeout_s: float = 120.0
    restart_backoff_s: float = 1.0          # first wait before relaunching a dead tritonserver
    restart_backoff_max_s: float = 30.0
    # a tritonserver that is running but has answered no control op for this long (hung: stopped, deadlocked)
    # is killed and relaunched, so the streams waiting on it end with an error; None: never
    hang_restart_s: float | None = 30.0
    stats_ttl_s: float = 10.0               # a worker silent this long drops out of /metrics, /health
    tps_window_s: float = 10.0              # smartexit_tokens_per_second averages over this window
    log_level: str = "WARNING"              # Ray Serve's replica logs (INFO: one access line per request)
    # a JSONL file the served engine appends one line per step to (edge/runtime/host_types.py HostConfig.step_log;
    # `smartexit profile` reads it); tritonservers this app starts only; None: no log
    step_log: str | None = None
    # each worker's power meter (edge.energy.detect.open_meter's kind: "auto" picks what the device has);
    # "none": no meter, the dashboard shows why instead of a power chart (docs/serving.md, Dashboard)
    power_meter: str = "none"
    dashboard_tick_s: float = 1.0           # the live dashboard samples its time series this often
    dashboard_points: int = 600             # and keeps this many samples (10 min at 1 s)
    # how a request's tokens reach the ingress: "triton", its own gRPC stream to the picked worker's
    # tritonserver on its node (one Ray hop fewer per chunk: scheduler/serving/routes.py; with none ready
    # there, through a worker); "worker", always through the worker replica
    stream_via: str = "triton"
    # which replica hosts each device's Triton: "ingress", the ingress replica (one per device) runs Triton's
    # core in its own process (scheduler/serving/triton_core.py) and streams from it without gRPC or another
    # actor (scheduler/serving/engine_host.py; docs/serving.md, stop 70); "worker", a Worker replica launches a
    # tritonserver (or reaches triton_url) and the ingress streams from it over gRPC (stream_via). None: ingress
    # for one device, worker with triton_url or several replicas (the scale-out docs/serving.md describes)
    triton_host: str | None = None
    # how HTTP reaches the ingress: "direct", the ingress replica's own HTTP server listens on host:port
    # (Ray Serve's direct ingress: no proxy process between the client and the ingress; needs the local
    # Ray that serving_stack starts, so with ray_address the proxy serves); "proxy", Serve's HTTP proxy
    # on host:port forwards each request to the ingress replica (docs/serving.md, The price of serving)
    ingress: str = "direct"
    # load shedding (edge/runtime/host.py): refuse with 429 + Retry-After a request still waiting when its
    # TTFT deadline passes; None: the bundle's setting (RepoConfig.shed_late, off by default)
    shed_late: bool | None = None
    # the Triton model's shortest gap between two responses of one request (RepoConfig.stream_interval_ms),
    # for the tritonservers this app starts; None: the bundle's
    stream_interval_ms: float | None = None

    def __post_init__(self) -> None:
        if self.bundle_dir is not None:
            self.bundle_dir = Path(self.bundle_dir)
        self.default_mode = _enum(Mode, self.default_mode, "default_mode")
        self.policy = _enum(PolicyName, self.policy, "policy")
        self.fallback_policy = _enum(PolicyName, self.fallback_policy, "fallback_policy")
        if self.fallback_policy is PolicyName.PPO:
            raise ConfigError("serve.fallback_policy must be a heuristic (aimd, fixed, maxdelay), not ppo")
        for name in ("policy_kwargs", "fallback_kwargs", "guard", "tuner"):
            if not isinstance(getattr(self, name), dict):
                raise ConfigError(f"serve.{name} must be a mapping, got {type(getattr(self, name)).__name__}")
        if not self.host:
            raise ConfigError("serve.host must not be empty")
        if not isinstance(self.power_meter, str) or not self.power_meter.strip():
            raise ConfigError(f"serve.power_meter must be a meter kind ('none', 'auto', ...), got {self.power_meter!r}")
        if self.shed_late is not None and not isinstance(self.shed_late, bool):
            raise ConfigError(f"serve.shed_late must be true, false or null, got {self.shed_late!r}")
        if self.stream_interval_ms is not None and (isinstance(self.stream_interval_ms, bool) or not isinstance(
                self.stream_interval_ms, (int, float)) or not 0 <= self.stream_interval_ms <= 1000):
            raise ConfigError(f"serve.stream_interval_ms must be a number in [0, 1000] or null, got "
                              f"{self.stream_interval_ms!r}")
        if self.stream_via not in STREAM_VIA:
            raise ConfigError(f"serve.stream_via must be one of {', '.join(STREAM_VIA)}, got {self.stream_via!r}")
        if self.triton_host is not None and self.triton_host not in TRITON_HOST:
            raise ConfigError(f"serve.triton_host must be one of {', '.join(TRITON_HOST)} or null, got "
                              f"{self.triton_host!r}")
        if self.triton_host == "ingress" and self.triton_url is not None:
            raise ConfigError("serve.triton_host: ingress runs Triton's core in the ingress; a running server at "
                              "serve.triton_url is reached with triton_host: worker")
        if self.ingress not in INGRESS:
            raise ConfigError(f"serve.ingress must be one of {', '.join(INGRESS)}, got {self.ingress!r}")
        if self.ingress == "direct" and self.port == 0:
            raise ConfigError("serve.port 0 (any free port) needs serve.ingress: proxy; direct ingress binds "
                              "the port it is given")
        if self.log_level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ConfigError(f"serve.log_level must be DEBUG, INFO, WARNING or ERROR, got {self.log_level!r}")
        if not is_loopback(self.host) and not self.api_key:
            raise ConfigError(f"serve.api_key is required when serve.host is {self.host!r} (not loopback): "
                              "set an API key or bind to 127.0.0.1")
        if self.api_key is not None and not self.api_key.strip():
            raise ConfigError("serve.api_key must not be blank")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"serve.port must be in [0, 65535], got {self.port}")
        if self.triton_url is not None and ":" not in self.triton_url:
            raise ConfigError(f"serve.triton_url must be host:port, got {self.triton_url!r}")
        for name in ("max_tokens_limit", "replicas", "max_inflight", "dashboard_points", "max_body_bytes"):
            _positive_int(self, name)
        if self.context_window is not None:
            _positive_int(self, "context_window")
        for name in ("default_sla_ttft_ms", "default_sla_tpot_ms", "control_tick_s", "retry_after_s",
                     "triton_timeout_s", "triton_start_timeout_s", "restart_backoff_s",
                     "restart_backoff_max_s", "stats_ttl_s", "tps_window_s", "dashboard_tick_s"):
            _positive_float(self, name)
        if self.hang_restart_s is not None:
            _positive_float(self, "hang_restart_s")
        if self.restart_backoff_max_s < self.restart_backoff_s:
            raise ConfigError(f"serve.restart_backoff_max_s ({self.restart_backoff_max_s}) must be >= "
                              f"serve.restart_backoff_s ({self.restart_backoff_s})")

    @property
    def engine_in_ingress(self) -> bool:
        """Whether the ingress hosts the engine (``triton_host``; None: for one device without ``triton_url``)."""
        if self.triton_host is None:
            return self.triton_url is None and self.replicas == 1
        return self.triton_host == "ingress"

    def resolve_bundle(self, repo_dir: Path | None) -> ServeConfig:
        """This config with ``bundle_dir`` (default: the repository's bundle) and ``context_window``
        set from the bundle.

        Raises:
            ConfigError: no bundle to read, or as :meth:`BundleInfo.load` and :meth:`with_bundle`.
        """
        bundle_dir = self.bundle_dir or (None if repo_dir is None else Path(repo_dir) / REPO_BUNDLE)
        return replace(self, bundle_dir=bundle_dir).with_bundle(BundleInfo.load(bundle_dir))

    def with_bundle(self, bundle: BundleInfo) -> ServeConfig:
        """This config with ``context_window`` set from the bundle (kept if set lower).

        Raises:
            ConfigError: ``context_window`` exceeds the model's positions, or ``max_tokens_limit``
                leaves no room for a prompt.
        """
        window = bundle.max_positions if self.context_window is None else self.context_window
        if window > bundle.max_positions:
            raise ConfigError(f"serve.context_window {window} exceeds the model's {bundle.max_positions} "
                              f"positions ({bundle.path})")
        if self.max_tokens_limit >= window:
            raise ConfigError(f"serve.max_tokens_limit {self.max_tokens_limit} must be below the context "
                              f"window {window} (a prompt needs at least one token)")
        return replace(self, context_window=window)


@dataclass(frozen=True)
class BundleInfo:
    """What the front end reads from a bundle directory."""
    path: Path
    max_positions: int
    num_layers: int
    exit_layers: tuple[int, ...]

    @property
    def tokenizer_path(self) -> Path:
        return self.path / TOKENIZER_JSON

    @classmethod
    def load(cls, bundle_dir: Path | str | None) -> BundleInfo:
        """Read ``bundle.json`` (``{"model": {"max_positions", "num_layers", "exit_layers"}}``;
        ``exit_layers`` may also sit at the top level, as in an export's graphs.json).

        Raises:
            ConfigError: the directory, ``bundle.json`` or ``tokenizer.json`` is missing, or a field
                is absent or malformed (named).
        """
        if bundle_dir is None:
            raise ConfigError("serve.bundle_dir is required (the folder with tokenizer.json and bundle.json)")
        path = Path(bundle_dir)
        meta_path = path / BUNDLE_JSON
        if not meta_path.is_file():
            raise ConfigError(f"serve.bundle_dir {path}: {BUNDLE_JSON} is missing")
        if not (path / TOKENIZER_JSON).is_file():
            raise ConfigError(f"serve.bundle_dir {path}: {TOKENIZER_JSON} is missing")
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConfigError(f"{meta_path}: not valid JSON ({exc})") from exc
        model = meta.get("model") if isinstance(meta, dict) else None
        if not isinstance(model, dict):
            raise ConfigError(f"{meta_path}: field 'model' must be an object")
        exits = model.get("exit_layers", meta.get("exit_layers"))
        max_positions, num_layers = model.get("max_positions"), model.get("num_layers")
        for name, value in (("model.max_positions", max_positions), ("model.num_layers", num_layers)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{meta_path}: field '{name}' must be a positive integer, got {value!r}")
        if (not isinstance(exits, list) or not exits
                or not all(isinstance(e, int) and not isinstance(e, bool) and 0 < e <= num_layers for e in exits)):
            raise ConfigError(f"{meta_path}: field 'model.exit_layers' must be a non-empty list of layers "
                              f"in [1, {num_layers}], got {exits!r}")
        return cls(path, max_positions, num_layers, tuple(sorted(set(exits))))


def _enum(kind: type[enum.Enum], value: Any, name: str):
    try:
        return kind(value)
    except ValueError:
        choices = ", ".join(repr(m.value) for m in kind)
        raise ConfigError(f"serve.{name} must be one of {choices}, got {value!r}") from None


def _positive_int(cfg: ServeConfig, name: str) -> None:
    value = getattr(cfg, name)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"serve.{name} must be a positive integer, got {value!r}")


def _positive_float(cfg: ServeConfig, name: str) -> None:
    value = getattr(cfg, name)
    if (not isinstance(value, (int, float)) or isinstance(value, bool)
            or not math.isfinite(value) or value <= 0):
        raise ConfigError(f"serve.{name} must be a positive number, got {value!r}")
