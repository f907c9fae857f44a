"""llama.cpp's decode and prefill speed (edge/pipeline/bench/llamacpp_bench.py, the timed loop of
llamacpp_timing.py, the same-precision GGUF of llamacpp_gguf.py): timing arithmetic with a fake clock, command
lines, llama-bench's JSON and the precision mapping everywhere; the real peer and the real llama-bench
where `make llamacpp` has built them."""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import types
from pathlib import Path

import pytest

import edge.core.device
from edge.compress.quant import Precision
from edge.core.errors import ConfigError, MissingExtraError, SmartExitError
from edge.model.bundled import BUNDLED_EE_DIR
from edge.pipeline.bench import llamacpp as lc
from edge.pipeline.bench import llamacpp_bench as lb
from edge.pipeline.bench import llamacpp_gguf as gg
from edge.pipeline.bench import llamacpp_peer as lp
from edge.pipeline.bench import llamacpp_timing as lt

REASON = lc.available()
BENCH_REASON = lb.llama_bench_unavailable()
needs_llamacpp = pytest.mark.skipif(REASON is not None, reason=REASON or "")
needs_llama_bench = pytest.mark.skipif(BENCH_REASON is not None, reason=BENCH_REASON or "")

# Recorded from the llama-bench of llama-cpp-python 0.3.36's vendored llama.cpp (built by
# build_llama_bench) on the f32 GGUF of a 10M-parameter distilled model, on 2 cores that other jobs were
# also using (hence the spread): llama-bench -m F -p 64 -n 0 -d 0 -t 2 -r 3 -fa off -o json, then
# -p 0 -n 31 -d 64 (one test each)
PREFILL_JSON = """[
  {
    "build_commit": "0c1e570",
    "build_number": 1,
    "cpu_info": "AMD EPYC",
    "gpu_info": "",
    "backends": "CPU",
    "model_filename": "artifacts/c0/llamacpp/d2e1456e8fe7f00d-llama-cpp-python-0.3.36-f32.gguf",
    "model_type": "llama ?B all F32",
    "model_size": 41968640,
    "model_n_params": 10492160,
    "n_batch": 2048,
    "n_ubatch": 512,
    "n_threads": 2,
    "cpu_mask": "0x0",
    "cpu_strict": false,
    "poll": 50,
    "type_k": "f16",
    "type_v": "f16",
    "n_gpu_layers": -1,
    "n_cpu_moe": 0,
    "split_mode": "layer",
    "main_gpu": 0,
    "no_kv_offload": false,
    "flash_attn": 0,
    "devices": "auto",
    "tensor_split": "0.00",
    "tensor_buft_overrides": "none",
    "load_mode": "auto",
    "lazy_mode": "auto",
    "embeddings": false,
    "no_op_offload": 0,
    "no_host": false,
    "repack": true,
    "fit_target": 0,
    "fit_min_ctx": 0,
    "n_prompt": 64,
    "n_gen": 0,
    "n_depth": 0,
    "test_time": "2026-12-02T06:51:15Z",
    "avg_ns": 882845355,
    "stddev_ns": 1043470137,
    "avg_ts": 198.519459,
    "stddev_ts": 193.472414,
    "samples_ns": [ 414007638, 156028903, 2078499525 ],
    "samples_ts": [ 154.587, 410.18, 30.7914 ]
  }
]
"""
DECODE_JSON = """[
  {
    "build_commit": "0c1e570",
    "build_number": 1,
    "cpu_info": "AMD EPYC",
    "gpu_info": "",
    "backends": "CPU",
    "model_filename": "artifacts/c0/llamacpp/d2e1456e8fe7f00d-llama-cpp-python-0.3.36-f32.gguf",
    "model_type": "llama ?B all F32",
    "model_size": 41968640,
    "model_n_params": 10492160,
    "n_batch": 2048,
    "n_ubatch": 512,
    "n_threads": 2,
    "cpu_mask": "0x0",
    "cpu_strict": false,
    "poll": 50,
    "type_k": "f16",
    "type_v": "f16",
    "n_gpu_layers": -1,
    "n_cpu_moe": 0,
    "split_mode": "layer",
    "main_gpu": 0,
    "no_kv_offload": false,
    "flash_attn": 0,
    "devices": "auto",
    "tensor_split": "0.00",
    "tensor_buft_overrides": "none",
    "load_mode": "auto",
    "lazy_mode": "auto",
    "embeddings": false,
    "no_op_offload": 0,
    "no_host": false,
    "repack": true,
    "fit_target": 0,
    "fit_min_ctx": 0,
    "n_prompt": 0,
    "n_gen": 31,
    "n_depth": 64,
    "test_time": "2026-12-02T06:51:18Z",
    "avg_ns": 1021810034,
    "stddev_ns": 331840205,
    "avg_ts": 33.005911,
    "stddev_ts": 12.437111,
    "samples_ns": [ 657685097, 1307205433, 1100539572 ],
    "samples_ts": [ 47.135, 23.7147, 28.168 ]
  }
]
"""


# ------------------------------------------------------------------ pure: the timed greedy loop
class FakeClock:
    """perf_counter stand-in that only moves when the fake llama.cpp works."""

    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def fake_model(clock: FakeClock, per_call: float, per_token: float, sample_cost: float, choices):
    """decode(ids) costs per_call + per_token * len(ids) seconds; sample() costs sample_cost."""
    calls: list[list[int]] = []
    it = iter(choices)

    def decode(ids):
        calls.append(list(ids))
        clock.t += per_call + per_token * len(ids)

    def sample():
        clock.t += sample_cost
        return next(it)

    return decode, sample, calls


def test_greedy_loop_feeds_back_each_token_and_stamps_after_each_choice():
    clock = FakeClock()
    decode, sample, calls = fake_model(clock, 0.5, 0.25, 0.125, [7, 8, 9, 10])
    tokens, stamps = lt.greedy_stamps(decode, sample, [1, 2, 3, 4], 4, clock)
    assert tokens == [7, 8, 9, 10] and calls == [[1, 2, 3, 4], [7], [8], [9]]
    # prefill: 0.5 + 4 * 0.25 + 0.125; each decode step: 0.5 + 0.25 + 0.125 (binary fractions: exact)
    assert stamps == [100.0, 101.625, 102.5, 103.375, 104.25]


def test_prefill_and_decode_are_timed_apart():
    prompt = list(range(64))
    clock = FakeClock()
    decode, sample, _ = fake_model(clock, 0.5, 0.25, 0.125, range(10, 42))
    tokens, stamps = lt.greedy_stamps(decode, sample, prompt, 32, clock)
    timing = lt.timing_from_stamps(tokens, len(prompt), stamps)
    assert timing.prefill_seconds == pytest.approx(0.5 + 64 * 0.25 + 0.125, rel=1e-12)
    assert timing.decode_seconds == pytest.approx(31 * 0.875, rel=1e-12)  # the 31 steps after the prefill
    assert timing.token_latencies == [0.875] * 31  # binary fractions: exact
    assert timing.decode_tokens_per_s == pytest.approx(1 / 0.875, rel=1e-12)
    assert timing.prefill_tokens_per_s == pytest.approx(64 / 16.625, rel=1e-12)


def test_timing_needs_a_decode_step_and_matching_stamps():
    with pytest.raises(SmartExitError, match=">= 2 tokens"):
        lt.timing_from_stamps([5], 3, [0.0, 1.0])
    with pytest.raises(SmartExitError, match="one stamp more"):
        lt.timing_from_stamps([5, 6], 3, [0.0, 1.0])


# ------------------------------------------------------------------ pure: the same precision
@pytest.mark.parametrize("ours, theirs", [("fp32", "f32"), (Precision.W8A8.value, "q8_0"),
                                         (Precision.W4.value, "q4_0")])
def test_same_precision_types(ours, theirs):
    assert gg.same_precision_type(ours) == theirs


def test_every_precision_of_ours_has_a_llamacpp_type():
    assert set(gg.SAME_PRECISION) == {"fp32"} | {p.value for p in Precision}
    assert set(gg.SAME_PRECISION.values()) <= set(gg.OUTTYPES) | set(gg.QTYPES)


@pytest.mark.parametrize("bad", ["w4+w8a8", "int8", "", "f32"])
def test_a_precision_without_counterpart_is_refused_with_the_known_ones(bad):
    with pytest.raises(ConfigError, match="fp32 -> f32.*w8a8 -> q8_0.*w4 -> q4_0"):
        gg.same_precision_type(bad)


def test_same_precision_gguf_converts_or_quantizes_the_float_weights(monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr(gg, "cached_gguf", lambda run, model, outtype="f32": seen.append(("f32", outtype)) or
                        tmp_path / "f32.gguf")
    monkeypatch.setattr(gg, "cached_quantized_gguf", lambda run, model, qtype, threads=0: seen.append(
        ("quantized", qtype)) or tmp_path / f"{qtype}.gguf")
    assert gg.same_precision_gguf(tmp_path, "model", "fp32") == tmp_path / "f32.gguf"
    assert gg.same_precision_gguf(tmp_path, "model", "w8a8") == tmp_path / "q8_0.gguf"
    assert gg.same_precision_gguf(tmp_path, "model", "w4") == tmp_path / "q4_0.gguf"
    assert seen == [("f32", "f32"), ("quantized", "q8_0"), ("quantized", "q4_0")]


# ------------------------------------------------------------------ pure: command lines
def test_llama_bench_argv():
    argv = lb.llama_bench_argv(Path("/b/llama-bench"), Path("m.gguf"), 0, 31, 64, 2, 5)
    assert argv == ["/b/llama-bench", "-m", "m.gguf", "-p", "0", "-n", "31", "-d", "64", "-t", "2", "-r", "5",
                    "-fa", "off", "-o", "json"]
    # weights as stored where llama.cpp's repacked kernels crash (llamacpp_repack.repack_runs)
    plain = lb.llama_bench_argv(Path("/b/llama-bench"), Path("m.gguf"), 0, 31, 64, 2, 5, repack=False)
    assert plain == argv + ["--repack", "0"]


def test_cmake_builds_only_llama_bench_cpu_native_release():
    configure, build = lb.cmake_argvs(Path("/src"), Path("/build"), 2)
    assert configure[:5] == ["cmake", "-S", "/src", "-B", "/build"]
    assert {"-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_TESTS=OFF",
            "-DLLAMA_BUILD_SERVER=OFF"} <= set(configure)
    assert not [a for a in configure if a.startswith(("-DGGML_CUDA=ON", "-DGGML_VULKAN=ON", "-DGGML_METAL=ON"))]
    assert build == ["cmake", "--build", "/build", "--target", "llama-bench", "--config", "Release", "-j", "2"]


# ------------------------------------------------------------------ pure: llama-bench's JSON
def test_recorded_output_parses_into_prefill_and_decode_tests():
    (pp,), (tg,) = lb.parse_llama_bench_json(PREFILL_JSON), lb.parse_llama_bench_json(DECODE_JSON)
    assert (pp.n_prompt, pp.n_gen, pp.n_depth, pp.n_threads) == (64, 0, 0, 2)
    assert (tg.n_prompt, tg.n_gen, tg.n_depth, tg.n_threads) == (0, 31, 64, 2)
    speed = lb.bench_speed(pp, tg)
    assert speed.source == "llama-bench" and speed.decode_samples == tg.samples_ts
    # llama-bench prints its statistics with 6 decimals: our mean and sample stddev agree to that
    assert statistics.mean(tg.samples_ts) == pytest.approx(tg.avg_ts, rel=1e-6)
    assert speed.decode_stddev == pytest.approx(tg.stddev_ts, rel=1e-4, abs=1e-6)
    assert speed.prefill_stddev == pytest.approx(pp.stddev_ts, rel=1e-4, abs=1e-6)
    assert speed.decode_tokens_per_s == statistics.median(tg.samples_ts)
    assert speed.prefill_tokens_per_s > speed.decode_tokens_per_s  # a batch of 64 beats 1 token a call


def test_find_test_picks_sizes_and_names_what_there_is():
    tests = lb.parse_llama_bench_json(PREFILL_JSON) + lb.parse_llama_bench_json(DECODE_JSON)
    assert lb.find_test(tests, 0, 31, 64).n_gen == 31
    with pytest.raises(SmartExitError, match=r"n_gen=31, n_depth=0.*\(64, 0, 0\), \(0, 31, 64\)"):
        lb.find_test(tests, 0, 31, 0)
    with pytest.raises(SmartExitError, match="prompt-only and a generation-only"):
        lb.bench_speed(tests[1], tests[0])


@pytest.mark.parametrize("text, says", [
    ("llama-bench: error", "not JSON"),
    ('{"n_prompt": 1}', "list of test objects"),
    ("[1, 2]", "list of test objects"),
])
def test_unreadable_output_is_a_clear_error(text, says):
    with pytest.raises(SmartExitError, match=says):
        lb.parse_llama_bench_json(text)


def test_a_test_without_its_timing_names_the_missing_field():
    (one,) = json.loads(DECODE_JSON)
    del one["samples_ts"], one["avg_ts"]
    with pytest.raises(SmartExitError, match="test 0 has no avg_ts, samples_ts"):
        lb.parse_llama_bench_json(json.dumps([one]))


# ------------------------------------------------------------------ pure: rows
def test_decode_speed_statistics_and_the_faster_row():
    api = lb.DecodeSpeed("python-api", (100.0, 110.0, 90.0), (900.0, 1000.0, 1100.0))
    bench = lb.DecodeSpeed("llama-bench", (120.0,), (1500.0,))
    assert api.decode_tokens_per_s == 100.0 and api.decode_stddev == pytest.approx(10.0, rel=1e-12)
    assert bench.decode_stddev == 0.0
    assert lb.faster_row([api, bench]) is bench
    assert json.loads(json.dumps(api.to_dict())) == {"source": "python-api", "decode_tokens_per_s": 100.0,
                                                     "decode_stddev": 10.0, "prefill_tokens_per_s": 1000.0,
                                                     "prefill_stddev": 100.0, "repeats": 3}
    with pytest.raises(SmartExitError, match="no timed repeats"):
        lb.DecodeSpeed("llama-bench", (), (1.0,))
    with pytest.raises(SmartExitError, match="at least one"):
        lb.faster_row([])


class FakeTimedPeer:
    """generate_timed on the fake clock: prefill 0.25 s, each of the n - 1 steps 0.0625 s."""

    def __init__(self) -> None:
        self.calls = 0

    def generate_timed(self, prompt, n):
        self.calls += 1
        stamps = [0.0, 0.25] + [0.25 + 0.0625 * i for i in range(1, n)]
        return lt.timing_from_stamps(list(range(n)), len(prompt), stamps)


def test_api_speed_warms_up_then_times_each_repeat():
    peer = FakeTimedPeer()
    speed = lb.api_speed(peer, [1] * 8, 5, repeats=3, warmup=2)
    assert peer.calls == 5 and speed.source == "python-api"
    assert speed.decode_samples == (16.0,) * 3 and speed.prefill_samples == (32.0,) * 3
    with pytest.raises(SmartExitError, match="repeats >= 1"):
        lb.api_speed(peer, [1], 5, repeats=0)


# ------------------------------------------------------------------ with fake llama-bench / cmake processes
@pytest.fixture
def fake_sdist(monkeypatch, tmp_path):
    """An unpacked 'sdist' with llama-bench's source and a PKG-INFO, and a build folder in tmp_path."""
    src = tmp_path / "src"
    (src / "vendor" / "llama.cpp" / "tools" / "llama-bench").mkdir(parents=True)
    (src / "vendor" / "llama.cpp" / "tools" / "llama-bench" / "llama-bench.cpp").write_text("")
    (src / "PKG-INFO").write_text("Metadata-Version: 2.1\nName: llama_cpp_python\nVersion: 9.9.9\n")
    monkeypatch.setenv(lc.SRC_ENV, str(src))
    monkeypatch.setattr(lb, "build_dir", lambda: tmp_path / "build")
    return tmp_path / "build"


def test_build_records_the_version_only_after_the_binary_exists(monkeypatch, fake_sdist):
    seen = []

    def fake_run(argv, timeout=600.0):
        seen.append(argv)
        if "--build" in argv:
            lb.binary_path(fake_sdist).parent.mkdir(parents=True)
            lb.binary_path(fake_sdist).write_text("")
        return subprocess.CompletedProcess(argv, 0, "", "")

    monkeypatch.setattr(edge.core.device, "run_command", fake_run)
    assert lb.build_llama_bench(jobs=3) == fake_sdist / "bin" / "llama-bench"
    assert seen == lb.cmake_argvs(lc.converter_dir(), fake_sdist, 3)
    assert (fake_sdist / lb.BUILT_FROM).read_text() == "9.9.9\n"


def test_a_failed_build_says_where_and_leaves_no_version(monkeypatch, fake_sdist):
    def fake_run(argv, timeout=600.0):
        return subprocess.CompletedProcess(argv, 1, "-- Configuring incomplete", "CMake Error: no compiler")

    monkeypatch.setattr(edge.core.device, "run_command", fake_run)
    with pytest.raises(SmartExitError, match=r"failed at `cmake -S .*exit 1.*\n.*\n.*no compiler"):
        lb.build_llama_bench(jobs=1)
    assert not (fake_sdist / lb.BUILT_FROM).exists()


def test_build_without_sources_names_make_llamacpp(monkeypatch, tmp_path):
    monkeypatch.setenv(lc.SRC_ENV, str(tmp_path / "nowhere"))
    with pytest.raises(MissingExtraError, match="make llamacpp"):
        lb.build_llama_bench()


def test_unavailable_says_not_built_or_built_from_another_version(monkeypatch, fake_sdist):
    monkeypatch.setattr(lb, "available", lambda: "llama-cpp-python not installed: run `make llamacpp`")
    assert lb.llama_bench_unavailable().startswith("llama-bench not usable: llama-cpp-python not installed")
    monkeypatch.setattr(lb, "available", lambda: None)
    monkeypatch.setitem(sys.modules, "llama_cpp", types.SimpleNamespace(__version__="9.9.9"))
    assert lb.llama_bench_unavailable().startswith("llama-bench not built")
    lb.binary_path(fake_sdist).parent.mkdir(parents=True)
    lb.binary_path(fake_sdist).write_text("")
    (fake_sdist / lb.BUILT_FROM).write_text("9.9.8\n")
    assert "built from llama-cpp-python 9.9.8, the installed package is 9.9.9" in lb.llama_bench_unavailable()
    (fake_sdist / lb.BUILT_FROM).write_text("9.9.9\n")
    assert lb.llama_bench_unavailable() is None


def test_llama_bench_speed_runs_prefill_and_decode_apart(monkeypatch, tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    seen = []

    def fake_run(argv, timeout=600.0):
        seen.append(argv)
        return subprocess.CompletedProcess(argv, 0, PREFILL_JSON if argv[argv.index("-n") + 1] == "0"
                                           else DECODE_JSON, "")

    monkeypatch.setattr(lb, "llama_bench_unavailable", lambda: None)
    monkeypatch.setattr(edge.core.device, "run_command", fake_run)
    speed = lb.llama_bench_speed(gguf, 64, 32, threads=2, repeats=3)
    assert seen == [lb.llama_bench_argv(lb.binary_path(), gguf, 64, 0, 0, 2, 3),
                    lb.llama_bench_argv(lb.binary_path(), gguf, 0, 31, 64, 2, 3)]
    assert speed == lb.bench_speed(*lb.parse_llama_bench_json(PREFILL_JSON), *lb.parse_llama_bench_json(DECODE_JSON))


def test_llama_bench_speed_refuses_before_running(monkeypatch, tmp_path):
    monkeypatch.setattr(edge.core.device, "run_command", lambda *a, **k: pytest.fail("must not run"))
    with pytest.raises(SmartExitError, match="new_tokens >= 2"):
        lb.llama_bench_speed(tmp_path / "m.gguf", 64, 1, 2, 3)
    with pytest.raises(SmartExitError, match="does not exist"):
        lb.llama_bench_speed(tmp_path / "m.gguf", 64, 32, 2, 3)
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    monkeypatch.setattr(lb, "llama_bench_unavailable", lambda: "llama-bench not built (x is missing)")
    with pytest.raises(MissingExtraError, match="llama-bench not built"):
        lb.llama_bench_speed(tmp_path / "m.gguf", 64, 32, 2, 3)


def test_a_failing_llama_bench_shows_its_last_lines(monkeypatch, tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    monkeypatch.setattr(lb, "llama_bench_unavailable", lambda: None)
    monkeypatch.setattr(edge.core.device, "run_command", lambda argv, timeout=600.0: subprocess.CompletedProcess(
        argv, 1, "", "main: error: failed to load model 'm.gguf'"))
    with pytest.raises(SmartExitError, match=r"prefill, exit 1\):\n.*failed to load model"):
        lb.llama_bench_speed(tmp_path / "m.gguf", 64, 32, 2, 3)


# ------------------------------------------------------------------ llama.cpp itself (after `make llamacpp`)
@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """The bundled early-exit model's f32 GGUF (the converter subprocess: ~20 s)."""
    if REASON is not None:
        pytest.skip(REASON)
    return gg.convert_to_gguf(BUNDLED_EE_DIR, tmp_path_factory.mktemp("bench") / "tiny-ee-f32.gguf", "f32")


@needs_llamacpp
@pytest.mark.slow
def test_timed_generation_decodes_what_generate_decodes(tiny_gguf):
    prompt = list(range(5, 37))
    with lp.LlamaCppPeer(tiny_gguf, threads=1) as peer:
        plain = peer.generate(prompt, 16)
        timed = peer.generate_timed(prompt, 16)
        speed = lb.api_speed(peer, prompt, 16, repeats=2)
        with pytest.raises(SmartExitError, match="n >= 2"):
            peer.generate_timed(prompt, 1)
    assert timed.tokens == plain.tokens and timed.prompt_tokens == 32
    assert timed.prefill_seconds > 0 and timed.decode_seconds > 0 and len(timed.token_latencies) == 15
    # the gaps telescope to the decode time: equal up to float64 rounding of ~16 sums
    assert sum(timed.token_latencies) == pytest.approx(timed.decode_seconds, rel=1e-9)
    assert len(speed.decode_samples) == 2 and speed.decode_tokens_per_s > 0 and speed.prefill_tokens_per_s > 0


@needs_llama_bench
@pytest.mark.slow
def test_llama_bench_runs_at_the_decode_bench_shape(tiny_gguf):
    speed = lb.llama_bench_speed(tiny_gguf, 32, 16, threads=1, repeats=2)
    assert speed.source == "llama-bench" and len(speed.decode_samples) == len(speed.prefill_samples) == 2
    assert speed.decode_tokens_per_s > 0 and speed.prefill_tokens_per_s > 0
