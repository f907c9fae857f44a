"""A stack's local Ray keeps its servers on the loopback address (scheduler/serving/loopback.py); the
integration test reads the listening sockets of a real stack, these test the two switches alone."""
from __future__ import annotations

import os

import pytest
import ray
from ray._private import ray_constants
from ray.serve._private import replica

from scheduler.serving import loopback


def test_loopback_ray_switches_rays_single_machine_setting_for_the_block_only():
    before = ray_constants.ENABLE_RAY_CLUSTER
    assert before is True  # Linux: Ray binds beyond the loopback address unless switched
    with loopback.loopback_ray():
        assert ray_constants.ENABLE_RAY_CLUSTER is False
        from ray._private.services import get_node_ip_address
        assert get_node_ip_address() == "127.0.0.1"  # what ray.init gives its processes
    assert ray_constants.ENABLE_RAY_CLUSTER is before
    with pytest.raises(RuntimeError), loopback.loopback_ray():
        raise RuntimeError("ray.init failed")
    assert ray_constants.ENABLE_RAY_CLUSTER is before


def test_a_local_rays_processes_start_with_the_switch_on_a_loopback_host_only(monkeypatch):
    """The environment serving_stack starts a local Ray with: the switch for an API on 127.0.0.1 (the default),
    beside direct ingress's settings; none for an API off loopback; the caller's own value back afterwards."""
    from scheduler.serving.config import ServeConfig
    from scheduler.serving.stack import USER_CODE_THREAD_ENV, _environ, direct_ingress_env, ray_start_env

    monkeypatch.delenv(USER_CODE_THREAD_ENV, raising=False)
    cfg = ServeConfig(port=8123)
    assert ray_start_env(cfg, direct=True) == {**direct_ingress_env(8123), loopback.RAY_CLUSTER_ENV: "0",
                                               USER_CODE_THREAD_ENV: "0"}
    assert ray_start_env(cfg, direct=False) == {loopback.RAY_CLUSTER_ENV: "0", USER_CODE_THREAD_ENV: "0"}
    monkeypatch.setenv(USER_CODE_THREAD_ENV, "1")  # the caller's own choice stands
    assert ray_start_env(cfg, direct=False)[USER_CODE_THREAD_ENV] == "1"
    monkeypatch.delenv(USER_CODE_THREAD_ENV)
    assert loopback.RAY_CLUSTER_ENV not in ray_start_env(ServeConfig(host="0.0.0.0", api_key="k"), direct=False)
    monkeypatch.delenv(loopback.RAY_CLUSTER_ENV, raising=False)
    with _environ(ray_start_env(cfg, direct=False)):
        assert os.environ[loopback.RAY_CLUSTER_ENV] == "0"
    assert loopback.RAY_CLUSTER_ENV not in os.environ
    monkeypatch.setenv(loopback.RAY_CLUSTER_ENV, "1")
    with pytest.raises(RuntimeError), _environ(ray_start_env(cfg, direct=False)):
        raise RuntimeError("ray.init failed")
    assert os.environ[loopback.RAY_CLUSTER_ENV] == "1"


@pytest.mark.parametrize("node, bound", [("127.0.0.1", "127.0.0.1:0"), ("10.0.0.5", "[::]:0")])
def test_the_replica_server_binds_to_loopback_only_on_a_loopback_node(monkeypatch, node, bound):
    seen = []
    monkeypatch.setattr(replica, "add_port_to_grpc_server", lambda server, address: seen.append(address) or 7)
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: node)
    loopback.replica_grpc_on_loopback()
    loopback.replica_grpc_on_loopback()  # every deployment of a replica's process calls it: wrapped once
    assert replica.add_port_to_grpc_server(None, "[::]:0") == 7
    replica.add_port_to_grpc_server(None, "127.0.0.1:5")  # an address Serve chose itself is left alone
    assert seen == [bound, "127.0.0.1:5"]
