"""The host's step log (``HostConfig.step_log``): one JSON line per engine step, saying what the step did
and how long it took under the stack; `smartexit profile` fits the served engine's step time from it
(scheduler/loadtest/serving_steps.py, docs/scheduler.md).
"""
from __future__ import annotations

import collections
import json
from collections.abc import Sequence
from typing import Any

from edge.runtime.engine import Engine
from edge.runtime.request import NO_TOKEN, TokenEvent

FRONT_WINDOW_S = 2.0  # the step log's recent arrivals ("a"): the front end's work follows them (docs/scheduler.md)

Before = tuple[dict[int, int], list[tuple[Any, int]]]


def before_step(e: Engine) -> Before:
    """What the step log needs from before a step: the decoding sequences' cached positions and the
    waiting or prefilling sequences with their prefilled tokens."""
    return {s.id: s.length for s in e.decoding}, [(s, s.prefilled) for s in e.waiting + e.prefilling]


def step_line(e: Engine, before: Before, events: list[TokenEvent], step_s: float, emit_s: float, chunks: int,
              arrivals: Sequence[float], now: float, live: int) -> str:
    """One line: step and emit seconds, chunks sent, decode rows ``[cached positions, exit layer]`` of the
    sequences that took a plain step, and per decoding sequence ``k`` = [tokens emitted, 1 if they came from
    a draft round (a verification call of its own) else 0] and ``i`` their request ids in the same order,
    prefill chunks ``[start, tokens]`` (a prefill's first token is not a decode row); ``n`` the host's
    ``live`` requests and ``a`` the ``arrivals`` (oldest first) of the last FRONT_WINDOW_S seconds before ``now``."""
    ctx, pending = before
    decoded = [ev for ev in events if ev.request_id in ctx and ev.token != NO_TOKEN]
    rounds = e.round_ids
    rows = [[ctx[ev.request_id], ev.exit_layer] for ev in decoded if ev.request_id not in rounds]
    per_seq = collections.Counter(ev.request_id for ev in decoded)
    pre = [[start, s.prefilled - start] for s, start in pending if s.prefilled > start]
    n = len(arrivals)  # other threads append while this one reads: indices below a length read once
    arrived = next((k for k in range(n) if arrivals[n - 1 - k] < now - FRONT_WINDOW_S), n)
    seqs = sorted((n, int(rid in rounds), rid) for rid, n in per_seq.items())
    return json.dumps({"s": round(step_s, 7), "e": round(emit_s, 7), "c": chunks, "d": rows,
                       "k": [[n, r] for n, r, _ in seqs], "i": [rid for _, _, rid in seqs], "p": pre,
                       "n": live, "a": arrived},
                      separators=(",", ":")) + "\n"
