"""The in-process Triton core's own parts that need no server (scheduler/serving/triton_capi.py): BYTES tensors
in Triton's wire form and back, an install without the core library and a core without a function the
client calls refused with what to do."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edge.core.errors import SmartExitError
from scheduler.serving.triton_capi import bytes_tensor, core_library, from_bytes
from scheduler.serving.tritonserver import TritonInstall


def test_bytes_tensors_round_trip_in_the_wire_form():
    arr = np.array([b'{"op": "stats"}', b"", "exact".encode()], dtype=np.object_)
    wire = bytes_tensor(arr)
    assert wire[:4] == (15).to_bytes(4, "little") and len(wire) == 3 * 4 + 15 + 0 + 5
    back = from_bytes(wire, (3,))
    assert back.dtype == np.object_ and list(back) == list(arr)
    assert from_bytes(bytes_tensor(arr.reshape(3, 1)), (3, 1)).shape == (3, 1)


def test_an_install_without_the_core_library_is_refused(tmp_path: Path):
    (tmp_path / "bin").mkdir()
    install = TritonInstall(tmp_path / "bin" / "tritonserver", tmp_path / "backends",
                            {"LD_LIBRARY_PATH": str(tmp_path / "nothing")}, "a test's")
    with pytest.raises(SmartExitError, match="no libtritonserver"):
        core_library(install)
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libtritonserver.so").write_bytes(b"")
    assert core_library(install) == tmp_path / "lib" / "libtritonserver.so"


def test_a_core_library_without_a_function_the_client_needs_is_refused_by_name():
    from types import SimpleNamespace

    from scheduler.serving.triton_capi import CoreApi

    with pytest.raises(SmartExitError, match="libold.so has no TRITONSERVER_ErrorMessage"):
        CoreApi(SimpleNamespace(_name="libold.so"))
