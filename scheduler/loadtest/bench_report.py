"""Serving benchmark arithmetic and presentation: summaries, the served/in-process comparison, Markdown,
figures. Everything here takes :class:`~scheduler.loadtest.loadgen.RequestResult` lists or the dicts made from
them; nothing reads or talks to a server.

Definitions (per run):
* duration: first submit to last response, seconds;
* SLA met: the request succeeded, its TTFT is within ``sla_ttft_ms`` and (more than one token) its
  mean time per later token, (e2e - ttft) / (n - 1), within ``sla_tpot_ms``;
* sla_attainment: requests meeting the SLA / all requests sent (errors count as misses);
* goodput_rps: requests meeting the SLA per second of the run (DistServe's goodput, Zhong et al., OSDI
  2024);
* tokens_per_s: generated tokens of successful requests per second of the run.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from scheduler.loadtest.loadgen import RequestResult

QUANTILES = (50, 95, 99)


def percentiles(values: Sequence[float], qs: Sequence[float] = QUANTILES) -> dict[str, float | None]:
    """``{"p50": ..., ...}`` by numpy's default (linear) interpolation; None for every q of no values."""
    arr = np.asarray([v for v in values if v is not None], dtype=np.float64)
    if arr.size == 0:
        return {f"p{q:g}": None for q in qs}
    return {f"p{q:g}": float(v) for q, v in zip(qs, np.percentile(arr, qs))}


def run_duration(results: Sequence[RequestResult]) -> float:
    starts = [r.t_submit for r in results if r.t_submit is not None]
    ends = [r.t_end for r in results if r.t_end is not None]
    return max(ends) - min(starts) if starts and ends else 0.0


def summarize(results: Sequence[RequestResult], sla_ttft_ms: float, sla_tpot_ms: float) -> dict[str, Any]:
    """One run's numbers (definitions in the module docstring); latencies in ms."""
    ok = [r for r in results if r.ok]
    duration = run_duration(results)
    met = sum(r.sla_met(sla_ttft_ms, sla_tpot_ms) for r in results)
    tokens = sum(r.tokens for r in ok)
    ms = lambda xs: [x * 1e3 for x in xs if x is not None]  # noqa: E731
    out: dict[str, Any] = {
        "requests": len(results),
        "completed": len(ok),
        "errors": sum(not r.ok for r in results),
        "errors_by_kind": dict(sorted(Counter(r.error_kind or "unfinished" for r in results if not r.ok).items())),
        "duration_s": duration,
        "tokens": tokens,
        "tokens_per_s": tokens / duration if duration > 0 else 0.0,
        "sla": {"ttft_ms": sla_ttft_ms, "tpot_ms": sla_tpot_ms},
        "sla_met": met,
        "sla_attainment": met / len(results) if results else 0.0,
        "goodput_rps": met / duration if duration > 0 else 0.0,
        "offered_rps": _offered_rps(results),
    }
    for name, vals in (("ttft", ms(r.ttft_s for r in ok)), ("tpot", ms(r.tpot_s for r in ok)),
                       ("e2e", ms(r.e2e_s for r in ok))):
        for k, v in percentiles(vals).items():
            out[f"{name}_{k}_ms"] = v
        out[f"{name}_mean_ms"] = float(np.mean(vals)) if vals else None
    # how late the client fired requests (an overloaded client would understate the server's queue)
    lag = ms(r.t_submit - r.arrival_s for r in results if r.t_submit is not None)
    out["send_lag_p99_ms"] = percentiles(lag, (99,))["p99"]
    layers = [layer for r in ok for layer in r.exit_layers]
    out["mean_exit_layer"] = float(np.mean(layers)) if layers else None
    return out


def _offered_rps(results: Sequence[RequestResult]) -> float:
    arr = sorted(r.arrival_s for r in results)
    return (len(arr) - 1) / (arr[-1] - arr[0]) if len(arr) > 1 and arr[-1] > arr[0] else 0.0


def compare(served: dict[str, Any], inprocess: dict[str, Any]) -> dict[str, float | None]:
    """The serving stack's cost: served / in-process tokens per second, and its TTFT p50 overhead."""
    ratio = served["tokens_per_s"] / inprocess["tokens_per_s"] if inprocess["tokens_per_s"] > 0 else None
    a, b = served.get("ttft_p50_ms"), inprocess.get("ttft_p50_ms")
    return {"served_vs_inprocess_tokens_ratio": ratio,
            "ttft_p50_overhead_ms": a - b if a is not None and b is not None else None}


def same_lengths(a: Sequence[RequestResult], b: Sequence[RequestResult]) -> float | None:
    """Of the requests both runs completed, the fraction that generated as many tokens in each (greedy,
    one bundle: a check that both ran the same requests, with the same stop tokens); None if none."""
    done = {r.request_id: r.tokens for r in b if r.ok}
    pairs = [(r.tokens, done[r.request_id]) for r in a if r.ok and r.request_id in done]
    return sum(x == y for x, y in pairs) / len(pairs) if pairs else None


def throughput_series(results: Sequence[RequestResult], bin_s: float = 1.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per ``bin_s`` bin from t = 0: ``([B] bin starts, [B] tokens/s, [B] completed requests/s)``;
    tokens counted when they arrived."""
    times = np.asarray([t for r in results if r.ok for t in r.token_times], dtype=np.float64)
    ends = np.asarray([r.t_end for r in results if r.ok], dtype=np.float64)
    last = max([times.max(initial=0.0), ends.max(initial=0.0)])
    edges = np.arange(0.0, last + bin_s, bin_s)
    if edges.size < 2:
        edges = np.array([0.0, bin_s])
    tok, _ = np.histogram(times, edges)
    done, _ = np.histogram(ends, edges)
    return edges[:-1], tok / bin_s, done / bin_s


def _fmt(v: Any, digits: int = 1) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def _lengths(stats: dict[str, float] | None) -> str:
    if not stats:
        return "n/a"
    return f"mean {stats['mean']:.0f} / p50 {stats['p50']:.0f} / max {stats['max']}"


def render_markdown(report: dict[str, Any]) -> str:
    """``serve.md`` from the ``serve.json`` dict (``runs``: label -> summary; ``comparison``; ``workload``)."""
    lines = ["# Serving benchmark", ""]
    w = report.get("workload", {})
    lines += [f"Workload: {w.get('source', 'n/a')}; {w.get('requests', 'n/a')} requests over "
              f"{_fmt(w.get('span_s'))} s of arrivals ({w.get('arrivals', 'n/a')}, time scale "
              f"{w.get('time_scale', 'n/a')}); prompt tokens {_lengths(w.get('prompt_tokens'))}, output tokens "
              f"{_lengths(w.get('output_tokens'))} (mapping: {w.get('length_mapping', 'n/a')}). "
              f"Open loop: each request is sent at its arrival time whatever the earlier ones are doing, so "
              f"tokens/s equals the offered rate wherever a system keeps up; a ratio below 1 or a growing "
              f"TTFT says where it did not.", ""]
    sla = report.get("sla", {})
    lines += [f"SLA: TTFT <= {_fmt(sla.get('ttft_ms'), 0)} ms and mean time per later token <= "
              f"{_fmt(sla.get('tpot_ms'), 0)} ms; goodput = requests meeting it per second of the run.", ""]
    head = ("| run | requests | errors | TTFT p50 / p95 / p99 (ms) | TPOT p50 / p95 / p99 (ms) | "
            "E2E p50 / p95 (ms) | SLA attainment | goodput (req/s) | tokens/s | offered (req/s) |")
    lines += [head, "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for label, s in report.get("runs", {}).items():
        lines.append(
            f"| {label} | {s['requests']} | {s['errors']} | "
            f"{_fmt(s['ttft_p50_ms'])} / {_fmt(s['ttft_p95_ms'])} / {_fmt(s['ttft_p99_ms'])} | "
            f"{_fmt(s['tpot_p50_ms'], 2)} / {_fmt(s['tpot_p95_ms'], 2)} / {_fmt(s['tpot_p99_ms'], 2)} | "
            f"{_fmt(s['e2e_p50_ms'])} / {_fmt(s['e2e_p95_ms'])} | {_fmt(s['sla_attainment'], 3)} | "
            f"{_fmt(s['goodput_rps'], 2)} | {_fmt(s['tokens_per_s'])} | {_fmt(s['offered_rps'], 2)} |")
    errs = {label: s["errors_by_kind"] for label, s in report.get("runs", {}).items() if s["errors_by_kind"]}
    if errs:
        lines += ["", "Errors by kind: " + "; ".join(
            f"{label}: " + ", ".join(f"{k} {n}" for k, n in kinds.items()) for label, kinds in errs.items())]
    cmp_ = report.get("comparison", {})
    if cmp_:
        lines += ["", "| served run vs in process | tokens/s ratio | TTFT p50 overhead (ms) | same output lengths |",
                  "| --- | ---: | ---: | ---: |"]
        for label, c in cmp_.items():
            lines.append(f"| {label} | {_fmt(c['served_vs_inprocess_tokens_ratio'], 3)} | "
                         f"{_fmt(c['ttft_p50_overhead_ms'])} | {_fmt(c.get('same_output_lengths'), 3)} |")
    for note in report.get("notes", []):
        lines += ["", note]
    return "\n".join(lines) + "\n"


def plot_latency_cdf(runs: dict[str, Sequence[RequestResult]], path: Path, sla_ttft_ms: float | None = None,
                     sla_tpot_ms: float | None = None) -> None:
    """Empirical CDFs of TTFT, TPOT and E2E (ms), one line per run; SLA targets dashed."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, (name, attr, target) in zip(axes, (("TTFT", "ttft_s", sla_ttft_ms), ("TPOT", "tpot_s", sla_tpot_ms),
                                               ("E2E", "e2e_s", None))):
        for label, results in runs.items():
            vals = np.sort([getattr(r, attr) * 1e3 for r in results if r.ok and getattr(r, attr) is not None])
            if vals.size:
                ax.step(vals, np.arange(1, vals.size + 1) / vals.size, where="post", label=label)
        if target is not None:
            ax.axvline(target, color="k", ls="--", lw=0.8, label="SLA")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of requests")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    _save(fig, path)


def plot_throughput(runs: dict[str, Sequence[RequestResult]], path: Path, bin_s: float = 1.0) -> None:
    """Generated tokens per second over the run (``bin_s`` bins), one line per run."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.8))
    for label, results in runs.items():
        t, tok, _ = throughput_series(results, bin_s)
        ax.stairs(tok, np.append(t, t[-1] + bin_s), label=label)
    ax.set_xlabel("time since the run started (s)")
    ax.set_ylabel(f"tokens/s ({bin_s:g} s bins)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    _save(fig, path)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> None:
    from edge.core.artifacts import atomic_path

    import matplotlib.pyplot as plt

    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
