"""What a llama.cpp peer's batch-1 greedy generation returns, and its timing: the greedy loop timestamped
(:func:`greedy_stamps`) and the stamps split into the prefill and the decode steps after it
(:func:`timing_from_stamps`). Pure Python: no llama.cpp needed.
"""
from __future__ import annotations

import time
from typing import Callable, NamedTuple, Sequence

from edge.core.errors import SmartExitError


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
    return PeerTiming(list(tokens), prompt_tokens, stamps[1] - stamps[0], stamps[-1] - stamps[1], gaps(stamps[1:]))


def gaps(stamps: Sequence[float]) -> list[float]:
    return [b - a for a, b in zip(stamps, stamps[1:])]
