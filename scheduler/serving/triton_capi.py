"""The few functions of Triton's core C API (``tritonserver.h``) that serving in process needs, bound with ctypes,
and where an install keeps the library (scheduler/serving/triton_core.py uses them).

nvidia-pytriton's wheel ships the core library its ``tritonserver`` binary is linked against
(``nvidia_pytriton.libs/libtritonserver-*.so``), a release keeps it in ``lib``; its dependencies sit beside it,
where a running process's loader does not look (it read ``LD_LIBRARY_PATH`` when the process started), so each one
the loader names missing is loaded from the install's folders first. The enums are tritonserver.h's, stable across
releases; a library that lacks a function is refused by name.
"""
from __future__ import annotations

import ctypes as C
import os
import re
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from edge.core.errors import SmartExitError
from scheduler.serving.triton_client import TritonUnavailable
from scheduler.serving.tritonserver import TritonInstall

P = C.c_void_p
# tritonserver.h's enums
MEMORY_CPU = 0
CONTROL_NONE = 0
FLAG_FINAL = 1
RELEASE_ALL = 1
BYTES = 13
DTYPES = {np.dtype(np.int32): 8, np.dtype(np.int64): 9, np.dtype(np.float32): 11}
NUMPY = {8: np.int32, 9: np.int64, 11: np.float32}
AllocFn = C.CFUNCTYPE(P, P, C.c_char_p, C.c_size_t, C.c_int, C.c_int64, P, C.POINTER(P), C.POINTER(P),
                     C.POINTER(C.c_int), C.POINTER(C.c_int64))
FreeFn = C.CFUNCTYPE(P, P, P, P, C.c_size_t, C.c_int, C.c_int64)
RequestReleasedFn = C.CFUNCTYPE(None, P, C.c_uint32, P)
ResponseFn = C.CFUNCTYPE(None, P, C.c_uint32, P)
_MISSING = re.compile(r"^([^:\s]+): cannot open shared object file")


def core_library(install: TritonInstall) -> Path:
    """The ``libtritonserver`` of an install: in a folder of its ``LD_LIBRARY_PATH`` (nvidia-pytriton's
    ``nvidia_pytriton.libs``, a release's ``lib``) or beside its binary (``../lib``).

    Raises:
        SmartExitError: none there.
    """
    for d in library_dirs(install):
        found = sorted(d.glob("libtritonserver*.so*"))
        if found:
            return found[0]
    raise SmartExitError(f"no libtritonserver beside {install.binary} ({install.source}): Triton's core library is "
                         "needed to serve in process (tritonserver over gRPC needs only the binary)")


def load_library(path: Path, dirs: Sequence[Path], depth: int = 0) -> C.CDLL:
    """``path`` loaded (globally) after each dependency the loader names missing, found in ``dirs`` (the install's
    library folders, which this process's loader does not search: it read ``LD_LIBRARY_PATH`` when it started)."""
    for _ in range(64):
        try:
            return C.CDLL(str(path), mode=C.RTLD_GLOBAL)
        except OSError as exc:
            m = _MISSING.search(str(exc))
            dep = next((d / m.group(1) for d in dirs if m and (d / m.group(1)).is_file()), None)
            if dep is None or depth > 16:
                raise SmartExitError(f"cannot load {path.name}: {exc}") from exc
            load_library(dep, dirs, depth + 1)
    raise SmartExitError(f"cannot load {path.name}: too many dependencies")


def library_dirs(install: TritonInstall) -> list[Path]:
    """The folders an install's libraries are found in: its ``LD_LIBRARY_PATH`` and ``../lib`` beside its binary."""
    dirs = [Path(p) for p in install.env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p]
    return [d for d in dict.fromkeys(dirs + [install.binary.parent.parent / "lib"]) if d.is_dir()]


class CoreApi:
    """The C functions used, typed (every one returns a ``TRITONSERVER_Error*``, NULL on success, unless noted)."""

    _lock = threading.Lock()
    _loaded: dict[Path, "CoreApi"] = {}

    @classmethod
    def of(cls, install: TritonInstall) -> "CoreApi":
        """The core library of ``install``, loaded once per process, and its python backend before the core
        opens it (the backend's own dependencies are in the install's library folders too)."""
        path, dirs = core_library(install), library_dirs(install)
        with cls._lock:
            if path not in cls._loaded:
                api = cls(load_library(path, dirs))
                backend = Path(install.backend_dir) / "python" / "libtriton_python.so"
                if backend.is_file():
                    load_library(backend.resolve(), dirs)
                cls._loaded[path] = api
            return cls._loaded[path]

    def __init__(self, lib: C.CDLL) -> None:
        def f(name: str, *args, restype=P):
            try:
                fn = getattr(lib, name)
            except AttributeError:
                raise SmartExitError(f"{lib._name} has no {name}: a Triton core too old for this client "
                                     "(tritonserver over gRPC still serves)") from None
            fn.restype, fn.argtypes = restype, list(args)
            return fn
        pp = C.POINTER(P)
        self.error_message = f("TRITONSERVER_ErrorMessage", P, restype=C.c_char_p)
        self.error_delete = f("TRITONSERVER_ErrorDelete", P, restype=None)
        self.options_new = f("TRITONSERVER_ServerOptionsNew", pp)
        self.options_delete = f("TRITONSERVER_ServerOptionsDelete", P)
        self.set_repository = f("TRITONSERVER_ServerOptionsSetModelRepositoryPath", P, C.c_char_p)
        self.set_backends = f("TRITONSERVER_ServerOptionsSetBackendDirectory", P, C.c_char_p)
        self.set_control = f("TRITONSERVER_ServerOptionsSetModelControlMode", P, C.c_int)
        self.set_strict = f("TRITONSERVER_ServerOptionsSetStrictReadiness", P, C.c_bool)
        self.set_exit_on_error = f("TRITONSERVER_ServerOptionsSetExitOnError", P, C.c_bool)
        self.set_exit_timeout = f("TRITONSERVER_ServerOptionsSetExitTimeout", P, C.c_uint)
        self.set_metrics = f("TRITONSERVER_ServerOptionsSetMetrics", P, C.c_bool)
        self.set_gpu_metrics = f("TRITONSERVER_ServerOptionsSetGpuMetrics", P, C.c_bool)
        self.set_log_file = f("TRITONSERVER_ServerOptionsSetLogFile", P, C.c_char_p)
        self.set_log_verbose = f("TRITONSERVER_ServerOptionsSetLogVerbose", P, C.c_int)
        self.server_new = f("TRITONSERVER_ServerNew", pp, P)
        self.server_stop = f("TRITONSERVER_ServerStop", P)
        self.server_delete = f("TRITONSERVER_ServerDelete", P)
        self.model_ready = f("TRITONSERVER_ServerModelIsReady", P, C.c_char_p, C.c_int64, C.POINTER(C.c_bool))
        self.allocator_new = f("TRITONSERVER_ResponseAllocatorNew", pp, AllocFn, FreeFn, P)
        self.allocator_delete = f("TRITONSERVER_ResponseAllocatorDelete", P)
        libc = C.CDLL(None)  # the output buffers the allocator hands the core
        self.malloc, self.free = libc.malloc, libc.free
        self.malloc.restype, self.malloc.argtypes = P, [C.c_size_t]
        self.free.restype, self.free.argtypes = None, [P]
        self.request_new = f("TRITONSERVER_InferenceRequestNew", pp, P, C.c_char_p, C.c_int64)
        self.request_delete = f("TRITONSERVER_InferenceRequestDelete", P)
        self.request_id = f("TRITONSERVER_InferenceRequestSetId", P, C.c_char_p)
        self.add_input = f("TRITONSERVER_InferenceRequestAddInput", P, C.c_char_p, C.c_int, C.POINTER(C.c_int64),
                           C.c_uint64)
        self.input_data = f("TRITONSERVER_InferenceRequestAppendInputData", P, C.c_char_p, P, C.c_size_t, C.c_int,
                            C.c_int64)
        self.on_release = f("TRITONSERVER_InferenceRequestSetReleaseCallback", P, RequestReleasedFn, P)
        self.on_response = f("TRITONSERVER_InferenceRequestSetResponseCallback", P, P, P, ResponseFn, P)
        self.infer = f("TRITONSERVER_ServerInferAsync", P, P, P)
        self.response_error = f("TRITONSERVER_InferenceResponseError", P)
        self.response_delete = f("TRITONSERVER_InferenceResponseDelete", P)
        self.output_count = f("TRITONSERVER_InferenceResponseOutputCount", P, C.POINTER(C.c_uint32))
        self.output = f("TRITONSERVER_InferenceResponseOutput", P, C.c_uint32, C.POINTER(C.c_char_p),
                        C.POINTER(C.c_int), C.POINTER(C.POINTER(C.c_int64)), C.POINTER(C.c_uint64), C.POINTER(P),
                        C.POINTER(C.c_size_t), C.POINTER(C.c_int), C.POINTER(C.c_int64), C.POINTER(P))

    def message(self, err: int | None, delete: bool = True) -> str | None:
        """The message of a returned error (deleted: the caller owns it) or None on success."""
        if not err:
            return None
        text = (self.error_message(err) or b"").decode(errors="replace")
        if delete:
            self.error_delete(err)
        return text

    def check(self, err: int | None, what: str) -> None:
        msg = self.message(err)
        if msg is not None:
            raise TritonUnavailable(f"Triton core: {what}: {msg}")


def bytes_tensor(arr: np.ndarray) -> bytes:
    """A BYTES tensor's wire form: each element as its 4-byte little-endian length and its bytes."""
    out = bytearray()
    for v in arr.reshape(-1):
        b = v if isinstance(v, bytes) else str(v).encode()
        out += len(b).to_bytes(4, "little") + b
    return bytes(out)


def from_bytes(buf: bytes, shape: tuple[int, ...]) -> np.ndarray:
    items, at = [], 0
    while at + 4 <= len(buf):
        n = int.from_bytes(buf[at:at + 4], "little")
        items.append(buf[at + 4:at + 4 + n])
        at += 4 + n
    return np.array(items, dtype=np.object_).reshape(shape)
