"""``smartexit bench energy``: energy per token of the same decode work, full depth against exits.

Systems (the same prompts, greedy). With ``backend: onnxruntime`` (the CPU engines): ``full`` the
distilled float model without exits, ``exits`` the same model with the run's exit rule, and for a
compressed run ``compressed_full`` / ``compressed_exits``, the served model without and with exits.
With another backend (``served``: the one ``smartexit jetson serve`` chose, jetson/units/backend.json;
or ``tensorrt``, ``torch_static``, ``onnxruntime_portable``): ``full`` and ``exits`` are the served
model on that backend without an exit rule and with it (what a device serves, with and without
early exit). Both ways ``served`` is the shipped system as the served engine runs it (the step gate and
bounded requests' lossless drafts), judged against the shipped model's own full depth. Each repeat
measures every system once, in a rotated order, each window on the power meter
(:mod:`edge.energy.detect`: jtop, tegrastats, NVML or RAPL, whichever exists) after an idle window
of ``idle_seconds`` that gives the idle baseline. Per system: joules per token with and without the
idle power (None without a sensor), CPU-seconds per token (process resource usage, always; the
labelled proxy where there is no sensor), tokens/s (median and min-max across repeats), and each against
``full`` paired by repeat: the systems of one repeat run back to back, so each repeat's ratio compares
windows that shared the machine's state; the median of those ratios and their min-max are reported (a ratio
of medians let one slow stretch of a shared VM in one system's window move it by a third).

Without a sensor nothing is estimated: the JSON says ``meter: none`` with the reason, joules are
null, and the Markdown and the PNG show CPU-seconds per token under that label.
"""
from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from edge.core.artifacts import atomic_write_json, atomic_write_text
from edge.pipeline.bench.energy_config import C_EXITS, EXITS, SERVED, EnergyBenchConfig
from edge.pipeline.bench.energy_figures import medians, paired_ratios, per_token
from edge.pipeline.bench.energy_report import plot, render_markdown, summarise
from edge.pipeline.bench.energy_systems import energy_systems, log, measure_windows

STAGE = "bench_energy"


def main(cfg: EnergyBenchConfig) -> int:
    from calibration.freerun import Served, check_continuations
    from edge.energy.detect import open_meter
    from edge.pipeline.run import open_run
    from edge.runtime.batch import run_batch
    from edge.runtime.request import Mode
    from edge.runtime.speculative import SpecConfig

    t0 = time.time()
    run = open_run(cfg.run_dir, cfg.threads)
    prompts = run.prompts(cfg.prompts, cfg.prompt_tokens, cfg.seed)
    systems, backends, full_is = energy_systems(cfg, run)
    groups = [prompts[i:i + cfg.batch] for i in range(0, len(prompts), cfg.batch)]
    made: dict[str, list] = {}  # each system's last window's results (the false-exit check reads them)
    as_served = dict(exit_gate=True, spec=SpecConfig(), mode=Mode.BOUNDED, bounded_drafts=True)  # SERVED's engine

    def decode(name: str, n: int) -> int:
        """One window's work: every group of prompts, ``n`` new tokens each; returns the tokens made."""
        kw = as_served if name == SERVED else {}
        made[name] = [run_batch(backends[name], systems[name][1], g, n, run.kv_mode, **kw) for g in groups]
        return sum(len(t) for r in made[name] for t in r.tokens)

    meter = open_meter(cfg.meter, cfg.interval_s)
    log(t0, f"meter: {meter.name}" + ("" if meter.available else f" (no sensor: {meter.reason})"))
    names = list(systems)
    windows, traces, idle_trace = measure_windows(cfg, meter, names, decode, t0)
    rows = {n: per_token(w) for n, w in windows.items()}
    spread = paired_ratios(windows)
    rel = medians(spread)
    exit_name = C_EXITS if C_EXITS in rows else EXITS
    # the shipped system's exits on this backend, judged against the same backend at full depth on the same
    # prefixes (the certificate was computed on the ONNX Runtime engine; a device's engine may differ)
    res = made[exit_name]  # its last timed window
    check = check_continuations(Served(backends[exit_name]), np.asarray(prompts),
                                np.asarray([t for r in res for t in r.tokens]),
                                np.asarray([e for r in res for e in r.exit_layers]), run.kv_mode).summary()
    log(t0, f"{exit_name} on {backends[exit_name].name}: false exits {check.false_exits + check.full_depth_mismatches}"
            f"/{check.tokens} against its own full depth")
    summary = summarise(cfg, meter, rows, spread, backends, full_is, exit_name, windows, names, check)
    result = {"config": asdict(cfg), "rows": rows, "ratios_vs_full": rel, "ratio_spreads_vs_full": spread,
              "summary": summary,
              "windows": {n: [asdict(w) for w in ws] for n, ws in windows.items()}, "idle": idle_trace,
              "power_trace_first_repeat": traces}
    out = Path(cfg.run_dir) / "bench"
    atomic_write_json(out / "energy.json", result)
    atomic_write_text(out / "energy.md", render_markdown(result))
    plot(result, out / "energy.png")
    run.manifest.record(STAGE, inputs={"checkpoint": run.path, "thresholds": run.thresholds}, config=asdict(cfg),
                    outputs={"json": out / "energy.json", "markdown": out / "energy.md", "png": out / "energy.png"},
                    metrics=summary, seconds=time.time() - t0)
    fig = "J/token" if meter.available else "CPU-s/token (no sensor: proxy, not energy)"
    key = "joules_per_token" if meter.available else "cpu_seconds_per_token"
    log(t0, f"wrote {out / 'energy.json'}: {fig} " + ", ".join(
        f"{n} {rows[n][key]['median']:.3g}" for n in names))
    return 0
