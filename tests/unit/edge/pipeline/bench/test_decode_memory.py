"""``bench decode``'s peak-memory probes run as many at once as there are cores (each reads its own process's
VmHWM), and every system's peak lands under its own name, at the batch the system runs at. The probes themselves
(fresh processes loading the run) run in the demo; here ``peak_rss_mib`` is replaced by a recorder."""
from __future__ import annotations

import os
import threading
import time

from edge.pipeline.bench import decode
from edge.pipeline.bench.decode_config import DecodeBenchConfig


class _Bar:
    def set_postfix_str(self, _: str) -> None:
        pass

    def update(self, n: int = 1) -> None:
        self.n = getattr(self, "n", 0) + n


def test_probes_run_side_by_side_and_keep_their_names(monkeypatch):
    lock, running, most, calls = threading.Lock(), [0], [0], []

    def probe(system: str, run_dir: str, batch: int, cfg: DecodeBenchConfig) -> float:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
            calls.append((system, batch))
        time.sleep(0.3)
        with lock:
            running[0] -= 1
        return float(len(system))  # a value each system's name decides

    monkeypatch.setattr(decode, "peak_rss_mib", probe)
    bench = decode._DecodeBench.__new__(decode._DecodeBench)
    bench.cfg = DecodeBenchConfig(run_dir="unused", batch_sizes=[1, 16], memory=True)
    bench.results, bench.bar = {}, _Bar()
    bench.memory = ["baseline", "hf", "layerskip", "engine_full", "engine_exit_defer"]
    bench.peak_memory()
    assert bench.results["peak_rss_mib"] == {s: float(len(s)) for s in bench.memory}
    assert list(bench.results["peak_rss_mib"]) == bench.memory and bench.bar.n == len(bench.memory)
    assert sorted(calls) == sorted([("baseline", 16), ("hf", 16), ("layerskip", 1), ("engine_full", 16),
                                    ("engine_exit_defer", 16)])  # LayerSkip runs at batch 1 only
    assert most[0] == min(len(bench.memory), os.cpu_count() or 1)
