"""Peak resident memory of the ONNX Runtime engine serving one export, measured in a fresh process that
imports what a device imports to serve (numpy, onnxruntime, the engine: no torch), loads the graphs and
decodes the given prompts with the exit rule: the number a recipe's row reports as its peak memory."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from edge.core.errors import ConfigError


def peak_rss_mib(graphs: Path, thresholds: Path, checkpoint: Path, prompts: list[list[int]], new_tokens: int,
                 threads: int, lookup_table: Path | None = None) -> float:
    """MiB the process added at its peak (VmHWM minus the resident size after the imports). ``lookup_table``:
    the corpus n-gram table the rule's context lookup falls back to, where it is not ``graphs``' own."""
    arg = json.dumps({"graphs": str(graphs), "thresholds": str(thresholds), "checkpoint": str(checkpoint),
                      "prompts": prompts, "new_tokens": new_tokens, "threads": threads,
                      "lookup_table": None if lookup_table is None else str(lookup_table)})
    out = subprocess.run([sys.executable, "-m", "edge.pipeline.bench.engine_memory", arg], capture_output=True,
                         text=True, check=False, timeout=600)
    if out.returncode != 0:
        raise ConfigError(f"memory probe of {graphs} failed: {out.stderr.strip()[-400:]}")
    return float(out.stdout.strip().splitlines()[-1])


def vm_kib(field_name: str) -> int:
    """A ``/proc/self/status`` memory field in KiB (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1])
    raise ConfigError(f"/proc/self/status has no {field_name} (peak memory is measured on Linux only)")


def _probe(arg: str) -> None:
    from calibration.table import TableRule, load_table
    from edge.runtime.batch import run_batch
    from edge.runtime.backend import make_backend
    from edge.runtime.engine_config import KVMode

    a = json.loads(arg)
    import onnxruntime  # noqa: F401  (imports first: their peak is not the engine's)

    before = vm_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # Linux: reset the peak (VmHWM) to the current RSS
    table = load_table(Path(a["thresholds"]), Path(a["checkpoint"]))
    backend = make_backend("onnxruntime", graphs_dir=Path(a["graphs"]), threads=a["threads"])
    if a.get("lookup_table"):
        from edge.model.ngram import NgramTable

        backend.ngram_table = NgramTable.load(a["lookup_table"])
    run_batch(backend, TableRule(table), a["prompts"], a["new_tokens"], KVMode(table.kv_mode))
    print((vm_kib("VmHWM") - before) / 1024)


if __name__ == "__main__" and len(sys.argv) == 2:
    _probe(sys.argv[1])
