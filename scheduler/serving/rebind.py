"""An ingress replica that replaces a crashed one binds the same HTTP port at once (direct ingress).

With ``serve.triton_host: ingress`` the engine's host is the ingress replica, so a crash of its process (Triton's
core or the python backend failing inside it) takes down the HTTP front end with it, and Serve starts a new replica.
That replica binds the port the dead one listened on, without SO_REUSEADDR or SO_REUSEPORT (Ray 2.60), while the old
one's closed connections sit in TIME_WAIT on it for a minute: the bind fails and Serve blocks the port for good,
so the stack never answers again (measured: stop 70, docs/serving.md). Serve quarantines a released port for
150 s besides (``RAY_SERVE_PORT_QUARANTINE_S``, for an HAProxy this stack does not run), which
scheduler/serving/stack.py sets to 0.

:func:`ingress_port_rebindable`, called in the ingress's constructor (it runs in the replica's process before
Serve starts the replica's HTTP server), makes that server's socket take SO_REUSEPORT, the option Serve's own
proxy sets: its closed connections' TIME_WAIT entries then carry it too, and the next replica's bind succeeds.
SO_REUSEPORT lets only sockets of the same user share the port. A Ray whose internals moved gets a warning
and the old behaviour.
"""
from __future__ import annotations

import inspect
import logging
from typing import Any

log = logging.getLogger("smartexit.serve")


def ingress_port_rebindable() -> None:
    """Make this replica's direct-ingress HTTP server bind its port with SO_REUSEPORT (idempotent)."""
    from ray.serve._private import replica

    start: Any = getattr(replica, "start_asgi_http_server", None)
    if start is None or "enable_so_reuseport" not in inspect.signature(start).parameters:
        log.warning("this Ray Serve starts its replica HTTP server otherwise: a crashed ingress's port may stay "
                    "unbindable for its replacement")
        return
    if getattr(start, "_rebindable", False):
        return

    async def start_rebindable(*args: Any, **kwargs: Any) -> Any:
        kwargs["enable_so_reuseport"] = True
        return await start(*args, **kwargs)

    start_rebindable._rebindable = True  # type: ignore[attr-defined]
    replica.start_asgi_http_server = start_rebindable
