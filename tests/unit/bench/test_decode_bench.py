"""Pure parts of the decode benchmark: pairing, summaries, applicability."""
from __future__ import annotations

import pytest

from edge.bench.decode import DecodeBenchConfig, RunResult, applicable, paired_ratio, summarise
from edge.errors import ConfigError


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
    from edge.bench.summary import goals

    g = goals({"speedup_exit_vs_full_b1": 0.75, "speedup_exit_vs_full_b16": 1.4, "speedup_exit_vs_hf_b1": None,
               "speedup_exit_vs_layerskip_b1": 2.0, "false_exit_rate": 0.012})
    assert g["speedup_exit_vs_full_b1"]["met"] is False and g["speedup_exit_vs_full_b1"]["shortfall"] == pytest.approx(0.75)
    assert g["speedup_exit_vs_full_b16"]["met"] is True and g["speedup_exit_vs_full_b16"]["shortfall"] == 0.0
    assert "speedup_exit_vs_hf_b1" not in g  # not measured: no verdict
    assert g["false_exit_rate"]["met"] is False and g["false_exit_rate"]["shortfall"] == pytest.approx(0.003)
