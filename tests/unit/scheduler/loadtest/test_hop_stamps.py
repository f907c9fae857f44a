"""The TTFT breakdown of bench serve (scheduler/loadtest/hop_stamps.py): requests cut from the stamps by their
client_send inside the served runs' spans, hops that add up to the client's TTFT, nothing made up where stamps
are missing."""
from __future__ import annotations

import pytest

from scheduler.loadtest.hop_stamps import ENGINE, breakdown, breakdown_markdown, read_stamps, requests_in
from scheduler.serving.stamps import POINTS


def _request(t0: float, gaps: list[float]) -> list[tuple[float, str]]:
    """One request's stamps from ``t0``, ``gaps`` (ms) between consecutive points."""
    out, t = [(t0, POINTS[0])], t0
    for point, gap in zip(POINTS[1:], gaps):
        t += gap
        out.append((t, point))
    return out


GAPS_A = [1.0, 0.2, 0.3, 14.0, 0.4, 0.3, 0.2, 0.5]
GAPS_B = [3.0, 0.4, 0.5, 16.0, 0.6, 0.5, 0.4, 0.7]


def test_hops_are_cut_per_request_and_add_up_to_the_ttft():
    stamps = sorted(_request(100.0, GAPS_A) + _request(200.0, GAPS_B)
                    + _request(500.0, GAPS_B)   # outside the spans: another system's run
                    + _request(300.0, GAPS_A)[:-1])  # no first token: left out
    reqs = requests_in(stamps, [(90.0, 400.0)])
    assert len(reqs) == 2
    b = breakdown(stamps, [(90.0, 400.0)])
    assert b["requests"] == 2 and [(h["from"], h["to"]) for h in b["hops"]] == list(zip(POINTS, POINTS[1:]))
    medians = [h["median_ms"] for h in b["hops"]]
    assert medians == pytest.approx([(a + c) / 2 for a, c in zip(GAPS_A, GAPS_B)])
    assert b["ttft"]["median_ms"] == pytest.approx((sum(GAPS_A) + sum(GAPS_B)) / 2)
    engine = POINTS.index(ENGINE[0])
    assert b["serving_hops"]["median_ms"] == pytest.approx(
        (sum(GAPS_A) - GAPS_A[engine] + sum(GAPS_B) - GAPS_B[engine]) / 2)
    md = "\n".join(breakdown_markdown(b, 13.5))
    assert "in process, same runs' repeats: 13.50 ms" in md and "| TTFT at the client |" in md


def test_no_breakdown_without_a_request_stamped_by_every_process():
    """A server this process did not start stamps nothing: only the client's points, no breakdown."""
    client_only = [(100.0, "client_send"), (120.0, "client_first")]
    assert breakdown(client_only, [(0.0, 1e9)]) is None
    assert breakdown_markdown(None, 10.0) == []


def test_reading_skips_torn_lines_and_unknown_points(tmp_path):
    (tmp_path / "1.tsv").write_text("client_send\tr\t5.0\nclient_first\tr\t9.5\nclient_fir")
    (tmp_path / "2.tsv").write_text("ingress_in\t\t6.0\nsomething_else\t\t7.0\ningress_first\t\tnot-a-time\n")
    assert read_stamps(tmp_path) == [(5.0, "client_send"), (6.0, "ingress_in"), (9.5, "client_first")]


def test_bench_serve_reports_the_hops_of_its_served_runs_at_concurrency_1(tmp_path):
    """capacity_section reads the stack's stamps for the served runs' spans at concurrency 1 only: serve.json's
    capacity.ttft_hops, the headline's serving hops and engine share beside the in-process TTFT, the report's line
    and serve.md's table."""
    from edge.pipeline.report_serving_md import _hops
    from scheduler.control.outcomes import RequestResult
    from scheduler.loadtest.bench_serve_capacity import capacity_section, stamps_dir
    from scheduler.loadtest.bench_serve_config import BenchServeConfig
    from scheduler.loadtest.capacity import Run, capacity_markdown

    def run(ttft_s: float, span=None) -> Run:
        res = [RequestResult(f"r{i}", 0.0, 8, 4, t_submit=0.0, t_first_token=ttft_s, t_end=ttft_s + 0.03, tokens=4,
                             token_times=[ttft_s + 0.01 * k for k in range(4)], finish_reason="length")
               for i in range(2)]
        return Run(res, 1.0, span)

    cfg = BenchServeConfig(run_dir=str(tmp_path), capacity_concurrency=[1, 8])
    folder = stamps_dir(cfg)
    folder.mkdir(parents=True)
    stamps = _request(100.0, GAPS_A) + _request(200.0, GAPS_B) + _request(1000.0, GAPS_B)  # the last: at c8
    (folder / "1.tsv").write_text("".join(f"{p}\t\t{t}\n" for t, p in stamps))
    cap = {"inprocess": {1: [run(0.0135)], 8: [run(0.05)]},
           "served": {1: [run(0.018, (90.0, 400.0))], 8: [run(0.06, (900.0, 1100.0))]}}
    rep = capacity_section(cfg, cap)
    assert rep["ttft_hops"]["requests"] == 2
    head = rep["headline"]
    assert head["ttft_engine_served_ms"] == pytest.approx(15.0) and head["inprocess_ttft_p50_c1_ms"] == pytest.approx(13.5)
    assert head["ttft_serving_hops_ms"] == pytest.approx(rep["ttft_hops"]["serving_hops"]["median_ms"])
    assert "the stack's hops" in _hops(head) and "15.0 ms served against 13.5 ms in process" in _hops(head)
    assert "| TTFT at the client |" in capacity_markdown(rep)
    assert _hops({}) == ""
