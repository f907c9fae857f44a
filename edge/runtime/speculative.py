"""Speculative decoding (mode ``exact``): the algorithm, its settings (:class:`SpecConfig`: draft sources,
stop rule, draft lengths) and its round counts (:class:`SpecStats`). The parts the engine's rounds
(edge/runtime/rounds.py) use are beside it: the measured call costs in spec_costs.py, the draft lengths and
stop rules in spec_length.py, the gates that say whether speculation pays in spec_gates.py, the greedy and
speculative-sampling acceptance rules in spec_accept.py.

Three draft sources, chosen per row and round by expected tokens per unit of measured cost
(:func:`edge.runtime.spec_length.lookup_length`, :class:`edge.runtime.spec_costs.CallCosts`,
:class:`edge.runtime.spec_gates.ExitDraftGate`); where no draft is expected to pay, the row takes a plain
full-depth step.

``lookup``  prompt-lookup drafts (Saxena 2023): the tokens that followed the latest earlier
            occurrence of the sequence's longest recent suffix (edge/model/lookup.py). No model call:
            the drafts and the row's newest token go to the graph of every layer in **one call** of
            k + 1 rows, the same graph that mode ``full`` runs one row at a time, so the output is that
            graph's own tokens. How many to draft: the acceptance of draft j after a match of length n
            is counted as the engine runs (:class:`~edge.runtime.spec_length.LookupAcceptance`), and k maximises
            E(k) / C(k + 1), E(k) = 1 + sum_{j<=k} prod_{i<=j} a_{n,i}, C the measured seconds of a
            call of k + 1 rows; against the plain step's 1 / C(1) (at batch B: B / C_B, the row's share
            of the batched step, since ONNX Runtime's CPU attention takes several rows with a past only
            at batch 1 and a speculating row is verified in a call of its own).
``corpus``  the training text's most frequent continuations of the sequence's last tokens (an n-gram
            table built from the training split, edge/model/ngram.py; REST, He et al. 2024), where the
            backend has one: drafted, chosen and verified as lookup drafts, with acceptance counted
            apart by the order n of the table's match.
``exit``    self-speculation from an early exit (below), at batches up to ``speculate_max_batch``,
            while its measured seconds per emitted token beat the plain step's.

The engine drafts tokens with the segments up to a draft exit (LayerSkip's self-speculation,
Elhoushi et al. 2024), then verifies them with the remaining segments in one call per segment, on
the draft's residuals: the draft already wrote the first layers' keys and values, the verification
writes the rest. Row j of the verification (the token at position L + j) gives the full model's
prediction for position L + j + 1, which checks draft j + 1; the first disagreement is replaced by
the full model's token and the rest is dropped. Nothing is copied back: the rejected rows' cache
entries sit past the sequence's new length and the next round overwrites them.

How many tokens to draft (:func:`edge.runtime.spec_length.include_next`): after each draft step the
draft token x_{k+1} is included in the verification, or drafting stops. Three rules:

``fixed``       k tokens, always.
``top1``        while the draft's top-1 probability is at least a threshold (Kangaroo, Liu et al.
                2024; Draft & Verify, Zhang et al. 2024).
``calibrated``  while one more draft token raises the round's expected tokens per second. The
                threshold table's calibrator gives p_j, the probability that draft j is the full
                model's token (for greedy decoding, that it is accepted); the round's expected output
                is E(k) = 1 + sum_{n<=k} prod_{i<=n} p_i tokens, and its cost C(k) = (k + 1) draft
                steps + a verification of k + 1 rows, measured as the engine runs
                (:class:`edge.runtime.spec_costs.DraftCosts`). Draft k + 1 is included when
                prod_{i<=k+1} p_i / (C(k+1) - C(k)) > E(k) / C(k).
A hard maximum (``max_draft``) bounds every rule and both sources.

Sampling (temperature > 0) uses the speculative-sampling acceptance rule (Leviathan et al. 2023;
Chen et al. 2023): draft x ~ q is accepted with probability min(1, p(x) / q(x)); the first rejected
position draws from max(0, p - q) normalised, and a round whose drafts are all accepted draws one
more token from p. The output is distributed exactly as the full model's. (The draft-length rules
read the greedy draft's statistics either way: when sampling, the calibrated agreement is only a
proxy for the acceptance probability, sum_x min(p(x), q(x)); a wrong length costs speed, never
exactness.)
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from edge.core.errors import ConfigError


# most rows a verification call holds (drafts + 1): the ONNX Runtime backend keeps bindings for calls of up
# to this many rows per sequence (ort_backend.MAX_PLAN_ROWS)
MAX_VERIFY_ROWS = 8


class Source(str, enum.Enum):
    LOOKUP = "lookup"
    CORPUS = "corpus"
    EXIT = "exit"


class StopRule(str, enum.Enum):
    CALIBRATED = "calibrated"
    FIXED = "fixed"
    TOP1 = "top1"


@dataclass
class SpecConfig:
    """Self-speculative decoding settings (engine ``speculative``)."""

    draft_exit: int | None = None  # exit layer that drafts (None: the first decision exit)
    stop: StopRule = StopRule.CALIBRATED
    max_draft: int = 6  # hard maximum of draft tokens per round (verification rows = drafts + 1 <= 8)
    fixed: int = 3  # draft tokens per round, rule ``fixed``
    top1: float = 0.6  # top-1 probability threshold, rule ``top1``
    sources: tuple[Source, ...] = (Source.LOOKUP, Source.CORPUS, Source.EXIT)  # draft sources to choose from

    def __post_init__(self) -> None:
        try:
            self.sources = tuple(Source(x) for x in self.sources)
        except ValueError:
            raise ConfigError(f"speculative.sources must be a list of {', '.join(x.value for x in Source)}, "
                              f"got {self.sources!r}") from None
        if not self.sources:
            raise ConfigError("speculative.sources is empty: mode exact needs a draft source")
        try:
            self.stop = StopRule(self.stop)
        except ValueError:
            raise ConfigError(f"speculative.stop must be one of {', '.join(r.value for r in StopRule)}, "
                              f"got {self.stop!r}") from None
        if not 1 <= self.max_draft < MAX_VERIFY_ROWS:
            raise ConfigError(f"speculative.max_draft must be in 1..{MAX_VERIFY_ROWS - 1}, got {self.max_draft}")
        if self.stop is StopRule.FIXED and not 1 <= self.fixed <= self.max_draft:
            raise ConfigError(f"speculative.fixed must be in 1..max_draft ({self.max_draft}), got {self.fixed}")
        if not 0.0 <= self.top1 <= 1.0:
            raise ConfigError(f"speculative.top1 must be in [0, 1], got {self.top1}")

    @property
    def exit_only(self) -> bool:
        """Exit drafts alone: they always draft, as before the other sources came."""
        return self.sources == (Source.EXIT,)


class Agreement(Protocol):
    """Calibrated probability [B] that exit ``layer``'s token is the full model's, from the exit's
    features [B, F] (a threshold table's calibrator: ``calibration.table.TableRule.agreement``)."""

    def agreement(self, layer: int, features: np.ndarray) -> np.ndarray: ...


@dataclass
class SpecStats:
    """Counts over an engine's speculative rounds."""

    rounds: int = 0
    drafted: int = 0  # draft tokens verified
    accepted: int = 0  # of them, accepted
    emitted: int = 0  # tokens the rounds produced (accepted + one per round)
    draft_steps: int = 0  # draft-step rows computed (including the drafts the stop rule then dropped)
    predicted: float = 0.0  # sum of the verified drafts' calibrated agreement (calibrated rule only)
    # rounds by (drafts verified, drafts accepted): where a stop rule's rounds end and why
    lengths: dict[tuple[int, int], int] = field(default_factory=dict)

    def record(self, drafted: int, accepted: int, predicted: float) -> None:
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted
        self.emitted += accepted + 1
        self.predicted += predicted
        self.lengths[(drafted, accepted)] = self.lengths.get((drafted, accepted), 0) + 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_round(self) -> float:
        return self.emitted / self.rounds if self.rounds else 0.0

    def as_dict(self) -> dict[str, float]:
        return {"rounds": self.rounds, "drafted": self.drafted, "accepted": self.accepted, "emitted": self.emitted,
                "draft_steps": self.draft_steps, "acceptance_rate": self.acceptance_rate,
                "predicted_acceptance": self.predicted / self.drafted if self.drafted else 0.0,
                "tokens_per_round": self.tokens_per_round,
                "mean_accepted_length": self.accepted / self.rounds if self.rounds else 0.0,
                "rounds_by_drafted_accepted": {f"{k}/{n}": c for (k, n), c in sorted(self.lengths.items())}}
