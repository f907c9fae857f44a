"""Peak resident memory of each system of ``smartexit bench decode``, each measured in a fresh process:
``peak_rss_mib`` starts ``python -m edge.pipeline.bench.decode --memory ...``, whose entry runs ``_memory_probe``."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from edge.compress.apply import precision_of
from edge.compress.checkpoint import load_served
from edge.core.errors import ConfigError
from edge.pipeline.bench.decode_config import DecodeBenchConfig
from edge.pipeline.bench.decode_systems import Systems
from edge.pipeline.bench.engine_memory import vm_kib
from edge.pipeline.run import open_run


def peak_rss_mib(system: str, run_dir: str, batch: int, cfg: DecodeBenchConfig) -> float:
    """Peak RSS of a fresh process that loads ``system`` and runs it once at ``batch``."""
    out = subprocess.run([sys.executable, "-m", "edge.pipeline.bench.decode", "--memory", system, run_dir, str(batch),
                          str(cfg.prompt_tokens), str(cfg.new_tokens), str(cfg.threads)],
                         capture_output=True, text=True, check=False, timeout=600)
    if out.returncode != 0:
        raise ConfigError(f"memory probe for {system} failed: {out.stderr.strip()[-400:]}")
    return float(out.stdout.strip().splitlines()[-1])


def _memory_probe(argv: list[str]) -> None:
    system, run_dir, batch, prompt_tokens, new_tokens, threads = argv
    cfg = DecodeBenchConfig(run_dir=run_dir, prompt_tokens=int(prompt_tokens), new_tokens=int(new_tokens),
                            threads=int(threads))
    torch.set_num_threads(cfg.threads)
    import onnxruntime  # noqa: F401  (import every library first: their import peak is not the system's)
    import transformers  # noqa: F401

    if system == "baseline":  # the interpreter with every library imported, nothing loaded
        print(vm_kib("VmRSS") / 1024)
        return
    run = open_run(run_dir, cfg.threads)
    ckpt, graphs, graphs_full, thresholds = run.path, run.graphs(), run.graphs(full=True), run.thresholds
    # llama.cpp's GGUF type follows the served model's precision: read it before the peak is reset
    precision = precision_of(load_served(ckpt)) if system == "llamacpp" else None
    before = vm_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # Linux: reset the peak RSS (VmHWM) to the current RSS
    model = load_served(ckpt) if system.startswith("engine") else None
    systems = Systems(cfg, ckpt, graphs, graphs_full, thresholds, model, only=(system,), precision=precision)
    prompts = run.prompts(int(batch), cfg.prompt_tokens, cfg.seed)
    systems.run(system, prompts, cfg.new_tokens)
    print((vm_kib("VmHWM") - before) / 1024)  # MiB the system added at its peak

