"""Every ONNX Runtime session of the process shares one intra-op thread pool.

The engine runs several sessions one after another in every decode step.
Per-session pools either spin and steal the core the next session needs
(measured: 1-13 ms stalls per call) or, with spinning off, pay a thread wake-up
on every parallel operator (measured: about 2x per segment call at batch 1).
ONNX Runtime's global pool fixes both, but once it exists every session must
use it, so all sessions are opened through :func:`session_options`.
"""
from __future__ import annotations

_POOL_THREADS: int | None = None  # size of this process's shared pool, once created


def session_options(ort, threads: int = 0):
    """SessionOptions on the process-wide pool, creating it with ``threads`` intra-op threads
    (0 = one per core) unless it exists. ONNX Runtime cannot resize the pool: the first caller of
    a process sizes it, later ones share it whatever they ask for (see :func:`pool_threads`)."""
    global _POOL_THREADS
    if _POOL_THREADS is None:
        ort.set_global_thread_pool_sizes(threads, 1)
        _POOL_THREADS = threads
    opts = ort.SessionOptions()
    opts.use_per_session_threads = False
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return opts


def pool_threads() -> int | None:
    """Intra-op threads of the shared pool (0 = one per core); None before any session."""
    return _POOL_THREADS
