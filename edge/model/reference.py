"""Reference early-exit generator in PyTorch (one sequence at a time, greedy).

Prefill runs full depth. Each decoded token walks the layers segment by
segment; at every exit it asks the exit rule whether to stop. When it stops at
layer k, the deeper layers still need keys and values for later tokens: they
are filled by *state propagation* (CALM, Schuster et al. 2022, sec. 4): the
exit hidden state h_k goes through each skipped layer's input norm and K/V
projections only. With the rule disabled this is exactly greedy decoding of the
full model.

The exit rule is the engine's (``edge.runtime.rules``: ``ConfidenceRule``, the threshold
table's ``TableRule``), asked with one row: at each decision exit it gets, for every
exit reached so far, the softmax statistics [1, 3] and argmax [1] that the segment
graphs would compute (:func:`edge.model.exits.exit_decision_stats`) and the normalised
hidden state [1, D], as numpy arrays (``decide``), or for a model with exit gates the
gate logits [1] (``decide_gated``), and returns bool [1]. So a rule is written once,
torch-free, and this generator checks the engine with the engine's own rules. A model with a
candidate shortlist decides as the engine's graphs do: the check of :mod:`edge.model.candidates`
(with the context lookup over prompt and output) scored by the rule's ``score_form`` (or its
linear score), and only rows whose lookup reaches the rule's ``route_min_lookup`` are checked.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from edge.core.errors import SmartExitError
from edge.model.candidates import CandidateOut, check, lookup_feature, shortlist_logits
from edge.model.exits import MultiExitModel, exit_decision_stats
from edge.model.decoder import attention_mask
from edge.model.ngram import checked_table
from edge.model.lookup import Lookup


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
                       rule: Any = None, stop_ids: Sequence[int] = (), lookup_table: Any = None) -> GenerationResult:
    """Greedy generation with per-token early exit.

    Args:
        model: the multi-exit model.
        prompt: token ids.
        max_new_tokens: tokens to generate (fewer if a stop id comes first).
        rule: an engine exit rule (module docstring); None runs full depth.
        stop_ids: token ids that end generation (the stop token is kept).
        lookup_table: the corpus n-gram table the rule's context lookup falls back to (a rule calibrated with
            one names it: ``lookup_table_sha256``, checked here as the engine checks it).

    Raises:
        SmartExitError: an empty prompt, an id outside the vocabulary or a context overflow.
        ConfigError: the rule names a corpus table and ``lookup_table`` is not that one.
    """
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
    table = checked_table(getattr(rule, "lookup_table_sha256", None), lookup_table, "reference_generate")
    lookup = Lookup(result.prompt, table) if model.has_shortlist else None
    while True:
        result.tokens.append(token)
        result.exit_layers.append(exit_layer)
        if lookup is not None:
            lookup.push(token)
        if token in stop_ids:
            result.stopped = "stop_token"
            break
        if len(result.tokens) >= max_new_tokens:
            break
        token, exit_layer = _decode_step(model, token, pos, keys, values, rule, lookup)
        pos += 1
    return result


def _decode_step(model: MultiExitModel, token: int, pos: int, keys: list, values: list, rule: Any,
                 lookup: Lookup | None = None) -> tuple[int, int]:
    """One token through the segments; appends this position's K/V for every layer."""
    bb = model.backbone
    depth = model.num_layers
    positions = torch.tensor([[pos]])
    cos, sin = bb.rope(positions)
    mask = attention_mask(positions, torch.arange(pos + 1).unsqueeze(0), window=bb.cfg.sliding_window)
    h = bb.embed(torch.tensor([[token]]))
    # what the rule sees, per exit reached so far (one row)
    stats: dict[int, np.ndarray] = {}  # [1, 3]
    tokens: dict[int, np.ndarray] = {}  # [1]
    hidden: dict[int, np.ndarray] = {}  # [1, D]
    gates: dict[int, np.ndarray] = {}  # [1]
    done = 0
    check = _Checks(model, rule, lookup) if rule is not None and model.has_shortlist else None
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
        e = model.exit_hidden(layer, h)[:, -1]  # [1, D]
        hidden[layer] = e.numpy()
        if check is not None:
            stop, tokens[layer] = check(layer, hidden[layer])
        elif model.gated:
            gates[layer] = model.exit_gate(layer, e).numpy()
            stop = rule.decide_gated(layer, gates, hidden)
        else:
            st, tk = exit_decision_stats(bb.logits(e))
            stats[layer], tokens[layer] = st.numpy(), tk.numpy()
            stop = rule.decide(layer, stats, tokens, hidden)
        if bool(np.asarray(stop)[0]):
            for j in range(layer, depth):  # state propagation into the skipped layers
                k, v = bb.layers[j].kv_only(h, cos, sin)
                keys[j] = torch.cat((keys[j], k), dim=2)
                values[j] = torch.cat((values[j], v), dim=2)
            if model.gated:  # the LM head runs for the exiting row only, as in the engine
                return int(bb.logits(e).argmax()), layer
            return int(tokens[layer][0]), layer
    raise AssertionError("exit_layers must end with the last layer")


class _Checks:
    """A shortlist model's checks of one decode step, one after another (each reads the previous one)."""

    def __init__(self, model: MultiExitModel, rule: Any, lookup: Lookup) -> None:
        self.model, self.rule = model, rule
        self.rows, self.act_scale = model.shortlist_rows().numpy(), model.shortlist_act_scale()
        token, n = lookup.predict()
        self.lookup = (np.array([token]), lookup_feature(np.array([n])))
        self.checked = float(self.lookup[1][0]) >= float(getattr(rule, "route_min_lookup", 0.0)) - 1e-6
        self.prev: CandidateOut | None = None

    def __call__(self, layer: int, hidden: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(exit here [1] bool, the check's token [1]) at decision exit ``layer``."""
        c = check(shortlist_logits(hidden, self.rows, self.act_scale), self.model.shortlist.numpy(), *self.lookup,
                  None if self.prev is None else self.prev.tokens, None if self.prev is None else self.prev.logits,
                  hidden)
        self.prev = c
        f = c.features.shape[1]
        if hasattr(self.rule, "score_form"):
            score = self.rule.score_form(layer, f)(c.features)
        else:
            w, b = self.rule.linear(layer, f)
            score = c.features @ np.asarray(w, np.float32) + np.float32(b)
        return np.asarray(score >= 0.0) & self.checked, c.token
