"""llama.cpp greedy decoding at batch 1 on a GGUF through llama-cpp-python's low-level API
(:class:`LlamaCppPeer`): prompt as ids in, ids out, timed; teacher-forced logits; the GGUF's tokenizer.

Run as a script it is the child of the repacking probe (``llamacpp_repack.repack_runs``): it loads a GGUF
and decodes a few greedy tokens, so a crash is the answer.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from edge.core.errors import SmartExitError
from edge.pipeline.bench.llamacpp import require_available
from edge.pipeline.bench.llamacpp_repack import PROBE_TOKENS, model_params, repack_runs
from edge.pipeline.bench.llamacpp_timing import PeerGeneration, PeerTiming, gaps, greedy_stamps, timing_from_stamps

if TYPE_CHECKING:
    import numpy as np


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
            with model_params(self.repack):
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
        return PeerGeneration(tokens, stamps[-1] - stamps[0], gaps(stamps[1:]))

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


def _probe(gguf: str, threads: int, repack: bool) -> None:
    """The child of :func:`repack_runs`: load ``gguf`` and decode a few greedy tokens (a crash is the answer)."""
    with LlamaCppPeer(gguf, threads, n_ctx=64, repack=repack) as peer:
        peer.generate(list(range(1, 9)), PROBE_TOKENS)


if __name__ == "__main__":  # the repacking probe's child (repack_runs)
    if len(sys.argv) != 5 or sys.argv[1] != "probe" or sys.argv[4] not in ("repack", "no-repack"):
        sys.exit("usage: python -m edge.pipeline.bench.llamacpp_peer probe GGUF THREADS repack|no-repack")
    _probe(sys.argv[2], int(sys.argv[3]), sys.argv[4] == "repack")
