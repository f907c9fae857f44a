"""The report's pipeline time: each stage's seconds, their sum, and the run's span against the demo's budget."""
from __future__ import annotations

import json

from edge.pipeline.report import build, render_markdown, summary_lines
from edge.pipeline.report_sections import DEMO_BUDGET_S


def _run(tmp_path, stages):
    (tmp_path / "manifest.json").write_text(json.dumps({"run": "t", "stages": stages}))
    return build(tmp_path)


def test_the_span_runs_from_the_first_start_to_the_last_end(tmp_path):
    # repo ends at 10:00:30 after 20 s (started 10:00:10); profile ends at 10:05:00 after 250 s (started 10:00:50)
    rep = _run(tmp_path, {"repo": {"time": "2026-12-07T10:00:30Z", "seconds": 20.0},
                          "profile": {"time": "2026-12-07T10:05:00Z", "seconds": 250.0}})
    t = rep["stages"]
    assert list(t["seconds"]) == ["repo", "profile"] and t["sum_s"] == 270.0
    assert t["span_s"] == 290.0  # 10:00:10 to 10:05:00: the 20 s between the stages counted
    assert t["demo_budget_s"] == DEMO_BUDGET_S == 900.0
    md = render_markdown(rep)
    assert "## Pipeline time" in md and "| repo | 20 |" in md and "| profile | 250 |" in md
    assert "270 s (4:30)" in md and "290 s (4:50)" in md and "32% of it" in md
    assert any(line.startswith("time: stages 270 s, first start to last end 290 s") for line in summary_lines(rep))


def test_a_stage_without_its_end_time_counts_in_the_sum_only(tmp_path):
    rep = _run(tmp_path, {"repo": {"seconds": 5.0}, "profile": {"time": "2026-12-07T10:05:00Z", "seconds": 60.0}})
    assert rep["stages"]["sum_s"] == 65.0 and rep["stages"]["span_s"] == 60.0
    rep = _run(tmp_path, {"repo": {"seconds": 5.0}})
    assert rep["stages"]["span_s"] is None
    assert "The stages took 5 s (0:05); `make demo`" in render_markdown(rep)


def test_no_stage_no_section(tmp_path):
    rep = _run(tmp_path, {})
    assert "stages" not in rep and "Pipeline time" not in render_markdown(rep)


def test_a_stage_the_manifest_records_is_read_back(tmp_path):
    from edge.core.artifacts import Manifest

    Manifest(tmp_path).record("repo", inputs={}, config={}, outputs={}, metrics={}, seconds=3.0)
    t = build(tmp_path)["stages"]
    assert t["seconds"] == {"repo": 3.0} and t["span_s"] == 3.0  # the time it wrote parses with the same format
