"""A local Ray whose node does not come up is started once more (Ray's raylet gives up when its dashboard agent
starts slowly: ray-project/ray#65983, seen once in a fresh-clone demo on the 2-core VM; its GCS never wrote its port
file, seen once in stop 61's); any other error, or a second failure, reaches the caller. Ray itself is not started
here: the calls are counted."""
from __future__ import annotations

import pytest

from scheduler.serving.stack import RAY_NODE_TIMEOUT, RAY_PORT_TIMEOUT, start_local_ray

TIMEOUT = Exception(f"The current node {RAY_NODE_TIMEOUT}. This could happen because some of the raylet failed "
                    "to startup or the GCS has become overloaded.")


def _init(errors: list[Exception | None]):
    calls = []

    def init():
        calls.append("init")
        error = errors[len([c for c in calls if c == "init"]) - 1]
        if error is not None:
            raise error

    return init, calls


def test_a_node_that_did_not_come_up_is_started_again(capsys):
    init, calls = _init([TIMEOUT, None])
    start_local_ray(init, lambda: calls.append("shutdown"))
    assert calls == ["init", "shutdown", "init"]
    assert "starting it again (2 of 2)" in capsys.readouterr().out


def test_a_gcs_that_never_wrote_its_port_is_started_again(capsys):
    """Ray 2.60's words when its GCS did not write its port file in 30 s (a fresh-clone demo, stop 61)."""
    gcs = RuntimeError(f"{RAY_PORT_TIMEOUT} /tmp/ray/session_x/gcs_server_port_89ef")
    init, calls = _init([gcs, None])
    start_local_ray(init, lambda: calls.append("shutdown"))
    assert calls == ["init", "shutdown", "init"]
    assert "starting it again (2 of 2)" in capsys.readouterr().out


def test_a_second_failure_and_any_other_error_reach_the_caller():
    init, calls = _init([TIMEOUT, TIMEOUT])
    with pytest.raises(Exception, match=RAY_NODE_TIMEOUT):
        start_local_ray(init, lambda: calls.append("shutdown"))
    assert calls == ["init", "shutdown", "init"]
    init, calls = _init([ValueError("resources must be a dict")])
    with pytest.raises(ValueError, match="resources"):
        start_local_ray(init, lambda: calls.append("shutdown"))
    assert calls == ["init"]  # not retried, nothing shut down
    init, calls = _init([None])
    start_local_ray(init, lambda: calls.append("shutdown"))
    assert calls == ["init"]


class _Draws:
    """randint's answers in order (a stand-in for free_port's random source)."""

    def __init__(self, *ports: int) -> None:
        self.ports = list(ports)

    def randint(self, lo: int, hi: int) -> int:
        p = self.ports.pop(0)
        assert lo <= p <= hi
        return p


def test_free_port_is_drawn_below_the_ephemeral_range_and_skips_a_port_in_use():
    """No bind(0) and no outgoing connection (a starting Ray makes dozens) can be handed the port between the
    check and the replica's bind: it lies below the OS's ephemeral range. A port something holds is passed over."""
    import socket

    from scheduler.serving import stack

    lo, hi = stack.PORTS_BELOW_EPHEMERAL
    top = min(hi, stack.ephemeral_floor() - 2)
    for _ in range(20):
        p = stack.free_port()
        assert lo <= p <= top < stack.ephemeral_floor()
    held = next(p for p in range(lo, top) if _bindable(p))
    spare = next(p for p in range(held + 1, top) if _bindable(p))
    with socket.socket() as s:
        s.bind(("127.0.0.1", held))
        assert stack.free_port(rng=_Draws(held, spare)) == spare  # the held one passed over


def test_free_port_lets_the_os_pick_where_no_room_is_left_below(monkeypatch):
    from scheduler.serving import stack

    monkeypatch.setattr(stack, "ephemeral_floor", lambda: 1024)
    assert 0 < stack.free_port(rng=_Draws()) <= 65535  # no draw at all: bind(0)


def _bindable(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False
