"""llama.cpp as a peer system of ``smartexit bench decode`` (system f).

``llama-cpp-python`` is built from its source distribution by ``make llamacpp`` (never by
``make test`` / ``make demo``), which also unpacks that sdist into ``.venv/llamacpp-src/``: the
converter (``vendor/llama.cpp/convert_hf_to_gguf.py`` with its ``conversion`` and ``gguf-py``
packages) ships in the sdist, not in the wheel. :func:`available` says why the peer cannot run.

The same weights reach llama.cpp through that converter (:func:`convert_to_gguf`, one subprocess).
The converter names a BPE tokenizer's pre-tokenizer by hashing the tokens of a fixed text against
a list of known models (llama.cpp PR 6920); ours is on no such list. It is GPT-2's byte-level BPE
(``edge.model.tokenizer.train_tokenizer``), which llama.cpp implements as the ``gpt-2`` pre-type (the name
the converter's list gives openai-community/gpt2). So only after :func:`tokenizer_is_gpt2_byte_level`
has checked the actual pre-tokenizer, decoder and model of ``tokenizer.json`` does the conversion
fall back to ``gpt-2`` for a hash it does not know (the vendored converter is never edited).
:func:`verify_tokenizer` then checks that the converted tokenizer reproduces ours id for id, and
:func:`check_greedy_match` that llama.cpp's greedy tokens are ours before its speed is reported.

For the compression comparison the peer also runs at our bit-widths: :func:`quantize_gguf` hands the
f32 GGUF to llama.cpp's own quantizer (``llama_model_quantize``, what the ``llama-quantize`` tool
calls) for :data:`QTYPES`, and :func:`gguf_tensor_types` reads back what was stored, because llama.cpp
picks per tensor (``llama-quant.cpp``): 1-d tensors (norms) stay F32; the output matrix, and the
token embedding when it is tied to it as ours is, get Q6_K under the 4-bit types; Q4_K_M keeps some
attn_v / ffn_down at Q6_K; and a tensor whose rows are not a multiple of a type's block (32 for
Q4_0 / Q8_0, 256 for the k-quants) falls back to another type (``tensor_type_fallback``:
Q4_K -> Q5_0, Q6_K -> Q8_0; F16 when even 32 does not divide). :func:`peer_perplexity` scores held-out windows teacher-forced from logits at every
position (:meth:`LlamaCppPeer.logits`), with the same arithmetic as ours (:func:`next_token_scores`).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Sequence

from edge.core.errors import ConfigError, MissingExtraError, SmartExitError

if TYPE_CHECKING:
    import numpy as np

INSTALL_HINT = "run `make llamacpp`"
SRC_ENV = "SMARTEXIT_LLAMACPP_SRC"  # overrides where the unpacked sdist is looked for
OUTTYPES = ("f32", "f16", "bf16", "q8_0")
GGUF_DIR = "llamacpp"  # under a run's artifacts folder
UNKNOWN_PRE = "BPE pre-tokenizer was not recognized"  # the converter's message for an unknown hash
# tokenizer.ggml.pre of GPT-2's own tokenizer: the converter's hash list maps openai-community/gpt2 to it,
# and llama.cpp's llama-vocab.cpp maps it to LLAMA_VOCAB_PRE_TYPE_GPT2 (GPT-2's split regex)
GPT2_PRE = "gpt-2"
# llama.cpp's quantizer targets (llama_ftype names in llama.h); "q4_K" is llama-quantize's own alias of Q4_K_M
QTYPES = {"q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0", "q4_K_M": "LLAMA_FTYPE_MOSTLY_Q4_K_M"}
QTYPE_ALIASES = {"q4_K": "q4_K_M"}


class TokenizerMismatch(SmartExitError):
    """llama.cpp's tokenizer (from the GGUF) gives other ids than ours for some text."""


class GreedyMismatch(SmartExitError):
    """llama.cpp's greedy tokens differ from ours: its speed must not be reported."""


class QuantizationFailed(SmartExitError):
    """llama.cpp's quantizer returned an error for a GGUF file."""


# ------------------------------------------------------------------ where things are
def source_dir() -> Path:
    """The unpacked llama-cpp-python sdist (``$SMARTEXIT_LLAMACPP_SRC`` or ``<venv>/llamacpp-src``)."""
    return Path(os.environ.get(SRC_ENV) or Path(sys.prefix) / "llamacpp-src")


def converter_dir() -> Path:
    """``vendor/llama.cpp`` of the sdist: ``convert_hf_to_gguf.py``, ``conversion/``, ``gguf-py/``."""
    return source_dir() / "vendor" / "llama.cpp"


def _sdist_version(src: Path) -> str | None:
    pkg_info = src / "PKG-INFO"
    if not pkg_info.is_file():
        return None
    for line in pkg_info.read_text(errors="replace").splitlines():
        if line.startswith("Version:"):
            return line.split(":", 1)[1].strip()
    return None


def available() -> str | None:
    """None when llama_cpp loads and the converter of the same version is unpacked; else why not."""
    try:
        import llama_cpp
    except ImportError:
        return f"llama-cpp-python not installed: {INSTALL_HINT}"
    except OSError as exc:  # the package is there but its shared library does not load
        return f"llama-cpp-python is installed but its library does not load ({exc}): {INSTALL_HINT}"
    conv = converter_dir()
    missing = [p for p in (conv / "convert_hf_to_gguf.py", conv / "conversion", conv / "gguf-py" / "gguf")
               if not p.exists()]
    if missing:
        return f"llama.cpp converter not found ({missing[0]} is missing): {INSTALL_HINT}"
    src_version = _sdist_version(source_dir())
    if src_version != llama_cpp.__version__:
        return (f"the converter in {source_dir()} is from llama-cpp-python {src_version}, the installed "
                f"package is {llama_cpp.__version__}: {INSTALL_HINT}")
    return None


def require_available() -> None:
    """Raise :class:`MissingExtraError` with :func:`available`'s reason when the peer cannot run."""
    reason = available()
    if reason is not None:
        raise MissingExtraError(reason)


def llamacpp_version() -> str:
    import llama_cpp

    return llama_cpp.__version__


# ------------------------------------------------------------------ tokenizer: pure JSON inspection
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (openai/gpt-2 ``encoder.py``), 256 entries."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def _as_json(tokenizer_json: str | Path | dict[str, Any]) -> dict[str, Any]:
    if isinstance(tokenizer_json, dict):
        return tokenizer_json
    path = Path(tokenizer_json)
    if path.is_dir():
        path = path / "tokenizer.json"
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SmartExitError(f"{path} is not a readable tokenizer.json: {exc}") from exc


def gpt2_byte_level_mismatch(tokenizer_json: str | Path | dict[str, Any]) -> str | None:
    """Why a ``tokenizer.json`` is not GPT-2-style byte-level BPE, or None when it is.

    GPT-2 style means what llama.cpp's ``gpt-2`` pre-type implements: no normalizer; a single
    ByteLevel pre-tokenizer with GPT-2's split regex (``use_regex``) and no added prefix space;
    a BPE model without byte fallback or subword affixes whose vocabulary is written in GPT-2's
    byte alphabet (added tokens aside); a ByteLevel decoder.

    Args:
        tokenizer_json: path to the file or its model folder, or the parsed JSON.
    """
    tj = _as_json(tokenizer_json)
    if tj.get("normalizer") is not None:
        return f"it has a normalizer ({tj['normalizer'].get('type')}); GPT-2 has none"
    pre = tj.get("pre_tokenizer") or {}
    if pre.get("type") != "ByteLevel":
        return f"pre_tokenizer is {pre.get('type')!r}, not a single ByteLevel"
    if not pre.get("use_regex", True):
        return "the ByteLevel pre_tokenizer does not split with GPT-2's regex (use_regex is false)"
    if pre.get("add_prefix_space", False):
        return "the ByteLevel pre_tokenizer adds a prefix space; llama.cpp's gpt-2 pre-type does not"
    dec = tj.get("decoder") or {}
    if dec.get("type") != "ByteLevel":
        return f"decoder is {dec.get('type')!r}, not ByteLevel"
    post = tj.get("post_processor")
    if post is not None and post.get("type") != "ByteLevel":
        return f"post_processor {post.get('type')!r} adds tokens; GPT-2 adds none"
    model = tj.get("model") or {}
    if model.get("type") != "BPE":
        return f"model is {model.get('type')!r}, not BPE"
    if model.get("byte_fallback"):
        return "the BPE model uses byte fallback (SentencePiece style), not byte-level tokens"
    for key in ("continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(key):
            return f"the BPE model has a {key} ({model[key]!r}); GPT-2 has none"
    alphabet = set(bytes_to_unicode().values())
    added = {t["content"] for t in tj.get("added_tokens", [])}
    vocab = model.get("vocab") or {}
    if not vocab:
        return "the BPE model has an empty vocabulary"
    for token in vocab:
        if token not in added and not set(token) <= alphabet:
            return f"vocabulary token {token!r} is not written in GPT-2's byte alphabet"
    return None


def tokenizer_is_gpt2_byte_level(tokenizer_json: str | Path | dict[str, Any]) -> bool:
    """True when ``tokenizer.json`` is GPT-2-style byte-level BPE (see :func:`gpt2_byte_level_mismatch`)."""
    return gpt2_byte_level_mismatch(tokenizer_json) is None


# ------------------------------------------------------------------ conversion (one subprocess)
def convert_argv(model_dir: str | Path, out_path: str | Path, outtype: str, converter: Path,
                 force_gpt2_pre: bool, python: str = sys.executable) -> list[str]:
    """The converter command line: this module's ``_convert`` entry around the shipped converter."""
    argv = [python, "-m", "edge.pipeline.bench.llamacpp", "_convert", "--converter-dir", str(converter)]
    if force_gpt2_pre:
        argv.append("--gpt2-pre-if-unknown")
    return [*argv, "--", str(model_dir), "--outtype", outtype, "--outfile", str(out_path)]


def convert_to_gguf(model_dir: str | Path, out_path: str | Path, outtype: str = "f32",
                    timeout: float = 900.0) -> Path:
    """Convert an HF Llama folder to GGUF with the converter shipped in the llama-cpp-python sdist.

    When our tokenizer is GPT-2-style byte-level BPE and the converter does not know its
    pre-tokenizer hash, the pre-type is :data:`GPT2_PRE` (module docstring); otherwise the converter
    decides alone. The file appears at ``out_path`` only if the conversion succeeded.

    Args:
        model_dir: HF Llama folder (``config.json``, ``model*.safetensors``, ``tokenizer.json``).
        out_path: the ``.gguf`` file to write.
        outtype: one of :data:`OUTTYPES`.
    Raises:
        MissingExtraError: llama-cpp-python or its converter is not installed.
        SmartExitError: bad ``outtype`` / ``out_path``, or the converter failed (its last output
            lines are in the message).
    """
    from edge.core.artifacts import atomic_path
    from edge.core.device import run_command

    if outtype not in OUTTYPES:
        raise SmartExitError(f"outtype must be one of {OUTTYPES}, got {outtype!r}")
    if Path(out_path).suffix != ".gguf" or Path(out_path).is_dir():
        raise SmartExitError(f"out_path must name a .gguf file, got {out_path} "
                             "(cached_gguf(run_dir, model_dir) picks the run's cached file)")
    require_available()
    model_dir = Path(model_dir)
    why_not = gpt2_byte_level_mismatch(model_dir / "tokenizer.json")
    with atomic_path(out_path) as tmp:
        res = run_command(convert_argv(model_dir, tmp, outtype, converter_dir(), why_not is None), timeout=timeout)
        if res.returncode != 0:
            tail = "\n".join((res.stdout + res.stderr).strip().splitlines()[-15:])
            hint = (f"\nits pre-tokenizer hash is unknown and ours is not GPT-2 byte-level BPE ({why_not})"
                    if UNKNOWN_PRE in res.stderr and why_not else "")
            raise SmartExitError(f"converting {model_dir} to GGUF ({outtype}) failed (exit {res.returncode}):"
                                 f"\n{tail}{hint}")
    return Path(out_path)


def gguf_path(run_dir: str | Path, model_dir: str | Path, outtype: str = "f32") -> Path:
    """Where a run caches the GGUF of a checkpoint: keyed by its sha256 and the llama-cpp-python version."""
    from edge.core.artifacts import sha256_path

    return Path(run_dir) / GGUF_DIR / f"{sha256_path(model_dir)[:16]}-llama-cpp-python-{llamacpp_version()}-{outtype}.gguf"


def cached_gguf(run_dir: str | Path, model_dir: str | Path, outtype: str = "f32") -> Path:
    """The run's GGUF of ``model_dir``, converting it on first use (see :func:`convert_to_gguf`)."""
    require_available()
    path = gguf_path(run_dir, model_dir, outtype)
    return path if path.is_file() else convert_to_gguf(model_dir, path, outtype)


def _convert_main(argv: list[str]) -> int:
    """In the converter subprocess: import the shipped converter, patch the pre-type fallback, run it."""
    ap = argparse.ArgumentParser(prog="python -m edge.pipeline.bench.llamacpp _convert")
    ap.add_argument("--converter-dir", type=Path, required=True)
    ap.add_argument("--gpt2-pre-if-unknown", action="store_true")
    ap.add_argument("converter_args", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    rest = args.converter_args[1:] if args.converter_args[:1] == ["--"] else args.converter_args
    sys.path[:0] = [str(args.converter_dir), str(args.converter_dir / "gguf-py")]
    import convert_hf_to_gguf as converter  # the vendored script; its main() runs only as __main__
    from conversion.base import TextModel, logger

    if args.gpt2_pre_if_unknown:
        upstream = TextModel.get_vocab_base_pre

        def get_vocab_base_pre(self, tokenizer) -> str:
            try:
                return upstream(self, tokenizer)
            except NotImplementedError:  # the converter's answer for a hash not on its list
                logger.warning("pre-tokenizer hash unknown; tokenizer.json checked to be GPT-2 byte-level "
                               "BPE by edge.pipeline.bench.llamacpp, so tokenizer.ggml.pre = %r", GPT2_PRE)
                return GPT2_PRE

        TextModel.get_vocab_base_pre = get_vocab_base_pre
    sys.argv = ["convert_hf_to_gguf.py", *rest]
    converter.main()
    return 0


# ------------------------------------------------------------------ quantization (llama.cpp's own quantizer)
def canonical_qtype(qtype: str) -> str:
    """The :data:`QTYPES` key for ``qtype`` (an alias such as ``q4_K`` resolved; case ignored).

    Raises:
        ConfigError: ``qtype`` is none of them (the message lists the allowed names).
    """
    names = {**{q.lower(): q for q in QTYPES}, **{a.lower(): q for a, q in QTYPE_ALIASES.items()}}
    try:
        return names[str(qtype).lower()]
    except KeyError:
        raise ConfigError(f"llama.cpp quantization type must be one of {[*QTYPES, *QTYPE_ALIASES]}, "
                          f"got {qtype!r}") from None


def quantized_gguf_path(src_gguf: str | Path, qtype: str) -> Path:
    """The quantized file beside ``src_gguf``, named after it: ``<stem>-to-<qtype>.gguf``.

    Derived from the source's name, so it inherits :func:`gguf_path`'s cache key (checkpoint sha256,
    llama-cpp-python version, source type) and never collides with a converter output of that type.
    """
    src = Path(src_gguf)
    return src.with_name(f"{src.stem}-to-{canonical_qtype(qtype)}.gguf")


class _LlamaLogCapture:
    """Collect llama.cpp's log lines while in the block, then give back the callback that was set."""

    def __enter__(self) -> list[str]:
        import ctypes

        import llama_cpp

        self._lib, self.lines = llama_cpp, []
        self._prev_cb, self._prev_data = llama_cpp.llama_log_callback(), ctypes.c_void_p()
        llama_cpp.llama_log_get(ctypes.byref(self._prev_cb), ctypes.byref(self._prev_data))

        @llama_cpp.llama_log_callback
        def collect(level: int, text: bytes, user_data) -> None:
            self.lines.append(text.decode("utf-8", errors="replace"))

        self._cb = collect  # referenced until restored: llama.cpp holds only the C pointer
        llama_cpp.llama_log_set(self._cb, None)
        return self.lines

    def __exit__(self, *exc) -> None:
        self._lib.llama_log_set(self._prev_cb, self._prev_data)


def quantize_gguf(src_gguf: str | Path, out_gguf: str | Path, qtype: str, threads: int = 0) -> Path:
    """Quantize a GGUF with llama.cpp's quantizer (``llama_model_quantize``, default parameters).

    llama.cpp chooses each tensor's type from ``qtype`` (module docstring): norms stay F32, and rows
    that a type's block does not divide fall back; :func:`gguf_tensor_types` tells what was stored.
    The file appears at ``out_gguf`` only if quantization succeeded.

    Args:
        src_gguf: an f32 / f16 / bf16 GGUF (:func:`cached_gguf`).
        out_gguf: the ``.gguf`` file to write.
        qtype: a :data:`QTYPES` key or alias (``q8_0``, ``q4_0``, ``q4_K_M`` = ``q4_K``).
        threads: quantizer threads; 0 lets llama.cpp use every hardware thread.
    Returns:
        ``out_gguf``.
    Raises:
        ConfigError: unknown ``qtype``.
        MissingExtraError: llama-cpp-python is not installed.
        SmartExitError: ``src_gguf`` missing or ``out_gguf`` not a ``.gguf`` path.
        QuantizationFailed: the quantizer returned non-zero (its last log lines are in the message).
    """
    import ctypes

    from edge.core.artifacts import atomic_path

    qtype = canonical_qtype(qtype)
    src, out = Path(src_gguf), Path(out_gguf)
    if not src.is_file():
        raise SmartExitError(f"GGUF file {src} does not exist")
    if out.suffix != ".gguf" or out.is_dir():
        raise SmartExitError(f"out_gguf must name a .gguf file, got {out}")
    if out.resolve() == src.resolve():
        raise SmartExitError(f"quantizing {src} onto itself")
    require_available()
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, QTYPES[qtype])
    params.nthread = max(0, int(threads))
    with atomic_path(out) as tmp, _LlamaLogCapture() as log:
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
        if rc != 0:
            tail = "".join(log).strip().splitlines()[-10:]
            raise QuantizationFailed(f"llama.cpp could not quantize {src} to {qtype} (llama_model_quantize "
                                     f"returned {rc}):\n" + "\n".join(tail))
    return out


def cached_quantized_gguf(run_dir: str | Path, model_dir: str | Path, qtype: str, threads: int = 0) -> Path:
    """The run's ``qtype`` GGUF of ``model_dir``: quantized from the run's cached f32 GGUF
    (:func:`cached_gguf`, converted on first use) into :func:`quantized_gguf_path` beside it.

    The name carries the f32 file's cache key, so other weights or another llama-cpp-python get
    another file; a quantized file older than its f32 source is rebuilt.
    """
    src = cached_gguf(run_dir, model_dir, "f32")
    out = quantized_gguf_path(src, qtype)
    if out.is_file() and out.stat().st_mtime >= src.stat().st_mtime:
        return out
    return quantize_gguf(src, out, qtype, threads)


# ------------------------------------------------------------------ what a GGUF stores
def _gguf_module():
    """The ``gguf`` package: installed, or the ``gguf-py`` of the unpacked sdist (as the converter uses)."""
    try:
        import gguf
    except ImportError:
        gguf_py = converter_dir() / "gguf-py"
        if not (gguf_py / "gguf").is_dir():
            raise MissingExtraError(f"the gguf package is not installed and {gguf_py} is missing: "
                                    f"{INSTALL_HINT}") from None
        sys.path.append(str(gguf_py))  # appended: an installed gguf would still win
        import gguf
    return gguf


def gguf_tensor_types(gguf_file: str | Path) -> dict[str, str]:
    """Tensor name -> ggml type name (``F32``, ``Q8_0``, ``Q4_K``, ...) as stored in a GGUF file, in file order.

    Raises:
        SmartExitError: the file is missing or not a readable GGUF.
    """
    path = Path(gguf_file)
    if not path.is_file():
        raise SmartExitError(f"GGUF file {path} does not exist")
    gguf = _gguf_module()
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError) as exc:
        raise SmartExitError(f"{path} is not a readable GGUF file: {exc}") from exc
    return {t.name: t.tensor_type.name for t in reader.tensors}


def tensor_type_counts(types: dict[str, str]) -> dict[str, int]:
    """How many tensors of each type (most frequent first), from :func:`gguf_tensor_types`."""
    from collections import Counter

    return dict(sorted(Counter(types.values()).items(), key=lambda kv: (-kv[1], kv[0])))


def gguf_bytes(gguf_file: str | Path) -> int:
    """Size of a GGUF file in bytes (weights, vocabulary and metadata)."""
    path = Path(gguf_file)
    if not path.is_file():
        raise SmartExitError(f"GGUF file {path} does not exist")
    return path.stat().st_size


# ------------------------------------------------------------------ the peer
class PeerGeneration(NamedTuple):
    tokens: list[int]  # [N] generated ids
    seconds: float  # the whole call, prefill included
    token_latencies: list[float]  # [N - 1] seconds between consecutive generated tokens


class LlamaCppPeer:
    """llama.cpp greedy decoding at batch 1 on a GGUF: prompt as ids in, ids out.

    The loop is the one of llama.cpp's ``simple`` example: ``llama_decode`` the prompt, then one
    token at a time, choosing with llama.cpp's own greedy sampler (first maximum, like argmax).
    Weights are read into memory at load (no mmap), so the first timed call pays no page faults.
    """

    def __init__(self, gguf: str | Path, threads: int, n_ctx: int = 512) -> None:
        require_available()
        import llama_cpp

        if threads < 1 or n_ctx < 2:
            raise SmartExitError(f"LlamaCppPeer needs threads >= 1 and n_ctx >= 2, got {threads} and {n_ctx}")
        if not Path(gguf).is_file():
            raise SmartExitError(f"GGUF file {gguf} does not exist")
        self._lib = llama_cpp
        self.gguf, self.threads, self.n_ctx = Path(gguf), threads, n_ctx
        try:
            self.llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx,
                                       n_threads=threads, n_threads_batch=threads, use_mmap=False,
                                       verbose=False)
        except ValueError as exc:  # llama-cpp-python's only word for any load failure
            raise SmartExitError(f"llama.cpp cannot load {gguf} ({exc}); load it with llama_cpp.Llama(..., "
                                 "verbose=True) to see llama.cpp's reason") from exc
        self._vocab = llama_cpp.llama_model_get_vocab(self.llm.model)
        self._sampler = llama_cpp.llama_sampler_init_greedy()
        self._batch = None  # a llama_batch of n_ctx tokens, made by the first logits() call

    def close(self) -> None:
        if self._sampler is not None:
            self._lib.llama_sampler_free(self._sampler)
            self._sampler = None
        if self._batch is not None:
            self._lib.llama_batch_free(self._batch)
            self._batch = None
        self.llm.close()

    def __enter__(self) -> LlamaCppPeer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _decode(self, ids: Sequence[int]) -> None:
        arr = (self._lib.llama_token * len(ids))(*ids)
        rc = self._lib.llama_decode(self.llm.ctx, self._lib.llama_batch_get_one(arr, len(ids)))
        if rc != 0:
            raise SmartExitError(f"llama_decode failed with code {rc} ({len(ids)} tokens)")

    def generate(self, prompt_ids: Sequence[int], n: int) -> PeerGeneration:
        """Greedy ``n`` tokens after ``prompt_ids``, from an empty cache.

        Raises:
            SmartExitError: empty prompt, n < 1, or prompt + n beyond ``n_ctx``.
        """
        lib, ctx = self._lib, self.llm.ctx
        if not prompt_ids or n < 1 or len(prompt_ids) + n > self.n_ctx:
            raise SmartExitError(f"prompt of {len(prompt_ids)} tokens + {n} new tokens must be within "
                                 f"n_ctx={self.n_ctx} (and both at least 1)")
        lib.llama_memory_clear(lib.llama_get_memory(ctx), True)
        lib.llama_sampler_reset(self._sampler)
        tokens: list[int] = []
        stamps: list[float] = []
        t0 = time.perf_counter()
        self._decode(list(prompt_ids))
        while True:
            tokens.append(int(lib.llama_sampler_sample(self._sampler, ctx, -1)))
            stamps.append(time.perf_counter())
            if len(tokens) == n:
                break
            self._decode(tokens[-1:])
        seconds = time.perf_counter() - t0
        return PeerGeneration(tokens, seconds, [b - a for a, b in zip(stamps, stamps[1:])])

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        """Teacher-forced logits at every position of ``ids``, from an empty cache: row ``i`` scores
        the token after ``ids[:i + 1]``. One ``llama_decode`` of a batch that asks for every
        position's output (``llama_batch_get_one`` would give only the last).

        Args:
            ids: [T] token ids, 1 <= T <= ``n_ctx``.
        Returns:
            [T, V] float32.
        Raises:
            SmartExitError: bad length or an id outside the vocabulary.
        """
        import numpy as np

        lib, ctx = self._lib, self.llm.ctx
        ids = [int(t) for t in ids]
        n, vocab = len(ids), self.vocab_size
        if not 1 <= n <= self.n_ctx:
            raise SmartExitError(f"logits() takes 1 to n_ctx={self.n_ctx} tokens, got {n}")
        if min(ids) < 0 or max(ids) >= vocab:
            raise SmartExitError(f"token ids must be in [0, {vocab}), got {min(ids)}..{max(ids)}")
        if self._batch is None:
            self._batch = lib.llama_batch_init(self.n_ctx, 0, 1)
        batch = self._batch
        for i, t in enumerate(ids):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = t, i, 1, 1
            batch.seq_id[i][0] = 0
        batch.n_tokens = n
        lib.llama_memory_clear(lib.llama_get_memory(ctx), True)
        rc = lib.llama_decode(ctx, batch)
        if rc != 0:
            raise SmartExitError(f"llama_decode failed with code {rc} ({n} tokens, all logits)")
        # llama.cpp returns requested outputs in batch order: [n_outputs, n_vocab]
        return np.ctypeslib.as_array(lib.llama_get_logits(ctx), shape=(n, vocab)).copy()

    # tokenizer of the GGUF
    def tokenize(self, text: str, special: bool = False) -> list[int]:
        return self.llm.tokenize(text.encode("utf-8"), add_bos=False, special=special)

    def piece(self, token: int, special: bool = True) -> bytes:
        """The bytes of one token (``llama_token_to_piece``, with a buffer as large as the piece).

        Not ``Llama.detokenize``: llama-cpp-python 0.3.36 renders each token into a 32-byte buffer
        and silently cuts longer pieces (our vocabulary has indentation runs of up to 45 bytes).
        """
        import ctypes

        size = 64
        for _ in range(2):  # a negative result is the size that was needed
            buf = ctypes.create_string_buffer(size)
            n = self._lib.llama_token_to_piece(self._vocab, token, buf, size, 0, special)
            if n >= 0:
                return buf.raw[:n]
            size = -n
        raise SmartExitError(f"llama_token_to_piece failed for token {token}")

    def detokenize(self, ids: Sequence[int], special: bool = False) -> bytes:
        """Ids back to bytes, piece by piece. (``llama_detokenize`` would also apply the
        tokenization-space clean-up, ``" ."`` -> ``"."``, that llama.cpp enables for GPT-2
        vocabularies; our tokenizer's decode does not, and neither matters to ids.)"""
        return b"".join(self.piece(t, special) for t in ids)

    @property
    def vocab_size(self) -> int:
        return self._lib.llama_vocab_n_tokens(self._vocab)


# ------------------------------------------------------------------ checks against ours
EDGE_CASES = (
    "", " ", "  ", "\n", "\n\n\n", "\t", "\t\t x", "a  b   c    d", "   leading", "trailing   ",
    "x = 1\n    \n\ty = 2\r\n", "if x:\n\tpass\n\n\n        return", "3 33 333 3333 3.14 1e-5 0x1F",
    "I'm sure you'll see it's 'quoted' and \"double\" 'S 'LL", "héllo wörld naïve café", "日本語のテキスト 中文",
    "emoji 🦙🚀 😶\u200d🌫️ ✅", "Ελληνικά and кириллица", "\u00a0non-breaking\u2003em space", "a\u0301 combining",
    "<|endoftext|>", "before<|endoftext|>after", "$$ @@ ## %% ^^ && ** (( )) [[ ]] {{ }}",
)


def verification_texts(max_chars: int = 4000, documents: int | None = None) -> list[str]:
    """Held-out texts (test-split documents, all by default, up to ``max_chars`` each) and the edge cases above."""
    from edge.core.data import Split, load_split

    docs = [d.text[:max_chars] for d in load_split(Split.TEST)[:documents]]
    return [*docs, *EDGE_CASES]


def our_token_bytes(tokenizer_json: str | Path | dict[str, Any]) -> list[bytes]:
    """Bytes of every id of a GPT-2 byte-level ``tokenizer.json`` (added tokens: their text)."""
    tj = _as_json(tokenizer_json)
    to_byte = {c: b for b, c in bytes_to_unicode().items()}
    table = {i: bytes(to_byte[c] for c in tok) for tok, i in tj["model"]["vocab"].items()}
    table.update({t["id"]: t["content"].encode("utf-8") for t in tj.get("added_tokens", [])})
    return [table.get(i, b"") for i in range(max(table) + 1)]


def verify_tokenizer(model_dir: str | Path, gguf: str | Path | LlamaCppPeer,
                     texts: Sequence[str] | None = None) -> int:
    """Check that llama.cpp's tokenizer from the GGUF is ours: the same bytes for every id, and the
    same ids for held-out texts (``<|endoftext|>`` special on both sides, llama.cpp ``special=True``).

    Args:
        model_dir: the HF folder whose ``tokenizer.json`` is ours.
        gguf: the converted file, or a peer already holding it.
        texts: defaults to :func:`verification_texts`.
    Returns:
        the number of texts checked.
    Raises:
        TokenizerMismatch: naming the first id whose bytes differ, or the first text and position
            where the ids differ.
    """
    from edge.model.tokenizer import load_tokenizer

    ours = load_tokenizer(model_dir)
    opened = isinstance(gguf, (str, Path))
    peer = LlamaCppPeer(gguf, threads=1) if opened else gguf
    try:
        pieces = our_token_bytes(Path(model_dir) / "tokenizer.json")
        if peer.vocab_size != len(pieces):
            raise TokenizerMismatch(f"llama.cpp's vocabulary has {peer.vocab_size} tokens, ours {len(pieces)}")
        for i, want_piece in enumerate(pieces):
            if peer.piece(i, special=True) != want_piece:
                raise TokenizerMismatch(f"token {i} is {want_piece!r} in {model_dir}/tokenizer.json but "
                                        f"{peer.piece(i, special=True)!r} in llama.cpp's vocabulary")
        texts = verification_texts() if texts is None else list(texts)
        for k, text in enumerate(texts):
            want = ours.encode(text).ids
            got = peer.tokenize(text, special=True)
            if got != want:
                i = next((j for j, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
                ctx = ours.decode(want[max(0, i - 3):i + 3], skip_special_tokens=False)
                raise TokenizerMismatch(
                    f"llama.cpp tokenizes text {k} ({text[:40]!r}...) differently from {model_dir}/tokenizer.json: "
                    f"first difference at token {i}: ours {want[i:i + 5]} vs llama.cpp {got[i:i + 5]} "
                    f"(around {ctx!r})")
        return len(texts)
    finally:
        if opened:
            peer.close()


def reference_greedy(model_dir: str | Path, prompts: Sequence[Sequence[int]], n: int) -> list[list[int]]:
    """Our greedy tokens: ``edge.model.checkpoint.load_decoder`` in float32 with a K/V cache, one prompt at a time."""
    import torch

    from edge.model.checkpoint import load_decoder

    dec = load_decoder(model_dir)
    out: list[list[int]] = []
    with torch.no_grad():
        for prompt in prompts:
            res = dec(torch.tensor([list(prompt)]))
            keys, values = res.keys, res.values  # per layer [1, KV, T, hd]
            toks = [int(res.logits[0, -1].argmax())]
            while len(toks) < n:
                res = dec(torch.tensor([toks[-1:]]), past=list(zip(keys, values)))
                keys = [torch.cat(kv, dim=2) for kv in zip(keys, res.keys)]
                values = [torch.cat(kv, dim=2) for kv in zip(values, res.values)]
                toks.append(int(res.logits[0, -1].argmax()))
            out.append(toks)
    return out


def check_greedy_match(peer: LlamaCppPeer, reference_tokens_per_prompt: Sequence[Sequence[int]],
                       prompts: Sequence[Sequence[int]]) -> float:
    """Fraction of llama.cpp's greedy tokens equal to the reference, position by position.

    The benchmark reports the peer's speed only when this is 1.0 (:func:`require_greedy_match`).
    """
    if len(prompts) != len(reference_tokens_per_prompt) or not prompts:
        raise SmartExitError(f"{len(prompts)} prompts but {len(reference_tokens_per_prompt)} reference sequences")
    same = total = 0
    for prompt, ref in zip(prompts, reference_tokens_per_prompt):
        got = peer.generate(prompt, len(ref)).tokens
        same += sum(a == b for a, b in zip(got, ref))
        total += len(ref)
    return same / total


def require_greedy_match(peer: LlamaCppPeer, reference_tokens_per_prompt: Sequence[Sequence[int]],
                         prompts: Sequence[Sequence[int]]) -> float:
    """:func:`check_greedy_match`, raising :class:`GreedyMismatch` below 1.0."""
    frac = check_greedy_match(peer, reference_tokens_per_prompt, prompts)
    if frac < 1.0:
        raise GreedyMismatch(f"llama.cpp ({peer.gguf.name}) matches our greedy tokens for only {frac:.1%} of "
                             f"{sum(map(len, reference_tokens_per_prompt))} tokens; its speed is not reported")
    return frac


# ------------------------------------------------------------------ quality on held-out text
def next_token_scores(logits: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Negative log-likelihood and top-1 hit of each next token of one window, in float64.

    Args:
        logits: [T, V] (row i predicts ids[i + 1]; the last row is unused).
        ids: [T] the window's token ids.
    Returns:
        (nll [T-1] float64, hit [T-1] bool: first argmax == next token).
    """
    import numpy as np

    z = np.asarray(logits, dtype=np.float64)[:-1]  # [T-1, V]
    nxt = np.asarray(ids, dtype=np.int64)[1:]  # [T-1]
    if z.ndim != 2 or z.shape[0] != nxt.shape[0]:
        raise SmartExitError(f"logits {np.shape(logits)} do not fit ids {np.shape(ids)}")
    m = z.max(axis=1, keepdims=True)
    log_z = (m + np.log(np.exp(z - m).sum(axis=1, keepdims=True)))[:, 0]  # [T-1] log-sum-exp
    nll = log_z - z[np.arange(nxt.size), nxt]
    return nll, z.argmax(axis=1) == nxt


@dataclass(frozen=True)
class PeerQuality:
    """Teacher-forced next-token quality over held-out windows (tokens 1..T-1 of each window)."""

    windows: int
    window_tokens: int  # T
    mean_nll: float  # nats per predicted token, over all N * (T - 1)
    perplexity: float  # exp(mean_nll)
    top1: float  # fraction of predicted tokens that are the argmax
    window_nll: tuple[float, ...]  # [N] mean NLL of each window

    @classmethod
    def from_scores(cls, nll: np.ndarray, hit: np.ndarray) -> PeerQuality:
        """From per-token ``nll`` / ``hit`` arrays [N, T-1] (:func:`next_token_scores` per window)."""
        import numpy as np

        nll, hit = np.asarray(nll, dtype=np.float64), np.asarray(hit, dtype=bool)
        if nll.ndim != 2 or nll.shape != hit.shape or nll.size == 0:
            raise SmartExitError(f"nll {nll.shape} and hit {hit.shape} must be the same non-empty [N, T-1]")
        mean = float(nll.mean())
        return cls(nll.shape[0], nll.shape[1] + 1, mean, float(np.exp(mean)), float(hit.mean()),
                   tuple(float(x) for x in nll.mean(axis=1)))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["window_nll"] = list(self.window_nll)
        return d


def peer_perplexity(peer_or_gguf: LlamaCppPeer | str | Path, windows_ids: np.ndarray,
                    threads: int = 2) -> PeerQuality:
    """llama.cpp's perplexity and top-1 accuracy on ``windows_ids``, each window scored from an
    empty cache (the tokenizer must be ours, :func:`verify_tokenizer`, for the ids to mean the same).

    Args:
        peer_or_gguf: a loaded peer, or a GGUF file (opened with ``threads`` and closed again).
        windows_ids: [N, T] int token ids (``TokenCorpus.draw(...).ids``), T >= 2.
        threads: llama.cpp threads when a file is given.
    Raises:
        SmartExitError: not a non-empty [N, T >= 2] array, or T beyond the peer's ``n_ctx``.
    """
    import numpy as np

    ids = np.asarray(windows_ids)
    if ids.ndim != 2 or ids.shape[0] < 1 or ids.shape[1] < 2 or not np.issubdtype(ids.dtype, np.integer):
        raise SmartExitError(f"windows_ids must be integer [N >= 1, T >= 2], got {ids.dtype} {ids.shape}")
    opened = isinstance(peer_or_gguf, (str, Path))
    peer = LlamaCppPeer(peer_or_gguf, threads, n_ctx=max(ids.shape[1], 2)) if opened else peer_or_gguf
    try:
        scores = [next_token_scores(peer.logits(w.tolist()), w) for w in ids]
    finally:
        if opened:
            peer.close()
    return PeerQuality.from_scores(np.stack([s[0] for s in scores]), np.stack([s[1] for s in scores]))


if __name__ == "__main__" and sys.argv[1:2] == ["_convert"]:
    sys.exit(_convert_main(sys.argv[2:]))
