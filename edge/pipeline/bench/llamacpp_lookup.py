"""llama.cpp with prompt-lookup drafting at batch 1 (:class:`LlamaCppLookupPeer`): the peer of mode
exact's lookup drafts, timed as :meth:`LlamaCppPeer.generate_timed`.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Sequence

from edge.core.errors import SmartExitError
from edge.pipeline.bench.llamacpp import require_available
from edge.pipeline.bench.llamacpp_repack import model_params, repack_runs
from edge.pipeline.bench.llamacpp_timing import PeerTiming, timing_from_stamps


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
            with model_params(self.repack):
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
