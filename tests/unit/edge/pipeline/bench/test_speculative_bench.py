"""System (e) of the decode benchmark, self-speculative decoding: mismatches, pooled rounds, the paired
sweep, and its headline numbers and goals, from synthetic results (no engine run)."""
from __future__ import annotations

import pytest

from edge.runtime.batch import RunResult
from edge.pipeline.bench.speculation import (calibrated_vs_best_other, distinct, pool_stats, run_paired,
                                             speculative_sweep, stop_rule_variants, sweep_variants, token_mismatches,
                                             variant_row)
from edge.pipeline.bench.summary import goals, goals_table, headline, render_markdown, summary_lines
from edge.runtime.speculative import SpecConfig, StopRule


def _stats(rounds, drafted, accepted, predicted=0.5):
    return {"rounds": rounds, "drafted": drafted, "accepted": accepted, "emitted": accepted + rounds,
            "draft_steps": drafted + rounds, "acceptance_rate": accepted / drafted, "predicted_acceptance": predicted,
            "tokens_per_round": (accepted + rounds) / rounds, "mean_accepted_length": accepted / rounds}


def test_mismatches_count_every_differing_and_missing_token():
    assert token_mismatches([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 5, 6]]) == (0, 6)
    assert token_mismatches([[1, 9, 3], [4, 5, 6]], [[1, 2, 3], [7, 5, 8]]) == (3, 6)
    assert token_mismatches([[1, 2]], [[1, 2, 3, 4]]) == (2, 4)  # a lossless system emits every token
    with pytest.raises(ValueError):
        token_mismatches([[1]], [[1], [2]])


def test_pooled_rates_come_from_summed_counts_not_a_mean_of_rates():
    s = pool_stats([_stats(10, 20, 10, predicted=0.5), _stats(2, 2, 2, predicted=1.0)])
    assert s["drafted"] == 22 and s["accepted"] == 12 and s["rounds"] == 12
    assert s["acceptance_rate"] == pytest.approx(12 / 22)  # a mean of the rates would say 0.75
    assert s["mean_accepted_length"] == pytest.approx(1.0)
    assert s["tokens_per_round"] == pytest.approx(24 / 12)
    assert s["predicted_acceptance"] == pytest.approx((0.5 * 20 + 1.0 * 2) / 22)
    assert pool_stats([]) is None


def test_stop_rule_and_draft_exit_variants():
    base = SpecConfig(draft_exit=3)
    v = stop_rule_variants(base)
    assert list(v) == ["calibrated", "fixed_1", "fixed_2", "fixed_3", "fixed_4",
                       "top1_0.3", "top1_0.5", "top1_0.7", "top1_0.9"]
    assert v["fixed_2"].stop is StopRule.FIXED and v["fixed_2"].fixed == 2 and v["fixed_2"].draft_exit == 3
    assert v["top1_0.7"].stop is StopRule.TOP1 and v["top1_0.7"].top1 == 0.7
    sweep = sweep_variants(base, [3, 9])
    assert sweep["exit:9"] == SpecConfig(draft_exit=9, sources=("exit",)) and sweep["exit:3"] == sweep["stop:calibrated"]
    assert "exit:3" not in distinct(sweep) and len(distinct(sweep)) == 10  # the same settings run once


def test_each_variant_runs_next_to_its_own_full_depth_run_and_duplicates_run_once():
    calls = []

    def run_full():
        calls.append("full")
        return RunResult([[1, 2]], None, 1.0, [])

    def run_spec(spec):
        calls.append(spec.fixed)
        return RunResult([[1, 2 if spec.fixed == 1 else 7]], None, 0.5 * spec.fixed, [], [_stats(1, 2, 1)])

    variants = {"a": SpecConfig(stop="fixed", fixed=1), "b": SpecConfig(stop="fixed", fixed=4),
                "a_again": SpecConfig(stop="fixed", fixed=1)}
    runs = run_paired(run_full, run_spec, variants, warmup=1, repeats=2)
    assert len(calls) == 2 * 2 * 3  # 2 distinct variants x (warm-up + 2 repeats), each with its (c) run
    assert calls[:4] == ["full", 1, "full", 4]  # repeat 0: (c) first, order a, b
    assert calls[4:8] == [4, "full", 1, "full"]  # repeat 1: rotated, the variant first
    assert runs["a_again"] is runs["a"] and len(runs["b"][0]) == len(runs["b"][1]) == 2
    row_a, row_b = variant_row(*runs["a"]), variant_row(*runs["b"])
    assert row_a["speedup_vs_full"] == pytest.approx(2.0) and row_b["speedup_vs_full"] == pytest.approx(0.5)
    assert row_a["mismatches"] == 0 and row_b["mismatches"] == 2 and row_b["tokens_compared"] == 4
    assert row_a["acceptance_rate"] == pytest.approx(0.5) and row_a["tokens_per_round"] == pytest.approx(2.0)


def test_sweep_rows_by_stop_rule_and_draft_exit_count_each_run_once():
    class FakeSystems:  # (c) takes 1 s; a variant 1 / (its fixed length) s, one wrong token from exit 9
        calls = 0

        def run(self, name, prompts, n, group=None, spec=None):
            assert group == 1 and len(prompts) == 2  # batch 1: the prompts one after another
            self.calls += 1
            if name == "engine_full":
                return RunResult([[1] * n, [2] * n], None, 1.0, [])
            wrong = spec.draft_exit == 9
            return RunResult([[1] * n, [2] * (n - 1) + [9 if wrong else 2]], None, 1.0 / spec.fixed, [],
                             [_stats(4, 8, 4)])

    fake = FakeSystems()
    stops, by_exit, bad = speculative_sweep(fake, [[5], [6]], 4, warmup=0, repeats=2,
                                            base=SpecConfig(draft_exit=3), decision_exits=[3, 9])
    assert fake.calls == 2 * 2 * 10  # 10 distinct variants (exit 3 calibrated is the calibrated stop rule)
    assert list(by_exit) == ["3", "9"] and by_exit["3"] == stops["calibrated"]
    assert stops["fixed_4"]["speedup_vs_full"] == pytest.approx(4.0) and stops["fixed_4"]["mismatches"] == 0
    assert by_exit["9"]["mismatches"] == 2 and by_exit["9"]["tokens_compared"] == 16
    assert bad == [2, 10 * 16]


def test_calibrated_rule_against_the_best_of_both_families():
    rows = {"calibrated": {"speedup_vs_full": 1.2}, "fixed_1": {"speedup_vs_full": 1.0},
            "fixed_2": {"speedup_vs_full": 1.5}, "top1_0.5": {"speedup_vs_full": 1.1}}
    assert calibrated_vs_best_other(rows) == pytest.approx(0.8)
    assert calibrated_vs_best_other({"calibrated": {"speedup_vs_full": 1.2}}) is None


def _results(batches=(1, 4, 16), mismatches=0, sweep=True):
    def row(b):
        sys_row = {"token_latency_p50_ms": 3.0, "token_latency_p95_ms": 4.0, "mean_exit_layer": None}
        return {"systems": {"engine_exit_defer": {**sys_row, "tokens_per_s": 10.0},
                            "engine_speculative": {**sys_row, "tokens_per_s": 9.0}},
                "speedup_exit_vs_full": 0.9, "efficiency_vs_ceiling": 0.9, "speedup_exit_vs_hf": 3.0,
                "speedup_exit_vs_layerskip": 4.0 if b == 1 else None, "exit_depth_ceiling": 1.2,
                "speedup_vs_full_by_mode": {"defer": 0.9, "propagate": 0.8},
                "false_exit_rate_by_mode": {"defer": 0.004, "propagate": 0.01},
                "speedup_speculative_vs_full": {1: 0.85, 4: 0.6, 16: 0.4}[b],
                "speedup_speculative_vs_full_decode_only": {1: 0.9, 4: 0.55, 16: 0.35}[b],
                "speedup_speculative_vs_layerskip": 5.5 if b == 1 else None,
                "speculative": pool_stats([_stats(12, 30, 18)]), "speculative_mismatches": mismatches,
                "speculative_tokens_compared": 96 * b}
    stop = {"speedup_vs_full": 0.85, "acceptance_rate": 0.6, "mean_accepted_length": 1.5, "tokens_per_round": 2.5,
            "rounds": 12, "mismatches": 0, "tokens_compared": 128}
    res = {"batches": {str(b): row(b) for b in batches}, "kv_mode": "defer", "false_exit_rate": 0.004,
           "false_exit_rate_by_mode": {"defer": 0.004, "propagate": 0.01}, "token_match_vs_full_engine": 0.99,
           "false_exit_tokens": 310, "calibration": {"epsilon": 0.009}, "ort_pool_threads": 2,
           "segment_call_overhead": {}, "profile_b1": {"total": 2.0, "engine_other": 0.1},
           "config": {"prompt_tokens": 64, "new_tokens": 32, "warmup": 1, "repeats": 3, "threads": 2,
                      "batch1_prompts": 4, "spec_sweep_repeats": 5},
           "speculative_config": {"draft_exit": 3, "stop": "calibrated", "max_draft": 6},
           "speculative_mismatches": mismatches, "speculative_tokens_compared": 2000,
           "speculative_stop_rules": None, "speculative_by_draft_exit": None}
    if sweep:
        res["speculative_stop_rules"] = {"calibrated": stop, "fixed_2": {**stop, "speedup_vs_full": 1.0},
                                         "top1_0.5": {**stop, "speedup_vs_full": 0.9}}
        res["speculative_by_draft_exit"] = {"3": stop, "9": {**stop, "speedup_vs_full": 0.7}}
        res["speculative_calibrated_vs_best_other_b1"] = calibrated_vs_best_other(res["speculative_stop_rules"])
    return res


def test_headline_and_goals_of_self_speculation_say_met_or_missed_by_how_much():
    results = _results(mismatches=3)
    h = headline(results)
    assert h["speedup_speculative_vs_full_b1"] == 0.85 and h["speedup_speculative_vs_full_b16"] == 0.4
    assert h["speedup_speculative_vs_layerskip_b1"] == 5.5 and h["speculative_mismatches"] == 3
    assert h["speculative_acceptance_rate"] == pytest.approx(0.6)
    assert h["speculative_calibrated_vs_best_other_b1"] == pytest.approx(0.85)
    g = goals(h, 0.009, [1, 4, 16])
    assert g["speedup_speculative_vs_full_b1"] == {"goal": ">= 1.6", "measured": 0.85, "met": False,
                                                   "shortfall": pytest.approx(0.75)}
    assert g["speedup_speculative_vs_full_b16"]["shortfall"] == pytest.approx(0.8)
    assert g["speedup_speculative_vs_layerskip_b1"]["met"] is True
    assert g["speculative_mismatches"] == {"goal": "<= 0", "measured": 3, "met": False, "shortfall": 3}
    assert g["speculative_calibrated_vs_best_other_b1"]["shortfall"] == pytest.approx(0.15)
    table = "\n".join(goals_table(g))
    assert "| speedup_speculative_vs_full_b1 | >= 1.6 | 0.850 | no | 0.750 |" in table
    assert "| speculative_mismatches | <= 0 | 3.000 | no | 3.000 |" in table
    assert "| speedup_speculative_vs_layerskip_b1 | >= 2.0 | 5.500 | yes | 0.000 |" in table
    assert goals(headline(_results()), 0.009, [1, 4, 16])["speculative_mismatches"]["met"] is True


def test_without_the_sweep_the_stop_rule_goal_is_not_measured():
    h = headline(_results(sweep=False))
    g = goals(h, 0.009, [1, 4, 16])
    assert g["speculative_calibrated_vs_best_other_b1"]["measured"] is None
    table = "\n".join(goals_table(g))
    assert "| speculative_calibrated_vs_best_other_b1 | >= 1.0 | not measured | n/a | n/a |" in table


def test_markdown_and_summary_lines_show_the_speculative_rows(tmp_path):
    results = _results(batches=(1, 16))
    summary = headline(results)
    summary["goals"] = goals(summary, 0.009, [1, 16])
    md = render_markdown(results, summary)
    assert "| 1 | (e) SmartExit engine, ORT, speculative (exact: lookup and exit drafts) | 9.0 |" in md
    assert "| 16 | 0.40 | 0.35 | n/a | 0.600 | 1.50 | 2.50 | 0 of 1536 |" in md
    assert "| fixed_2 | 1.00 | 0.600 | 1.50 | 2.50 | 0 |" in md and "| 9 | 0.70 | 0.600 |" in md
    assert "Calibrated rule / best other rule (fixed or top-1): 0.850." in md
    text = "\n".join(summary_lines(results, summary, tmp_path / "decode.md", 1.0))
    assert "batch 1: (d) 10.0 tok/s, (d)/(c) 0.90x, (d)/(a) 3.00x, (e)/(c) 0.85x" in text
    assert "(e) self-speculative: acceptance 0.600 at batch 1, 0 tokens differ from (c) of 2000" in text


def test_report_folds_in_the_speculative_rows():
    from edge.pipeline.report import summary_lines as report_lines
    from edge.pipeline.report_decode_md import bench_md

    results = _results(batches=(1, 16))
    summary = headline(results)
    summary["goals"] = goals(summary, 0.009, [1, 16])
    bench = {**summary, "batches": results["batches"], "profile_b1": results["profile_b1"], "peak_rss_mib": None,
             **{k: results[k] for k in ("speculative_config", "speculative_stop_rules", "speculative_by_draft_exit")}}
    md = "\n".join(bench_md(bench))
    assert "tokens differing from full depth (c) **0** of 2000" in md
    assert "| 9 | 0.700 | 0.600 | 1.50 |" in md and "| top1_0.5 | 0.900 | 0.600 | 2.50 |" in md
    assert "speculative" not in md.split("- (d) = exits")[1].split("\n")[0]  # (d)'s line keeps to (d)
    line = report_lines({"decode_bench": bench})[0]
    assert line.startswith("decode: ") and "speculative_vs_full_b1 0.85" in line
    old = {k: v for k, v in bench.items() if not k.startswith("speculative")}
    assert "self-speculative" not in "\n".join(bench_md(old))  # a run benchmarked before (e): no section


def test_markdown_says_when_the_llamacpp_row_ran_its_weights_as_stored():
    """Where llama.cpp's repacked kernels crash (llamacpp_repack.repack_runs) the peer runs its plain layout: the
    report's llama.cpp section says so, and says nothing where the peer ran llama.cpp's default."""
    results = _results(batches=(1, 16))
    row = {"source": "llama-bench", "decode_tokens_per_s": 1400.0, "decode_stddev": 25.0,
           "prefill_tokens_per_s": 5100.0, "prefill_stddev": 130.0, "repeats": 3}
    summary = headline(results)
    summary["goals"] = goals(summary, 0.009, [1, 16])
    for repack, said in ((False, True), (True, False)):
        results["llamacpp"] = {"gguf_type": "q8_0", "repack": repack, "rows": {"llama-bench": row},
                               "used": "llama-bench", "llama_bench_skipped": None}
        md = render_markdown(results, summary)
        assert "(f) llama.cpp on a q8_0 GGUF" in md and "| llama-bench | 1400.0 (sd 25.0) |" in md
        assert ("its weights as stored: its repacked kernels failed on this machine" in md) is said
