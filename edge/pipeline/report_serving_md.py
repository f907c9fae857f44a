"""The report's Markdown about the served stack: the served benchmark (SLA attainment, the price of serving,
the dashboard) and the SLA scheduler against fixed budgets and heuristics."""
from __future__ import annotations

from typing import Any

from edge.pipeline.report_format import fmt


def serve_md(b: dict[str, Any]) -> list[str]:
    lines = ["## Served (Ray Serve + Triton)", "",
             f"Open-loop arrivals ({b.get('workload_source')}); SLA attainment and goodput against the "
             "requests' TTFT / TPOT targets; details, CDFs and throughput in bench/serve.md.", "",
             "| run | requests | errors | TTFT p95 ms | TPOT p95 ms | SLA attainment | goodput req/s | tokens/s |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    runs = dict(b.get("policies", {}))
    if "inprocess" in b:
        runs["in process"] = b["inprocess"]
    for name, r in runs.items():
        lines.append(f"| {name} | {r['requests']} | {r['errors']} | {fmt(r['ttft_p95_ms'], '.1f')} | "
                     f"{fmt(r['tpot_p95_ms'], '.1f')} | {r['sla_attainment']:.3f} | {r['goodput_rps']:.2f} | "
                     f"{r['tokens_per_s']:.1f} |")
    spread = b.get("spread") or {}

    def rng(key: str, spec: str) -> str:  # median (min-max over the interleaved repeats), where measured
        r = spread.get(key)
        return (f"{fmt(r['median'], spec)} ({fmt(r['min'], spec)}-{fmt(r['max'], spec)})" if r
                else fmt(b.get(key), spec))
    lines += ["", f"The price of serving (closed loop, interleaved with the engine in process, "
              f"{b.get('capacity_repeats', 1)} repeats; median (range)): served / in-process tokens/s "
              f"{rng('served_vs_inprocess_tokens_ratio_c1', '.3f')} at concurrency "
              f"{b.get('ttft_overhead_concurrency', 'n/a')} and {rng('served_vs_inprocess_tokens_ratio', '.3f')} at "
              f"{b.get('served_vs_inprocess_concurrency', 'n/a')}; TTFT p50 overhead "
              f"{rng('ttft_p50_overhead_ms', '.1f')} ms at concurrency {b.get('ttft_overhead_concurrency', 'n/a')}; "
              f"machine CPU per token added by serving {rng('serving_cpu_ms_per_token', '.2f')} ms at "
              f"{b.get('served_vs_inprocess_concurrency', 'n/a')} (bench/serve.md: every system and level)."
              + _hops(b),
              "", "![latency CDFs against the SLA](bench/serve_latency_cdf.png)", "",
              "![served throughput](bench/serve_throughput.png)", ""]
    if b.get("dashboard_png"):
        lines += ["The live dashboard (`/dashboard`) during the load, in headless Chromium:", "",
                  f"![dashboard]({b['dashboard_png']})", ""]
    elif b.get("dashboard_skipped"):
        lines += [f"Dashboard screenshot not taken: {b['dashboard_skipped']}.", ""]
    return lines


def _hops(b: dict) -> str:
    """Where the served first token's time went, from the stack's stamps (empty without them)."""
    if b.get("ttft_serving_hops_ms") is None:
        return ""
    inproc = b.get("inprocess_ttft_p50_c1_ms")
    ref = "" if inproc is None else f" against {inproc:.1f} ms in process"
    return (f" Stamped along the way (concurrency 1, medians): the stack's hops {b['ttft_serving_hops_ms']:.1f} ms "
            f"per request, the engine's share {b['ttft_engine_served_ms']:.1f} ms served{ref} (bench/serve.md).")


def _loads(loads: list[float] | None) -> str:
    return "n/a" if not loads else ", ".join(f"x{x:g}" for x in loads)


def _sweep(s: dict[str, Any]) -> str:
    """Which form of the benchmark ran: the demo's reduced grid or `make bench-scheduler`'s full one."""
    full = len(s.get("loads") or []) >= 5 and (s.get("validation_repeats") or 0) >= 3
    return ("the full sweep of `make bench-scheduler`" if full else
            "the demo's reduced form; `make bench-scheduler` runs the full sweep")


def scheduler_md(s: dict[str, Any]) -> list[str]:
    """The learned scheduler against the heuristics (bench/scheduler.md has every table)."""
    ratios = ", ".join(f"{w} {fmt(v, '.3f')}" for w, v in s["goodput_ratio_vs_best_fixed"].items())
    att = ", ".join(f"{p} {fmt(v, '.3f')}" for p, v in sorted(s["sla_attainment"].items()))
    lines = ["## SLA scheduler (learned vs fixed budgets and heuristics)", "",
             f"Simulator, held-out workloads, loads {_loads(s.get('loads'))} of each workload's capacity "
             f"({_sweep(s)}; reference capacity {s['capacity_rps']:.2f} req/s): "
             f"goodput of the learned policy / the best fixed budget, the smallest over loads per workload: {ratios} "
             f"(min {fmt(s['goodput_ratio_vs_best_fixed_min'], '.3f')}). Mean SLA attainment over the grid: {att}."]
    if s.get("goodput_ratio_exit_features_ablation") is not None:
        lines.append(f"What predicted exit depth buys (the same training without it, `ppo-noexit`): goodput of the "
                     f"learned policy / the ablated one, median over the grid's cells "
                     f"{fmt(s['goodput_ratio_exit_features_ablation'], '.3f')}, smallest "
                     f"{fmt(s.get('goodput_ratio_exit_features_ablation_min'), '.3f')} (goal > 1).")
    if "goodput_ratio_vs_best_fixed_at_sla_edge" in s:
        real = ", ".join(f"{p} {fmt(v, '.3f')}" for p, v in s["sla_attainment_real"].items())
        lines.append(f"Real served stack at the best fixed budget's SLA edge: goodput ratio "
                     f"{fmt(s['goodput_ratio_vs_best_fixed_at_sla_edge'], '.3f')}; SLA attainment {real}. The "
                     f"simulator against the real stack: largest relative error of TTFT / TPOT p50 / p95 "
                     f"{fmt(s['sim_validation_max_rel_err'], '.3f')} on held-out runs below the edge, "
                     f"{fmt(s.get('sim_validation_at_edge_max_rel_err'), '.3f')} at the edge, where the stack "
                     f"is at its knee; two served runs of one schedule differ by up to "
                     f"{fmt(s.get('real_repeat_max_rel_diff'), '.3f')} (bench/scheduler.md). The simulator's error "
                     f"over the served runs' own spread, largest over loads and metrics: "
                     f"{fmt(s.get('sim_error_vs_repeat_spread_max'), '.2f')} (goal <= 1.5); p95 TTFT and TPOT "
                     f"within the SLA at 0.8x the edge: {fmt(s.get('p95_within_sla_at_0_8_edge'), '')}.")
    if s.get("overload_factor"):
        rng = s.get("goodput_ratio_vs_best_fixed_overload_range") or [None, None]
        att = ", ".join(f"{p} {fmt(v, '.3f')}" for p, v in (s.get("sla_attainment_overload") or {}).items())
        aimd = s.get("goodput_ratio_vs_aimd_overload")
        lines.append(f"Past the edge, at x{s['overload_factor']:g} of its rate on the real stack ({s.get('overload_repeats')} "
                     f"interleaved repeats, medians), where the edge's ceiling no longer binds: goodput of the learned "
                     f"policy / the best fixed budget {fmt(s.get('goodput_ratio_vs_best_fixed_overload'), '.2f')} "
                     f"(range {fmt(rng[0], '.2f')}-{fmt(rng[1], '.2f')})"
                     + (f", / AIMD {fmt(aimd, '.2f')}" if aimd is not None else "")
                     + (f", / the best constant action of its own grid ({s.get('best_constant_overload')}) "
                        f"{fmt(s.get('goodput_ratio_vs_best_constant_overload'), '.2f')}"
                        if s.get("goodput_ratio_vs_best_constant_overload") is not None else "")
                     + f"; SLA attainment {att}. In the simulator the learned policy / the best constant action of its "
                     f"grid: {fmt(s.get('goodput_ratio_vs_best_constant_sim_at_sla_edge'), '.3f')} at the edge, "
                     f"{fmt(s.get('goodput_ratio_vs_best_constant_sim_overload'), '.3f')} past it.")
    return lines + [""]
