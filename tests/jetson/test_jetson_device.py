"""On a Jetson: the device check reads the real L4T release and TensorRT packages."""
from __future__ import annotations

import pytest

from edge.core.device import jetson_info


@pytest.mark.jetson
def test_jetson_info_on_device():
    info = jetson_info()
    assert info["jetpack"] != "unknown", info
