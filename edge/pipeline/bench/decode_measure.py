"""What ``smartexit bench decode`` (:mod:`edge.pipeline.bench.decode`) reads off the systems' runs: false exits,
the rows' medians and paired ratios (whole runs and decode alone), the compute ceiling, llama.cpp's rows, (e)'s
rounds by draft source, what a check point costs in the engine, and where a decode step's time goes."""
from __future__ import annotations

from typing import Any

import numpy as np

from calibration.freerun import Served, check_continuations
from edge.model.exits import MultiExitModel
from edge.pipeline.bench.decode_systems import Systems, run_groups
from edge.pipeline.bench.speculation import pool_stats, token_mismatches
from edge.runtime.batch import RunResult, run_batch
from edge.runtime.engine import held_step_gate
from edge.runtime.engine_config import KVMode
from edge.runtime.profile import ProfiledBackend, ProfiledRule
from edge.runtime.rules import NeverExit
from edge.runtime.speculative import Source


def false_exits(served: Served, prompts: list[list[int]], res: RunResult, mode: KVMode) -> tuple[int, int]:
    """(wrong tokens, judged tokens) of an engine run: the tokens that differ from the full model's greedy
    choice on the same prefix, by calibration's check (:func:`calibration.freerun.check_continuations`);
    ``Served(backend)``: the full model is that backend at full depth (what calibration certifies)."""
    r = check_continuations(served, np.asarray(prompts), np.asarray(res.tokens), np.asarray(res.exit_layers),
                            mode).summary()
    return r.false_exits + r.full_depth_mismatches, r.tokens


def gate_share(systems: Systems, b: int) -> float | None:
    """The share of (d)-gated's decode steps at batch ``b`` that its step gate let check exits (None: the gated
    system did not run, or no step could check)."""
    if "engine_exit_gated" not in systems.loaded:
        return None
    gate = held_step_gate(systems.backend, systems.gated_mode, systems.table_rule)
    return None if gate is None else gate.share_checked(b)


def _token_match(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of positions where two systems' greedy tokens agree (a missing token disagrees)."""
    bad, total = token_mismatches(a, b)
    return 1.0 - bad / max(1, total)


def kv_fraction(model: MultiExitModel) -> float:
    """Share of a decoder layer's multiply-adds that its K/V projections are (what propagation
    computes for a skipped layer): 2 D KV hd over D (H hd) + 2 D KV hd + (H hd) D + 3 D F."""
    c = model.backbone.cfg
    kv = 2 * c.hidden_size * c.num_kv_heads * c.head_dim
    return kv / (2 * c.hidden_size * c.num_heads * c.head_dim + kv + 3 * c.hidden_size * c.intermediate_size)


def layers_computed(exit_layers: list[int], num_layers: int, mode: KVMode, kv_frac: float) -> float:
    """Mean layers computed per token, recomputation counted: a token that exits at layer k runs k
    layers, then (propagate) the K/V projections of the skipped ones or (defer) all of them later."""
    e = np.asarray(exit_layers, np.float64)
    skipped = num_layers - e
    return float(np.mean(e + (kv_frac * skipped if KVMode(mode) is KVMode.PROPAGATE else skipped)))


def summarise(runs: dict[str, list[RunResult]], sequences: int, n: int,
              repeats: int | None = None) -> dict[str, dict[str, float]]:
    """Each system's row of the table: median tokens/s, token-latency percentiles, mean exit layer, over its
    first ``repeats`` runs (None: all), so that every system reads the same interleaved repeats and none
    the extra pairs some systems ran after them (:meth:`edge.pipeline.bench.decode._DecodeBench.batch`)."""
    rows = {}
    for name, rs in runs.items():
        rs = rs[:repeats]
        lat = np.concatenate([r.token_latencies for r in rs]) if rs else np.zeros(0)
        layers = [e for r in rs for seq in (r.exit_layers or []) for e in seq]
        rows[name] = {
            "tokens_per_s": float(np.median([sequences * n / r.seconds for r in rs])),
            "token_latency_p50_ms": float(1e3 * np.percentile(lat, 50)) if lat.size else None,
            "token_latency_p95_ms": float(1e3 * np.percentile(lat, 95)) if lat.size else None,
            "mean_exit_layer": float(np.mean(layers)) if layers else None,
        }
    return rows


def paired_ratio(runs: dict[str, list[RunResult]], num: str, den: str) -> float | None:
    """Median over repeats of (tokens/s of num) / (tokens/s of den), pairing repeat r with repeat r."""
    if num not in runs or den not in runs:
        return None
    return float(np.median([d.seconds / u.seconds for u, d in zip(runs[num], runs[den])]))


def decode_ratio(runs: dict[str, list[RunResult]], num: str, den: str, sequences: int, n: int) -> float | None:
    """Median over paired repeats of decode-only tokens/s of num over den."""
    if num not in runs or den not in runs:
        return None
    return float(np.median([decode_tokens_per_s(u, sequences, n) / decode_tokens_per_s(d, sequences, n)
                            for u, d in zip(runs[num], runs[den])]))


def source_rows(rs: list[RunResult]) -> dict[str, Any]:
    """(e)'s rounds by draft source over its repeats, pooled, and its plain steps; ``tokens_per_call``: tokens
    a verification call emitted (a lookup round is one call; an exit round's draft steps are calls too)."""
    stats = [d for r in rs for d in r.source_stats]
    out: dict[str, Any] = {"plain_steps": int(sum(d["plain_steps"] for d in stats))}
    for src in Source:
        out[src.value] = pool_stats([d[src.value] for d in stats if d[src.value]["rounds"]])
    return out


def decode_tokens_per_s(r: RunResult, sequences: int, n: int) -> float:
    """Decode alone: the n - 1 tokens after each sequence's first, over the gaps between its tokens."""
    return sequences * (n - 1) / sum(r.token_latencies)


def llamacpp_rows(runs: dict[str, list[RunResult]], bench: list, sequences: int, n: int, prompt_tokens: int) -> dict:
    """llama.cpp's rows at batch 1, decode and prefill apart: its Python API (the runs of system
    ``llamacpp``) and llama-bench (``bench``: one DecodeSpeed per repeat, or none), and a function giving our
    system's decode-only speed-up over the faster row, the median over repeats of the paired ratios."""
    from edge.pipeline.bench.llamacpp_bench import DecodeSpeed, faster_row

    api = runs["llamacpp"]
    rows = [DecodeSpeed("python-api", tuple(decode_tokens_per_s(r, sequences, n) for r in api),
                        tuple(sequences * prompt_tokens / (r.seconds - sum(r.token_latencies)) for r in api))]
    if bench:
        rows.append(DecodeSpeed("llama-bench", tuple(x.decode_tokens_per_s for x in bench),
                                tuple(x.prefill_tokens_per_s for x in bench)))
    best = faster_row(rows)

    def ratio(ours: list[RunResult]) -> float:
        return float(np.median([decode_tokens_per_s(r, sequences, n) / t for r, t in zip(ours, best.decode_samples)]))

    return {"rows": {r.source: r.to_dict() for r in rows}, "used": best.source, "ratio": ratio}


def engine_check_point_cost(systems: Systems, prompts: list[list[int]], n: int, layer_ms: float,
                            repeats: int) -> dict[str, float]:
    """What a check point costs a token that does not leave, in the engine at batch 1, host work included:
    the exits export with every row checked and none leaving (NeverExit: its score is always negative)
    against (c) on the same prompts, paired runs, median; per check point, in layers (``layer_ms``)."""
    n_checks = len(systems.backend.exit_layers) - 1
    never, full = [], []
    for rep in range(repeats + 1):  # the first pair warms up
        pair = (("never", lambda g, k: run_batch(systems.backend, NeverExit(), g, k, KVMode.DEFER)),
                ("full", lambda g, k: systems.run("engine_full", g, k)))
        for name, fn in (pair if rep % 2 == 0 else pair[::-1]):
            r = run_groups(fn, [[p] for p in prompts], n)
            if rep:
                (never if name == "never" else full).append(r.seconds / (len(prompts) * n))
    extra_ms = 1e3 * float(np.median(np.array(never) - np.array(full)))
    return {"extra_ms_per_token": extra_ms, "checks": n_checks, "layers": extra_ms / n_checks / layer_ms,
            "ratio_never_vs_full": float(np.median(np.array(never) / np.array(full)))}


def profile_step(systems: Systems, prompts: list[list[int]], n: int, system: str) -> dict[str, float]:
    """Where the time of (d)'s decode goes: ms per decode step by component, at this batch."""
    backend = ProfiledBackend(systems.backend)
    rule = ProfiledRule(systems.table_rule)
    res = systems.run(system, prompts, n, backend=backend, rule=rule, group=1)
    steps = len(prompts) * (n - 1)
    parts = {k: 1e3 * v / steps for k, v in {**backend.seconds, "exit_rule": rule.seconds}.items()}
    parts["total"] = 1e3 * res.seconds / steps
    parts["engine_other"] = parts["total"] - sum(v for k, v in parts.items() if k != "total")
    return {k: round(v, 3) for k, v in parts.items()}
