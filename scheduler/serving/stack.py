"""The whole serving stack in one context manager: Ray, the Serve application, its tritonservers.

``serving_stack(run_dir, cfg)`` starts a local Ray (with ``cfg.replicas`` units of the
``smartexit_device`` resource, one per worker replica), deploys the application
(scheduler/serving/app.py: each worker launches its own tritonserver on the run's Triton repository),
waits until ``/health`` says every worker is ready, yields the base URL, and on exit shuts Serve and
Ray down, which ends the workers and, with them, their tritonservers.

HTTP reaches the ingress replica directly (``serve.ingress: direct``, the default): Ray Serve's direct
ingress, where the ingress replica runs its own HTTP server on ``host:port``, so a request and each of
its chunks skip the proxy process and its hop to the replica (docs/serving.md, The price of serving).
Ray's processes read that setting from their environment when they start, so it is set for the start
of the local Ray this function begins, and only then; Serve still starts its proxy on the head node,
which listens on a free port of the same host, unused. ``serve.ingress: proxy`` (and any stack joining
a running cluster, whose processes started with their own environment) serves through the proxy.

A local Ray started for an API on a loopback host (the default) keeps its own servers (GCS, raylet, workers'
gRPC, the dashboard and runtime-env agents, Serve's replicas) on the loopback address too
(scheduler/serving/loopback.py); Ray on Linux
otherwise binds them to every interface or to the machine's reachable address.

On several devices (Jetsons) the same application runs on a Ray cluster instead: ``ray start
--head --resources='{"smartexit_device": 1}'`` on one, ``ray start --address=HEAD:6379
--resources='{"smartexit_device": 1}'`` on each other, then ``smartexit serve ray_address=auto
serve.replicas=N``: Serve places one worker (and its tritonserver) per device (docs/serving.md).
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable, Iterator

from edge.core.errors import ConfigError, SmartExitError
from scheduler.serving.config import DEVICE_RESOURCE, REPO_BUNDLE, ServeConfig
from scheduler.serving.loopback import LOOPBACK_RAY_ENV, is_loopback, loopback_ray


def repository(run_dir: str | Path) -> Path:
    """The run's Triton repository (``smartexit repo``).

    Raises:
        ConfigError: it has not been written.
    """
    repo = Path(run_dir) / "triton"
    if not (repo / "smartexit" / "config.pbtxt").is_file():
        raise ConfigError(f"{repo} is not a Triton model repository: run `smartexit repo run_dir={run_dir}` first")
    return repo


def bundle(run_dir: str | Path) -> Path:
    """The serving bundle inside the run's Triton repository (what model.py opens)."""
    return repository(run_dir) / REPO_BUNDLE


def health(base_url: str, timeout_s: float = 5.0) -> tuple[int, dict]:
    """``GET /health``: (status, body); (0, {}) when nothing answers."""
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=timeout_s) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, json.loads(exc.read() or b"{}")
        except json.JSONDecodeError:
            return exc.code, {}
    except (urllib.error.URLError, OSError, json.JSONDecodeError):
        return 0, {}


def wait_healthy(base_url: str, timeout_s: float) -> dict:
    """Poll ``/health`` until it answers 200.

    Raises:
        SmartExitError: not healthy in time (the last answer is in the message).
    """
    deadline, last = time.monotonic() + timeout_s, (0, {})
    while time.monotonic() < deadline:
        last = health(base_url)
        if last[0] == 200:
            return last[1]
        time.sleep(0.5)
    raise SmartExitError(f"the serving stack at {base_url} was not healthy after {timeout_s:.0f} s "
                         f"(last /health: {last[0]} {last[1]})")


def set_policy(changes: dict[str, Any], app: str = "smartexit") -> dict[str, Any]:
    """Switch the control policy of the running stack's engine host (this process started it with
    :func:`serving_stack`, one device: the worker, or the ingress with ``serve.triton_host: ingress``) to the one
    ``changes`` names, its other policy fields at their defaults:
    :meth:`scheduler.serving.engine_host.EngineHost.set_policy`. Returns the host's scheduler state.

    Raises:
        ConfigError: more than one host replica (a handle call reaches one of them), or changes the
            host refuses.
    """
    from ray import serve

    status = serve.status().applications.get(app)
    deployments = {} if status is None else status.deployments
    name = "Worker" if "Worker" in deployments else "Ingress"
    replicas = deployments.get(name)
    running = None if replicas is None else sum(
        n for state, n in replicas.replica_states.items() if getattr(state, "value", state) == "RUNNING")
    if running != 1:
        raise ConfigError(f"set_policy switches a stack of one engine host replica; {app!r} has {running}")
    return serve.get_deployment_handle(name, app_name=app).set_policy.remote(changes).result()


def direct_ingress_env(port: int) -> dict[str, str]:
    """Ray Serve's settings for direct ingress on ``port``: the ingress replica's HTTP port range is
    that one port, and a stopping replica does not wait out a drain period for an external load
    balancer (there is none)."""
    return {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1", "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port),
            "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + 1),
            "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0", "RAY_SERVE_PORT_QUARANTINE_S": "0"}


# Ray Serve runs a replica's code on an event loop of its own thread by default, so that every request and every
# streamed chunk crosses between that loop and the one of the replica's HTTP server (its direct ingress) and its
# control plane. This stack's replicas never block their loop (what blocks runs in a thread: asyncio.to_thread), so
# they share the replica's own loop, as Serve's throughput-optimized mode does: measured on the 2-core VM (stop 71,
# docs/serving.md), the hop from Serve's ASGI entry to the handler 0.74 -> 0.41 ms per request.
USER_CODE_THREAD_ENV = "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"


def ray_start_env(cfg: ServeConfig, direct: bool) -> dict[str, str]:
    """What a local Ray's processes must find in their environment when they start: direct ingress's settings
    (``direct``), for an API on a loopback host the switch that keeps Ray's servers there too, and the replicas' code
    on their own event loop (:data:`USER_CODE_THREAD_ENV` ``0``, unless this process's environment names it)."""
    return {**(direct_ingress_env(cfg.port) if direct else {}), **(LOOPBACK_RAY_ENV if is_loopback(cfg.host) else {}),
            USER_CODE_THREAD_ENV: os.environ.get(USER_CODE_THREAD_ENV, "0")}


@contextlib.contextmanager
def _environ(extra: dict[str, str]) -> Iterator[None]:
    """``os.environ`` with ``extra`` set, restored afterwards."""
    old = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _bind(host: str, port: int) -> int:
    """Bind a TCP socket to ``host:port`` as direct ingress's replica binds (no SO_REUSEADDR, so a closed
    connection's TIME_WAIT stops it too) and close it; the port bound.

    Raises:
        ConfigError: the address is in use or cannot be bound.
    """
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as s:
            s.bind(addr)
            return s.getsockname()[1]
    except OSError as exc:
        raise ConfigError(f"cannot serve on {host}:{port}: {exc.strerror or exc}") from None


def _listening(host: str, port: int) -> bool:
    """Whether something accepts TCP connections on ``host:port`` (a wildcard host: on its loopback)."""
    target = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    try:
        with socket.create_connection((target, port), timeout=1.0):
            return True
    except OSError:
        return False


PORTS_BELOW_EPHEMERAL = (20000, 32767)  # free_port's range where the local ephemeral range starts above it
PORT_TRIES = 200


def ephemeral_floor() -> int:
    """The lowest port the OS gives ``bind(0)`` and outgoing connections (Linux's ``ip_local_port_range``; its
    default where that cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1", rng: random.Random | None = None) -> int:
    """A port of ``host`` nothing uses now, not even a closed connection's TIME_WAIT: for the stacks a benchmark
    starts for itself, so that one started right after another does not wait out the last one's connections
    (:func:`_wait_bindable`). Drawn below the OS's ephemeral range (:data:`PORTS_BELOW_EPHEMERAL`), where no
    ``bind(0)`` and no outgoing connection is given a port: between this check and the replica's bind a local Ray
    starts, and its processes bind port 0 and connect by the dozen; a port the OS had just handed out and taken back
    was once handed to one of them, and the ingress replica could not bind it (a fresh-clone demo's profile, 2026-12-06,
    Serve's `NoAvailablePortError`). Where the ephemeral range leaves no room below it, the OS picks."""
    lo, hi = PORTS_BELOW_EPHEMERAL
    hi = min(hi, ephemeral_floor() - 2)  # direct ingress may take port + 1 too
    rng = rng or random.SystemRandom()
    for _ in range(PORT_TRIES if hi - lo >= 100 else 0):
        try:
            return _bind(host, rng.randint(lo, hi))
        except ConfigError:  # in use (or in TIME_WAIT): another
            continue
    return _bind(host, 0)


TIME_WAIT_S = 75.0  # Linux keeps a closed connection's local port in TIME_WAIT for 60 s


def _wait_bindable(host: str, port: int, timeout_s: float = TIME_WAIT_S) -> None:
    """Wait until a server can bind ``host:port``. A stack stopped with connections open leaves them in
    TIME_WAIT on its port for a minute; a server socket without SO_REUSEADDR (direct ingress's replica
    in Ray 2.60) cannot bind past them, nor can any server past those of a listener that had it unset
    (direct ingress's own), and Serve then gives the port up for good.

    Raises:
        ConfigError: something listens there (at once), or the port is still held after ``timeout_s``.
    """
    if _listening(host, port):
        raise ConfigError(f"cannot serve on {host}:{port}: something listens there (stop it or set serve.port)")
    deadline, told = time.monotonic() + timeout_s, False
    while True:
        try:
            _bind(host, port)
            return
        except ConfigError as exc:
            if time.monotonic() > deadline:
                raise ConfigError(f"{exc}; still held (closed connections in TIME_WAIT?) after {timeout_s:.0f} s: "
                                  "set serve.port to another port") from None
            if not told:
                print(f"serve: waiting for the closed connections on {host}:{port} to time out (up to "
                      f"{timeout_s:.0f} s)", flush=True)
                told = True
            time.sleep(0.5)


RAY_START_ATTEMPTS = 2
RAY_NODE_TIMEOUT = "timed out during startup"  # what Ray 2.60 raises (a bare Exception) when its node did not come up
# what it raises (RuntimeError) when a process it started never wrote its port file (the GCS: 30 s)
RAY_PORT_TIMEOUT = "Timed out waiting for file"


def start_local_ray(init: Callable[[], Any], shutdown: Callable[[], Any], attempts: int = RAY_START_ATTEMPTS) -> None:
    """``init()`` a local Ray; where its node does not come up, ``shutdown()`` what started and try again, up to
    ``attempts`` in all. Ray's raylet gives up for good when its agents start slowly (ray-project/ray#65983: a
    fixed 15 s wait on the dashboard agent's port file): on the 2-core VM a stack started a second after the one
    before it once failed so (a fresh-clone demo's `bench scheduler`, 2026-12-06, the agent aborting with
    -6), where every other start of the day came up. And once (stop 61, the same stage) the GCS never wrote its port
    file nor a line of its log within Ray's 30 s: a process that never reached its program, as a fork in a process
    with gRPC threads can leave one (Ray runs Python in the child before exec). Any other error is raised at once."""
    for attempt in range(1, attempts + 1):
        try:
            init()
            return
        except Exception as exc:  # noqa: BLE001 - Ray raises a bare Exception for this
            if not any(m in str(exc) for m in (RAY_NODE_TIMEOUT, RAY_PORT_TIMEOUT)) or attempt == attempts:
                raise
            with contextlib.suppress(Exception):
                shutdown()
            print(f"serve: Ray's node did not come up ({exc}); starting it again ({attempt + 1} of {attempts})",
                  flush=True)


@contextlib.contextmanager
def serving_stack(run_dir: str | Path, cfg: ServeConfig, ray_address: str | None = None,
                  start_timeout_s: float = 300.0, graceful: bool = True) -> Iterator[str]:
    """Start Ray + Serve + tritonservers for ``run_dir``; yields the base URL (``http://host:port``).

    ``ray_address``: join a running Ray cluster (``"auto"``) instead of starting a local one.
    ``graceful=False`` (a benchmark between runs): skip Serve's graceful shutdown (~10 s) and end the
    local Ray at once; its workers' tritonservers are killed as their parent dies (edge.core.device.spawn).
    """
    import ray
    from ray import serve

    from scheduler.serving.app import run as run_app

    repo = None if cfg.triton_url is not None else repository(run_dir)
    if repo is None and cfg.bundle_dir is None:
        raise ConfigError("serve.triton_url needs serve.bundle_dir (the tokenizer and bundle.json)")
    # a policy setting it does not take, or a missing, altered or mismatched learned policy, fails here, not inside
    # a replica that Serve then restarts in vain
    from scheduler.serving.engine_host import build_policy
    build_policy(cfg)
    direct = cfg.ingress == "direct" and ray_address is None
    if direct and cfg.engine_in_ingress and cfg.replicas > 1:
        raise ConfigError("serve.triton_host: ingress runs one ingress replica per device, and direct ingress gives "
                          "one machine's replicas one port: serve several devices of one machine with "
                          "serve.ingress: proxy (or serve.triton_host: worker)")
    if cfg.port:  # a port in use fails here, with its name, not as a replica that cannot start
        _wait_bindable(cfg.host, cfg.port)
    # a changed or missing bundle file fails here with its name, not as tritonservers that cannot load the model
    from exporters.triton import read_bundle

    read_bundle(cfg.bundle_dir if cfg.bundle_dir is not None else repo / REPO_BUNDLE)
    kwargs = dict(include_dashboard=False, configure_logging=True, logging_level="WARNING")
    if ray_address is None:
        local = loopback_ray() if is_loopback(cfg.host) else contextlib.nullcontext()
        with local, _environ(ray_start_env(cfg, direct)):
            start_local_ray(lambda: ray.init(resources={DEVICE_RESOURCE: cfg.replicas}, **kwargs), ray.shutdown)
    else:
        ray.init(address=ray_address, **kwargs)
    try:
        run_app(cfg, repo, proxy_port=free_port(cfg.host) if direct else None)
        host = "127.0.0.1" if cfg.host in ("0.0.0.0", "::") else cfg.host
        url = f"http://{host}:{cfg.port}"
        wait_healthy(url, start_timeout_s)
        yield url
    finally:
        if graceful or ray_address is not None:
            with contextlib.suppress(Exception):  # shutting down: report nothing over the caller's error
                serve.shutdown()
        ray.shutdown()
