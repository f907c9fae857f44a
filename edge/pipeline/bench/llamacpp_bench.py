"""llama.cpp's decode and prefill speed, two ways, for the peer rows of ``smartexit bench decode``.

Both rows run the same GGUF (at the precision of the system they are compared with:
``llamacpp_gguf.same_precision_gguf``), batch 1, and report decode and prefill tokens/s apart:

- ``python-api``: :meth:`LlamaCppPeer.generate_timed` on real prompts, llama.cpp's greedy sampler
  choosing every token; decode is the ``n - 1`` single-token ``llama_decode`` calls after the
  prefill, each with its greedy choice and the ctypes round trip of llama-cpp-python.
- ``llama-bench``: llama.cpp's own benchmark loop (``tools/llama-bench``), built by
  :func:`build_llama_bench` from the vendored llama.cpp of the same llama-cpp-python sdist with the
  flags of the Python package's build (Release, ``GGML_NATIVE=ON``, CPU backend only). Its prefill
  test decodes ``p`` random tokens into an empty cache; its generation test decodes ``n - 1`` tokens
  one at a time *after* a cache of ``p`` tokens (``-d p``, the positions our decode steps sit at),
  with no logits read and no sampling. It is the stricter row (no Python, no sampling: normally the
  faster); a speed-up over llama.cpp is stated against whichever row measured faster (:func:`faster_row`).

Both keep llama.cpp's defaults otherwise (f16 K/V cache), with flash attention off as in the
Python API (llama-cpp-python's ``flash_attn=False``; llama-bench would choose ``auto``).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from edge.core.errors import MissingExtraError, SmartExitError
from edge.pipeline.bench.llamacpp import INSTALL_HINT, available, converter_dir, sdist_version, source_dir
from edge.pipeline.bench.llamacpp_peer import LlamaCppPeer

BUILD_DIR = "llamacpp-bench-build"  # under the venv, beside llamacpp-src
BUILT_FROM = "built-from-llama-cpp-python"  # a file in the build folder: the sdist version it was built from
# llama-bench's flash attention choice matching llama-cpp-python's Llama(flash_attn=False)
FLASH_ATTN = "off"
# what a llama-bench JSON test object must carry to be read (tools/llama-bench/llama-bench.cpp, test::get_fields)
BENCH_FIELDS = ("n_prompt", "n_gen", "n_depth", "n_threads", "avg_ts", "stddev_ts", "samples_ts")


# ------------------------------------------------------------------ typed results
@dataclass(frozen=True)
class DecodeSpeed:
    """Batch-1 tokens/s of one llama.cpp row: one sample per timed repeat."""

    source: str  # "python-api" or "llama-bench"
    decode_samples: tuple[float, ...]  # decode tokens/s per repeat
    prefill_samples: tuple[float, ...]  # prefill (prompt) tokens/s per repeat

    def __post_init__(self) -> None:
        if not self.decode_samples or not self.prefill_samples:
            raise SmartExitError(f"{self.source}: no timed repeats (decode {len(self.decode_samples)}, "
                                 f"prefill {len(self.prefill_samples)})")

    @property
    def decode_tokens_per_s(self) -> float:
        """Median over repeats, as the decode bench reports every system."""
        return statistics.median(self.decode_samples)

    @property
    def prefill_tokens_per_s(self) -> float:
        return statistics.median(self.prefill_samples)

    @property
    def decode_stddev(self) -> float:
        """Sample standard deviation (n - 1), as llama-bench's ``stddev_ts``; 0 for one repeat."""
        return statistics.stdev(self.decode_samples) if len(self.decode_samples) > 1 else 0.0

    @property
    def prefill_stddev(self) -> float:
        return statistics.stdev(self.prefill_samples) if len(self.prefill_samples) > 1 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "decode_tokens_per_s": self.decode_tokens_per_s,
                "decode_stddev": self.decode_stddev, "prefill_tokens_per_s": self.prefill_tokens_per_s,
                "prefill_stddev": self.prefill_stddev, "repeats": len(self.decode_samples)}


def faster_row(rows: Sequence[DecodeSpeed]) -> DecodeSpeed:
    """The row with the highest decode tokens/s: the one a speed-up over llama.cpp is stated against."""
    if not rows:
        raise SmartExitError("faster_row needs at least one llama.cpp row")
    return max(rows, key=lambda r: r.decode_tokens_per_s)


# ------------------------------------------------------------------ the Python API row
def api_speed(peer: LlamaCppPeer, prompt_ids: Sequence[int], n: int, repeats: int, warmup: int = 1) -> DecodeSpeed:
    """Decode and prefill tokens/s of :meth:`LlamaCppPeer.generate_timed` on one prompt, ``repeats``
    timed calls after ``warmup`` untimed ones (back to back: the decode bench interleaves instead,
    calling ``generate_timed`` once per repeat in its rotation).

    Raises:
        SmartExitError: repeats < 1, warmup < 0, or what ``generate_timed`` refuses (n < 2, too long).
    """
    if repeats < 1 or warmup < 0:
        raise SmartExitError(f"api_speed needs repeats >= 1 and warmup >= 0, got {repeats} and {warmup}")
    for _ in range(warmup):
        peer.generate_timed(prompt_ids, n)
    runs = [peer.generate_timed(prompt_ids, n) for _ in range(repeats)]
    return DecodeSpeed("python-api", tuple(r.decode_tokens_per_s for r in runs),
                       tuple(r.prefill_tokens_per_s for r in runs))


# ------------------------------------------------------------------ building llama-bench
def build_dir() -> Path:
    """Where :func:`build_llama_bench` builds (``<venv>/llamacpp-bench-build``)."""
    return Path(sys.prefix) / BUILD_DIR


def binary_path(build: Path | None = None) -> Path:
    return (build or build_dir()) / "bin" / "llama-bench"


def cmake_argvs(src: Path, build: Path, jobs: int, cmake: str = "cmake") -> list[list[str]]:
    """Configure and build only the ``llama-bench`` target of llama.cpp at ``src``, CPU backend only.

    The options mirror llama-cpp-python's own build of the same sources (Release, ``GGML_NATIVE=ON``,
    ggml's defaults: OpenMP, llamafile kernels, CPU weight repacking), so both rows run the same
    kernels; libraries are linked statically so that the binary depends on no build-tree path.
    Everything llama-bench does not link is off (tests, examples, server, the unified app, OpenSSL).
    """
    configure = [cmake, "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
                 "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_COMMON=ON", "-DLLAMA_BUILD_TOOLS=ON",
                 "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF",
                 "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_OPENSSL=OFF"]
    return [configure, [cmake, "--build", str(build), "--target", "llama-bench", "--config", "Release",
                        "-j", str(jobs)]]


def _tail(res, lines: int = 20) -> str:
    """The last ``lines`` lines of a finished command's stdout, then stderr."""
    return "\n".join(f"{res.stdout}\n{res.stderr}".strip().splitlines()[-lines:])


def build_llama_bench(jobs: int | None = None, timeout: float = 3600.0) -> Path:
    """Build ``llama-bench`` from the unpacked sdist's ``vendor/llama.cpp`` into :func:`build_dir`
    (from scratch: the folder is removed first) and record the sdist version it was built from.

    Returns:
        the binary's path.
    Raises:
        MissingExtraError: the sdist is not unpacked (``make llamacpp`` unpacks it).
        SmartExitError: cmake is missing, or configuring / building failed (its last lines are in the message).
    """
    from edge.core.device import run_command

    src = converter_dir()
    version = sdist_version()
    if not (src / "tools" / "llama-bench" / "llama-bench.cpp").is_file() or version is None:
        raise MissingExtraError(f"llama.cpp sources not found in {src} (or no PKG-INFO in {source_dir()}): "
                                f"{INSTALL_HINT}")
    build = build_dir()
    shutil.rmtree(build, ignore_errors=True)
    for argv in cmake_argvs(src, build, jobs or os.cpu_count() or 1):
        res = run_command(argv, timeout=timeout)
        if res.returncode != 0:
            raise SmartExitError(f"building llama-bench failed at `{' '.join(argv[:4])} ...` "
                                 f"(exit {res.returncode}):\n{_tail(res)}")
    binary = binary_path(build)
    if not binary.is_file():
        raise SmartExitError(f"cmake succeeded but {binary} is missing")
    (build / BUILT_FROM).write_text(version + "\n")  # last: a failed build leaves no version behind
    return binary


def llama_bench_unavailable() -> str | None:
    """None when ``llama-bench`` is built from the installed llama-cpp-python's sources; else why not."""
    reason = available()
    if reason is not None:
        return f"llama-bench not usable: {reason}"
    binary, stamp = binary_path(), build_dir() / BUILT_FROM
    if not binary.is_file() or not stamp.is_file():
        return f"llama-bench not built ({binary} is missing): {INSTALL_HINT}"
    import llama_cpp

    built_from = stamp.read_text().strip()
    if built_from != llama_cpp.__version__:
        return (f"llama-bench was built from llama-cpp-python {built_from}, the installed package is "
                f"{llama_cpp.__version__}: {INSTALL_HINT}")
    return None


# ------------------------------------------------------------------ running and reading llama-bench
def llama_bench_argv(binary: Path, gguf: Path, n_prompt: int, n_gen: int, depth: int, threads: int,
                     repeats: int, flash_attn: str = FLASH_ATTN, repack: bool = True) -> list[str]:
    """One llama-bench run: a prefill test of ``n_prompt`` tokens and / or a generation test of
    ``n_gen`` tokens (0 skips a test), each after a cache of ``depth`` tokens, ``repeats`` times,
    as JSON on stdout (flags of ``tools/llama-bench/llama-bench.cpp``); ``repack`` False: the weights
    as stored (``--repack 0``; see ``llamacpp_repack.repack_runs``)."""
    return [str(binary), "-m", str(gguf), "-p", str(n_prompt), "-n", str(n_gen), "-d", str(depth),
            "-t", str(threads), "-r", str(repeats), "-fa", flash_attn, "-o", "json",
            *([] if repack else ["--repack", "0"])]


@dataclass(frozen=True)
class LlamaBenchTest:
    """One test object of llama-bench's JSON output."""

    n_prompt: int
    n_gen: int
    n_depth: int
    n_threads: int
    avg_ts: float  # mean tokens/s over repeats, tokens = n_prompt + n_gen (the depth is not timed)
    stddev_ts: float  # sample standard deviation
    samples_ts: tuple[float, ...]
    model_type: str = ""
    build_commit: str = ""


def parse_llama_bench_json(text: str) -> list[LlamaBenchTest]:
    """The tests of llama-bench's ``-o json`` output (a list of objects, one per test).

    Raises:
        SmartExitError: not JSON, not a list of objects, or a test without one of :data:`BENCH_FIELDS`.
    """
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SmartExitError(f"llama-bench output is not JSON ({exc}): {text[:200]!r}") from exc
    if not isinstance(data, list) or not all(isinstance(t, dict) for t in data):
        raise SmartExitError(f"llama-bench JSON must be a list of test objects, got {type(data).__name__}")
    tests = []
    for i, t in enumerate(data):
        missing = [f for f in BENCH_FIELDS if f not in t]
        if missing:
            raise SmartExitError(f"llama-bench test {i} has no {', '.join(missing)} (fields: {sorted(t)})")
        tests.append(LlamaBenchTest(int(t["n_prompt"]), int(t["n_gen"]), int(t["n_depth"]), int(t["n_threads"]),
                                    float(t["avg_ts"]), float(t["stddev_ts"]), tuple(map(float, t["samples_ts"])),
                                    str(t.get("model_type", "")), str(t.get("build_commit", ""))))
    return tests


def find_test(tests: Sequence[LlamaBenchTest], n_prompt: int, n_gen: int, depth: int) -> LlamaBenchTest:
    """The test of those sizes. Raises SmartExitError naming the tests there are when it is absent."""
    for t in tests:
        if (t.n_prompt, t.n_gen, t.n_depth) == (n_prompt, n_gen, depth):
            return t
    have = [(t.n_prompt, t.n_gen, t.n_depth) for t in tests]
    raise SmartExitError(f"llama-bench output has no test with n_prompt={n_prompt}, n_gen={n_gen}, "
                         f"n_depth={depth}; it has (n_prompt, n_gen, n_depth) {have}")


def bench_speed(prefill: LlamaBenchTest, decode: LlamaBenchTest) -> DecodeSpeed:
    """The llama-bench row from its prefill test and its generation test."""
    if prefill.n_gen or not prefill.n_prompt or decode.n_prompt or not decode.n_gen:
        raise SmartExitError(f"want a prompt-only and a generation-only test, got (n_prompt, n_gen) "
                             f"{(prefill.n_prompt, prefill.n_gen)} and {(decode.n_prompt, decode.n_gen)}")
    return DecodeSpeed("llama-bench", decode.samples_ts, prefill.samples_ts)


def llama_bench_speed(gguf: str | Path, prompt_tokens: int, new_tokens: int, threads: int, repeats: int,
                      flash_attn: str = FLASH_ATTN, timeout: float = 600.0, repack: bool = True) -> DecodeSpeed:
    """llama-bench on ``gguf`` at the decode bench's shape: prefill of ``prompt_tokens`` into an empty
    cache, and the ``new_tokens - 1`` decode steps that follow a prompt of that length (two runs, as a
    depth applies to every test of a run).

    Raises:
        MissingExtraError: llama-bench is not built (:func:`llama_bench_unavailable` says why).
        SmartExitError: bad sizes, a missing GGUF, or llama-bench failed (its last lines are in the message).
    """
    from edge.core.device import run_command

    if prompt_tokens < 1 or new_tokens < 2 or threads < 1 or repeats < 1:
        raise SmartExitError(f"llama_bench_speed needs prompt_tokens >= 1, new_tokens >= 2, threads >= 1 and "
                             f"repeats >= 1, got {prompt_tokens}, {new_tokens}, {threads}, {repeats}")
    if not Path(gguf).is_file():
        raise SmartExitError(f"GGUF file {gguf} does not exist")
    reason = llama_bench_unavailable()
    if reason is not None:
        raise MissingExtraError(reason)
    shapes = {"prefill": (prompt_tokens, 0, 0), "decode": (0, new_tokens - 1, prompt_tokens)}
    found = {}
    for name, (p, n, d) in shapes.items():
        argv = llama_bench_argv(binary_path(), Path(gguf), p, n, d, threads, repeats, flash_attn, repack)
        res = run_command(argv, timeout=timeout)
        if res.returncode != 0:
            raise SmartExitError(f"llama-bench failed on {gguf} ({name}, exit {res.returncode}):\n{_tail(res)}")
        found[name] = find_test(parse_llama_bench_json(res.stdout), p, n, d)
    return bench_speed(found["prefill"], found["decode"])


def _main(argv: list[str]) -> int:
    """``python -m edge.pipeline.bench.llamacpp_bench build [--jobs N]``: what ``make llamacpp`` runs."""
    ap = argparse.ArgumentParser(prog="python -m edge.pipeline.bench.llamacpp_bench")
    ap.add_argument("command", choices=["build"])
    ap.add_argument("--jobs", type=int, default=None, help="parallel compile jobs (default: every CPU)")
    args = ap.parse_args(argv)
    try:
        print(f"llama-bench built: {build_llama_bench(args.jobs)}")
    except SmartExitError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
