"""What ``smartexit bench energy`` (:mod:`edge.pipeline.bench.energy`) says: the manifest's metrics of a run (the
summary in energy.json), bench/energy.md and the figure bench/energy.png."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from edge.pipeline.bench.energy_config import C_EXITS, C_FULL, EXITS, FULL, SERVED, EnergyBenchConfig
from edge.pipeline.bench.energy_figures import Window, clopper_pearson, medians, paired_ratios


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
