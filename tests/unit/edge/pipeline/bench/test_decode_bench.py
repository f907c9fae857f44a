"""Pure parts of the decode benchmark: pairing, summaries, applicability."""
from __future__ import annotations

import pytest

from edge.pipeline.bench.decode_config import DecodeBenchConfig
from edge.pipeline.bench.decode_measure import paired_ratio, summarise
from edge.pipeline.bench.decode_systems import applicable
from edge.runtime.batch import RunResult
from edge.core.errors import ConfigError


def _r(seconds, lat=(0.01, 0.02), layers=None):
    return RunResult([[1, 2]], layers, seconds, list(lat))


def test_paired_ratio_is_median_of_per_repeat_ratios():
    runs = {"a": [_r(1.0), _r(2.0), _r(4.0)], "b": [_r(2.0), _r(2.0), _r(2.0)]}
    # tokens/s ratio a/b = seconds_b / seconds_a per repeat: 2, 1, 0.5 -> median 1
    assert paired_ratio(runs, "a", "b") == pytest.approx(1.0)
    assert paired_ratio(runs, "a", "missing") is None


def test_summarise_counts_tokens_and_latency():
    rows = summarise({"x": [_r(0.5, layers=[[3, 12]])]}, sequences=4, n=10)
    assert rows["x"]["tokens_per_s"] == pytest.approx(80.0)
    assert rows["x"]["token_latency_p50_ms"] == pytest.approx(15.0)
    assert rows["x"]["mean_exit_layer"] == pytest.approx(7.5)


def test_the_table_reads_the_interleaved_repeats_of_every_system_only():
    """(e) and (c) run extra pairs after the interleaved repeats (spec_extra_pairs): the table leaves them out,
    so each system's row comes from the same repeats as every other's."""
    runs = {"c": [_r(1.0), _r(1.0), _r(0.1), _r(0.1), _r(0.1)], "d": [_r(2.0), _r(2.0)]}
    rows = summarise(runs, sequences=1, n=10, repeats=2)
    assert rows["c"]["tokens_per_s"] == pytest.approx(10.0) and rows["d"]["tokens_per_s"] == pytest.approx(5.0)
    assert summarise(runs, sequences=1, n=10)["c"]["tokens_per_s"] == pytest.approx(100.0)  # all five


def test_layerskip_only_at_batch_one():
    assert applicable("layerskip", 1) and not applicable("layerskip", 4) and applicable("hf", 16)


def test_config_validation():
    with pytest.raises(ConfigError):
        DecodeBenchConfig(batch_sizes=[])
    with pytest.raises(ConfigError):
        DecodeBenchConfig(new_tokens=1)


def test_the_transformers_peers_run_their_own_number_of_repeats():
    cfg = DecodeBenchConfig(repeats=3, peer_repeats=1)
    assert [cfg.repeats_of(s) for s in ("hf", "layerskip", "hf_lookup")] == [1, 1, 1]
    assert [cfg.repeats_of(s) for s in ("engine_full", "engine_speculative", "llamacpp")] == [3, 3, 3]
    assert DecodeBenchConfig(repeats=3).repeats_of("hf") == 3  # null: every system the same
    for bad in (0, 4):
        with pytest.raises(ConfigError, match="peer_repeats"):
            DecodeBenchConfig(repeats=3, peer_repeats=bad)


def test_goals_say_whether_met_and_by_how_much():
    from edge.pipeline.bench.summary import goals

    g = goals({"speedup_exit_vs_full_b1": 0.75, "speedup_exit_vs_full_b16": 1.4, "speedup_exit_vs_hf_b1": None,
               "false_exit_rate": 0.012, "segment_call_overhead": 1.02, "peak_rss_exit_vs_full": 1.0},
              epsilon=0.009, batch_sizes=[1, 4, 16])
    assert g["speedup_exit_vs_full_b1"]["met"] is False and g["speedup_exit_vs_full_b1"]["shortfall"] == pytest.approx(0.6)
    assert g["speedup_exit_vs_full_b16"]["met"] is True and g["speedup_exit_vs_full_b16"]["shortfall"] == 0.0
    assert g["speedup_exit_vs_hf_b1"]["met"] is None  # not measured: no verdict
    assert g["false_exit_rate"]["met"] is False and g["false_exit_rate"]["shortfall"] == pytest.approx(0.003)
    assert g["segment_call_overhead"]["met"] is True  # an upper bound
    assert g["peak_rss_exit_vs_full"]["met"] is False  # strictly below


def test_layers_computed_counts_recomputation():
    from edge.pipeline.bench.decode_measure import layers_computed
    from edge.runtime.engine_config import KVMode

    exits = [3, 12, 9, 12]
    assert layers_computed(exits, 12, KVMode.DEFER, 0.1) == pytest.approx(12.0)  # every skipped layer runs later
    # propagation: the skipped layers' K/V projections only (9 + 0 + 3 + 0 skipped layers at 0.1 each)
    assert layers_computed(exits, 12, KVMode.PROPAGATE, 0.1) == pytest.approx((36 + 1.2) / 4)


def test_segment_split_covers_all_layers():
    from edge.pipeline.bench.segments import split_layers

    assert split_layers(12, 4) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    assert sum(split_layers(10, 3), []) == list(range(10))
    with pytest.raises(ConfigError):
        split_layers(4, 5)


def test_false_exit_goal_is_the_runs_epsilon():
    from edge.pipeline.bench.summary import goals

    g = goals({"false_exit_rate": 0.012}, epsilon=0.02, batch_sizes=[1])
    assert g["false_exit_rate"] == {"goal": "<= 0.02", "measured": 0.012, "met": True, "shortfall": 0.0}
    assert goals({"false_exit_rate": 0.012}, epsilon=0.01, batch_sizes=[1])["false_exit_rate"]["met"] is False
    assert goals({"false_exit_rate": 0.012}, epsilon=None, batch_sizes=[1])["false_exit_rate"]["met"] is None


def _results(batches):
    row = {"systems": {"engine_exit_defer": {"tokens_per_s": 10.0}}, "speedup_exit_vs_full": 1.2,
           "efficiency_vs_ceiling": 0.9, "speedup_exit_vs_hf": 3.0, "speedup_exit_vs_layerskip": None,
           "exit_depth_ceiling": 1.5, "speedup_vs_full_by_mode": {"defer": 1.2, "propagate": 1.1}}
    return {"batches": {str(b): dict(row) for b in batches}, "kv_mode": "defer", "false_exit_rate": 0.004,
            "false_exit_rate_by_mode": {"defer": 0.004, "propagate": 0.01}, "token_match_vs_full_engine": 0.99,
            "false_exit_tokens": 310, "calibration": {"epsilon": 0.009},
            "segment_call_overhead": {"1": {"ratio": 1.03}, "4": {"ratio": 1.02}}}


def test_a_batch_size_not_run_says_not_run_and_is_never_another_batchs_number():
    from edge.pipeline.bench.summary import GOALS, goals, goals_table, headline

    h = headline(_results([4, 8]))  # neither batch 1 nor batch 16 was run
    assert h["speedup_exit_vs_full_b1"] is None and h["speedup_exit_vs_hf_b1"] is None
    assert h["speedup_exit_vs_full_b8"] == 1.2 and h["segment_call_overhead"] == 1.03
    g = goals(h, 0.009, [4, 8])
    assert g["speedup_exit_vs_full_b16"]["not_run"] and g["efficiency_vs_ceiling_b1"]["not_run"]
    assert "not_run" not in g["false_exit_rate"] and g["speedup_full_vs_llamacpp_b1"]["not_run"]
    table = "\n".join(goals_table(g))
    assert "| speedup_exit_vs_full_b16 | >= 1.25 | not run (batch 16) | n/a | n/a |" in table
    assert "| speedup_exit_vs_hf_b1 | >= 3.0 | not run (batch 1) | n/a | n/a |" in table
    assert "| peak_rss_exit_vs_hf | < 1.0 | not measured | n/a | n/a |" in table
    assert "| speedup_speculative_vs_full_b16 | >= 1.2 | not run (batch 16) | n/a | n/a |" in table
    assert len(table.splitlines()) == 2 + len(GOALS)  # every goal has its row


def test_summary_lines_name_the_key_numbers_and_the_report(tmp_path):
    from edge.pipeline.bench.summary import goals, headline, summary_lines

    results = _results([1, 16])
    summary = headline(results)
    summary["goals"] = goals(summary, 0.009, [1, 16])
    lines = summary_lines(results, summary, tmp_path / "decode.md", 12.0)
    text = "\n".join(lines)
    assert "batch 1: (d) 10.0 tok/s, (d)/(c) 1.20x" in text and "batch 16:" in text
    assert "false exits of (d): 0.0040 on 310 tokens (certified eps 0.009)" in text
    assert lines[-1] == f"  report: {tmp_path / 'decode.md'}" and len(lines) <= 8


def test_token_stamps_time_each_token_and_bursts_of_assisted_decoding():
    """The LayerSkip row's latencies are measured per token: a verification step that accepts k tokens
    puts them together, so they arrive together (k - 1 gaps of 0)."""
    import torch

    from edge.pipeline.bench.decode_systems import TokenStamps

    s = TokenStamps()
    s.put(torch.zeros(1, 5, dtype=torch.long))  # the prompt: not a generated token
    s.put(torch.zeros(1, dtype=torch.long))  # greedy step of batch 1: one token
    s.put(torch.zeros(1, 3, dtype=torch.long))  # assisted step: three accepted tokens at once
    s.put(torch.zeros(1, 1, dtype=torch.long))
    assert len(s.arrivals) == 5
    gaps = s.gaps()
    assert len(gaps) == 4 and gaps[1] == gaps[2] == 0.0 and gaps[0] > 0 and gaps[3] > 0
