"""A local Ray whose servers listen on the loopback address only, as the API and tritonserver do.

On Linux Ray binds its servers (GCS, raylet, the workers' gRPC, the dashboard and runtime-env agents) to every
interface or to the machine's reachable address, and turns a loopback ``_node_ip_address`` into that address;
Serve's replicas start their inter-deployment gRPC server on ``[::]:0``, every interface, whatever the node's
address (Ray 2.60). Two switches keep a single-machine stack off the network:

- :func:`loopback_ray` around ``ray.init``, with :data:`LOOPBACK_RAY_ENV` in the environment Ray's processes start
  with: Ray's own single-machine setting (``ENABLE_RAY_CLUSTER`` off, meant for Windows and macOS, read on Linux
  too) makes the loopback address the node's address, and Ray's servers bind there;
- :func:`replica_grpc_on_loopback` in each deployment's constructor (it runs in the replica's process before
  Serve starts that server): on a node whose address is loopback, Serve's replica server binds there too.

The integration test ``test_every_process_of_the_stack_listens_on_loopback_only`` reads every listening socket of
a stack's processes; a Ray whose internals moved fails it, and these switches then do nothing (a warning).
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Iterator

log = logging.getLogger("smartexit.serve")

#: Ray's single-machine switch, read by each of its processes when it starts (Ray 2.60:
#: ray/_private/ray_constants.py ENABLE_RAY_CLUSTER, ray/_private/services.py get_node_ip_address)
RAY_CLUSTER_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
_ANY = "[::]:"  # how Serve's replica names every interface for its gRPC server


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


#: what a local Ray's processes must find in their environment when they start, for their servers to bind there
LOOPBACK_RAY_ENV = {RAY_CLUSTER_ENV: "0"}


@contextlib.contextmanager
def loopback_ray() -> Iterator[None]:
    """``ray.init`` inside this block takes the loopback address as the node's: the processes it starts read
    :data:`LOOPBACK_RAY_ENV` from their environment (the caller sets it for them: scheduler/serving/stack.py); this
    process read that switch when it imported Ray, so its copy is switched for the block (``ray.init`` resolves the
    node's address here)."""
    from ray._private import ray_constants

    old = getattr(ray_constants, "ENABLE_RAY_CLUSTER", None)
    if old is None:
        log.warning("this Ray has no ENABLE_RAY_CLUSTER setting: its servers may listen beyond 127.0.0.1")
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = old


def replica_grpc_on_loopback() -> None:
    """In a Serve replica on a node whose address is loopback (a stack's local Ray, :func:`loopback_ray`):
    the replica's inter-deployment gRPC server, which Serve binds to every interface, binds to 127.0.0.1.
    Elsewhere (a Ray cluster) nothing changes."""
    import ray
    from ray.serve._private import replica

    if not is_loopback(ray.util.get_node_ip_address()):
        return
    add: Callable[..., Any] | None = getattr(replica, "add_port_to_grpc_server", None)
    if add is None:
        log.warning("this Ray Serve has no add_port_to_grpc_server: its replica server listens beyond 127.0.0.1")
        return
    if getattr(add, "_loopback", False):
        return

    def add_on_loopback(server: Any, address: str) -> int:
        if address.startswith(_ANY):
            address = "127.0.0.1:" + address[len(_ANY):]
        return add(server, address)

    add_on_loopback._loopback = True  # type: ignore[attr-defined]
    replica.add_port_to_grpc_server = add_on_loopback
