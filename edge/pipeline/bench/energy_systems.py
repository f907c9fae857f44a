"""The systems ``smartexit bench energy`` (:mod:`edge.pipeline.bench.energy`) measures and their runs: the backend
each runs on, and the repeats of idle and decode windows on the power meter."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from edge.core.artifacts import sha256_path
from edge.core.errors import ConfigError
from edge.pipeline.bench.energy_config import C_EXITS, C_FULL, EXITS, FULL, SERVED, EnergyBenchConfig
from edge.pipeline.bench.energy_figures import Window
from edge.pipeline.bench.quiesce import settle


def log(t0: float, msg: str) -> None:
    print(f"[bench energy {time.time() - t0:6.1f}s] {msg}", flush=True)


def backend_choice(cfg: EnergyBenchConfig, served: Path) -> dict[str, Any]:
    """The backend file's dict (edge.runtime.served) of a run on another backend than ONNX Runtime's fused
    graphs: ``served`` reads the one ``smartexit jetson serve`` wrote; the others name theirs.

    Raises:
        ConfigError: ``served`` without that file.
    """
    from edge.runtime.served import CHOICE_FILE, ENGINES_DIR, read_backend_choice

    run = Path(cfg.run_dir)
    if cfg.backend == "served":
        if not (run / CHOICE_FILE).is_file():
            raise ConfigError(f"bench energy backend=served: {run / CHOICE_FILE} is missing (`make jetson-serve` "
                              f"writes it); name the backend instead: tensorrt, torch_static, onnxruntime_portable")
        return read_backend_choice(run / CHOICE_FILE)
    if cfg.backend == "tensorrt":
        return {"name": "tensorrt", "engines_dir": str(run / ENGINES_DIR)}
    if cfg.backend == "torch_static":
        return {"name": "torch_static", "checkpoint": str(served), "device": cfg.device, "dtype": cfg.dtype}
    return {"name": cfg.backend}


def energy_systems(cfg: EnergyBenchConfig, run: Any) -> tuple[dict[str, tuple[Path, Any]], dict[str, Any], str]:
    """The systems measured (name -> (graphs, rule)), their backends, and what "full" is.

    With ``backend: onnxruntime``: the distilled float model without and with exits (and a compressed run's
    own graphs beside them); otherwise the served model on the device's backend, without and with the rule.
    """
    from edge.pipeline.bench.float_graphs import float_graphs
    from edge.runtime.backend import make_backend
    from edge.runtime.graphs import load_ngram_table
    from edge.runtime.rules import NeverExit
    from edge.runtime.served import open_backend

    manifest, served, rule = run.manifest, run.path, run.rule
    if cfg.backend == "onnxruntime":
        graphs = float_graphs(manifest, run.prompts(3, 32, cfg.seed + 7))
        systems = {FULL: (graphs["full"], NeverExit()), EXITS: (graphs["exits"], rule)}
        if served != manifest.verified_output("distill", "checkpoint"):  # a compressed run
            systems[C_FULL] = (manifest.verified_output("export", "graphs_full"), NeverExit())
            systems[C_EXITS] = (manifest.verified_output("export", "graphs"), rule)
        backends = {n: make_backend("onnxruntime", graphs_dir=g, threads=cfg.threads) for n, (g, _) in systems.items()}
        # the float graphs run the run's rule, whose context lookup may fall back to the run's export's corpus table
        table = load_ngram_table(manifest.verified_output("export", "graphs"))
        for backend in backends.values():
            backend.ngram_table = table
        shipped = C_EXITS if C_EXITS in systems else EXITS
        systems[SERVED], backends[SERVED] = systems[shipped], backends[shipped]  # the same graphs, run as served
        full_is = "the distilled float model without exit heads (ONNX Runtime, graphs_full)"
    else:  # the served model on the device's backend, without and with the rule
        choice = backend_choice(cfg, served)
        graphs_dir = manifest.verified_output("export", "graphs")
        backend = open_backend(choice, graphs_dir, sha256_path(served), cfg.threads)
        systems = {FULL: (graphs_dir, NeverExit()), EXITS: (graphs_dir, rule), SERVED: (graphs_dir, rule)}
        backends = {FULL: backend, EXITS: backend, SERVED: backend}
        full_is = f"the served model on {choice['name']} without an exit rule"
    return systems, backends, full_is


def measure_windows(cfg: EnergyBenchConfig, meter: Any, names: list[str], decode: Any, t0: float
                    ) -> tuple[dict[str, list[Window]], dict[str, list[tuple[float, float]]], list[Any]]:
    """Warm-up, then ``cfg.repeats`` rounds: an idle window, then every system's decode window (rotated);
    returns the windows, the first round's power traces and the idle windows."""
    windows: dict[str, list[Window]] = {n: [] for n in names}
    traces: dict[str, list[tuple[float, float]]] = {n: [] for n in names}  # the first repeat's power samples
    idle_trace: list[Any] = []
    try:
        for name in names:  # warm-up: sessions, plans, caches
            decode(name, 4)
        for rep in range(cfg.repeats):
            idle_w = None
            if cfg.idle_seconds > 0:
                meter.start()
                time.sleep(cfg.idle_seconds)
                idle = meter.stop()
                idle_w = idle.mean_watts
                idle_trace.append(idle.to_dict())
            for name in names[rep % len(names):] + names[:rep % len(names)]:
                # each window starts on quiet cores and ends when its own threads have stopped spinning (ONNX
                # Runtime's pool ~40 ms of a core after the last call): that CPU is this system's, not the next's
                settle()
                meter.start()
                t_run = time.perf_counter()
                tokens = decode(name, cfg.new_tokens)
                t_run = time.perf_counter() - t_run
                settle()
                m = meter.stop()
                windows[name].append(Window(tokens, m.seconds, m.cpu_seconds, m.joules, idle_w, t_run))
                if rep == 0 and m.samples:
                    traces[name] = [(s.t - m.samples[0].t, s.watts) for s in m.samples]
            log(t0, f"repeat {rep + 1}: " + ", ".join(
                f"{n} {windows[n][-1].tokens / windows[n][-1].seconds:.0f} tok/s" for n in names))
    finally:
        meter.close()
    return windows, traces, idle_trace
