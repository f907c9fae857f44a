"""System (e) in ``smartexit bench decode`` (:mod:`edge.pipeline.bench.decode`) beyond the systems' table: its keys
of a batch row (against (c), LayerSkip and the lookup peers; its rounds and mismatches), its tokens against mode
full on its own graphs, its pairs against (c) at the batch sizes the export verifies in one call, and at batch 1
the sweep of its stop rules and draft exits and the self-speculation ceiling (the arithmetic:
:mod:`.speculation`, :mod:`.spec_ceiling`)."""
from __future__ import annotations

from typing import Any

from tqdm import tqdm

from edge.pipeline.bench.decode_config import DecodeBenchConfig
from edge.pipeline.bench.decode_measure import decode_ratio, paired_ratio, source_rows
from edge.pipeline.bench.decode_systems import Systems
from edge.pipeline.bench.spec_ceiling import agreement_trace, ceiling as spec_ceiling, measure_costs
from edge.pipeline.bench.speculation import (calibrated_vs_best_other, divergences, pool_stats, speculative_sweep,
                                             token_mismatches)
from edge.pipeline.run import Run
from edge.runtime.batch import RunResult, run_batch
from edge.runtime.engine_config import KVMode
from edge.runtime.request import Mode
from edge.runtime.speculative import SpecConfig


def against_same_graph(systems: Systems, prompts: list[list[int]], b: int, n: int, exact_tokens: list[list[int]]
                       ) -> tuple[tuple[int, int], list[dict[str, Any]]]:
    """(e)'s tokens against mode full on the same backend (the graph (e) verifies with): ((differing tokens,
    tokens compared), where each differing sequence first differs, with the full model's top-2 logit gap there)."""
    # at (e)'s batch size (b prompts at a time), so each reference step has (e)'s plain steps' shapes
    ref = [t for i in range(0, len(prompts), b) for t in run_batch(
        systems.backend, systems.table_rule, prompts[i:i + b], n, KVMode.PROPAGATE,
        mode=Mode.FULL).tokens]
    return token_mismatches(exact_tokens, ref), divergences(systems.backend, prompts, exact_tokens, ref)


def batch_row_keys(runs: dict[str, list[RunResult]], bad_e: list[tuple[int, int]], same_bad: tuple[int, int],
                   same_div: list[dict[str, Any]], n_prompts: int, n: int, peer: dict | None) -> dict[str, Any]:
    """(e)'s keys of a batch row, in their order in ``bench/decode.json``: ``bad_e``, (e)'s mismatches against (c)
    repeat by repeat; ``same_bad`` and ``same_div``, :func:`against_same_graph`'s; ``peer``, llama.cpp's rows
    (:func:`.decode_measure.llamacpp_rows`) or None."""
    return {
        "speedup_speculative_vs_full": paired_ratio(runs, "engine_speculative", "engine_full"),
        "speculative_pairs": min(len(runs["engine_speculative"]), len(runs["engine_full"])),
        # the same without the prompts' prefill, which both run alike (a 64-token prompt's prefill is ~17% of
        # (c)'s time for 32 new tokens at batch 1): what drafting does to the decode itself; not a goal's key
        "speedup_speculative_vs_full_decode_only": decode_ratio(runs, "engine_speculative", "engine_full",
                                                                n_prompts, n),
        "speedup_speculative_vs_layerskip": paired_ratio(runs, "engine_speculative", "layerskip"),
        # (e)'s rounds over its measured repeats: acceptance rate, mean accepted length, tokens per round
        "speculative": pool_stats([d for r in runs["engine_speculative"] for d in r.spec_stats]),
        "speculative_mismatches": sum(m for m, _ in bad_e),
        "speculative_tokens_compared": sum(t for _, t in bad_e),
        # the same against mode full on the same backend (the graph (e) verifies with), and where each
        # differing sequence first differs, with the full model's top-2 logit gap there
        "speculative_mismatches_same_graph": same_bad[0],
        "speculative_tokens_compared_same_graph": same_bad[1],
        "speculative_divergences_same_graph": same_div,
        "speculative_by_source": source_rows(runs["engine_speculative"]),
        "speedup_speculative_vs_hf_lookup": paired_ratio(runs, "engine_speculative", "hf_lookup"),
        # decode only, same precision
        "speedup_speculative_vs_llamacpp_lookup": decode_ratio(runs, "engine_speculative", "llamacpp_lookup",
                                                               n_prompts, n),
        "speedup_speculative_vs_llamacpp": None if peer is None else peer["ratio"](runs["engine_speculative"]),
    }


def at_verify_batches(cfg: DecodeBenchConfig, run: Run, systems: Systems, bar: tqdm
                      ) -> tuple[dict[str, Any], tuple[int, int]]:
    """(e) against (c) at ``spec_verify_batches`` (default: the batch sizes the export verifies several
    sequences at in one call, ``Backend.verify_batches``, that the batch rows do not run): warm-up +
    repeats, interleaved and paired.

    Returns:
        (the rows by batch size, (differing tokens, tokens compared) over all of them).
    """
    sizes = ([b for b in systems.backend.verify_batches if b not in cfg.batch_sizes]
             if cfg.spec_verify_batches is None else cfg.spec_verify_batches)
    rows = {}
    mismatches = compared = 0
    for b in sizes:
        prompts = run.prompts(b, cfg.prompt_tokens, cfg.seed)
        runs: dict[str, list[RunResult]] = {"engine_speculative": [], "engine_full": []}
        for rep in range(cfg.warmup + cfg.repeats):
            for s in (("engine_speculative", "engine_full") if rep % 2 else ("engine_full", "engine_speculative")):
                bar.set_postfix_str(f"(e) at batch {b}, {'warm-up' if rep < cfg.warmup else 'repeat'} {rep + 1}, {s}")
                r = systems.run(s, prompts, cfg.new_tokens)
                if rep >= cfg.warmup:
                    runs[s].append(r)
        bad = [token_mismatches(e.tokens, c.tokens) for e, c in zip(runs["engine_speculative"], runs["engine_full"])]
        mismatches += sum(m for m, _ in bad)
        compared += sum(t for _, t in bad)
        rows[str(b)] = {"speedup_speculative_vs_full": paired_ratio(runs, "engine_speculative", "engine_full"),
                        "verify_graph": b in systems.backend.verify_batches,
                        "speculative_by_source": source_rows(runs["engine_speculative"]),
                        "speculative_mismatches": sum(m for m, _ in bad),
                        "speculative_tokens_compared": sum(t for _, t in bad)}
        tqdm.write(f"(e) at batch {b} ({'verify graph' if rows[str(b)]['verify_graph'] else 'per-row calls'}): "
                   f"{rows[str(b)]['speedup_speculative_vs_full']:.2f}x (c), "
                   f"{rows[str(b)]['speculative_mismatches']} of {rows[str(b)]['speculative_tokens_compared']} "
                   "tokens differ")
    return rows, (mismatches, compared)


def at_batch1(cfg: DecodeBenchConfig, run: Run, systems: Systems, bar: tqdm, spec: SpecConfig,
              decision_exits: list[int], sweep: bool, sweep_warmup: int) -> tuple[dict[str, Any], list[int]]:
    """(e)'s stop-rule and draft-exit sweep (where ``sweep``) and the self-speculation ceiling at batch 1.

    Returns:
        (their keys of the results, in their order in ``bench/decode.json``; [differing tokens, tokens
        compared] over the sweep's runs, [0, 0] without it).
    """
    out: dict[str, Any] = {"speculative_stop_rules": None, "speculative_by_draft_exit": None}
    bad = [0, 0]
    if sweep:
        prompts = run.prompts(cfg.batch1_prompts, cfg.prompt_tokens, cfg.seed)

        def tick(what: str) -> None:
            bar.set_postfix_str(f"(e) sweep at batch 1, {what}")
            bar.update()

        stops, by_exit, bad = speculative_sweep(systems, prompts, cfg.new_tokens, sweep_warmup,
                                                cfg.spec_sweep_repeats, spec, decision_exits, tick)
        out["speculative_stop_rules"], out["speculative_by_draft_exit"] = stops, by_exit
        out["speculative_calibrated_vs_best_other_b1"] = calibrated_vs_best_other(stops)
    out["speculative_ceiling"] = None
    # the ceiling records the draft exit's host-side decision inputs along full-depth decoding; a shortlist
    # model decides in its graphs and has none (its replay is not ported: the closing note of issue 27)
    skip_ceiling = cfg.spec_ceiling and systems.backend.spec.candidates
    out["speculative_ceiling_skipped"] = (
        "the model decides over a candidate shortlist in its graphs: the ceiling's host-side recording does not "
        "apply" if skip_ceiling else None)
    if cfg.spec_ceiling and decision_exits and not skip_ceiling:
        bar.set_postfix_str("(e) the self-speculation ceiling at batch 1")
        draft = spec.draft_exit if spec.draft_exit is not None else decision_exits[0]
        prompts = run.prompts(cfg.batch1_prompts, cfg.prompt_tokens, cfg.seed)
        trace = agreement_trace(systems.backend, systems.table_rule, prompts, cfg.new_tokens, draft)
        costs = measure_costs(systems.backend, systems.full_backend, draft, spec.max_draft + 1,
                              past=cfg.prompt_tokens + cfg.new_tokens // 2)
        out["speculative_ceiling"] = {"draft_exit": draft, **spec_ceiling(trace, costs, spec)}
    return out, bad
