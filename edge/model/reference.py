"""Reference early-exit generator in PyTorch (one sequence at a time, greedy).

Prefill runs full depth. Each decoded token walks the layers segment by
segment; at every exit it asks the exit rule whether to stop. When it stops at
layer k, the deeper layers still need keys and values for later tokens: they
are filled by *state propagation* (CALM, Schuster et al. 2022, sec. 4): the
exit hidden state h_k goes through each skipped layer's input norm and K/V
projections only. With the rule disabled this is exactly greedy decoding of the
full model.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from edge.core.errors import SmartExitError
from edge.model.exits import MultiExitModel
from edge.model.decoder import attention_mask

# An exit rule sees (exit layer, logits [V], normalised exit hidden state [D]) for the
# current token and says whether to stop there. Rules that keep per-token state across
# exits (consistency signals) also have ``reset()``, called before each token.
ExitRule = Callable[[int, torch.Tensor, torch.Tensor], bool]


def confidence_rule(threshold: float) -> ExitRule:
    """Stop when the exit's top-1 probability reaches ``threshold`` (the uncalibrated baseline)."""
    def rule(layer: int, logits: torch.Tensor, hidden: torch.Tensor) -> bool:
        return torch.softmax(logits.float(), -1).max().item() >= threshold
    return rule


@dataclass
class GenerationResult:
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    exit_layers: list[int] = field(default_factory=list)  # 1-based layer each token was decided at
    stopped: str = "length"  # "length" or "stop_token"

    @property
    def mean_exit_layer(self) -> float:
        return sum(self.exit_layers) / max(1, len(self.exit_layers))


def check_prompt(model: MultiExitModel, prompt: Sequence[int], max_new_tokens: int) -> None:
    """Raise a clear error for an empty prompt, an id outside the vocabulary or a context overflow."""
    cfg = model.backbone.cfg
    if not prompt:
        raise SmartExitError("empty prompt: at least one token is needed")
    bad = [t for t in prompt if not 0 <= int(t) < cfg.vocab_size]
    if bad:
        raise SmartExitError(f"token ids {bad[:5]} are outside the vocabulary [0, {cfg.vocab_size})")
    if len(prompt) + max_new_tokens > cfg.max_position_embeddings:
        raise SmartExitError(
            f"prompt of {len(prompt)} tokens + {max_new_tokens} new tokens exceeds the context window of "
            f"{cfg.max_position_embeddings} tokens"
        )


@torch.no_grad()
def reference_generate(model: MultiExitModel, prompt: Sequence[int], max_new_tokens: int,
             rule: ExitRule | None = None, stop_ids: Sequence[int] = ()) -> GenerationResult:
    """Greedy generation with per-token early exit; ``rule=None`` runs full depth."""
    check_prompt(model, prompt, max_new_tokens)
    bb = model.backbone
    depth = model.num_layers
    result = GenerationResult(prompt=list(map(int, prompt)))
    if max_new_tokens <= 0:
        return result
    out = bb(torch.tensor([result.prompt]))
    keys, values = list(out.keys), list(out.values)  # per layer [1, KV, P, hd]
    token = int(out.logits[0, -1].argmax())
    exit_layer = depth  # prefill is always full depth
    pos = len(prompt)
    while True:
        result.tokens.append(token)
        result.exit_layers.append(exit_layer)
        if token in stop_ids:
            result.stopped = "stop_token"
            break
        if len(result.tokens) >= max_new_tokens:
            break
        token, exit_layer = _decode_step(model, token, pos, keys, values, rule)
        pos += 1
    return result


def _decode_step(model: MultiExitModel, token: int, pos: int, keys: list, values: list,
                 rule: ExitRule | None) -> tuple[int, int]:
    """One token through the segments; appends this position's K/V for every layer."""
    bb = model.backbone
    depth = model.num_layers
    positions = torch.tensor([[pos]])
    cos, sin = bb.rope(positions)
    mask = attention_mask(positions, torch.arange(pos + 1).unsqueeze(0), window=bb.cfg.sliding_window)
    h = bb.embed(torch.tensor([[token]]))
    if hasattr(rule, "reset"):
        rule.reset()
    done = 0
    for layer in model.exit_layers:
        for j in range(done, layer):
            h, k, v = bb.layers[j](h, cos, sin, keys[j], values[j], mask)
            keys[j] = torch.cat((keys[j], k), dim=2)
            values[j] = torch.cat((values[j], v), dim=2)
        done = layer
        if layer == depth:
            return int(model.exit_logits(layer, h)[0, -1].argmax()), depth
        if rule is None:
            continue
        hidden = model.exit_hidden(layer, h)[0, -1]
        logits = torch.nn.functional.linear(hidden, bb.head_weight)
        if rule(layer, logits, hidden):
            for j in range(layer, depth):  # state propagation into the skipped layers
                k, v = bb.layers[j].kv_only(h, cos, sin)
                keys[j] = torch.cat((keys[j], k), dim=2)
                values[j] = torch.cat((values[j], v), dim=2)
            return int(logits.argmax()), layer
    raise AssertionError("exit_layers must end with the last layer")
