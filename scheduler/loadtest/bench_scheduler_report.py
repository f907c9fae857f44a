"""``bench/scheduler.md``: the tables of ``smartexit bench scheduler`` (pure: dict in, text out)."""
from __future__ import annotations

import statistics
from typing import Any

from scheduler.control.evaluate import FIXED_PREFIX, cell_table
from scheduler.control.sim_config import round_summary


def _f(v: Any, d: int = 2) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, (int, float)):
        return f"{v:.{d}f}"
    return str(v)


def render_markdown(r: dict[str, Any]) -> str:
    env, s = r["env"], r["summary"]
    sla = env["sim"]
    out = ["# Scheduler benchmark", "",
           f"SLA: TTFT <= {sla['sla_ttft_ms']:g} ms, time per output token <= {sla['sla_tpot_ms']:g} ms. "
           f"Capacity of each workload (the rate at which a fixed budget of 128 keeps 95% of its requests within "
           f"the SLA in the simulator): " + ", ".join(f"{k} {v:.2f}" for k, v in r["capacities_rps"].items())
           + " req/s; loads are multiples of it. Ratios skip cells where even the best fixed budget serves "
           "under 10% of the offered requests within the SLA (collapse: two near-zero numbers). Workloads held out from "
           f"training: Poisson and bursty arrivals on other seeds, diurnal arrivals (never used in training), "
           f"{r['workloads']}. Goodput = requests meeting the SLA per second; the best fixed budget is chosen per "
           "cell in hindsight. Load shedding (a request still waiting when its TTFT deadline passes is refused, "
           f"a miss in goodput): {'on, the same rule for every policy' if sla.get('shed_late') else 'off'}.", ""]
    out += _sim_tables(r)
    out += ["## The learned policy against the best fixed budget (simulator)", "",
            "| workload | min goodput ratio over loads | SLA edge load (best fixed) | ratio there | "
            "highest load held: best fixed / learned | capacity ratio |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    sim = r["sim"]
    for w, ratio in sim["goodput_ratio_vs_best_fixed"].items():
        edge = sim["at_sla_edge"].get(w, {})
        cap = sim["sla_capacity"][w]
        out.append(f"| {w} | {_f(ratio, 3)} | {_f(edge.get('load'))} | {_f(edge.get('ratio'), 3)} | "
                   f"{_f(cap['best_fixed_edge_load'])} / {_f(cap['learned_edge_load'])} | {_f(cap['ratio'], 3)} |")
    out.append("")
    abl = sim.get("exit_features_ablation")
    if abl:
        loads = sorted({k for row in abl["ratios"].values() for k in row}, key=float)
        out += ["## What predicted exit depth buys (simulator)", "",
                "The learned policy against the same training without the predicted exit depth in its observation "
                "(`make train-scheduler-ablation`, `ppo-noexit`): goodput ratio per cell (collapsed cells left out). "
                f"Median {_f(abl['median'], 3)}, smallest {_f(abl['min'], 3)}; the largest relative spread of either "
                f"policy's goodput over the exit-depth draws {_f(abl['seed_spread_rel_max'], 3)} (0 with one draw). "
                "Two PPO trainings differ by their runs as well as by the feature: a ratio within that is no effect.", "",
                "| workload | " + " | ".join(f"x{k}" for k in loads) + " |",
                "| --- | " + " | ".join("---:" for _ in loads) + " |"]
        for w, row in abl["ratios"].items():
            out.append(f"| {w} | " + " | ".join(_f(row.get(k), 3) if k in row else "collapsed" for k in loads) + " |")
        out.append("")
    pred = r.get("predictor")
    if pred and "token_mae" in pred:
        out += ["## Exit-depth predictor (held-out requests of the profile's exit traces)", "",
                f"{pred['train_requests']} requests to fit, {pred['test_requests']} to test; mean absolute error in layers "
                "of each next token's exit layer, and of each request's mean exit layer predicted at admission.", "",
                "| predictor | per token | per request (at admission) |", "| --- | ---: | ---: |"]
        for k, v in pred["token_mae"].items():
            out.append(f"| {k} | {_f(v, 3)} | {_f(pred['request_mae'].get(k), 3)} |")
        out.append("")
    real = r.get("real")
    if real:
        out += _real_tables(real, sla)
        if real.get("overload"):
            out += _overload_table(real["overload"], real.get("constant_actions_sim"))
    out += ["## Headline", "", "```", *(f"{k}: {v}" for k, v in s.items()), "```", ""]
    return "\n".join(out)


def _sim_tables(r: dict[str, Any]) -> list[str]:
    cells = cell_table(r["sim"]["rows"])
    workloads = sorted({w for w, _, _ in cells})
    loads = sorted({lo for _, lo, _ in cells})
    policies = sorted({p for _, _, p in cells}, key=lambda p: (not p.startswith(FIXED_PREFIX),
                                                               int(p[len(FIXED_PREFIX):]) if p.startswith(FIXED_PREFIX) else 0, p))
    out = ["## Simulator: goodput (req/s) and SLA attainment per policy", "",
           "Each cell: goodput / attainment (mean over exit-depth seeds); `*` holds the SLA at p95.", ""]
    for w in workloads:
        out += [f"### {w}", "", "| load | rate (req/s) | " + " | ".join(policies) + " |",
                "| ---: | ---: | " + " | ".join("---:" for _ in policies) + " |"]
        for lo in loads:
            rate = next(row["rate_rps"] for row in r["sim"]["rows"] if row["workload"] == w and row["load"] == lo)
            vals = []
            for p in policies:
                c = cells[(w, lo, p)]
                vals.append(f"{c['goodput_rps']:.2f} / {c['sla_attainment']:.2f}{'*' if c['holds_sla'] else ''}")
            out.append(f"| x{lo:g} | {rate:.2f} | " + " | ".join(vals) + " |")
        out.append("")
    return out


def _real_tables(real: dict[str, Any], sla: dict[str, Any]) -> list[str]:
    out = ["## Real served stack (Ray Serve -> Triton -> engine)", "",
           f"Workload {real['workload']} at x{real['load']:g} = {real['rate_rps']:.2f} req/s, the load where the best "
           f"fixed budget ({real['best_fixed']}) just holds the SLA in the simulator.", "",
           "| policy | requests | errors | SLA attainment | goodput (req/s) | TTFT p50 / p95 (ms) | TPOT p50 / p95 (ms) |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for p, s in real["runs"].items():
        out.append(f"| {p} | {s['requests']} | {s['errors']} | {_f(s['sla_attainment'], 3)} | {_f(s['goodput_rps'])} | "
                   f"{_f(s['ttft_p50_ms'], 1)} / {_f(s['ttft_p95_ms'], 1)} | {_f(s['tpot_p50_ms'], 1)} / "
                   f"{_f(s['tpot_p95_ms'], 1)} |")
    o = real["serving_path"]
    ceiling = real.get("goodput_ceiling")
    out += ["", f"Goodput ratio, learned / best fixed, on the real stack: {_f(real['goodput_ratio'], 3)}."
            + (f" The most any policy could reach on this schedule: {_f(ceiling, 3)} (every request within the SLA: "
               f"1 / the best fixed budget's attainment, the run's length aside). The edge is the load at which the "
               f"best fixed budget holds the SLA for 95% of requests in the simulator, so there no policy can beat it "
               f"by more than ~1 / 0.95 = 1.05 plus what the served stack falls short of the simulator; what a policy "
               f"can add shows past the edge (the simulator's x2 cells) and in the load it holds." if ceiling else ""),
            "",
            "### The simulator against the real stack", "",
            f"Each served run replayed in the simulator (same arrivals, prompt lengths and produced output lengths), "
            f"with the serving path `smartexit profile` fitted on its own requests (never on these runs): decode "
            f"steps x{o['engine_slowdown']:.2f} and prefill x{o['prefill_slowdown'] or o['engine_slowdown']:.2f} the "
            f"profiled time, {o['serve_chunk_ms']:.2f} ms per chunk sent (+{o.get('serve_chunk_sq_ms') or 0:.3f} ms x "
            f"chunks^2), +{o['ttft_overhead_ms']:.1f} ms to the first "
            f"token, +{o['token_overhead_ms']:.2f} ms per later token, {o.get('ingress_ms') or 0:.2f} ms per request at the "
            f"front end (one at a time); draft rounds, {o.get('round_ms') or 0:.2f} ms each on average ("
            + (", ".join(f"batch {k}: {v:.2f}" for k, v in (o.get("round_ms_by_batch") or {}).items())
               or "one price for every batch") + "): their share of a decoding "
            f"sequence's steps and its tokens per step, by decode batch: "
            + (", ".join("{}: {:.2f}, {:.2f}".format(k, *round_summary(v))
                         for k, v in (o.get("decode_rounds") or {}).items()) or "none measured")
            + f". The runs below the edge (same stack as the fixed "
            f"budget's run) give `sim_validation_max_rel_err`; at the edge the stack is at its knee and two runs of one "
            f"schedule can differ by up to 2x on 2 cores: those errors are reported apart."]
    spread = real.get("repeat_spread")
    if spread:
        out += ["", "The real stack against itself: two runs of one schedule below the edge differ by "
                + ", ".join(f"{k} {v:.3f}" for k, v in spread["rel_diff"].items())
                + " (|a - b| / their mean): no simulator can be closer to one run than the runs are to each other."]
    noise = real.get("noise_check")
    if noise:
        lv0 = noise["levels"][0]
        starts = lv0.get("starts", 1)
        out += ["", "The simulator against the served stack's own noise (each load's schedule served "
                f"{lv0['runs']} times, interleaved with the other loads, on {starts} start"
                f"{'s' if starts > 1 else ''} of the stack): the served runs' spread (median over pairs of |a - b| / "
                "their mean), the simulator's error (the same between a run and its replay, median over the runs) and "
                "their ratio (goal <= 1.5: the simulator about as close to a run as another run is). The simulator's "
                "serving path was fitted on the profile's stack, another start, so the ratio reads the spread between "
                "runs on different starts where there are such pairs; the spread between runs on one start, and the "
                f"ratio against it, beside it. Largest ratio: {_f(noise['max_ratio'], 2)} (against runs on one "
                f"stack: {_f(noise.get('max_ratio_one_stack'), 2)}).", "",
                "| share of the edge | metric | spread across starts | spread on one stack | sim error | ratio | "
                "ratio vs one stack |", "| ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
        for lv in noise["levels"]:
            across, one = lv.get("served_spread_across_starts") or {}, lv.get("served_spread_one_stack") or {}
            for k in lv["ratio"]:
                out.append(f"| x{lv['share_of_edge']:g} | {k} | {_f(across.get(k), 3)} | {_f(one.get(k), 3)} | "
                           f"{_f(lv['sim_error'][k], 3)} | {_f(lv['ratio'][k], 2)} | "
                           f"{_f((lv.get('ratio_one_stack') or {}).get(k), 2)} |")
    check = real.get("sla_check")
    if check:
        p95 = "; ".join(f"TTFT {_f(r['ttft_p95_ms'], 1)} ms, TPOT {_f(r['tpot_p95_ms'], 1)} ms, {r['errors']} refused"
                        for r in check["runs"])
        out += ["", f"At x{check['share_of_edge']:g} of the SLA edge ({check['policy']}, SLA "
                f"{check['sla']['ttft_ms']:g} / {check['sla']['tpot_ms']:g} ms), p95 of each served run: {p95}; "
                f"held in every run: {'yes' if check['held'] else 'no'}."]
    out += ["", "| run | metric | measured (ms) | simulated (ms) | relative error |", "| --- | --- | ---: | ---: | ---: |"]
    runs = [(f"{v['policy']} at {v['rate_rps']:.2f} req/s (x{v['share_of_edge']:g} of the edge)", v)
            for v in real.get("validation_below_edge", [])]
    runs += [(f"{p} at the edge", v) for p, v in real["validation"].items()]
    for label, v in runs:
        for k in v["measured"]:
            out.append(f"| {label} | {k} | {_f(v['measured'][k], 1)} | {_f(v['simulated'][k], 1)} | "
                       f"{_f(v['rel_err'].get(k), 3)} |")
    out.append("")
    return out


def _rng(v: dict[str, Any], d: int = 2) -> str:
    return f"{_f(v['median'], d)} ({_f(v['min'], d)}-{_f(v['max'], d)})"


def _overload_table(o: dict[str, Any], consts: dict[str, Any] | None = None) -> list[str]:
    """The policies past the edge on the real stack (scheduler.loadtest.bench_scheduler_overload.overload_report),
    and the simulator's best constant actions (``constant_actions``) beside them."""
    const = o.get("best_constant")
    out = [f"### Past the edge: x{o['factor']:g} of it, {o['rate_rps']:.2f} req/s", "",
           f"One schedule served by each policy {o['repeats']} times, interleaved (every repeat runs every policy, the "
           f"order rotated), on {o.get('stack') or 'one stack'}, with the same shedding rule (a refused request is a "
           f"miss). The best "
           f"fixed budget is {o['best_fixed']}, the best of {o['best_fixed_from']} (every fixed budget admits as many "
           f"sequences as there are cache slots); "
           + (f"the best constant action of the learned policy's own grid (budget x admission limit) there is "
              f"{const}" + (", the same action" if const == o["best_fixed"] else "") if const else
              "no constant action was searched")
           + ". Medians over the repeats (range).", "",
           "| policy | SLA attainment | goodput (req/s) | refused or failed (per run) | TTFT p50 / p95 (ms) | "
           "TPOT p50 / p95 (ms) |", "| --- | ---: | ---: | --- | --- | --- |"]
    for p, runs in o["runs"].items():
        def med(k: str, runs: list[dict[str, Any]] = runs) -> str:
            v = [r[k] for r in runs if r[k] is not None]
            return _f(statistics.median(v) if v else None, 1)
        out.append(f"| {p} | {_rng(o['sla_attainment'][p], 3)} | {_rng(o['goodput_rps'][p])} | "
                   f"{', '.join(str(r['errors']) for r in runs)} of {runs[0]['requests']} | {med('ttft_p50_ms')} / "
                   f"{med('ttft_p95_ms')} | {med('tpot_p50_ms')} / {med('tpot_p95_ms')} |")
    ratios = "; ".join(f"/ {p} {_rng(v, 3)}" for p, v in o["ratio_vs"].items())
    out += ["", f"Goodput of {o['learned']}, taken within each repeat: {ratios}. The most any policy could reach "
            f"against {o['best_fixed']} on this schedule: {_rng(o['ceiling_vs_best_fixed'], 3)} (1 / its attainment).",
            ""]
    if consts:
        out += ["In the simulator (the same workload family, the grid's duration and draws), the learned policy's "
                "goodput over the best constant action of its own grid: " + "; ".join(
                    f"{k} {_f(c['ratio'], 3)} ({c['learned_goodput_rps']:.2f} against {c['best']}'s "
                    f"{c['goodput_rps']:.2f} req/s)" for k, c in consts.items())
                + ". A policy that learned no more than a better constant is worth that constant.", ""]
    return out
