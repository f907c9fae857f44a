"""The price of serving, measured side by side: the same closed-loop requests on the engine in
process, on Triton's core in process (no gRPC), straight to a tritonserver over gRPC, and through the whole
stack (HTTP, Ray Serve, Triton),
interleaved and repeated (``smartexit bench serve``, the ``capacity`` section of ``serve.json``).

Two identical served runs on a shared 2-core machine differ by 10-50%, so one run of each system
says little. Here every system stays up for the whole measurement (an idle engine host waits on an
event; an idle tritonserver waits on its socket) and the runs interleave: repeat r runs every
concurrency level, and within a level every system, in an order rotated by r, so a slow minute of
the machine lands on each system in turn. Each system's numbers are medians over the repeats with
their range; the ratios (served / in process tokens/s, TTFT overhead) are taken within a repeat and
then their median and range, so the spread shown is the spread of the comparison itself.

CPU: the machine's busy CPU seconds (``/proc/stat``: all processes, all cores) over each run,
divided by the tokens it generated. The difference between a served run and the in-process run of
the same repeat is what serving costs in CPU per token, the load generator's HTTP client included
(it shares the machine as a client on the device would not; an in-process run has no client at
all). Where ``/proc/stat`` is absent the CPU numbers are None.
"""
from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from scheduler.control.outcomes import RequestResult, summarize
from scheduler.loadtest.bench_report import same_lengths
from scheduler.loadtest.hop_stamps import breakdown_markdown
from scheduler.loadtest.loadgen import ScheduledRequest, run_closed_loop

Send = Callable[[ScheduledRequest], Awaitable[RequestResult]]
INPROCESS, TRITON, SERVED = "inprocess", "triton_direct", "served"
TRITON_CORE = "triton_core"  # Triton's core in the load generator's process (C API), no gRPC
SUMMARY_KEYS = ("requests", "errors", "tokens", "tokens_per_s", "ttft_p50_ms", "ttft_p95_ms", "tpot_p50_ms",
                "tpot_p95_ms", "e2e_p50_ms")


def busy_cpu_s() -> float | None:
    """Seconds all cores of this machine spent busy since boot (``/proc/stat``'s first line: every
    field but idle and iowait); None where there is no ``/proc/stat``."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    busy = sum(fields) - fields[3] - (fields[4] if len(fields) > 4 else 0)
    return busy / os.sysconf("SC_CLK_TCK")


@dataclass
class Run:
    """One closed-loop run of one system: its results and the machine's busy CPU seconds meanwhile."""
    results: list[RequestResult]
    cpu_s: float | None
    span: tuple[float, float] | None = None  # its start and end, ``time.monotonic()`` in ms (serving/stamps.py's clock)

    @property
    def cpu_ms_per_token(self) -> float | None:
        tokens = sum(r.tokens for r in self.results if r.ok)
        return None if self.cpu_s is None or not tokens else 1e3 * self.cpu_s / tokens


def order(systems: Sequence[str], repeat: int) -> list[str]:
    """The systems rotated by ``repeat`` (repeat 0: as given)."""
    k = repeat % len(systems)
    return list(systems[k:]) + list(systems[:k])


async def interleaved(senders: dict[str, Send], requests: Sequence[ScheduledRequest], levels: Sequence[int],
                      repeats: int, warmup: int = 2) -> dict[str, dict[int, list[Run]]]:
    """``repeats`` rounds; in each, every level; in each level, every system (rotated order), the same
    ``requests`` closed loop at that concurrency. Each system first serves ``warmup`` requests one by
    one, not measured. Returns system -> level -> its runs, in repeat order."""
    for name, send in senders.items():
        for i, req in enumerate(requests[:warmup]):
            await send(ScheduledRequest(0.0, req.prompt_ids, req.max_tokens, f"warmup-{name}-{i}"))
    runs: dict[str, dict[int, list[Run]]] = {name: {c: [] for c in levels} for name in senders}
    for r in range(repeats):
        for c in levels:
            for name in order(list(senders), r):
                reqs = [ScheduledRequest(0.0, q.prompt_ids, q.max_tokens, f"{q.request_id}-{name}-c{c}-r{r}")
                        for q in requests]
                cpu0, t0 = busy_cpu_s(), time.monotonic() * 1e3
                results = await run_closed_loop(reqs, senders[name], c)
                cpu1, t1 = busy_cpu_s(), time.monotonic() * 1e3
                runs[name][c].append(Run(results, None if cpu0 is None or cpu1 is None else cpu1 - cpu0, (t0, t1)))
    return runs


def base_id(request_id: str) -> str:
    """A measured request's id without the system, level and repeat that :func:`interleaved` appends
    (each system's requests keep ids of their own, so a late cancel cannot reach another's)."""
    return request_id.rsplit("-", 3)[0]


def tokens_ratio(a: Sequence[Run], b: Sequence[Run], sla_ttft_ms: float, sla_tpot_ms: float) -> dict[str, float | None]:
    """Tokens/s of ``a``'s runs over ``b``'s, paired by repeat: median, min and max of the ratios."""
    rate = lambda run: summarize(run.results, sla_ttft_ms, sla_tpot_ms)["tokens_per_s"]  # noqa: E731
    return _spread([_ratio(rate(x), rate(y)) for x, y in zip(a, b)])


def _spread(values: Sequence[float | None]) -> dict[str, float | None]:
    """Median, min and max of the values that exist (all None when none does)."""
    xs = [float(v) for v in values if v is not None]
    if not xs:
        return {"median": None, "min": None, "max": None}
    return {"median": float(np.median(xs)), "min": min(xs), "max": max(xs)}


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b <= 0 else a / b


def _diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def level_report(runs: dict[str, list[Run]], sla_ttft_ms: float, sla_tpot_ms: float) -> dict[str, Any]:
    """One concurrency level: per system the medians of its summary numbers over the repeats (same
    keys as one run's summary) with ``spread`` (median / min / max of tokens/s, TTFT p50, TPOT p50 and CPU
    ms per token); the paired comparisons of each repeat against the in-process run of the same repeat."""
    out: dict[str, Any] = {}
    summaries = {name: [summarize(run.results, sla_ttft_ms, sla_tpot_ms) for run in rs] for name, rs in runs.items()}
    for name, ss in summaries.items():
        med = {k: _spread([s[k] for s in ss])["median"] for k in SUMMARY_KEYS}
        med["cpu_ms_per_token"] = _spread([run.cpu_ms_per_token for run in runs[name]])["median"]
        med["spread"] = {k: _spread([s[k] for s in ss]) for k in ("tokens_per_s", "ttft_p50_ms", "tpot_p50_ms")}
        med["spread"]["cpu_ms_per_token"] = _spread([run.cpu_ms_per_token for run in runs[name]])
        out[name] = med
    base = summaries.get(INPROCESS)
    if base is None:
        return out
    n = len(base)
    for name in [s for s in summaries if s != INPROCESS]:
        other = summaries[name]
        prefix = "served_vs_inprocess" if name == SERVED else f"{name}_vs_inprocess"
        out[f"{prefix}_tokens_ratio"] = _spread([_ratio(other[i]["tokens_per_s"], base[i]["tokens_per_s"])
                                                 for i in range(n)])
        out[f"{prefix}_ttft_p50_overhead_ms"] = _spread([_diff(other[i]["ttft_p50_ms"], base[i]["ttft_p50_ms"])
                                                         for i in range(n)])
        out[f"{prefix}_tpot_p50_overhead_ms"] = _spread([_diff(other[i]["tpot_p50_ms"], base[i]["tpot_p50_ms"])
                                                         for i in range(n)])
        out[f"{prefix}_cpu_ms_per_token"] = _spread([_diff(runs[name][i].cpu_ms_per_token,
                                                           runs[INPROCESS][i].cpu_ms_per_token) for i in range(n)])
        out[f"{prefix}_same_output_lengths"] = _spread([same_lengths(runs[name][i].results, runs[INPROCESS][i].results,
                                                                      key=base_id) for i in range(n)])
    return out


def capacity_report(runs: dict[str, dict[int, list[Run]]], sla_ttft_ms: float, sla_tpot_ms: float,
                    meta: dict[str, Any]) -> dict[str, Any]:
    """``serve.json``'s ``capacity``: ``meta`` (the requests' shape, the policy) with ``levels`` (per
    concurrency: :func:`level_report`) and the ``headline``: the served / in-process tokens/s ratio at
    the highest concurrency (the stack's capacity cost) and at the lowest, the TTFT p50 overhead at the
    lowest (its latency cost per request), and the CPU per token serving adds, each a median over the
    repeats with its range in ``headline["spread"]``."""
    levels_n = sorted({c for per in runs.values() for c in per})
    levels = {str(c): level_report({name: per[c] for name, per in runs.items()}, sla_ttft_ms, sla_tpot_ms)
              for c in levels_n}
    hi, lo = str(levels_n[-1]), str(levels_n[0])
    pick = lambda level, key: levels[level].get(key) or _spread([])  # noqa: E731
    spread = {"served_vs_inprocess_tokens_ratio": pick(hi, "served_vs_inprocess_tokens_ratio"),
              "served_vs_inprocess_tokens_ratio_c1": pick(lo, "served_vs_inprocess_tokens_ratio"),
              "ttft_p50_overhead_ms": pick(lo, "served_vs_inprocess_ttft_p50_overhead_ms"),
              "tpot_p50_overhead_ms": pick(lo, "served_vs_inprocess_tpot_p50_overhead_ms"),
              "serving_cpu_ms_per_token": pick(hi, "served_vs_inprocess_cpu_ms_per_token"),
              "serving_cpu_ms_per_token_c1": pick(lo, "served_vs_inprocess_cpu_ms_per_token")}
    headline = {k: v["median"] for k, v in spread.items()}
    headline.update({"served_vs_inprocess_concurrency": int(hi), "ttft_overhead_concurrency": int(lo),
                     "capacity_repeats": min(len(rs) for per in runs.values() for rs in per.values()),
                     "spread": spread})
    return {**meta, "systems": list(runs), "levels": levels, "headline": headline}


def capacity_markdown(cap: dict[str, Any] | None) -> str:
    """The capacity section of ``serve.md``: per level and system, medians with their ranges."""
    if not cap:
        return ""
    f = lambda v, spec=".1f": "n/a" if v is None else format(v, spec)  # noqa: E731
    rng = lambda s, spec=".1f": f"{f(s['median'], spec)} ({f(s['min'], spec)}-{f(s['max'], spec)})"  # noqa: E731
    head = cap["headline"]
    lines = ["", "## The price of serving (closed loop, interleaved)", "",
             f"{cap['requests_per_level']} requests per run, {cap['prompt_tokens']} prompt tokens, {cap['max_tokens']} "
             f"new tokens each (greedy, stop at end of text); {head['capacity_repeats']} repeats, the systems rotated "
             f"within each; medians (min-max over the repeats). Stack policy {cap['policy']}, tokens "
             f"{cap.get('stream_via', 'n/a')}, HTTP ingress {cap.get('ingress', 'n/a')}.", "",
             "| concurrency | system | tokens/s | TTFT p50 ms | TPOT p50 ms | machine CPU ms / token |",
             "| ---: | --- | ---: | ---: | ---: | ---: |"]
    for c, lv in cap["levels"].items():
        for name in cap["systems"]:
            s = lv[name]["spread"]
            lines.append(f"| {c} | {name} | {rng(s['tokens_per_s'])} | {rng(s['ttft_p50_ms'])} | "
                         f"{rng(s['tpot_p50_ms'])} | {rng(s['cpu_ms_per_token'], '.2f')} |")
    lines += ["", "Paired with the in-process run of the same repeat:", "",
              "| concurrency | system | tokens/s ratio | TTFT p50 overhead ms | TPOT p50 overhead ms | "
              "CPU ms / token added |", "| ---: | --- | ---: | ---: | ---: | ---: |"]
    for c, lv in cap["levels"].items():
        for name in [s for s in cap["systems"] if s != INPROCESS]:
            p = "served_vs_inprocess" if name == SERVED else f"{name}_vs_inprocess"
            if f"{p}_tokens_ratio" not in lv:
                continue
            lines.append(f"| {c} | {name} | {rng(lv[f'{p}_tokens_ratio'], '.3f')} | "
                         f"{rng(lv[f'{p}_ttft_p50_overhead_ms'])} | {rng(lv[f'{p}_tpot_p50_overhead_ms'])} | "
                         f"{rng(lv[f'{p}_cpu_ms_per_token'], '.2f')} |")
    exact = head["spread"].get("exact_vs_bounded_tokens_ratio")
    if exact:
        lines += ["", f"Mode exact (lossless speculative decoding) through the stack / mode {cap.get('mode', 'bounded')}, "
                  f"tokens/s at concurrency {head['ttft_overhead_concurrency']}, paired per repeat: {rng(exact, '.3f')}."]
    lo = cap["levels"].get(str(head["ttft_overhead_concurrency"]), {})
    lines += breakdown_markdown(cap.get("ttft_hops"), (lo.get(INPROCESS) or {}).get("ttft_p50_ms"))
    return "\n".join(lines) + "\n"

