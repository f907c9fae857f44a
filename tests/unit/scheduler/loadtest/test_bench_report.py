"""Serving benchmark report: percentiles against numpy, goodput / attainment arithmetic, the comparison,
the Markdown and PNGs, and the stage end to end with the runs faked (no servers)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from edge.core.configio import apply, load_yaml
from edge.pipeline.bench import serve as serve_stage
from scheduler.loadtest import bench_serve_inputs, bench_serve_report, bench_serve_runs
from scheduler.loadtest.bench_report import compare, same_lengths, plot_latency_cdf, plot_throughput, render_markdown, throughput_series
from scheduler.control.outcomes import summarize
from edge.core.stats import percentiles
from scheduler.loadtest.bench_serve_config import BenchServeConfig
from scheduler.loadtest.bench_serve_report import INPROCESS
from scheduler.loadtest.capacity import Run
from scheduler.control.outcomes import RequestResult

PNG = b"\x89PNG\r\n\x1a\n"
ROOT = __import__("pathlib").Path(__file__).parents[4]


def _done(i: int, submit: float, ttft: float, tpot: float, n: int) -> RequestResult:
    """A finished request: first token after ``ttft``, then one every ``tpot`` seconds."""
    times = [submit + ttft + k * tpot for k in range(n)]
    return RequestResult(f"r{i}", submit, 8, n, t_submit=submit, t_first_token=times[0], t_end=times[-1],
                         tokens=n, token_times=times, exit_layers=[3] * n, finish_reason="length")


def _failed(i: int, submit: float, kind: str) -> RequestResult:
    return RequestResult(f"e{i}", submit, 8, 4, t_submit=submit, t_end=submit + 0.01, http_status=429,
                         error_kind=kind, error="queue full")


def test_percentiles_match_numpy():
    rng = np.random.default_rng(0)
    x = rng.lognormal(0, 1, 1001)
    got = percentiles(list(x))
    want = np.percentile(x, [50, 95, 99])
    assert [got["p50"], got["p95"], got["p99"]] == pytest.approx(list(want), rel=1e-12)
    assert percentiles([]) == {"p50": None, "p95": None, "p99": None}
    assert percentiles([None, 2.0, None])["p99"] == 2.0


def test_summary_arithmetic():
    # 10 s run: 6 requests meet the SLA (TTFT 0.125 s, TPOT 0.0625 s), 2 miss TTFT, 1 misses TPOT,
    # 1 single-token request meets TTFT (no TPOT), 2 are refused
    res = [_done(i, float(i), 0.125, 0.0625, 5) for i in range(6)]
    res += [_done(6, 6.0, 0.75, 0.0625, 5), _done(7, 7.0, 1.0, 0.0625, 5)]
    res += [_done(8, 8.0, 0.125, 0.25, 5), _done(9, 9.0, 0.125, 0.0, 1)]
    res += [_failed(0, 9.5, "http_429"), _failed(1, 9.9, "http_503")]
    last_end = max(r.t_end for r in res)
    s = summarize(res, sla_ttft_ms=500.0, sla_tpot_ms=100.0)
    assert s["requests"] == 12 and s["completed"] == 10 and s["errors"] == 2
    assert s["errors_by_kind"] == {"http_429": 1, "http_503": 1}
    assert s["duration_s"] == pytest.approx(last_end - 0.0)
    assert s["sla_met"] == 7 and s["sla_attainment"] == pytest.approx(7 / 12)
    assert s["goodput_rps"] == pytest.approx(7 / last_end)
    assert s["tokens"] == 46 and s["tokens_per_s"] == pytest.approx(46 / last_end)
    ok = [r for r in res if r.ok]
    assert s["ttft_p95_ms"] == pytest.approx(np.percentile([r.ttft_s * 1e3 for r in ok], 95))
    assert s["tpot_p50_ms"] == pytest.approx(np.percentile([r.tpot_s * 1e3 for r in ok if r.tpot_s is not None], 50))
    assert s["e2e_p99_ms"] == pytest.approx(np.percentile([r.e2e_s * 1e3 for r in ok], 99))
    assert s["mean_exit_layer"] == 3.0 and s["send_lag_p99_ms"] == 0.0


def test_compare_and_throughput():
    served = {"tokens_per_s": 80.0, "ttft_p50_ms": 130.0}
    inproc = {"tokens_per_s": 100.0, "ttft_p50_ms": 30.0}
    assert compare(served, inproc) == {"served_vs_inprocess_tokens_ratio": 0.8, "ttft_p50_overhead_ms": 100.0}
    assert compare(served, {"tokens_per_s": 0.0, "ttft_p50_ms": None}) == {
        "served_vs_inprocess_tokens_ratio": None, "ttft_p50_overhead_ms": None}
    res = [_done(0, 0.0, 0.25, 0.5, 4), _done(1, 1.0, 0.5, 0.25, 2), _failed(0, 0.0, "http_429")]
    other = [_done(0, 0.0, 0.1, 0.1, 4), _done(1, 1.0, 0.1, 0.1, 3)]
    assert same_lengths(res, other) == 0.5 and same_lengths(res, []) is None
    t, tok, done = throughput_series(res, 1.0)
    # token times: 0.25 0.75 1.25 1.75 | 1.5 1.75; ends 1.75, 1.75
    assert list(t) == [0.0, 1.0] and list(tok) == [2.0, 4.0] and list(done) == [0.0, 2.0]


def _fake_runs(schedule):
    def run(scale):
        return [_done(i, r.arrival_s, 0.05 * scale, 0.01 * scale, r.max_tokens) for i, r in enumerate(schedule)]

    return run


def test_stage_end_to_end_with_fake_runs(tmp_path, monkeypatch):
    """main() with the runs faked: serve.json / serve.md / both PNGs and the manifest record."""
    cfg = apply(BenchServeConfig(), load_yaml(ROOT / "configs" / "bench_serve.yaml"))
    cfg.run_dir, cfg.tokenizer = str(tmp_path / "run"), str(ROOT / "edge" / "assets" / "tiny-ee" / "tokenizer.json")
    cfg.context_window = 512  # no bundle here
    cfg.policies = ["fixed", "aimd"]  # the demo preset runs one; both here: the first heads the summary
    seen = {}

    def served(c, schedule, cap):
        seen["schedule"], seen["capacity"] = schedule, cap
        # three repeats per system and level; the machine's CPU seconds per run: more through the stack
        scales = {"inprocess": (1.0, 1.0), "triton_direct": (1.5, 1.2), "served": (2.0, 2.0), "served_exact": (1.0, 2.0)}
        runs = {name: {k: [Run(_fake_runs(cap)(scale), cpu) for _ in range(3)] for k in c.capacity_concurrency}
                for name, (scale, cpu) in scales.items()}
        return ({p: _fake_runs(schedule)(2.0 if p == "fixed" else 1.5) for p in c.policies}, runs,
                {"dashboard_skipped": "no browser (fake)"})

    monkeypatch.setattr(serve_stage, "served_runs", served)
    monkeypatch.setattr(serve_stage, "inprocess_run", lambda c, schedule: _fake_runs(schedule)(1.0))
    assert serve_stage.main(cfg) == 0
    out = tmp_path / "run" / "bench"
    rep = json.loads((out / "serve.json").read_text())
    head = rep["serve_bench"]
    for key in ("requests", "errors", "ttft_p95_ms", "tpot_p95_ms", "sla_attainment", "goodput_rps", "tokens_per_s",
                "served_vs_inprocess_tokens_ratio", "policies", "workload_source"):
        assert key in head, key
    assert head["policy"] == "fixed" and set(head["policies"]) == {"fixed", "aimd"}
    assert head["dashboard_skipped"] == "no browser (fake)" and "dashboard_png" not in head
    assert head["requests"] == len(seen["schedule"]) and head["errors"] == 0
    assert head["served_vs_inprocess_tokens_ratio"] < 1.0 and head["ttft_p50_overhead_ms"] == pytest.approx(50.0)
    assert set(rep["runs"]) == {"fixed", "aimd", INPROCESS}
    assert rep["comparison"]["fixed"]["same_output_lengths"] == 1.0
    # the price of serving comes from the closed-loop runs: fixed lengths, every system, each concurrency,
    # medians over the repeats, comparisons paired within a repeat
    cap = rep["capacity"]
    assert set(cap["levels"]) == {str(c) for c in cfg.capacity_concurrency}
    assert all(len(r.prompt_ids) == cfg.capacity_prompt_tokens and r.max_tokens == cfg.capacity_max_tokens
               for r in seen["capacity"])
    assert head["served_vs_inprocess_concurrency"] == max(cfg.capacity_concurrency)
    assert head["capacity_repeats"] == 3
    assert head["served_vs_inprocess_tokens_ratio"] == pytest.approx(0.5, rel=0.02)  # twice as long per request
    assert head["served_vs_inprocess_tokens_ratio_c1"] == pytest.approx(0.5, rel=0.02)
    assert head["spread"]["ttft_p50_overhead_ms"] == {"median": pytest.approx(50.0), "min": pytest.approx(50.0),
                                                      "max": pytest.approx(50.0)}
    tokens = sum(r.tokens for r in _fake_runs(seen["capacity"])(1.0))
    assert head["serving_cpu_ms_per_token"] == pytest.approx(1e3 * (2.0 - 1.0) / tokens)
    assert head["exact_vs_bounded_tokens_ratio"] == pytest.approx(2.0, rel=0.02)
    assert cap["levels"]["1"]["triton_direct"]["ttft_p50_ms"] == pytest.approx(75.0)
    md = (out / "serve.md").read_text()
    assert "The price of serving" in md and "Paired with the in-process run" in md and "| 1 | triton_direct |" in md
    assert all(len(r.prompt_ids) + r.max_tokens <= 512 for r in seen["schedule"])
    for png in ("serve_latency_cdf.png", "serve_throughput.png"):
        assert (out / png).read_bytes()[:8] == PNG
    md = (out / "serve.md").read_text()
    assert md.startswith("# Serving benchmark") and "| fixed |" in md and "| in-process |" in md
    assert rep["workload"]["source"] in md
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    stage = manifest["stages"]["bench_serve"]
    assert set(stage["outputs"]) == {"json", "md", "latency_cdf_png", "throughput_png"}
    assert stage["metrics"]["requests"] == head["requests"] and stage["config"]["api_key"] is None


def test_report_says_when_arrivals_are_synthetic(tmp_path, monkeypatch):
    monkeypatch.setattr("scheduler.control.workload.SHARED_TRACE", tmp_path / "absent.csv")
    monkeypatch.setattr(bench_serve_inputs, "SHARED_TRACE", tmp_path / "absent.csv")
    cfg = BenchServeConfig(run_dir=str(tmp_path / "r"), duration_s=5.0, rate_rps=3.0, inprocess=False, context_window=256,
                           tokenizer=str(ROOT / "edge" / "assets" / "tiny-ee" / "tokenizer.json"))
    schedule, w = bench_serve_inputs.make_schedule(cfg)
    workload = bench_serve_report.describe_workload(cfg, w, schedule, 256)
    assert workload["synthetic"] and "no trace at" in workload["source"]
    rep = bench_serve_report.build_report(cfg, workload, {"fixed": _fake_runs(schedule)(1.0)})
    assert rep["serve_bench"]["served_vs_inprocess_tokens_ratio"] is None
    assert any("synthetic" in n for n in rep["notes"]) and "synthetic" in render_markdown(rep)


def test_plots_write_pngs(tmp_path):
    runs = {"a": [_done(i, 0.1 * i, 0.05, 0.01, 6) for i in range(20)], "b": [_failed(0, 0.0, "http_503")]}
    plot_latency_cdf(runs, tmp_path / "cdf.png", 500.0, 50.0)
    plot_throughput(runs, tmp_path / "tput.png")
    assert (tmp_path / "cdf.png").read_bytes()[:8] == PNG and (tmp_path / "tput.png").read_bytes()[:8] == PNG
    assert not list(tmp_path.glob(".*.tmp"))


@pytest.mark.parametrize("kv,msg", [
    ({"arrivals": "uniform"}, "arrivals must be one of"),
    ({"mode": "fast"}, "mode must be one of"),
    ({"duration_s": None, "max_requests": None}, "set duration_s or max_requests"),
    ({"policies": []}, "policies is empty"),
    ({"sla_tpot_ms": 0}, "must be > 0"),
])
def test_config_errors(kv, msg):
    from edge.core.errors import ConfigError

    with pytest.raises(ConfigError, match=msg):
        apply(BenchServeConfig(), kv)


def test_a_failed_warmup_stops_the_stage():
    import asyncio

    from edge.core.errors import SmartExitError
    from scheduler.loadtest.loadgen import ScheduledRequest

    async def refusing(req):
        return _failed(0, 0.0, "http_404")

    with pytest.raises(SmartExitError, match="warm-up request to http://x failed \\(http_404\\)"):
        asyncio.run(bench_serve_runs.warm_then_run(refusing, [ScheduledRequest(0.0, [1], 2, "a")], 1, "http://x"))
