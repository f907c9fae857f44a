"""The energy benchmark's arithmetic: per-token figures, idle subtraction, ratios, and what it says
without a sensor (hand-computed windows)."""
from __future__ import annotations

import pytest

from edge.core.errors import ConfigError
from edge.pipeline.bench.energy_config import EnergyBenchConfig
from edge.pipeline.bench.energy_figures import Window, paired_ratios, per_token, ratios
from edge.pipeline.bench.energy_report import plot, render_markdown


def _windows(joules: list[float | None], idle_w: float | None = 2.0) -> list[Window]:
    # 100 tokens in 2 s each; 0.5 CPU-seconds
    return [Window(100, 2.0, 0.5, j, idle_w) for j in joules]


def test_per_token_medians_spread_and_idle():
    r = per_token(_windows([30.0, 10.0, 20.0]))
    assert r["joules_per_token"] == {"median": 0.2, "min": 0.1, "max": 0.3}
    # above idle: 2 W for 2 s = 4 J less per window -> 16 J / 100 tokens
    assert r["joules_per_token_above_idle"]["median"] == pytest.approx(0.16)
    assert r["cpu_seconds_per_token"]["median"] == pytest.approx(0.005)
    assert r["tokens_per_s"]["median"] == 50.0 and r["watts"]["median"] == 10.0 and r["tokens"] == 300


def test_no_sensor_gives_no_joules_but_the_proxy():
    r = per_token(_windows([None, None], idle_w=None))
    assert r["joules_per_token"] is None and r["joules_per_token_above_idle"] is None and r["watts"] is None
    assert r["cpu_seconds_per_token"]["median"] == pytest.approx(0.005)


def test_ratios_against_full_depth():
    rel = ratios({"full": _windows([20.0]), "exits": _windows([15.0])})
    assert rel["full"]["joules_per_token"] == 1.0
    assert rel["exits"]["joules_per_token"] == pytest.approx(0.75)
    assert rel["exits"]["cpu_seconds_per_token"] == 1.0
    none = ratios({"full": _windows([None]), "exits": _windows([None])})
    assert none["exits"]["joules_per_token"] is None and none["exits"]["tokens_per_s"] == 1.0


def test_ratios_are_paired_by_repeat():
    """Slow stretches of a shared machine: in repeat 2 one fell on the exits' window alone, in repeat 3 on
    both systems' windows. The ratio of the medians reads them as a difference between the systems (1.6x);
    the median of the repeat-by-repeat ratios keeps the two undisturbed pairs' 0.8 and shows the bad pair
    in the range."""
    def win(cpu: list[float]) -> list[Window]:  # 100 tokens per window, the CPU-seconds given
        return [Window(100, 2.0, c, None, None) for c in cpu]

    full = win([1.0, 1.0, 2.0])
    exits = win([0.8, 1.6, 1.6])
    spread = paired_ratios({"full": full, "exits": exits})["exits"]["cpu_seconds_per_token"]
    assert spread == {"median": 0.8, "min": 0.8, "max": pytest.approx(1.6)}
    assert ratios({"full": full, "exits": exits})["exits"]["cpu_seconds_per_token"] == 0.8
    # the ratio of the medians (1.6 / 1.0) would have said exits cost 60% more
    assert per_token(exits)["cpu_seconds_per_token"]["median"] / per_token(full)["cpu_seconds_per_token"]["median"] \
        == pytest.approx(1.6)
    with pytest.raises(ValueError, match="one window per repeat"):
        paired_ratios({"full": full, "exits": exits[:2]})
    # a base figure of zero gives no ratio rather than a division by zero
    assert paired_ratios({"full": win([0.0]), "exits": win([1.0])})["exits"]["cpu_seconds_per_token"] is None


def test_markdown_and_plot_say_what_was_measured(tmp_path):
    rows = {"full": per_token(_windows([None])), "exits": per_token(_windows([None]))}
    result = {"config": {"prompts": 4, "prompt_tokens": 64, "new_tokens": 32, "batch": 1, "repeats": 1, "threads": 2,
                         "idle_seconds": 1.0},
              "rows": rows, "ratios_vs_full": ratios({"full": _windows([None]), "exits": _windows([None])}),
              "ratio_spreads_vs_full": paired_ratios({"full": _windows([None]), "exits": _windows([None])}),
              "power_trace_first_repeat": {"full": [], "exits": []},
              "summary": {"meter": "none", "meter_available": False, "meter_reason": "no sensor here", "rails": [],
                          "interval_s": 0.05}}
    md = render_markdown(result)
    assert "**no power sensor** (no sensor here)" in md and "it is not energy" in md
    assert "| exits | - | - | 0.005 (0.005-0.005) |" in md and "| 1 (1-1) | 1 (1-1) |" in md
    # 0.5 CPU-seconds over each 2 s window
    assert rows["full"]["cpu_per_second"]["median"] == pytest.approx(0.25)
    assert "CPU-seconds per second of window: 0.25-0.25 across systems, with 2 CPU threads" in md
    plot(result, tmp_path / "e.png")
    assert (tmp_path / "e.png").stat().st_size > 1000


@pytest.mark.parametrize("kw,msg", [({"interval_s": 0}, "interval_s"), ({"prompts": 3, "batch": 2}, "multiple"),
                                    ({"new_tokens": 1}, "new_tokens"), ({"backend": "tvm"}, "backend 'tvm'")])
def test_bad_configs(kw, msg):
    with pytest.raises(ConfigError, match=msg):
        EnergyBenchConfig(**kw)


def test_served_backend_needs_the_choice_jetson_serve_wrote(tmp_path):
    from edge.pipeline.bench.energy_systems import backend_choice

    cfg = EnergyBenchConfig(run_dir=str(tmp_path), backend="served")
    with pytest.raises(ConfigError, match="make jetson-serve"):
        backend_choice(cfg, tmp_path / "ckpt")
    (tmp_path / "jetson" / "units").mkdir(parents=True)
    (tmp_path / "jetson" / "units" / "backend.json").write_text('{"name": "tensorrt", "engines_dir": "/e"}')
    assert backend_choice(cfg, tmp_path / "ckpt") == {"name": "tensorrt", "engines_dir": "/e"}
    cfg.backend = "torch_static"
    assert backend_choice(cfg, tmp_path / "ckpt")["checkpoint"] == str(tmp_path / "ckpt")


def test_tokens_per_s_reads_the_decode_alone_while_cpu_and_joules_read_the_whole_window():
    # a window of 2 s whose decode took 1.6 s (the rest: its threads spinning down, edge/pipeline/bench/quiesce.py)
    w = Window(100, 2.0, 0.5, 20.0, 2.0, decode_seconds=1.6)
    r = per_token([w])
    assert r["tokens_per_s"]["median"] == pytest.approx(100 / 1.6)
    assert r["cpu_seconds_per_token"]["median"] == pytest.approx(0.005)
    assert r["joules_per_token_above_idle"]["median"] == pytest.approx((20.0 - 2.0 * 2.0) / 100)
