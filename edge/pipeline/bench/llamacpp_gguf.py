"""The same weights for llama.cpp: GGUF conversion, quantization at our bit-widths, what a GGUF stores.

The same weights reach llama.cpp through the converter shipped in the llama-cpp-python sdist (unpacked
by ``make llamacpp``, found by ``llamacpp.converter_dir``): :func:`convert_to_gguf`, one subprocess.
The converter names a BPE tokenizer's pre-tokenizer by hashing the tokens of a fixed text against
a list of known models (llama.cpp PR 6920); ours is on no such list. It is GPT-2's byte-level BPE
(``edge.model.tokenizer.train_tokenizer``), which llama.cpp implements as the ``gpt-2`` pre-type (the name
the converter's list gives openai-community/gpt2). So only after :func:`tokenizer_is_gpt2_byte_level`
(``llamacpp_tokenizer``) has checked the actual pre-tokenizer, decoder and model of ``tokenizer.json`` does
the conversion fall back to ``gpt-2`` for a hash it does not know (the vendored converter is never edited).

For the compression comparison the peer also runs at our bit-widths: :func:`quantize_gguf` hands the
f32 GGUF to llama.cpp's own quantizer (``llama_model_quantize``, what the ``llama-quantize`` tool
calls) for :data:`QTYPES`, and :func:`gguf_tensor_types` reads back what was stored, because llama.cpp
picks per tensor (``llama-quant.cpp``): 1-d tensors (norms) stay F32; the output matrix, and the
token embedding when it is tied to it as ours is, get Q6_K under the 4-bit types; Q4_K_M keeps some
attn_v / ffn_down at Q6_K; and a tensor whose rows are not a multiple of a type's block (32 for
Q4_0 / Q8_0, 256 for the k-quants) falls back to another type (``tensor_type_fallback``:
Q4_K -> Q5_0, Q6_K -> Q8_0; F16 when even 32 does not divide).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from edge.core.errors import ConfigError, MissingExtraError, SmartExitError
from edge.pipeline.bench.llamacpp import INSTALL_HINT, converter_dir, llamacpp_version, require_available
from edge.pipeline.bench.llamacpp_tokenizer import gpt2_byte_level_mismatch

OUTTYPES = ("f32", "f16", "bf16", "q8_0")
GGUF_DIR = "llamacpp"  # under a run's artifacts folder
UNKNOWN_PRE = "BPE pre-tokenizer was not recognized"  # the converter's message for an unknown hash
# tokenizer.ggml.pre of GPT-2's own tokenizer: the converter's hash list maps openai-community/gpt2 to it,
# and llama.cpp's llama-vocab.cpp maps it to LLAMA_VOCAB_PRE_TYPE_GPT2 (GPT-2's split regex)
GPT2_PRE = "gpt-2"
# llama.cpp's quantizer targets (llama_ftype names in llama.h); "q4_K" is llama-quantize's own alias of Q4_K_M
QTYPES = {"q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0", "q4_K_M": "LLAMA_FTYPE_MOSTLY_Q4_K_M"}
QTYPE_ALIASES = {"q4_K": "q4_K_M"}


class QuantizationFailed(SmartExitError):
    """llama.cpp's quantizer returned an error for a GGUF file."""


# ------------------------------------------------------------------ conversion (one subprocess)
def convert_argv(model_dir: str | Path, out_path: str | Path, outtype: str, converter: Path,
                 force_gpt2_pre: bool, python: str = sys.executable) -> list[str]:
    """The converter command line: this module's ``_convert`` entry around the shipped converter."""
    argv = [python, "-m", "edge.pipeline.bench.llamacpp_gguf", "_convert", "--converter-dir", str(converter)]
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
    ap = argparse.ArgumentParser(prog="python -m edge.pipeline.bench.llamacpp_gguf _convert")
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
                               "BPE by edge.pipeline.bench.llamacpp_tokenizer, so tokenizer.ggml.pre = %r", GPT2_PRE)
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


# ------------------------------------------------------------------ the same precision as ours
# our precision (edge.compress.quant.Precision values; "fp32" for the float model, as
# edge.compress.apply.precision_of names it) -> the llama.cpp type that stores weights at that width
SAME_PRECISION = {"fp32": "f32", "w8a8": "q8_0", "w4": "q4_0"}


def same_precision_type(precision: str) -> str:
    """The GGUF type a llama.cpp peer runs at when compared with a system of our ``precision``.

    The float engine is compared with f32, the shipped INT8 (W8A8) model with q8_0, INT4 (W4) with q4_0:
    the same bits per weight, not the same arithmetic. What the pairing does not equalise:

    - W8A8 vs q8_0: ours stores INT8 weights with one scale per output channel and quantizes activations
      per tensor with a static scale calibrated offline; q8_0 stores an f16 scale per block of 32 weights
      (8.5 bits a weight) and its vec_dot quantizes each activation row on the fly to int8 per block of
      32 (``quantize_row_q8_0``), so its activation scales follow the data and are finer-grained.
    - W4 vs q4_0: a scale per block of weights in both (ours: ``block_size`` inputs, 32 by default,
      the scale searched over clipping ratios; q4_0: 32, from the block's largest magnitude); both
      quantize activations per block on the fly.
    - Everywhere: llama.cpp keeps norms in f32 and K/V in f16 (its default cache type), and its kernels,
      graph and threading are ggml's, not ONNX Runtime's.

    Raises:
        ConfigError: a precision with no llama.cpp counterpart (a mix such as ``w4+w8a8``).
    """
    try:
        return SAME_PRECISION[precision]
    except KeyError:
        raise ConfigError(f"no llama.cpp GGUF type has the precision {precision!r}; known: "
                          f"{', '.join(f'{ours} -> {theirs}' for ours, theirs in SAME_PRECISION.items())}") from None


def same_precision_gguf(run_dir: str | Path, model_dir: str | Path, precision: str, threads: int = 0) -> Path:
    """The run's GGUF of the float weights ``model_dir`` at :func:`same_precision_type` (``precision``):
    the f32 conversion itself (:func:`cached_gguf`) or llama.cpp's quantization of it
    (:func:`cached_quantized_gguf`), both cached under the run.

    ``model_dir`` is the float checkpoint (the distilled model) even for a compressed run: llama.cpp
    quantizes those weights itself, as it would for any user.
    """
    qtype = same_precision_type(precision)
    if qtype == "f32":
        return cached_gguf(run_dir, model_dir, "f32")
    return cached_quantized_gguf(run_dir, model_dir, qtype, threads)


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


if __name__ == "__main__" and sys.argv[1:2] == ["_convert"]:
    sys.exit(_convert_main(sys.argv[2:]))
