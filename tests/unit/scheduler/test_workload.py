"""Workloads: the shared Azure trace where it exists, synthetic arrivals otherwise; bad traces fail clearly."""
import numpy as np
import pytest

from edge.core.errors import ConfigError
from scheduler.workload import SHARED_TRACE, Arrivals, load_workload, read_trace, synthetic


def test_project_carries_no_trace_copy():
    from pathlib import Path
    root = Path(__file__).resolve().parents[3]
    copies = [p for p in root.rglob("*azure*") if ".venv" not in p.parts and "artifacts" not in p.parts]
    assert copies == [], f"another repository's data must be read from ../shared, not copied: {copies}"


@pytest.mark.skipif(not SHARED_TRACE.is_file(), reason=f"shared trace absent ({SHARED_TRACE})")
def test_reads_shared_azure_trace():
    w = load_workload(n=500)
    assert w.source.startswith("trace ") and len(w) == 500
    assert w.arrival_s[0] == 0 and np.all(np.diff(w.arrival_s) >= 0)
    assert w.prompt_tokens.min() >= 1 and w.output_tokens.min() >= 1


def test_falls_back_to_synthetic_and_says_so(monkeypatch, tmp_path):
    monkeypatch.setattr("scheduler.workload.SHARED_TRACE", tmp_path / "absent.csv")
    w = load_workload(n=200, rate=5.0)
    assert "synthetic poisson" in w.source and "no trace at" in w.source
    assert len(w) == 200


@pytest.mark.parametrize("kind", list(Arrivals))
def test_synthetic_mean_rate(kind):
    w = synthetic(4000, rate=5.0, kind=kind, seed=1)
    rate = (len(w) - 1) / w.arrival_s[-1]
    assert 4.0 < rate < 6.0, rate   # long-run mean rate within 20% over 4000 arrivals


def test_bursty_is_burstier_than_poisson():
    cv = lambda w: np.std(np.diff(w.arrival_s)) / np.mean(np.diff(w.arrival_s))
    assert cv(synthetic(4000, 5.0, Arrivals.BURSTY, seed=2)) > 1.2 * cv(synthetic(4000, 5.0, Arrivals.POISSON, seed=2))


def test_named_trace_missing_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_workload(trace=tmp_path / "nope.csv")


def test_malformed_trace_names_the_line(tmp_path):
    p = tmp_path / "t.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.97996,10,2\n2023-11-16 18:17:04,x,3\n")
    with pytest.raises(ConfigError, match="line 3"):
        read_trace(p)
    p.write_text("TIMESTAMP,Prompt\n")
    with pytest.raises(ConfigError, match="missing column"):
        read_trace(p)
