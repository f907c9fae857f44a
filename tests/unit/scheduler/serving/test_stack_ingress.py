"""The serving stack's ingress settings (scheduler/serving/stack.py) without starting Ray: direct
ingress's environment for Ray's processes, the environment restored after, and a port in use refused
by name before anything starts. The served path itself runs in tests/integration/test_serving.py."""
from __future__ import annotations

import os
import time
import socket

import pytest

from edge.core.errors import ConfigError
from scheduler.serving import stack


def test_direct_ingress_pins_the_replica_to_the_one_port_and_drains_at_once():
    env = stack.direct_ingress_env(8123)
    assert env["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"
    # Ray's allocator takes range(min, max): the one port asked for
    assert list(range(int(env["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"]),
                      int(env["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"]))) == [8123]
    assert float(env["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"]) == 0.0
    # a crashed ingress's port goes back at once to the replica replacing it (no HAProxy to wait for)
    assert float(env["RAY_SERVE_PORT_QUARANTINE_S"]) == 0.0


def test_the_ingress_http_server_binds_with_so_reuseport(monkeypatch):
    """scheduler/serving/rebind.py: the replica's call to start its HTTP server goes through with SO_REUSEPORT
    asked (Serve's replica passes False), once however often the constructor runs; the rest of the call unchanged."""
    from ray.serve._private import replica

    from scheduler.serving.rebind import ingress_port_rebindable

    calls = []

    async def start(app, options, *, event_loop, enable_so_reuseport=False):
        calls.append((app, options, event_loop, enable_so_reuseport))
        return "task", "server"

    monkeypatch.setattr(replica, "start_asgi_http_server", start)
    ingress_port_rebindable()
    ingress_port_rebindable()
    wrapped = replica.start_asgi_http_server
    assert wrapped is not start and getattr(wrapped, "_rebindable", False)
    import asyncio
    assert asyncio.run(wrapped("app", "opts", event_loop="loop", enable_so_reuseport=False)) == ("task", "server")
    assert calls == [("app", "opts", "loop", True)]


def test_the_environment_is_restored_even_on_error(monkeypatch):
    monkeypatch.setenv("SMARTEXIT_TEST_KEPT", "before")
    monkeypatch.delenv("SMARTEXIT_TEST_NEW", raising=False)
    with pytest.raises(RuntimeError):
        with stack._environ({"SMARTEXIT_TEST_KEPT": "during", "SMARTEXIT_TEST_NEW": "x"}):
            assert os.environ["SMARTEXIT_TEST_KEPT"] == "during" and os.environ["SMARTEXIT_TEST_NEW"] == "x"
            raise RuntimeError("a failed start")
    assert os.environ["SMARTEXIT_TEST_KEPT"] == "before"
    assert "SMARTEXIT_TEST_NEW" not in os.environ


def test_a_port_in_use_is_refused_by_name_and_a_free_one_is_given():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ConfigError, match=f"127.0.0.1:{port}"):
            stack._bind("127.0.0.1", port)
        assert stack._listening("127.0.0.1", port)
    assert not stack._listening("127.0.0.1", port)
    free = stack.free_port()
    assert 0 < free < 65536
    assert stack._bind("127.0.0.1", free) == free  # nothing holds it after the probe


def test_serving_stack_refuses_a_busy_port_before_starting_ray(tmp_path):
    from scheduler.serving.config import ServeConfig

    (tmp_path / "triton" / "smartexit").mkdir(parents=True)
    (tmp_path / "triton" / "smartexit" / "config.pbtxt").write_text("")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        cfg = ServeConfig(port=s.getsockname()[1])
        with pytest.raises(ConfigError, match="cannot serve on"):
            with stack.serving_stack(tmp_path, cfg):
                pass
    import ray
    assert not ray.is_initialized()


def test_serving_stack_refuses_several_core_hosting_ingresses_on_one_port(tmp_path):
    """``triton_host: ingress`` runs an ingress replica per device; direct ingress gives one machine's replicas
    one port, so two devices there are refused (naming the settings that work) before Ray starts."""
    from scheduler.serving.config import ServeConfig

    (tmp_path / "triton" / "smartexit").mkdir(parents=True)
    (tmp_path / "triton" / "smartexit" / "config.pbtxt").write_text("")
    cfg = ServeConfig(port=stack.free_port(), triton_host="ingress", replicas=2)
    with pytest.raises(ConfigError, match="serve.ingress: proxy"):
        with stack.serving_stack(tmp_path, cfg):
            pass
    import ray
    assert not ray.is_initialized()


def _time_wait_port(reuse: bool) -> int:
    """A port of 127.0.0.1 left in TIME_WAIT: its server (listening with SO_REUSEADDR or not) accepted a
    connection and closed it first (as a stack stopped with a client's keep-alive connection open
    does), then stopped listening."""
    with socket.socket() as srv:
        if reuse:
            srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        port = srv.getsockname()[1]
        cli = socket.create_connection(("127.0.0.1", port))
        conn, _ = srv.accept()
        conn.close()  # the server's side closes first: its end (the port) enters TIME_WAIT
        cli.recv(1)
        cli.close()
    return port


def test_closed_connections_block_a_server_bind_until_they_time_out():
    """What made a direct-ingress stack fail to start within a minute of the last one on its port: the
    replica binds without SO_REUSEADDR. The stack waits (here: gives up after 0.6 s, naming TIME_WAIT)."""
    for reuse in (True, False):  # after uvicorn / Serve's proxy (SO_REUSEADDR) and after direct ingress
        port = _time_wait_port(reuse)
        assert not stack._listening("127.0.0.1", port)
        with pytest.raises(ConfigError, match="in use"):
            stack._bind("127.0.0.1", port)
        with pytest.raises(ConfigError, match="TIME_WAIT"):
            stack._wait_bindable("127.0.0.1", port, timeout_s=0.6)
    assert stack._bind("127.0.0.1", stack.free_port())  # a benchmark's own port binds at once


def test_waiting_for_a_port_refuses_a_listener_at_once():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        t0 = time.monotonic()
        with pytest.raises(ConfigError, match="something listens there"):
            stack._wait_bindable("127.0.0.1", port, timeout_s=30)
        assert time.monotonic() - t0 < 5


def test_serving_stack_refuses_a_policy_setting_before_starting_ray(tmp_path):
    """A setting the heuristic policy does not take is refused with its name before Ray starts (it used to fail
    inside the ingress replica, which Serve restarted until the stack's start gave up)."""
    from scheduler.serving.config import ServeConfig

    (tmp_path / "triton" / "smartexit").mkdir(parents=True)
    (tmp_path / "triton" / "smartexit" / "config.pbtxt").write_text("")
    cfg = ServeConfig(port=stack.free_port(), policy="fixed", policy_kwargs={"prefill_budget:32": None})
    with pytest.raises(ConfigError, match="policy 'fixed'.*prefill_budget:32"):
        with stack.serving_stack(tmp_path, cfg):
            pass
    import ray
    assert not ray.is_initialized()
