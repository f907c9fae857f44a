"""On an NVIDIA GPU: the real NVML meter over a short CUDA workload measures energy, and its mean
power stays within the GPU's enforced power limit (``nvmlDeviceGetEnforcedPowerLimit``)."""
from __future__ import annotations

import time

import pytest
import torch

from edge.energy.meter import SensorUnavailable

pytestmark = pytest.mark.gpu
pynvml = pytest.importorskip("pynvml", reason="nvidia-ml-py is not installed (the 'gpu' extra)")


def nvml_index_of_cuda_device(device: int) -> int:
    """NVML numbers GPUs by PCI order, CUDA may not (CUDA_VISIBLE_DEVICES): match them by UUID."""
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    for i in range(pynvml.nvmlDeviceGetCount()):
        nv = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i))
        nv = nv.decode() if isinstance(nv, bytes) else nv
        if nv.removeprefix("GPU-") == uuid.removeprefix("GPU-"):
            return i
    raise AssertionError(f"CUDA device {device} (UUID {uuid}) not found among NVML's GPUs")


@pytest.fixture
def meter():
    from edge.energy.nvml import NvmlMeter

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        pytest.skip(f"no NVIDIA driver: {exc}")
    try:
        index = nvml_index_of_cuda_device(torch.cuda.current_device())
        limit_w = pynvml.nvmlDeviceGetEnforcedPowerLimit(pynvml.nvmlDeviceGetHandleByIndex(index)) / 1e3
    finally:
        pynvml.nvmlShutdown()
    try:
        m = NvmlMeter(0.05, device_index=index)
    except SensorUnavailable as exc:
        pytest.skip(str(exc))
    m.limit_w = limit_w
    yield m
    m.close()


def test_energy_of_a_cuda_workload(meter):
    a = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    meter.start()
    t_end = time.monotonic() + 2.0
    while time.monotonic() < t_end:
        for _ in range(10):
            a = torch.tanh(a @ a)  # tanh keeps the values bounded
        torch.cuda.synchronize()
    m = meter.stop()
    assert m.available and m.source in ("counter", "samples") and len(m.samples) >= 10
    assert m.joules is not None and m.joules > 0, m.to_dict()
    # mean power within the enforced limit (5 % for the limit being a controller target, not a cap per sample)
    assert 0 < m.mean_watts <= meter.limit_w * 1.05, (m.mean_watts, meter.limit_w)
    assert all(s.watts > 0 for s in m.samples)
    print(f"\nNVML {m.reason}: {m.joules:.1f} J over {m.seconds:.2f} s = {m.mean_watts:.1f} W "
          f"(limit {meter.limit_w:.0f} W), {len(m.samples)} samples, source {m.source}")
