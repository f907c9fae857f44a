"""Workloads: the shared Azure trace where it exists, synthetic arrivals otherwise (Poisson, bursty, diurnal;
lognormal or mixed lengths); any CSV / JSONL workload file, whose bad input fails naming file, line and field;
rate scaling and length clipping."""
import numpy as np
import pytest

from edge.core.errors import ConfigError
from scheduler.control.workload import (SHARED_TRACE, Arrivals, LengthMix, Lengths, Workload, clip_lengths, load_workload,
                                rate_of, read_trace, read_workload_file, scale_rate, synthetic)


def test_project_carries_no_trace_copy():
    from pathlib import Path
    root = Path(__file__).resolve().parents[4]
    copies = [p for p in root.rglob("*azure*") if ".venv" not in p.parts and "artifacts" not in p.parts]
    assert copies == [], f"another repository's data must be read from ../shared, not copied: {copies}"


@pytest.mark.skipif(not SHARED_TRACE.is_file(), reason=f"shared trace absent ({SHARED_TRACE})")
def test_reads_shared_azure_trace():
    w = load_workload(n=500)
    assert w.source.startswith("trace ") and len(w) == 500
    assert w.arrival_s[0] == 0 and np.all(np.diff(w.arrival_s) >= 0)
    assert w.prompt_tokens.min() >= 1 and w.output_tokens.min() >= 1


def test_falls_back_to_synthetic_and_says_so(monkeypatch, tmp_path):
    monkeypatch.setattr("scheduler.control.workload.SHARED_TRACE", tmp_path / "absent.csv")
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


# --- diurnal arrivals ------------------------------------------------------------------------------

def test_default_synthetic_draws_what_it_always_drew():
    """The default path (Poisson, lognormal lengths) is the pre-diurnal code, seed for seed."""
    rng = np.random.default_rng(3)
    gaps = rng.exponential(1.0 / 2.0, 50)
    sigma = 0.8
    lengths = lambda mean: np.maximum(1, rng.lognormal(np.log(mean) - sigma ** 2 / 2, sigma, 50)).astype(np.int64)
    prompts, outputs = lengths(256.0), lengths(64.0)
    w = synthetic(50, 2.0, seed=3)
    np.testing.assert_array_equal(w.arrival_s, np.concatenate([[0.0], np.cumsum(gaps[1:])]))
    np.testing.assert_array_equal(w.prompt_tokens, prompts)
    np.testing.assert_array_equal(w.output_tokens, outputs)


def test_diurnal_is_seeded():
    a, b = synthetic(500, 5.0, Arrivals.DIURNAL, seed=4), synthetic(500, 5.0, "diurnal", seed=4)
    np.testing.assert_array_equal(a.arrival_s, b.arrival_s)
    np.testing.assert_array_equal(a.prompt_tokens, b.prompt_tokens)
    assert not np.array_equal(a.arrival_s, synthetic(500, 5.0, Arrivals.DIURNAL, seed=5).arrival_s)
    assert a.arrival_s[0] == 0 and np.all(np.diff(a.arrival_s) >= 0) and len(a) == 500


def _whole_periods(w, period_s):
    """Arrivals in the whole periods the workload covers (the rate's mean over a whole period is exact)."""
    k = int(w.arrival_s[-1] // period_s)
    t = w.arrival_s[w.arrival_s < k * period_s]
    return t, k * period_s


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_diurnal_mean_rate(seed):
    w = synthetic(4000, rate=5.0, kind=Arrivals.DIURNAL, seed=seed, period_s=120.0, amplitude=0.6)
    t, span = _whole_periods(w, 120.0)
    # Over whole periods the count is Poisson with mean rate * span (~3600): sd = sqrt(mean), 1.7 %
    # relative; 4 sd. (The first arrival is shifted to 0, a ~0.1 s shift of a 720 s span: negligible.)
    expected = 5.0 * span
    assert abs(len(t) - expected) < 4 * np.sqrt(expected), (len(t), expected)


@pytest.mark.parametrize("amplitude", [0.0, 0.6, 0.9])
def test_diurnal_follows_the_sine(amplitude):
    """The share of arrivals in the half-cycle where sin > 0 is (pi + 2 A) / (2 pi)."""
    w = synthetic(4000, rate=5.0, kind=Arrivals.DIURNAL, seed=7, period_s=60.0, amplitude=amplitude)
    t, _ = _whole_periods(w, 60.0)
    share = np.mean((t % 60.0) < 30.0)
    expected = (np.pi + 2 * amplitude) / (2 * np.pi)
    # binomial over ~3600 arrivals: sd <= sqrt(0.25 / 3600) = 0.0083; 4 sd
    assert abs(share - expected) < 4 * np.sqrt(expected * (1 - expected) / len(t)), (share, expected)


@pytest.mark.parametrize("kw", [{"amplitude": 1.0}, {"amplitude": -0.1}, {"period_s": 0.0}])
def test_diurnal_bad_parameters(kw):
    with pytest.raises(ConfigError, match="diurnal arrivals need"):
        synthetic(10, 1.0, Arrivals.DIURNAL, **kw)


# --- mixed lengths --------------------------------------------------------------------------------

def test_mixed_lengths_means_and_classes():
    mix = LengthMix()
    w = synthetic(20000, 5.0, seed=3, lengths=Lengths.MIXED, mix=mix)
    s = mix.short_share
    for got, short_mean, long_mean in ((w.prompt_tokens, mix.short_prompt_mean, mix.long_prompt_mean),
                                       (w.output_tokens, mix.short_output_mean, mix.long_output_mean)):
        mean = s * short_mean + (1 - s) * long_mean
        # lognormal sigma 0.8: E[X^2] = mean^2 exp(sigma^2) per class; the mixture's sd over 20000 draws
        # gives the standard error; 4 of them, plus 1 token for the floor to whole tokens
        ex2 = np.exp(0.64) * (s * short_mean ** 2 + (1 - s) * long_mean ** 2)
        se = np.sqrt((ex2 - mean ** 2) / len(w))
        assert abs(got.mean() - mean) < 4 * se + 1, (got.mean(), mean, se)
    # a class ties long prompts to short outputs; independent lognormals do not
    corr = lambda w: np.corrcoef(np.log(w.prompt_tokens), np.log(w.output_tokens))[0, 1]
    assert corr(w) < -0.3 and abs(corr(synthetic(20000, 5.0, seed=3))) < 0.05
    again = synthetic(20000, 5.0, seed=3, lengths="mixed", mix=mix)
    np.testing.assert_array_equal(w.prompt_tokens, again.prompt_tokens)
    np.testing.assert_array_equal(w.arrival_s, synthetic(20000, 5.0, seed=3).arrival_s)   # lengths only


def test_mixed_lengths_configurable():
    w = synthetic(2000, 5.0, lengths=Lengths.MIXED, mix=LengthMix(short_share=1.0, short_prompt_mean=10.0))
    assert w.prompt_tokens.mean() < 15 and w.prompt_tokens.min() >= 1 and w.output_tokens.min() >= 1


@pytest.mark.parametrize("kw, field", [({"short_share": 1.5}, "short_share"),
                                       ({"long_prompt_mean": 0.0}, "long_prompt_mean")])
def test_length_mix_validates(kw, field):
    with pytest.raises(ConfigError, match=field):
        LengthMix(**kw)


# --- workload files -------------------------------------------------------------------------------

def _write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_reads_simple_csv_and_jsonl(tmp_path):
    csv_ = _write(tmp_path, "w.csv", "arrival_s,prompt_tokens,output_tokens,note\n2.5,10,3,a\n3,20,4,b\n3,5,1,c\n")
    jsonl = _write(tmp_path, "w.jsonl", '{"arrival_s": 2.5, "prompt_tokens": 10, "output_tokens": 3}\n\n'
                   '{"arrival_s": 3, "prompt_tokens": 20.0, "output_tokens": 4, "x": null}\n'
                   '{"arrival_s": 3, "prompt_tokens": 5, "output_tokens": 1}\n')
    for p in (csv_, jsonl):
        w = read_workload_file(p)
        np.testing.assert_array_equal(w.arrival_s, [0.0, 0.5, 0.5])
        np.testing.assert_array_equal(w.prompt_tokens, [10, 20, 5])
        np.testing.assert_array_equal(w.output_tokens, [3, 4, 1])
        assert w.source == f"trace {p}"
    assert len(read_workload_file(csv_, limit=2)) == 2


def test_reads_azure_columns_in_csv_and_jsonl(tmp_path):
    rows = [("2023-11-16 18:17:04.0319600", 3180, 8), ("2023-11-16 18:17:03.9799600", 4808, 10)]
    csv_ = _write(tmp_path, "a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
                  + "".join(f"{t},{p},{o}\n" for t, p, o in rows))
    jsonl = _write(tmp_path, "a.jsonl", "".join(
        f'{{"TIMESTAMP": "{t}", "ContextTokens": {p}, "GeneratedTokens": {o}}}\n' for t, p, o in rows))
    ref = read_trace(csv_)
    for p in (csv_, jsonl):
        w = read_workload_file(p)   # TIMESTAMP rows are sorted, as read_trace does
        np.testing.assert_allclose(w.arrival_s, ref.arrival_s)
        np.testing.assert_array_equal(w.prompt_tokens, [4808, 3180])
        np.testing.assert_array_equal(w.output_tokens, ref.output_tokens)


@pytest.mark.skipif(not SHARED_TRACE.is_file(), reason=f"shared trace absent ({SHARED_TRACE})")
def test_file_reader_agrees_with_read_trace_on_the_shared_trace():
    a, b = read_workload_file(SHARED_TRACE, limit=3000), read_trace(SHARED_TRACE, limit=3000)
    for f in ("arrival_s", "prompt_tokens", "output_tokens", "source"):
        np.testing.assert_array_equal(getattr(a, f), getattr(b, f))


def test_load_workload_reads_a_named_simple_file(tmp_path):
    p = _write(tmp_path, "w.csv", "arrival_s,prompt_tokens,output_tokens\n0,10,3\n1,20,4\n")
    w = load_workload(trace=p)
    assert w.source == f"trace {p}" and len(w) == 2


HEADER = "arrival_s,prompt_tokens,output_tokens\n"
BAD_FILES = [
    # (name, text, expected message: file, line, field, what)
    ("e.csv", "", r"e\.csv: empty file"),
    ("e.jsonl", "\n  \n", r"e\.jsonl: empty file"),
    ("h.csv", HEADER, r"h\.csv: no requests"),
    ("m.csv", "arrival_s,prompt_tokens\n0,1\n", r"m\.csv, header \(line 1\): missing 'output_tokens' / 'GeneratedTokens'"),
    ("m.jsonl", '{"arrival_s": 0, "output_tokens": 1}\n', r"m\.jsonl, line 1: missing 'prompt_tokens' / 'ContextTokens'"),
    ("m2.jsonl", '{"arrival_s": 0, "prompt_tokens": 1, "output_tokens": 1}\n{"arrival_s": 1, "prompt_tokens": 1}\n',
     r"m2\.jsonl, line 2: missing field 'output_tokens'"),
    ("c.csv", HEADER + "0,5,1\n1,,2\n", r"c\.csv, line 3, field 'prompt_tokens': no value"),
    ("s.csv", HEADER + "0,5\n", r"s\.csv, line 2, field 'output_tokens': no value"),
    ("n.csv", HEADER + "0,-3,1\n", r"n\.csv, line 2, field 'prompt_tokens': token counts must be >= 1, got '-3'"),
    ("z.jsonl", '{"arrival_s": 0, "prompt_tokens": 4, "output_tokens": 0}\n',
     r"z\.jsonl, line 1, field 'output_tokens': token counts must be >= 1, got 0"),
    ("x.csv", HEADER + "0,ten,1\n", r"x\.csv, line 2, field 'prompt_tokens': expected a whole number of tokens, got 'ten'"),
    ("f.jsonl", '{"arrival_s": 0, "prompt_tokens": 4.5, "output_tokens": 1}\n',
     r"f\.jsonl, line 1, field 'prompt_tokens': expected a whole number of tokens, got 4.5"),
    ("b.jsonl", '{"arrival_s": 0, "prompt_tokens": true, "output_tokens": 1}\n',
     r"b\.jsonl, line 1, field 'prompt_tokens': expected a whole number of tokens, got True"),
    ("a.csv", HEADER + "-1,5,1\n", r"a\.csv, line 2, field 'arrival_s': arrival times must be >= 0, got '-1'"),
    ("a.jsonl", '{"arrival_s": "soon", "prompt_tokens": 4, "output_tokens": 1}\n',
     r"a\.jsonl, line 1, field 'arrival_s': expected seconds \(a number\), got 'soon'"),
    ("i.csv", HEADER + "nan,5,1\n", r"i\.csv, line 2, field 'arrival_s': expected a finite number of seconds"),
    ("d.csv", HEADER + "0,5,1\n2,5,1\n1,5,1\n",
     r"d\.csv, line 4, field 'arrival_s': arrival times must not decrease, got 1.0 after 2.0 \(line 3\)"),
    ("t.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,5,1\n",
     r"t\.csv, line 2, field 'TIMESTAMP': expected a datetime"),
    ("j.jsonl", '{"arrival_s": 0, "prompt_tokens": 4, "output_tokens": 1}\n{"arrival_s": 1,\n',
     r"j\.jsonl, line 2: expected one JSON object per line \(JSONL\), got invalid JSON"),
    ("l.json", '[{"arrival_s": 0, "prompt_tokens": 4, "output_tokens": 1}]\n',
     r"l\.json, line 1: expected one JSON object per line \(JSONL\), got a list"),
]


@pytest.mark.parametrize("name, text, message", BAD_FILES, ids=[b[0] for b in BAD_FILES])
def test_bad_workload_file_says_where(tmp_path, name, text, message):
    p = _write(tmp_path, name, text)
    with pytest.raises(ConfigError, match=rf"^workload .*{message}"):
        read_workload_file(p)


def test_workload_file_missing(tmp_path):
    with pytest.raises(ConfigError, match=r"nope\.jsonl: no such file"):
        read_workload_file(tmp_path / "nope.jsonl")


# --- load sweeps and context windows --------------------------------------------------------------

def test_scale_rate_compresses_time():
    w = synthetic(1000, 2.0, Arrivals.BURSTY, seed=1)
    for factor in (0.5, 2, 8.0):
        s = scale_rate(w, factor)
        np.testing.assert_allclose(s.arrival_s * factor, w.arrival_s, rtol=1e-12)   # one division
        np.testing.assert_array_equal(s.prompt_tokens, w.prompt_tokens)
        assert rate_of(s) == pytest.approx(factor * rate_of(w), rel=1e-12)
        assert f"rate x{factor:g}" in s.source


def test_rate_of():
    one = np.ones(3, np.int64)
    assert rate_of(Workload(np.array([0.0, 1.0, 4.0]), one, one, "t")) == 0.5
    for t in ([0.0], [0.0, 0.0]):
        with pytest.raises(ConfigError, match="two or more requests"):
            rate_of(Workload(np.array(t), one[: len(t)], one[: len(t)], "t"))


@pytest.mark.parametrize("factor", [0, -1.0, float("inf"), float("nan"), "2", True])
def test_scale_rate_bad_factor(factor):
    with pytest.raises(ConfigError, match="factor must be a finite number > 0"):
        scale_rate(synthetic(5, 1.0), factor)


def test_clip_lengths():
    w = Workload(np.array([0.0, 1.0, 2.0]), np.array([1, 50, 900]), np.array([300, 2, 7]), "t")
    c = clip_lengths(w, max_prompt=100, max_output=5)
    np.testing.assert_array_equal(c.prompt_tokens, [1, 50, 100])
    np.testing.assert_array_equal(c.output_tokens, [5, 2, 5])
    np.testing.assert_array_equal(c.arrival_s, w.arrival_s)
    assert "clipped to 100 + 5 tokens" in c.source
    for bad in ({"max_prompt": 0, "max_output": 5}, {"max_prompt": 10, "max_output": 2.5}):
        with pytest.raises(ConfigError, match="must be a whole number >= 1"):
            clip_lengths(w, **bad)
