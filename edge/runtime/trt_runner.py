"""Running one TensorRT plan from Python: torch CUDA tensors as its buffers, numpy in and out.

The runtime's seam to TensorRT (exporters/tensorrt.py builds the plans, the TensorRT backend in
edge/runtime/portable_backend.py runs them). ``tensorrt`` and torch are imported only here, and only
when a plan is opened: a machine without them never imports this module's dependencies, and one that
lacks them gets an error naming what to install, never an ImportError traceback.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from edge.core.errors import ArtifactError, ConfigError, MissingExtraError, SmartExitError, require

RUN_MISSING = (": TensorRT plans run on the device they were built on (a Jetson with JetPack's TensorRT, or a "
               "machine with an NVIDIA GPU and the 'tensorrt' extra: pip install 'smartexit[tensorrt]'); "
               "elsewhere serve the export with the 'onnxruntime' or 'onnxruntime_portable' backend")
RUN_NO_GPU = "TensorRT plans run on the GPU they were built for"

_TORCH_DTYPES = {"FLOAT": "float32", "HALF": "float16", "BF16": "bfloat16", "INT8": "int8", "UINT8": "uint8",
                 "INT32": "int32", "INT64": "int64", "BOOL": "bool"}


class NoCudaDeviceError(SmartExitError):
    """TensorRT is importable but no CUDA GPU is visible to build or run engines on."""


def require_tensorrt(missing: str = RUN_MISSING, no_gpu: str = RUN_NO_GPU):
    """The ``tensorrt`` module, with a CUDA GPU to run it on.

    Args:
        missing: what to do instead, appended to "TensorRT is not installed here".
        no_gpu: why a GPU is needed / where to go, appended to the no-GPU message.

    Raises:
        MissingExtraError: tensorrt cannot be imported.
        NoCudaDeviceError: it can, but torch sees no CUDA GPU.
    """
    try:
        trt = require("tensorrt", "tensorrt")
    except MissingExtraError as exc:
        raise MissingExtraError(f"TensorRT is not installed here{missing}") from exc
    import torch

    if not torch.cuda.is_available():
        raise NoCudaDeviceError(f"TensorRT {trt.__version__} is installed but no CUDA GPU is visible "
                                f"(torch.cuda.is_available() is False): {no_gpu}")
    return trt


class TrtRunner:
    """One TensorRT plan run with torch CUDA tensors as its buffers (numpy in, numpy out)."""

    def __init__(self, engine_path: str | Path) -> None:
        self.trt = trt = require_tensorrt()
        import torch

        self.torch = torch
        self.path = Path(engine_path)
        if not self.path.is_file():
            raise ArtifactError(f"{self.path} (TensorRT plan) is missing")
        self._runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self.engine = self._runtime.deserialize_cuda_engine(self.path.read_bytes())
        if self.engine is None:
            raise ArtifactError(f"{self.path}: TensorRT {trt.__version__} cannot load this plan (built with "
                                f"another TensorRT version or for another GPU?); rebuild it on this device")
        self.context = self.engine.create_execution_context()
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.inputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.outputs = [n for n in names if n not in self.inputs]
        self.stream = torch.cuda.Stream()

    def _dtype(self, name: str):
        dt = str(self.engine.get_tensor_dtype(name)).rsplit(".", 1)[-1]  # "DataType.FLOAT" -> "FLOAT"
        if dt not in _TORCH_DTYPES:
            raise ArtifactError(f"{self.path}: tensor {name!r} has type {dt}, which TrtRunner does not handle")
        return getattr(self.torch, _TORCH_DTYPES[dt])

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run the engine once on ``feeds`` (every input by name); returns every output by name.

        Raises:
            ConfigError: a missing or unknown input, or a shape outside the engine's profile.
            SmartExitError: TensorRT failed to enqueue the work.
        """
        torch, ctx = self.torch, self.context
        if set(feeds) != set(self.inputs):
            raise ConfigError(f"{self.path.name}: inputs {sorted(feeds)} given, the engine takes {sorted(self.inputs)}")
        keep = []  # device buffers must outlive the execution
        for name in self.inputs:
            arr = np.ascontiguousarray(feeds[name])
            if not ctx.set_input_shape(name, arr.shape):
                lo, _, hi = self.engine.get_tensor_profile_shape(name, 0)
                raise ConfigError(f"{self.path.name}: input {name!r} shape {arr.shape} is outside the "
                                  f"engine's profile {tuple(lo)}..{tuple(hi)}")
            t = torch.from_numpy(arr).to(device="cuda", dtype=self._dtype(name))
            if t.numel() == 0:  # an empty input still needs a non-null address
                t = torch.empty(1, dtype=t.dtype, device="cuda")
            keep.append(t)
            ctx.set_tensor_address(name, t.data_ptr())
        outs = {}
        for name in self.outputs:
            shape = tuple(ctx.get_tensor_shape(name))  # known once every input shape is set
            outs[name] = torch.empty(shape, dtype=self._dtype(name), device="cuda")
            buf = outs[name] if outs[name].numel() else torch.empty(1, dtype=outs[name].dtype, device="cuda")
            keep.append(buf)
            ctx.set_tensor_address(name, buf.data_ptr())
        self.stream.wait_stream(torch.cuda.current_stream())  # inputs were copied on the current stream
        if not ctx.execute_async_v3(self.stream.cuda_stream):
            raise SmartExitError(f"{self.path.name}: TensorRT execute_async_v3 failed (see its log)")
        self.stream.synchronize()
        return {n: (t.float() if t.dtype == torch.bfloat16 else t).cpu().numpy() for n, t in outs.items()}
