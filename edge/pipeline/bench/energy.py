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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edge.core.artifacts import atomic_write_json, atomic_write_text, sha256_path
from edge.core.errors import ConfigError
from edge.pipeline.bench.quiesce import settle

STAGE = "bench_energy"
FULL, EXITS, C_FULL, C_EXITS = "full", "exits", "compressed_full", "compressed_exits"
# the shipped graphs and rule as the served engine runs them: the step gate (exits only where checking steps measured
# cheaper than full depth) and bounded requests' lossless lookup / corpus drafts (EngineConfig.bounded_drafts)
SERVED = "served"


@dataclass
class EnergyBenchConfig:
    run_dir: str = "artifacts/demo"
    meter: str = "auto"  # auto | jtop | tegrastats | nvml | rapl | none (edge.energy.detect.MeterKind)
    interval_s: float = 0.05  # power sampling interval
    idle_seconds: float = 1.0  # idle baseline window before each repeat (0: none)
    batch: int = 1  # sequences decoded together
    prompts: int = 4  # prompts per window (in groups of ``batch``)
    prompt_tokens: int = 64
    new_tokens: int = 32
    repeats: int = 3
    threads: int = 2
    seed: int = 0
    backend: str = "onnxruntime"  # or served | tensorrt | torch_static | onnxruntime_portable (module docstring)
    device: str | None = None  # torch_static's (default: cuda where there is one)
    dtype: str = "float32"  # torch_static's

    def __post_init__(self) -> None:
        from edge.runtime.served import SERVED_BACKENDS

        if self.backend not in ("served", *SERVED_BACKENDS):
            raise ConfigError(f"bench energy: backend {self.backend!r} is not served or one of "
                              f"{', '.join(SERVED_BACKENDS)}")
        if self.interval_s <= 0 or self.idle_seconds < 0:
            raise ConfigError("bench energy: interval_s > 0 and idle_seconds >= 0 are required")
        if min(self.batch, self.prompts, self.prompt_tokens, self.repeats) < 1 or self.new_tokens < 2:
            raise ConfigError("bench energy: batch, prompts, prompt_tokens, repeats >= 1 and new_tokens >= 2 "
                              "are required")
        if self.prompts % self.batch:
            raise ConfigError(f"bench energy: prompts ({self.prompts}) must be a multiple of batch ({self.batch})")


@dataclass
class Window:
    """One measured decode window of one system."""

    tokens: int
    seconds: float  # the whole window: the decode and its threads' spin-down (edge/pipeline/bench/quiesce.py)
    cpu_seconds: float
    joules: float | None
    idle_watts: float | None  # mean power of the idle window before this repeat
    decode_seconds: float | None = None  # the decode alone (tokens/s); None: the whole window

    @property
    def joules_above_idle(self) -> float | None:
        if self.joules is None or self.idle_watts is None:
            return None
        return self.joules - self.idle_watts * self.seconds


def _log(t0: float, msg: str) -> None:
    print(f"[bench energy {time.time() - t0:6.1f}s] {msg}", flush=True)


def _stat(values: list[float | None]) -> dict[str, float] | None:
    """Median and min-max of ``values``; None if there are none or any is None."""
    if not values or any(v is None for v in values):
        return None
    a = np.asarray(values, np.float64)
    return {"median": float(np.median(a)), "min": float(a.min()), "max": float(a.max())}


# the per-token figures a system is compared by, from one window
FIGURES: dict[str, Any] = {
    "joules_per_token": lambda w: w.joules / w.tokens if w.joules is not None else None,
    "joules_per_token_above_idle": lambda w: w.joules_above_idle / w.tokens if w.joules_above_idle is not None
    else None,
    "cpu_seconds_per_token": lambda w: w.cpu_seconds / w.tokens,
    "tokens_per_s": lambda w: w.tokens / (w.decode_seconds or w.seconds),
}


def per_token(windows: list[Window]) -> dict[str, Any]:
    """Median and min-max across repeats of each per-token figure (None where a figure is None)."""
    return {
        **{key: _stat([f(w) for w in windows]) for key, f in FIGURES.items()},
        # how busy the process's threads were over the window: near the thread count, a spinning pool (docs/energy.md)
        "cpu_per_second": _stat([w.cpu_seconds / w.seconds for w in windows]),
        "watts": _stat([w.joules / w.seconds if w.joules is not None else None for w in windows]),
        "tokens": int(sum(w.tokens for w in windows)),
    }


def clopper_pearson(k: int, n: int, level: float = 0.95) -> list[float]:
    """Exact two-sided binomial interval [lo, hi] of a rate of ``k`` in ``n`` (Clopper and Pearson, 1934).
    Tokens of one prompt are correlated, so this is optimistic; calibration's certificate counts prompts."""
    from scipy.stats import beta

    a = (1.0 - level) / 2.0
    lo = 0.0 if k == 0 else float(beta.ppf(a, k, n - k + 1))
    hi = 1.0 if k == n else float(beta.ppf(1.0 - a, k + 1, n - k))
    return [lo, hi]


def paired_ratios(windows: dict[str, list[Window]], base: str = FULL) -> dict[str, dict[str, dict[str, float] | None]]:
    """Each system's figures (:data:`FIGURES`) over ``base``'s, repeat by repeat (window i of every system is
    repeat i's, and a repeat runs the systems back to back), as median and min-max over the repeats; None
    for a figure that is None in any window or zero in ``base``'s.

    Raises:
        ValueError: systems with different numbers of windows (the repeats cannot be paired).
    """
    n = len(windows[base])
    if any(len(ws) != n for ws in windows.values()):
        raise ValueError(f"paired ratios need one window per repeat for every system, got "
                         f"{ {k: len(v) for k, v in windows.items()} }")
    out: dict[str, dict[str, dict[str, float] | None]] = {}
    for name, ws in windows.items():
        out[name] = {}
        for key, f in FIGURES.items():
            pairs = [(f(a), f(b)) for a, b in zip(ws, windows[base])]
            ok = pairs and all(a is not None and b for a, b in pairs)
            out[name][key] = _stat([a / b for a, b in pairs]) if ok else None
    return out


def medians(spread: dict[str, dict[str, dict[str, float] | None]]) -> dict[str, dict[str, float | None]]:
    """The medians of :func:`paired_ratios`'s answer."""
    return {name: {key: None if d is None else d["median"] for key, d in r.items()} for name, r in spread.items()}


def ratios(windows: dict[str, list[Window]], base: str = FULL) -> dict[str, dict[str, float | None]]:
    """The medians of :func:`paired_ratios`: joules, CPU-seconds per token, tokens/s against ``base``."""
    return medians(paired_ratios(windows, base))


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
            _log(t0, f"repeat {rep + 1}: " + ", ".join(
                f"{n} {windows[n][-1].tokens / windows[n][-1].seconds:.0f} tok/s" for n in names))
    finally:
        meter.close()
    return windows, traces, idle_trace


def summarise(cfg: EnergyBenchConfig, meter: Any, rows: dict[str, Any], spread: dict[str, Any], backends: dict[str, Any],
              full_is: str, exit_name: str, windows: dict[str, list[Window]], names: list[str], check: Any
              ) -> dict[str, Any]:
    """The manifest's metrics of the run (``spread``: :func:`paired_ratios` against ``full``)."""
    rel = medians(spread)
    own = C_FULL if C_FULL in rows else FULL  # the shipped model's own full depth: what ``served`` is judged against
    by_own = spread if own == FULL else paired_ratios(windows, own)
    served, exits = by_own[SERVED], spread[EXITS]
    compressed = by_own.get(C_EXITS) if own == C_FULL else None  # the compressed model's exits vs its full depth

    def med(d: dict[str, float] | None) -> float | None:
        return None if d is None else d["median"]

    def span(d: dict[str, float] | None) -> list[float] | None:  # min-max of the per-repeat ratios
        return None if d is None else [d["min"], d["max"]]
    summary = {
        "backend": backends[FULL].name, "full_is": full_is,
        "meter": meter.name, "meter_available": meter.available, "meter_reason": meter.reason,
        "rails": list(meter.rails), "interval_s": cfg.interval_s,
        "joules_per_token": {n: (r["joules_per_token"] or {}).get("median") for n, r in rows.items()},
        "joules_per_token_above_idle": {n: (r["joules_per_token_above_idle"] or {}).get("median")
                                        for n, r in rows.items()},
        "cpu_seconds_per_token": {n: r["cpu_seconds_per_token"]["median"] for n, r in rows.items()},
        "tokens_per_s": {n: r["tokens_per_s"]["median"] for n, r in rows.items()},
        "ratio_exit_vs_full": rel[EXITS]["joules_per_token"],
        "cpu_ratio_exit_vs_full": rel[EXITS]["cpu_seconds_per_token"],
        "cpu_ratio_exit_vs_full_range": span(exits["cpu_seconds_per_token"]),
        "shipped_system": exit_name,
        "ratio_shipped_vs_full": rel[exit_name]["joules_per_token"],
        "cpu_ratio_shipped_vs_full": rel[exit_name]["cpu_seconds_per_token"],
        "speed_ratio_shipped_vs_full": rel[exit_name]["tokens_per_s"],
        "idle_watts": [w.idle_watts for w in windows[names[0]]],
        # the compressed model's exits against its own full depth (the served model, with and without exits)
        "cpu_ratio_compressed_exit_vs_compressed_full": med(compressed and compressed["cpu_seconds_per_token"]),
        "cpu_ratio_compressed_exit_vs_compressed_full_range": span(compressed and compressed["cpu_seconds_per_token"]),
        # the shipped system as the served engine runs it, against the same model at full depth
        "served_full_depth": own,
        "ratio_served_vs_full_depth": med(served["joules_per_token"]),
        "cpu_ratio_served_vs_full_depth": med(served["cpu_seconds_per_token"]),
        "cpu_ratio_served_vs_full_depth_range": span(served["cpu_seconds_per_token"]),
        "speed_ratio_served_vs_full_depth": med(served["tokens_per_s"]),
        "speed_ratio_served_vs_full_depth_range": span(served["tokens_per_s"]),
        "false_exit_rate": check.false_exit_rate, "false_exit_tokens": check.tokens,
        # a 95% interval of the rate on these tokens: a few hundred tokens tell little about a rate near 1%
        "false_exit_interval_95": clopper_pearson(check.false_exits + check.full_depth_mismatches, check.tokens),
        "false_exits_judged_against": f"{backends[exit_name].name}, full-depth decode",
    }
    return summary


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
    _log(t0, f"meter: {meter.name}" + ("" if meter.available else f" (no sensor: {meter.reason})"))
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
    _log(t0, f"{exit_name} on {backends[exit_name].name}: false exits {check.false_exits + check.full_depth_mismatches}"
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
    _log(t0, f"wrote {out / 'energy.json'}: {fig} " + ", ".join(
        f"{n} {rows[n][key]['median']:.3g}" for n in names))
    return 0


def _fmt(v: float | None, spec: str = ".3g") -> str:
    return "-" if v is None else format(v, spec)


def _span(r: list[float] | None) -> str:
    return "" if not r else f" ({r[0]:.3g}-{r[1]:.3g})"


def render_markdown(result: dict[str, Any]) -> str:
    s, rows, rel = result["summary"], result["rows"], result["ratios_vs_full"]
    c = result["config"]
    sensor = (f"meter `{s['meter']}`, rails {', '.join(s['rails']) or '-'}, sampled every {s['interval_s']} s"
              if s["meter_available"] else
              f"**no power sensor** ({s['meter_reason']}): no joules are reported; CPU-seconds per token "
              "(process user + system time, all threads) is shown as a proxy, and it is not energy")
    lines = ["# Energy per token", "",
             f"The same decode work for each system: {c['prompts']} held-out prompts of {c['prompt_tokens']} tokens, "
             f"{c['new_tokens']} new tokens each, batch {c['batch']}, {c['repeats']} repeats in rotated order, backend "
             f"`{s.get('backend', 'onnxruntime')}` ({c['threads']} CPU threads); `full` is {s.get('full_is', '-')}; "
             f"{sensor}. Idle baseline: {c['idle_seconds']} s before each "
             "repeat. Median over repeats (min-max); ratios against `full` are the median (min-max) of each repeat's "
             "ratio, the systems of a repeat run back to back.", "",
             "| system | J/token | J/token above idle | CPU-s/token | tokens/s | J ratio | CPU-s ratio | speed ratio |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]

    def cell(d: dict[str, float] | None, spec: str = ".4g") -> str:
        return "-" if not d else f"{d['median']:{spec}} ({d['min']:{spec}}-{d['max']:{spec}})"

    spreads = result.get("ratio_spreads_vs_full") or {}

    def ratio(n: str, key: str) -> str:  # the median of the per-repeat ratios, with their min-max where known
        d = (spreads.get(n) or {}).get(key)
        return _fmt(rel[n][key]) if not d else f"{d['median']:.3g} ({d['min']:.3g}-{d['max']:.3g})"

    for n, r in rows.items():
        lines.append(f"| {n} | {cell(r['joules_per_token'])} | {cell(r['joules_per_token_above_idle'])} | "
                     f"{cell(r['cpu_seconds_per_token'])} | {cell(r['tokens_per_s'], '.0f')} | "
                     f"{ratio(n, 'joules_per_token')} | {ratio(n, 'cpu_seconds_per_token')} | "
                     f"{ratio(n, 'tokens_per_s')} |")
    busy = [r["cpu_per_second"]["median"] for r in rows.values() if r.get("cpu_per_second")]
    if busy:
        lines += ["", f"CPU-seconds per second of window: {min(busy):.2f}-{max(busy):.2f} across systems, with "
                      f"{c['threads']} CPU threads. A thread pool that spins while it waits keeps its cores busy whether "
                      "or not they compute: where this is near the thread count, CPU-seconds per token follow the time "
                      "per token more than the work (docs/energy.md)."]
    if s.get("cpu_ratio_served_vs_full_depth") is not None:
        lines += ["", f"`{SERVED}` is the shipped system as the served engine runs it (exits only where checking steps "
                      "measured cheaper than full depth; lossless lookup and corpus drafts where a round pays): against "
                      f"`{s['served_full_depth']}`, J ratio {_fmt(s.get('ratio_served_vs_full_depth'))}, CPU-s ratio "
                      f"{_fmt(s['cpu_ratio_served_vs_full_depth'])}{_span(s.get('cpu_ratio_served_vs_full_depth_range'))}, "
                      f"speed ratio {_fmt(s.get('speed_ratio_served_vs_full_depth'))}"
                      f"{_span(s.get('speed_ratio_served_vs_full_depth_range'))} (per-repeat ratios: median, min-max)."]
    if s.get("false_exit_tokens"):
        ci = s.get("false_exit_interval_95") or [float("nan")] * 2
        lines += ["", f"False exits of `{s['shipped_system']}`: {s['false_exit_rate']:.4f} (95% interval "
                      f"{ci[0]:.4f}-{ci[1]:.4f}) of {s['false_exit_tokens']} "
                      f"judged tokens, against {s['false_exits_judged_against']} on the same prefixes."]
    return "\n".join(lines + ["", "![energy](energy.png)", ""])


def plot(result: dict[str, Any], path: Path) -> None:
    """Power over time per system (first repeat) where a sensor exists; else the CPU-seconds proxy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s, rows = result["summary"], result["rows"]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    if s["meter_available"] and any(result["power_trace_first_repeat"].values()):
        for name, trace in result["power_trace_first_repeat"].items():
            if trace:
                t, w = zip(*trace)
                ax.plot(t, w, label=f"{name} ({rows[name]['joules_per_token']['median']:.3g} J/token)")
        ax.set_xlabel("seconds into the window")
        ax.set_ylabel(f"power, W ({s['meter']})")
        ax.set_title("power during the same decode work (first repeat)")
        ax.legend(fontsize=8)
    else:
        names = list(rows)
        med = [rows[n]["cpu_seconds_per_token"]["median"] * 1e3 for n in names]
        lo = [m - rows[n]["cpu_seconds_per_token"]["min"] * 1e3 for n, m in zip(names, med)]
        hi = [rows[n]["cpu_seconds_per_token"]["max"] * 1e3 - m for n, m in zip(names, med)]
        ax.bar(names, med, yerr=[lo, hi], color="tab:gray", capsize=4)
        ax.set_ylabel("CPU-ms per token (proxy)")
        ax.set_title(f"no power sensor ({s['meter']}): CPU time per token, NOT energy", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
