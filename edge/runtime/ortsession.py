"""ONNX Runtime sessions: one shared thread pool, optimised graphs cached next to the export.

The engine runs several sessions one after another in every decode step.
Per-session pools either spin and steal the core the next session needs
(measured: 1-13 ms stalls per call) or, with spinning off, pay a thread wake-up
on every parallel operator (measured: about 2x per segment call at batch 1).
ONNX Runtime's global pool fixes both, but once it exists every session must
use it, so all sessions are opened through :func:`session_options`.

ONNX Runtime optimises a graph every time a session opens it. :func:`open_session` keeps the
optimised graph (at the ``ORT_ENABLE_EXTENDED`` level) in
``<graphs>/.ort_cache/<onnxruntime version>/<int8 kernels>/`` and opens that, with no optimisation
pass, from then on; a cached graph is used only if it was made from a source file with the same
sha256. The level is hardware-independent except for INT8 matrix products, hence the kind of
kernel in the path (:func:`int8_kernels`).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from edge.core.artifacts import sha256_file

_POOL_THREADS: int | None = None  # size of this process's shared pool, once created
X64_QUANT_PRECISION = "session.x64quantprecision"  # ONNX Runtime's session config key (see session_options)
CACHE_DIR = ".ort_cache"  # hidden: not part of the export's hash (edge.core.artifacts.sha256_path)


def session_options(ort, threads: int = 0, shared: bool = True):
    """SessionOptions on the process-wide pool, creating it with ``threads`` intra-op threads
    (0 = one per core) unless it exists. ONNX Runtime cannot resize the pool: the first caller of
    a process sizes it, later ones share it whatever they ask for (see :func:`pool_threads`).
    ``shared`` False: the pool is not created (for a session given a pool of its own, which ONNX Runtime
    refuses in a process that has the shared one)."""
    global _POOL_THREADS
    if _POOL_THREADS is None and shared:
        ort.set_global_thread_pool_sizes(threads, 1)
        _POOL_THREADS = threads
    opts = ort.SessionOptions()
    opts.use_per_session_threads = False
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    # INT8 matrix products: on x86 without VNNI (AVX2, AVX-512 before VNNI, SSE4.1) MLAS's U8S8 kernel
    # sums pairs of products in saturating 16-bit lanes (VPMADDUBSW). On such a CPU (a 2-core AMD EPYC
    # with AVX2, 2026-12-02) the compressed demo model's graphs then missed torch by up to 7.6% of an
    # output's scale where 1.5% was measured on VNNI CPUs, and the export's parity gate failed. This
    # makes ONNX Runtime convert to the exact U8U8 kernel on those CPUs only (its
    # kOrtSessionOptionsAvx2PrecisionMode); elsewhere nothing changes. Exported graphs give each Q/DQ
    # pair its own zero point, which the conversion needs (exporters/onnx_files.py own_zero_points).
    opts.add_session_config_entry(X64_QUANT_PRECISION, "1")
    return opts


def int8_kernels() -> str:
    """Which INT8 matrix product ONNX Runtime runs here: ``x86-vnni`` (U8S8 without saturation),
    ``x86-u8u8`` (x86 without VNNI: the exact U8U8 kernel, see :func:`session_options`) or the machine
    name elsewhere (aarch64: the dot-product kernels). The optimised-graph cache is kept per kind: a
    graph optimised on one kind of CPU may hold the fused kernels of that kind."""
    import platform

    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64", "i386", "i686"):
        return machine or "unknown"
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:  # not Linux: assume the conservative kind
        return "x86-u8u8"
    return "x86-vnni" if flags & {"avx512_vnni", "avx_vnni", "avx_vnni_int8"} else "x86-u8u8"


def pool_threads() -> int | None:
    """Intra-op threads of the shared pool (0 = one per core); None before any session."""
    return _POOL_THREADS


def open_session(ort, path: str | Path, threads: int = 0, providers: list[str] | None = None,
                 source_sha256: str | None = None, cache: bool = True, own_threads: int | None = None):
    """An InferenceSession of ``path`` on the shared pool (or a pool of its own), through the optimised-graph cache.

    Args:
        ort: the onnxruntime module.
        path: the exported graph.
        threads: size of the shared pool if this call creates it.
        providers: execution providers (default CPU). The cache is used for the CPU provider only
            (other providers optimise for their device).
        source_sha256: the graph's recorded sha256 (hashed here if not given).
        cache: False to always optimise at load (and write nothing).
        own_threads: a pool of this many intra-op threads for this session alone (1: the caller's thread
            only; 0: one per core), its threads sleeping between calls instead of spinning (the shared pool's spin control is
            not exposed to Python); only in a process without the shared pool.
    """
    path = Path(path)
    providers = providers or ["CPUExecutionProvider"]
    opts = session_options(ort, threads, shared=own_threads is None)
    if own_threads is not None:
        opts.use_per_session_threads = True
        opts.intra_op_num_threads = own_threads
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if not cache or providers != ["CPUExecutionProvider"]:
        return ort.InferenceSession(str(path), opts, providers=providers)
    folder = path.parent / CACHE_DIR / ort.__version__ / int8_kernels()
    cached, stamp = folder / path.name, folder / f"{path.name}.json"
    # a graph with external weights keeps them external in the cache too (protobuf's 2 GiB limit)
    data = f"{path.name}.data" if (path.parent / f"{path.name}.data").is_file() else None
    files = [cached] + ([folder / data] if data else [])
    sha = source_sha256 or sha256_file(path)
    if stamp.is_file() and all(f.is_file() for f in files) and _stamp_matches(stamp, sha, files):
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        return ort.InferenceSession(str(cached), opts, providers=providers)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{path.name}.{os.getpid()}.tmp"
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    opts.optimized_model_filepath = str(tmp)
    if data:
        opts.add_session_config_entry("session.optimized_model_external_initializers_file_name", data)
        opts.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    ort.InferenceSession(str(path), opts, providers=providers)  # optimises and writes tmp (+ data)
    os.replace(tmp, cached)
    stamp.write_text(json.dumps({"source_sha256": sha, "optimized_sha256": [sha256_file(f) for f in files],
                                 "onnxruntime": ort.__version__}))
    return open_session(ort, path, threads, providers, sha, cache, own_threads)


def _stamp_matches(stamp: Path, sha: str, files: list[Path]) -> bool:
    try:
        rec = json.loads(stamp.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return rec.get("source_sha256") == sha and rec.get("optimized_sha256") == [sha256_file(f) for f in files]
