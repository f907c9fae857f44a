"""A local Ray whose node does not come up is started once more (Ray's raylet gives up when its dashboard agent
starts slowly: ray-project/ray#65983, seen once in a fresh-clone demo on the 2-core VM); any other error, or a
second failure, reaches the caller. Ray itself is not started here: the calls are counted."""
from __future__ import annotations

import pytest

from scheduler.serving.stack import RAY_NODE_TIMEOUT, start_local_ray

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
