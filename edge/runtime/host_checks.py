"""What callers hand :class:`edge.runtime.host.EngineHost`, checked on the caller's thread before it goes
to the engine thread: a generation request (as the engine's :class:`~edge.runtime.request.Request`) and a
control op (docs/serving.md: ``stats``, ``set``, ``cancel``, ``audit_reset``).
"""
from __future__ import annotations

from typing import Any

from edge.core.errors import RequestError
from edge.runtime.engine import Engine
from edge.runtime.request import Mode, Request
from edge.runtime.host_types import GenRequest, HostError


def check_request(req: GenRequest, engine: Engine) -> Request:
    """``req`` as the engine's request, checked as the engine checks it (its checks read only its configuration).

    Raises:
        HostError: ``invalid_request``, naming the field.
    """
    try:
        mode = Mode(req.mode)
    except ValueError:
        raise HostError("invalid_request", f"mode {req.mode!r} is not one of "
                        f"{', '.join(m.value for m in Mode)}", "mode") from None
    ereq = Request(list(req.prompt), int(req.max_tokens), float(req.temperature), float(req.top_p),
                   tuple(req.stop_ids), req.seed, mode=mode)
    try:
        engine.check(ereq)
    except RequestError as exc:
        raise HostError("invalid_request", str(exc), exc.field) from None
    for name in ("sla_ttft_ms", "sla_tpot_ms"):
        v = getattr(req, name)
        if v is not None and not v > 0:
            raise HostError("invalid_request", f"{name} must be > 0, got {v}", name)
    return ereq

def parse_control(op: Any) -> tuple[str, Any]:
    """A control op as ``(name, argument)``: ``("stats", None)``, ``("set", {setting: value})``,
    ``("cancel", request_id)`` or ``("audit_reset", None)``.

    Raises:
        HostError: ``invalid_request`` for an unknown op or a bad value.
    """
    name = op.get("op") if isinstance(op, dict) else None
    if name == "stats":
        return name, None
    if name == "set":
        values = {}
        for key in ("prefill_budget", "max_running"):
            if key in op:
                v = op[key]
                if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                    raise HostError("invalid_request", f"{key} must be an integer >= 1, got {v!r}", key)
                values[key] = v
        if "shed_late" in op:
            if not isinstance(op["shed_late"], bool):
                raise HostError("invalid_request", f"shed_late must be true or false, got {op['shed_late']!r}",
                                "shed_late")
            values["shed_late"] = op["shed_late"]
        return name, values
    if name == "cancel":
        rid = op.get("request_id")
        if not isinstance(rid, str):
            raise HostError("invalid_request", "cancel needs a string request_id", "request_id")
        return name, rid
    if name == "audit_reset":
        return name, None
    raise HostError("invalid_request", f"unknown control op {name!r}; expected stats, set, cancel or "
                    "audit_reset", "op")
