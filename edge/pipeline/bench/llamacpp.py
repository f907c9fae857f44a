"""llama.cpp as a peer system of ``smartexit bench decode`` (system f): where it is installed, the peer
itself (:class:`LlamaCppPeer`) and the check of its greedy tokens against ours.

``llama-cpp-python`` is built from its source distribution by ``make llamacpp`` (never by
``make test`` / ``make demo``), which also unpacks that sdist into ``.venv/llamacpp-src/``: the
converter (``vendor/llama.cpp/convert_hf_to_gguf.py`` with its ``conversion`` and ``gguf-py``
packages) ships in the sdist, not in the wheel. :func:`available` says why the peer cannot run.

The same weights reach llama.cpp through that converter (``llamacpp_gguf``, which also quantizes them
and reads back what a GGUF stores); ``llamacpp_tokenizer`` checks that the converted tokenizer reproduces
ours id for id, and :func:`check_greedy_match` that llama.cpp's greedy tokens are ours before its speed is
reported. Its quality on held-out text is scored in ``llamacpp_quality``. :meth:`LlamaCppPeer.generate_timed`
times the prefill and the decode steps apart; ``llamacpp_bench`` sets that row beside llama.cpp's own
``llama-bench``.
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, NamedTuple, Sequence

from edge.core.errors import MissingExtraError, SmartExitError

if TYPE_CHECKING:
    import numpy as np

INSTALL_HINT = "run `make llamacpp`"
SRC_ENV = "SMARTEXIT_LLAMACPP_SRC"  # overrides where the unpacked sdist is looked for


class GreedyMismatch(SmartExitError):
    """llama.cpp's greedy tokens differ from ours: its speed must not be reported."""


# ------------------------------------------------------------------ where things are
def source_dir() -> Path:
    """The unpacked llama-cpp-python sdist (``$SMARTEXIT_LLAMACPP_SRC`` or ``<venv>/llamacpp-src``)."""
    return Path(os.environ.get(SRC_ENV) or Path(sys.prefix) / "llamacpp-src")


def converter_dir() -> Path:
    """``vendor/llama.cpp`` of the sdist: ``convert_hf_to_gguf.py``, ``conversion/``, ``gguf-py/``."""
    return source_dir() / "vendor" / "llama.cpp"


def sdist_version(src: Path | None = None) -> str | None:
    """The llama-cpp-python version of the unpacked sdist (its ``PKG-INFO``; default :func:`source_dir`),
    or None when it is not there."""
    pkg_info = (src or source_dir()) / "PKG-INFO"
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
    src_version = sdist_version()
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


# ------------------------------------------------------------------ the peer
class PeerGeneration(NamedTuple):
    tokens: list[int]  # [N] generated ids
    seconds: float  # the whole call, prefill included
    token_latencies: list[float]  # [N - 1] seconds between consecutive generated tokens


class PeerTiming(NamedTuple):
    """One greedy generation timed in two parts: the prefill, and the decode steps after it."""

    tokens: list[int]  # [N] generated ids, N >= 2
    prompt_tokens: int
    prefill_seconds: float  # llama_decode of the whole prompt + the greedy choice of the first token
    decode_seconds: float  # the N - 1 single-token llama_decode calls after it, each with its greedy choice
    token_latencies: list[float]  # [N - 1] seconds between consecutive generated tokens (sum: decode_seconds)

    @property
    def decode_tokens_per_s(self) -> float:
        return (len(self.tokens) - 1) / self.decode_seconds

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_seconds


def greedy_stamps(decode: Callable[[list[int]], None], sample: Callable[[], int], prompt_ids: Sequence[int],
                  n: int, clock: Callable[[], float] = time.perf_counter) -> tuple[list[int], list[float]]:
    """The batch-1 greedy loop, timestamped: ``decode(prompt)``, then ``n - 1`` times ``decode([last])``,
    choosing each token with ``sample()`` after its decode.

    Returns:
        (tokens [n], stamps [n + 1]): ``stamps[0]`` is taken before the prompt's decode and ``stamps[i]``
        right after token ``i - 1`` was chosen, so ``stamps[1] - stamps[0]`` is the prefill and
        ``stamps[n] - stamps[1]`` the ``n - 1`` decode steps.
    """
    tokens: list[int] = []
    stamps = [clock()]
    decode(list(prompt_ids))
    while True:
        tokens.append(int(sample()))
        stamps.append(clock())
        if len(tokens) == n:
            return tokens, stamps
        decode(tokens[-1:])


def timing_from_stamps(tokens: Sequence[int], prompt_tokens: int, stamps: Sequence[float]) -> PeerTiming:
    """Split :func:`greedy_stamps`' timestamps into prefill and decode seconds.

    Raises:
        SmartExitError: fewer than 2 tokens (no decode step to time), or not one stamp more than tokens.
    """
    if len(tokens) < 2 or len(stamps) != len(tokens) + 1:
        raise SmartExitError(f"decode timing needs >= 2 tokens and one stamp more than tokens, got "
                             f"{len(tokens)} tokens and {len(stamps)} stamps")
    return PeerTiming(list(tokens), prompt_tokens, stamps[1] - stamps[0], stamps[-1] - stamps[1], _gaps(stamps[1:]))


def _gaps(stamps: Sequence[float]) -> list[float]:
    return [b - a for a, b in zip(stamps, stamps[1:])]


# ------------------------------------------------------------------ weight repacking
# llama.cpp repacks some weight types at load into layouts for its CPU kernels ("extra buffer types"; on
# by default, llama-bench's --repack). Its repacked q8_0 kernels of llama-cpp-python 0.3.36 crash
# (SIGSEGV in the first llama_decode) on a 2-core Intel Xeon with AVX-512 VNNI (2026-12-05), where the
# plain kernels run: a crash takes the whole bench process with it, so whether repacking runs is
# probed in a child process first, per GGUF file, and the peer runs without it where it crashes.
PROBE_TOKENS = 4  # greedy tokens the probe decodes after an 8-token prompt
_REPACK: dict[tuple, bool] = {}  # (path, size, mtime, threads) -> whether repacking runs there


@contextlib.contextmanager
def _model_params(repack: bool) -> Iterator[None]:
    """llama-cpp-python's ``Llama`` takes no repacking switch: within this block the model parameters it
    starts from have ``use_extra_bufts`` = ``repack`` (llama.cpp's ``llama_model_params``)."""
    import llama_cpp.llama_cpp as lib

    default = lib.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = repack
        return p

    lib.llama_model_default_params = params
    try:
        yield
    finally:
        lib.llama_model_default_params = default


def probe_argv(gguf: str | Path, threads: int, repack: bool) -> list[str]:
    return [sys.executable, "-m", "edge.pipeline.bench.llamacpp", "probe", str(gguf), str(threads),
            "repack" if repack else "no-repack"]


def repack_runs(gguf: str | Path, threads: int, timeout: float = 120.0) -> bool:
    """Whether llama.cpp runs ``gguf`` with its weights repacked (its default), else False where the
    plain kernels run and the repacked ones fail (a crash, in a child process: :func:`probe_argv`).
    Cached per file (path, size, modification time) and thread count.

    Raises:
        SmartExitError: the file is missing, or llama.cpp fails on it either way (both children's last
            lines in the message).
    """
    path = Path(gguf).resolve()
    if not path.is_file():
        raise SmartExitError(f"GGUF file {gguf} does not exist")
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns, threads)
    if key not in _REPACK:
        tails = []
        for repack in (True, False):
            how = "with" if repack else "without"
            try:
                res = subprocess.run(probe_argv(path, threads, repack), capture_output=True, text=True,
                                     timeout=timeout, env={**os.environ, "PYTHONFAULTHANDLER": "1"})
            except subprocess.TimeoutExpired:  # a hang counts as a failure of that way
                tails.append(f"{how} repacking: no answer in {timeout:g} s")
                continue
            if res.returncode == 0:
                _REPACK[key] = repack
                break
            what = f"signal {-res.returncode}" if res.returncode < 0 else f"exit {res.returncode}"
            lines = (res.stderr or res.stdout).strip().splitlines()[-3:]
            tails.append(f"{how} repacking: {what}: " + " | ".join(lines))
        else:
            raise SmartExitError(f"llama.cpp fails to decode {gguf} on this machine ({'; '.join(tails)})")
    return _REPACK[key]


def _probe(gguf: str, threads: int, repack: bool) -> None:
    """The child of :func:`repack_runs`: load ``gguf`` and decode a few greedy tokens (a crash is the answer)."""
    with LlamaCppPeer(gguf, threads, n_ctx=64, repack=repack) as peer:
        peer.generate(list(range(1, 9)), PROBE_TOKENS)


class LlamaCppLookupPeer:
    """llama.cpp with prompt-lookup drafting at batch 1: llama-cpp-python's ``Llama.generate`` with its
    ``LlamaPromptLookupDecoding`` draft model (drafts from n-grams of the context, verified by llama.cpp
    in one batch), greedy (top-k 1, no repeat penalty). The peer of mode exact's lookup drafts.

    Its settings are its best measured on the decode bench's prompts, not the library's defaults (10 drafts
    after a 2-gram match): decode tokens/s through the same API (q8_0 of the demo model, 16 prompts x 32
    tokens, 3 repeats, medians; 2-core AMD EPYC VM, 2026-12-05) 1,158 with 4 drafts, 1,154 with 2, 1,059 with
    6 and 768 with 10 (3-gram matches: 1,140 / 930 / 990 / 800); plain llama.cpp 1,645 on the same prompts."""

    def __init__(self, gguf: str | Path, threads: int, num_pred_tokens: int = 4, max_ngram_size: int = 2,
                 n_ctx: int = 512, repack: bool | None = None) -> None:
        require_available()
        import llama_cpp
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        if not Path(gguf).is_file():
            raise SmartExitError(f"GGUF file {gguf} does not exist")
        self.gguf, self.num_pred_tokens = Path(gguf), num_pred_tokens
        self.repack = repack_runs(gguf, threads) if repack is None else repack
        draft = LlamaPromptLookupDecoding(max_ngram_size=max_ngram_size, num_pred_tokens=num_pred_tokens)
        try:
            with _model_params(self.repack):
                self.llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx,
                                           n_threads=threads, n_threads_batch=threads, use_mmap=False,
                                           draft_model=draft, verbose=False)
        except ValueError as exc:
            raise SmartExitError(f"llama.cpp cannot load {gguf} ({exc})") from exc

    def close(self) -> None:
        self.llm.close()

    def generate_timed(self, prompt_ids: Sequence[int], n: int) -> PeerTiming:
        """Greedy ``n`` tokens after ``prompt_ids`` from an empty cache, timed as
        :meth:`LlamaCppPeer.generate_timed` (a round's accepted drafts arrive together)."""
        if n < 2:
            raise SmartExitError(f"generate_timed needs n >= 2 (one decode step after the prefill), got {n}")
        self.llm.reset()  # no prefix reuse from the previous call: the prompt is prefilled every time
        tokens: list[int] = []
        stamps = [time.perf_counter()]
        gen = self.llm.generate(list(prompt_ids), top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0,
                                reset=True)
        for tok in gen:
            tokens.append(int(tok))
            stamps.append(time.perf_counter())
            if len(tokens) == n:
                break
        gen.close()
        return timing_from_stamps(tokens, len(prompt_ids), stamps)


class LlamaCppPeer:
    """llama.cpp greedy decoding at batch 1 on a GGUF: prompt as ids in, ids out.

    The loop is the one of llama.cpp's ``simple`` example: ``llama_decode`` the prompt, then one
    token at a time, choosing with llama.cpp's own greedy sampler (first maximum, like argmax).
    Weights are read into memory at load (no mmap), so the first timed call pays no page faults.
    """

    def __init__(self, gguf: str | Path, threads: int, n_ctx: int = 512, repack: bool | None = None) -> None:
        require_available()
        import llama_cpp

        if threads < 1 or n_ctx < 2:
            raise SmartExitError(f"LlamaCppPeer needs threads >= 1 and n_ctx >= 2, got {threads} and {n_ctx}")
        if not Path(gguf).is_file():
            raise SmartExitError(f"GGUF file {gguf} does not exist")
        self._lib = llama_cpp
        self.gguf, self.threads, self.n_ctx = Path(gguf), threads, n_ctx
        # repacked weights where they run (llama.cpp's default), else plain: None probes (repack_runs)
        self.repack = repack_runs(gguf, threads) if repack is None else repack
        try:
            with _model_params(self.repack):
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

    def _greedy(self, prompt_ids: Sequence[int], n: int) -> tuple[list[int], list[float]]:
        """:func:`greedy_stamps` from an empty cache with llama.cpp's greedy sampler."""
        lib, ctx = self._lib, self.llm.ctx
        if not prompt_ids or n < 1 or len(prompt_ids) + n > self.n_ctx:
            raise SmartExitError(f"prompt of {len(prompt_ids)} tokens + {n} new tokens must be within "
                                 f"n_ctx={self.n_ctx} (and both at least 1)")
        lib.llama_memory_clear(lib.llama_get_memory(ctx), True)
        lib.llama_sampler_reset(self._sampler)
        return greedy_stamps(self._decode, lambda: lib.llama_sampler_sample(self._sampler, ctx, -1), prompt_ids, n)

    def generate(self, prompt_ids: Sequence[int], n: int) -> PeerGeneration:
        """Greedy ``n`` tokens after ``prompt_ids``, from an empty cache; ``seconds`` holds the prefill.

        Raises:
            SmartExitError: empty prompt, n < 1, or prompt + n beyond ``n_ctx``.
        """
        tokens, stamps = self._greedy(prompt_ids, n)
        return PeerGeneration(tokens, stamps[-1] - stamps[0], _gaps(stamps[1:]))

    def generate_timed(self, prompt_ids: Sequence[int], n: int) -> PeerTiming:
        """Greedy ``n`` tokens after ``prompt_ids`` with the prefill and the ``n - 1`` decode steps timed
        apart (:class:`PeerTiming`): decode tokens/s is what a batch-1 decode bench compares.

        Raises:
            SmartExitError: empty prompt, n < 2, or prompt + n beyond ``n_ctx``.
        """
        if n < 2:
            raise SmartExitError(f"generate_timed needs n >= 2 (one decode step after the prefill), got {n}")
        tokens, stamps = self._greedy(prompt_ids, n)
        return timing_from_stamps(tokens, len(prompt_ids), stamps)

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


if __name__ == "__main__":  # the repacking probe's child (repack_runs)
    if len(sys.argv) != 5 or sys.argv[1] != "probe" or sys.argv[4] not in ("repack", "no-repack"):
        sys.exit("usage: python -m edge.pipeline.bench.llamacpp probe GGUF THREADS repack|no-repack")
    _probe(sys.argv[2], int(sys.argv[3]), sys.argv[4] == "repack")
