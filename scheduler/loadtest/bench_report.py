"""Serving benchmark arithmetic and presentation: summaries, the served/in-process comparison, Markdown,
figures. Everything here takes :class:`~scheduler.control.outcomes.RequestResult` lists or the dicts made from
them; nothing reads or talks to a server.

The numbers themselves (attainment, goodput, percentiles) are :func:`scheduler.control.outcomes.summarize`'s.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from scheduler.control.outcomes import RequestResult


def compare(served: dict[str, Any], inprocess: dict[str, Any]) -> dict[str, float | None]:
    """The serving stack's cost: served / in-process tokens per second, and its TTFT p50 overhead."""
    ratio = served["tokens_per_s"] / inprocess["tokens_per_s"] if inprocess["tokens_per_s"] > 0 else None
    a, b = served.get("ttft_p50_ms"), inprocess.get("ttft_p50_ms")
    return {"served_vs_inprocess_tokens_ratio": ratio,
            "ttft_p50_overhead_ms": a - b if a is not None and b is not None else None}


def same_lengths(a: Sequence[RequestResult], b: Sequence[RequestResult],
                 key: Callable[[str], str] = lambda rid: rid) -> float | None:
    """Of the requests both runs completed, the fraction that generated as many tokens in each (greedy,
    one bundle: a check that both ran the same requests, with the same stop tokens); None if none.
    Requests pair by ``key`` of their ids (by default the id itself)."""
    done = {key(r.request_id): r.tokens for r in b if r.ok}
    pairs = [(r.tokens, done[key(r.request_id)]) for r in a if r.ok and key(r.request_id) in done]
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
