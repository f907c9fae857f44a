"""A stack's local Ray keeps its servers on the loopback address (scheduler/serving/loopback.py); the
integration test reads the listening sockets of a real stack, these test the two switches alone."""
from __future__ import annotations

import os

import pytest
import ray
from ray._private import ray_constants
from ray.serve._private import replica

from scheduler.serving import loopback


def test_loopback_ray_switches_rays_single_machine_setting_for_the_block_only(monkeypatch):
    monkeypatch.delenv(loopback.RAY_CLUSTER_ENV, raising=False)
    before = ray_constants.ENABLE_RAY_CLUSTER
    assert before is True  # Linux: Ray binds beyond the loopback address unless switched
    with loopback.loopback_ray():
        assert os.environ[loopback.RAY_CLUSTER_ENV] == "0" and ray_constants.ENABLE_RAY_CLUSTER is False
        from ray._private.services import get_node_ip_address
        assert get_node_ip_address() == "127.0.0.1"  # what ray.init gives its processes
    assert loopback.RAY_CLUSTER_ENV not in os.environ and ray_constants.ENABLE_RAY_CLUSTER is before
    monkeypatch.setenv(loopback.RAY_CLUSTER_ENV, "1")
    with pytest.raises(RuntimeError), loopback.loopback_ray():
        raise RuntimeError("ray.init failed")
    assert os.environ[loopback.RAY_CLUSTER_ENV] == "1" and ray_constants.ENABLE_RAY_CLUSTER is before


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
