"""What a request is and what it gets back: :class:`Request` and its :class:`Mode`, its events
(:class:`TokenEvent`, :data:`NO_TOKEN`), deferral's verdicts on its early exits (:class:`Verdict`), the checks of
its fields (:func:`check_request`); and the engine's own state per request (``_Seq``, with the ``_Pending`` rows
that owe their skipped layers)."""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from edge.model.lookup import Lookup
from edge.core.errors import RequestError


class Mode(str, enum.Enum):
    """What a request accepts. ``bounded``: calibrated exits, false exits within the certified eps;
    ``full``: every token from the full model (this request never exits early); ``exact``: the full
    model's output, sped up by speculative decoding from context lookups and a draft exit
    (edge/runtime/speculative.py)."""

    BOUNDED = "bounded"
    FULL = "full"
    EXACT = "exact"


NO_TOKEN = -1  # token and exit layer of an event that ends a request without a token


@dataclass
class TokenEvent:
    """One output token, or the end of a request without one.

    ``finish_reason`` is set on a request's last event: "length" (``max_tokens`` reached), "stop" (a
    stop id was emitted), "cancelled" (:meth:`Engine.cancel`), "deadline" (``Request.deadline``
    passed). The last two carry no token: ``token`` and ``exit_layer`` are :data:`NO_TOKEN` and
    ``index`` is the number of tokens emitted before.
    """

    request_id: int
    token: int
    exit_layer: int
    index: int  # position in the output
    finished: bool
    finish_reason: str | None = None


@dataclass
class Request:
    prompt: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    stop_ids: tuple[int, ...] = ()
    seed: int | None = None
    # absolute time on the engine's clock (time.monotonic by default): a request still active at the
    # start of a later step is ended there, finish_reason "deadline", and its cache slot freed
    deadline: float | None = None
    on_token: Callable[[TokenEvent], None] | None = None
    mode: Mode = Mode.BOUNDED
    # with deferral, the full model's verdict on each greedy token this request emitted from an early exit
    # (:class:`Verdict`), once the exit's skipped layers have been computed (with the next token); the
    # engine runs the one more head row this takes only for requests that set it
    on_verdict: Callable[["Verdict"], None] | None = None


@dataclass
class Verdict:
    """The full model's judgement of a token that left early, free with deferral.

    A row that exits with deferral owes its skipped layers; the engine computes them with the sequence's
    next token (or the batch's catch-up call) and there runs the last layer's head on that row too: its
    argmax is the full model's token on exactly the prefix the exit decided on (the row's K/V and every
    earlier one are exact under deferral). ``full_token`` is None when the request ended (its last token,
    a stop id, a cancel) before the owed layers ran: that exit is not judged by the engine."""

    request_id: int
    index: int  # the token's position in the output
    exit_layer: int
    token: int  # what the exit emitted
    full_token: int | None

    @property
    def false_exit(self) -> bool | None:
        return None if self.full_token is None else self.full_token != self.token


@dataclass
class _Pending:
    pos: int
    hidden: np.ndarray  # [D] residual at the depth reached so far
    next_seg: int
    # the token the exit emitted, its output index and layer, for the verdict (token -1: not judged, e.g.
    # a sampled token, whose exit is not an argmax the full model's argmax can judge)
    token: int = -1
    index: int = -1
    layer: int = -1


@dataclass(eq=False)  # identity: lists of sequences are searched by object
class _Seq:
    id: int
    req: Request
    slot: int = -1
    admitted_slot: int = -1  # the slot it held, kept after release (a batch run reads what it left there)
    prefilled: int = 0  # prompt tokens in the cache
    tokens: list[int] = field(default_factory=list)
    exit_layers: list[int] = field(default_factory=list)
    pending: list[_Pending] = field(default_factory=list)
    rng: np.random.Generator | None = None
    submitted: float = 0.0
    finished: str | None = None  # the finish reason, once ended
    lookup: Lookup | None = None  # the context lookup over prompt + output (a shortlist model's checks read it)

    @property
    def length(self) -> int:
        """Tokens whose position is in the cache (the newest output token is not yet)."""
        return self.prefilled + max(0, len(self.tokens) - 1)


def check_request(req: Request, max_len: int, vocab_size: int) -> None:
    """Raise :class:`RequestError` (naming the field) for a request that no engine with a context window of
    ``max_len`` tokens over a vocabulary of ``vocab_size`` takes: an empty or oversize prompt, out-of-vocabulary
    ids, bad sampling values, an unknown mode (what ``Engine.check`` asks before the engine's own modes).
    Normalises ``req.mode`` to :class:`Mode`."""
    if not req.prompt:
        raise RequestError("empty prompt: at least one token is needed", "prompt")
    if req.max_tokens < 1:
        raise RequestError(f"max_tokens must be >= 1, got {req.max_tokens}", "max_tokens")
    if len(req.prompt) + req.max_tokens > max_len:
        raise RequestError(f"prompt of {len(req.prompt)} tokens + max_tokens {req.max_tokens} exceeds the "
                           f"context window of {max_len} tokens", "prompt")
    bad = [t for t in req.prompt if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})",
                           "prompt")
    if not (math.isfinite(req.temperature) and req.temperature >= 0):
        raise RequestError(f"temperature must be finite and >= 0, got {req.temperature}", "temperature")
    if not 0.0 < req.top_p <= 1.0:
        raise RequestError(f"top_p must be in (0, 1], got {req.top_p}", "top_p")
    # numpy's generator takes non-negative integers only; a negative seed used to kill the engine thread
    if req.seed is not None and (isinstance(req.seed, bool) or not isinstance(req.seed, (int, np.integer))
                                 or req.seed < 0):
        raise RequestError(f"seed must be a non-negative integer, got {req.seed!r}", "seed")
    try:
        req.mode = Mode(req.mode)
    except ValueError:
        raise RequestError(f"mode {req.mode!r} is not one of {', '.join(m.value for m in Mode)}",
                           "mode") from None
