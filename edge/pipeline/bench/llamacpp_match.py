"""Whether llama.cpp's greedy tokens are ours: our reference tokens (:func:`reference_greedy`), the
fraction of the peer's that equal them (:func:`check_greedy_match`), and the refusal to report its
speed below 1.0 (:func:`require_greedy_match`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from edge.core.errors import SmartExitError
from edge.pipeline.bench.llamacpp_peer import LlamaCppPeer


class GreedyMismatch(SmartExitError):
    """llama.cpp's greedy tokens differ from ours: its speed must not be reported."""


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
