"""Let the last system's threads stop before the next one is timed.

Every runtime the benches compare keeps its worker threads spinning for a while after its work ends,
a full core each: measured on the 2-core AMD EPYC VM (2026-12-05, CPU time of this process in 10 ms
windows after the last call), ONNX Runtime's shared intra-op pool ~40 ms (its workers spin whatever a
session's ``allow_spinning`` says: the global pool's spin control is not exposed to Python), torch's
OpenMP pool and llama.cpp's threads ~10 ms. A system timed right after another therefore starts on
cores the last one's threads still hold. In `bench decode`, llama.cpp ran right after the exits
engine in every repeat: paired in one process, it decoded 1,374 tokens/s right after the engine's run
and 1,780 after a wait (12 interleaved repeats; docs/runtime.md). :func:`settle` waits until this process's threads have
stopped (CPU time in a short window below a small share of it), so each interleaved system starts on
quiet cores; what a system's own spinning costs while it runs stays in its time.
"""
from __future__ import annotations

import time

WINDOW_S = 0.005  # the window over which the process's CPU use is read
QUIET_SHARE = 0.1  # a window is quiet when the process used at most this share of one core in it
LIMIT_S = 0.5  # the longest wait: a process with a thread that never stops (a monitor, a server) is not waited on


def settle(window_s: float = WINDOW_S, quiet: float = QUIET_SHARE, limit_s: float = LIMIT_S) -> float:
    """Wait until the threads of this process stop using CPU: until a ``window_s`` window in which the
    process used at most ``quiet`` of a core, or ``limit_s`` have passed. Returns the seconds waited."""
    if window_s <= 0 or not 0 <= quiet < 1 or limit_s < 0:
        raise ValueError(f"settle needs window_s > 0, 0 <= quiet < 1 and limit_s >= 0, got {window_s}, {quiet}, "
                         f"{limit_s}")
    t0 = time.perf_counter()
    while True:
        c0, w0 = time.process_time(), time.perf_counter()
        time.sleep(window_s)
        now = time.perf_counter()
        if time.process_time() - c0 <= quiet * (now - w0) or now - t0 >= limit_s:
            return now - t0
