"""Pure parts of the decode benchmark: pairing, summaries, applicability."""
from __future__ import annotations

import pytest

from edge.pipeline.bench.decode import DecodeBenchConfig, RunResult, applicable, paired_ratio, summarise
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


def test_layerskip_only_at_batch_one():
    assert applicable("layerskip", 1) and not applicable("layerskip", 4) and applicable("hf", 16)


def test_config_validation():
    with pytest.raises(ConfigError):
        DecodeBenchConfig(batch_sizes=[])
    with pytest.raises(ConfigError):
        DecodeBenchConfig(new_tokens=1)


def test_goals_say_whether_met_and_by_how_much():
    from edge.pipeline.bench.summary import goals

    g = goals({"speedup_exit_vs_full_b1": 0.75, "speedup_exit_vs_full_b16": 1.4, "speedup_exit_vs_hf_b1": None,
               "false_exit_rate": 0.012, "segment_call_overhead": 1.02, "peak_rss_exit_vs_full": 1.0})
    assert g["speedup_exit_vs_full_b1"]["met"] is False and g["speedup_exit_vs_full_b1"]["shortfall"] == pytest.approx(0.6)
    assert g["speedup_exit_vs_full_b16"]["met"] is True and g["speedup_exit_vs_full_b16"]["shortfall"] == 0.0
    assert g["speedup_exit_vs_hf_b1"]["met"] is None  # not measured: no verdict
    assert g["false_exit_rate"]["met"] is False and g["false_exit_rate"]["shortfall"] == pytest.approx(0.003)
    assert g["segment_call_overhead"]["met"] is True  # an upper bound
    assert g["peak_rss_exit_vs_full"]["met"] is False  # strictly below


def test_layers_computed_counts_recomputation():
    from edge.pipeline.bench.decode import layers_computed
    from edge.runtime.engine import KVMode

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
