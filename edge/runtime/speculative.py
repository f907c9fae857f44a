"""Speculative decoding (mode ``exact``): the parts the engine's loop uses.

Three draft sources, chosen per row and round by expected tokens per unit of measured cost
(:func:`lookup_length`, :class:`CallCosts`, :class:`ExitDraftGate`); where no draft is expected to pay,
the row takes a plain full-depth step.

``lookup``  prompt-lookup drafts (Saxena 2023): the tokens that followed the latest earlier
            occurrence of the sequence's longest recent suffix (edge/model/lookup.py). No model call:
            the drafts and the row's newest token go to the graph of every layer in **one call** of
            k + 1 rows, the same graph that mode ``full`` runs one row at a time, so the output is that
            graph's own tokens. How many to draft: the acceptance of draft j after a match of length n
            is counted as the engine runs (:class:`LookupAcceptance`), and k maximises
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

How many tokens to draft (:class:`DraftStop`): after each draft step the draft token x_{k+1} is
included in the verification, or drafting stops. Three rules:

``fixed``       k tokens, always.
``top1``        while the draft's top-1 probability is at least a threshold (Kangaroo, Liu et al.
                2024; Draft & Verify, Zhang et al. 2024).
``calibrated``  while one more draft token raises the round's expected tokens per second. The
                threshold table's calibrator gives p_j, the probability that draft j is the full
                model's token (for greedy decoding, that it is accepted); the round's expected output
                is E(k) = 1 + sum_{n<=k} prod_{i<=n} p_i tokens, and its cost C(k) = (k + 1) draft
                steps + a verification of k + 1 rows, measured as the engine runs
                (:class:`DraftCosts`). Draft k + 1 is included when
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


class DraftCosts:
    """Measured seconds of a draft step and of a verification of m rows (exponential moving averages).

    The first call of each shape is not counted (it builds the backend's bindings). A verification
    of a row count not measured yet is estimated from the nearest one measured, ``ROW_GROWTH`` more
    per extra row (measured on ONNX Runtime CPU, 2 cores: 1 -> 3 rows costs +3%, 1 -> 8 rows +70%), so
    an estimate never keeps the rule from trying a length. Before any measurement the costs are the
    layer counts' shares of a full-depth step: only their ratios matter to the stop rule.

    Outliers (a GC pause, a context switch) must not turn drafting off for good: a length the rule
    stops choosing is never measured again. So an observation counts at most ``OUTLIER`` times the
    current estimate, and no estimate exceeds ``CAP`` times what the cheapest measured length
    predicts for it."""

    ALPHA = 0.2
    ROW_GROWTH = 0.05
    OUTLIER = 3.0
    CAP = 1.5

    def __init__(self, draft_layers: int, num_layers: int, max_rows: int) -> None:
        self.step = draft_layers / num_layers
        self._verify0 = 1.0 - self.step  # prior of a one-row verification, in the step's unit
        self.verify = np.zeros(max_rows + 1)  # [rows] measured seconds (where _seen)
        self._calls = np.zeros(max_rows + 2, int)  # calls seen: [0] draft steps, [m] verifications of m rows
        self._seen = np.zeros(max_rows + 1, bool)

    @classmethod
    def fixed(cls, step: float, verify: dict[int, float]) -> "DraftCosts":
        """Costs given, not measured (any unit): a draft step and a verification by row count."""
        costs = cls(0, 1, max(verify))
        costs.step, costs._calls[0] = step, 2
        for rows, v in verify.items():
            costs.verify[rows], costs._seen[rows] = v, True
        return costs

    def observe_step(self, seconds: float) -> None:
        self._calls[0] += 1
        if self._calls[0] == 2:
            self._verify0 *= seconds / self.step
            self.step = seconds
        elif self._calls[0] > 2:
            self.step += self.ALPHA * (min(seconds, self.OUTLIER * self.step) - self.step)

    def observe_verify(self, rows: int, seconds: float) -> None:
        self._calls[rows] += 1
        if self._calls[rows] == 1:
            return
        seconds = min(seconds, self.OUTLIER * self.verification(rows))
        if not self._seen[rows]:
            self.verify[rows], self._seen[rows] = seconds, True
        else:
            self.verify[rows] += self.ALPHA * (seconds - self.verify[rows])

    def _extrapolated(self, rows: int, seen: np.ndarray) -> float:
        near = int(seen[np.argmin(np.abs(seen - rows))])
        return float(self.verify[near]) * (1 + self.ROW_GROWTH * (rows - near))

    def verification(self, rows: int) -> float:
        seen = np.flatnonzero(self._seen)
        if not len(seen):
            return self._verify0 * (1 + self.ROW_GROWTH * (rows - 1))
        if not self._seen[rows]:
            return self._extrapolated(rows, seen)
        low = int(seen[0])
        cap = self.CAP * float(self.verify[low]) * (1 + self.ROW_GROWTH * (rows - low))
        return min(float(self.verify[rows]), cap) if rows > low else float(self.verify[rows])

    def round(self, drafts: int) -> float:
        """C(k): the seconds of a round with ``drafts`` draft tokens."""
        return (drafts + 1) * self.step + self.verification(drafts + 1)

    def as_dict(self) -> dict[str, object]:
        return {"draft_step_s": self.step, "verify_s_by_rows": {int(m): float(self.verify[m])
                                                               for m in np.flatnonzero(self._seen)}}


class CallCosts:
    """Measured seconds of the graph of every layer by call shape (batch B, rows per sequence T):
    exponential moving averages, the first call of a shape not counted (it builds the bindings), an
    observation capped at ``OUTLIER`` times the estimate. A shape not measured yet is estimated from
    the nearest measured one (the same B first) by the ratio of a growth model: ``ROW_GROWTH`` more per
    extra row (measured on ONNX Runtime CPU, 2 cores, the demo model at batch 1: T = 2, 4, 8 cost
    1.07-1.16, 1.18-1.33 and 1.42-1.68 of T = 1), ``BATCH_GROWTH`` more per extra sequence; a call of
    several rows of several sequences (a ``verify_{B}`` graph) ``BATCH_GROWTH`` more per extra row of
    the B * T (2-core AMD EPYC, INT8 demo model: C(4, 4) / C(4, 1) 1.8-2.0, C(2, 4) / C(2, 1) 1.2-1.5,
    C(8, 3) / C(8, 1) 2.0-2.3). Before any measurement the unit is one step at batch 1. Only ratios
    matter to the choices."""

    ALPHA = 0.2
    OUTLIER = 3.0
    ROW_GROWTH = 0.07
    BATCH_GROWTH = 0.1

    def __init__(self) -> None:
        self._est: dict[tuple[int, int], float] = {}
        self._calls: dict[tuple[int, int], int] = {}

    @classmethod
    def fixed(cls, costs: dict[tuple[int, int], float]) -> "CallCosts":
        """Costs given, not measured (any unit), by (B, T); observations still refine them."""
        out = cls()
        for key, seconds in costs.items():
            out._est[key], out._calls[key] = float(seconds), 2
        return out

    def observe(self, b: int, t: int, seconds: float) -> None:
        key = (b, t)
        self._calls[key] = self._calls.get(key, 0) + 1
        if self._calls[key] == 1:
            return
        if key not in self._est:
            self._est[key] = seconds
        else:
            self._est[key] += self.ALPHA * (min(seconds, self.OUTLIER * self._est[key]) - self._est[key])

    def _growth(self, b: int, t: int) -> float:
        if b > 1 and t > 1:  # several rows of several sequences (a verify graph): the rows' products grow with b * t
            return 1 + self.BATCH_GROWTH * (b * t - 1)
        return (1 + self.BATCH_GROWTH * (b - 1)) * (1 + self.ROW_GROWTH * (t - 1))

    def cost(self, b: int, t: int) -> float:
        """Seconds of a call of B = ``b`` sequences, T = ``t`` rows each (estimated where not measured)."""
        key = (b, t)
        if key in self._est:
            return self._est[key]
        if not self._est:
            return self._growth(b, t)
        # the nearest measured shape: the same batch first, then the nearest batch
        ref = min(self._est, key=lambda k: (k[0] != b, abs(k[0] - b), abs(k[1] - t)))
        return self._est[ref] * self._growth(b, t) / self._growth(*ref)

    def as_dict(self) -> dict[str, float]:
        return {f"{b}x{t}": v for (b, t), v in sorted(self._est.items())}


class LookupAcceptance:
    """How often lookup draft j (1-based) is the full model's token, given drafts 1..j-1 were, after a
    suffix match of length n: counts as the engine verifies, with one success and one failure as the
    prior (a row that never drafted starts at 1/2)."""

    def __init__(self, max_n: int, max_draft: int) -> None:
        self.hits = np.ones((max_n + 1, max_draft))
        self.tries = np.full((max_n + 1, max_draft), 2.0)

    def probs(self, n: int, k: int) -> np.ndarray:
        return self.hits[n, :k] / self.tries[n, :k]

    def record(self, n: int, drafted: int, accepted: int) -> None:
        """A round of ``drafted`` drafts after a match of length n, the first ``accepted`` accepted:
        drafts 1..accepted hit, draft accepted + 1 (if any) missed, the rest were never judged."""
        judged = min(accepted + 1, drafted)
        self.tries[n, :judged] += 1
        self.hits[n, :accepted] += 1


def lookup_length(probs: np.ndarray, costs: CallCosts, plain: float) -> tuple[int, float]:
    """(k, value): the number of drafts 0..len(probs) whose round has the most expected tokens per
    second, E(k) / C(1, k + 1), and that value; k = 0 (no speculation) unless it beats ``plain``, the
    row's tokens per second on a plain step."""
    best, value = 0, plain
    expected, prefix = 1.0, 1.0
    for k in range(1, len(probs) + 1):
        prefix *= float(probs[k - 1])
        expected += prefix
        v = expected / costs.cost(1, k + 1)
        if v > value:
            best, value = k, v
    return best, value


class ExitDraftGate:
    """Whether exit-draft rounds pay: their measured seconds per emitted token (moving average) against
    a plain step's. Untried, they are tried; a source that lost is tried again every ``RETRY`` rounds
    (costs drift, and a source never chosen is never measured again)."""

    ALPHA = 0.2
    RETRY = 32

    def __init__(self) -> None:
        self.per_token: float | None = None
        self._since = 0

    def observe(self, seconds: float, tokens: int) -> None:
        v = seconds / max(tokens, 1)
        self.per_token = v if self.per_token is None else self.per_token + self.ALPHA * (v - self.per_token)

    def pays(self, plain_per_token: float) -> bool:
        if self.per_token is None or self.per_token < plain_per_token:
            return True
        self._since += 1
        if self._since >= self.RETRY:
            self._since = 0
            return True
        return False


class SpeculationGate:
    """Whether mode exact's speculation pays at a decode batch size above 1, by the realized seconds per
    emitted token of whole decode iterations (drafting, verification, padding, host work all in), over
    the last ``WINDOW`` iterations that looked for drafts and over the last that took plain steps, per
    batch size (:meth:`per_token`). It speculates while the first is below ``MARGIN`` times the second; each side is measured
    ``MIN_SAMPLES`` times first (speculation first), and the side not chosen is measured again after
    ``RETRY`` iterations (costs drift), the interval doubling up to ``MAX_RETRY`` while the same side
    keeps winning (a losing side's re-measurement is what the gate costs) and reset when the winner
    changes. A re-measurement starts the losing side's window afresh and judges it on that one iteration
    (its window then fills as usual if it wins): on what it costs now, not on samples from when it lost,
    which may date from the first iterations, while the acceptance tables were still learning; one fresh
    sample at a time beside them kept a side that lost early lost for hundreds of iterations after it
    became the cheaper one (at batch 3 in a served run: plain steps on 1,100 consecutive log lines, then
    drafts on 23 of 25 iterations), so that stacks started alike settled differently. One iteration, not
    ``MIN_SAMPLES``: where drafting loses by far (rows verified one call each at batch 8) a probe is the
    gate's whole cost, and a replay of the gate measured two-iteration probes at 3.3% over the cheaper side's
    cost there against 1.6% with one, and the same 6% where drafting wins by a fifth (docs/scheduler.md).
    The caller leaves out iterations that did one-time work (a graph opened, a binding built:
    ``Backend.setup_events``), and :meth:`per_token` the rest of a shared machine's spikes. The
    per-shape call costs (:class:`CallCosts`) choose the drafts; this gate answers whether choosing
    them has paid on this machine, which a model of calls alone misses where calls of one shape vary
    by tens of percent (a shared 2-core VM)."""

    WINDOW = 16
    MIN_SAMPLES = 2
    SPIKE = 3.0
    # speculation must measure this much cheaper per token than plain steps: what it costs beyond its own
    # iterations is not in them (sequences that speculate finish unevenly, leaving a smaller, dearer-per-token
    # batch at the end; measured: batch 4 at 0.84-0.93x mode full in three demos while its iterations
    # measured on par with plain ones)
    MARGIN = 0.9
    RETRY = 32
    MAX_RETRY = 1024

    def __init__(self) -> None:
        self.samples: dict[tuple[int, bool], list[float]] = {}  # (batch, speculated) -> seconds per token
        self._since: dict[int, int] = {}
        self._interval: dict[int, int] = {}
        self._winner: dict[int, bool] = {}
        self._per_token: dict[tuple[int, bool], float | None] = {}  # per_token's answers until the next observe
        self._probing: set[tuple[int, bool]] = set()  # re-measured sides, judged on fewer than MIN_SAMPLES

    def per_token(self, b: int, speculated: bool) -> float | None:
        """The side's seconds per token at batch ``b``: its iterations' seconds over their tokens (not a mean
        or median of per-iteration rates, which an iteration that emitted many tokens would skew), leaving out
        iterations slower per token than ``SPIKE`` times the window's median; None: fewer than MIN_SAMPLES.
        Asked twice every decode iteration above batch 1, so computed once per observation and in plain Python:
        computed each time with numpy it cost mode exact 3% of its speed at batch 4 on the tiny model (0.934x ->
        0.960x (c), 30 interleaved repeats on a 2-core VM; docs/runtime.md)."""
        key = (b, speculated)
        if key not in self._per_token:
            got = self.samples.get(key, [])
            if len(got) < (1 if key in self._probing else self.MIN_SAMPLES):
                self._per_token[key] = None
            else:  # plain Python on at most WINDOW pairs: numpy's fixed costs were most of it
                rates = sorted(sec / tok for sec, tok in got)
                limit = self.SPIKE * (rates[(len(rates) - 1) // 2] + rates[len(rates) // 2]) / 2  # the median
                kept = [(sec, tok) for sec, tok in got if sec / tok <= limit]
                self._per_token[key] = sum(sec for sec, _ in kept) / sum(tok for _, tok in kept)
        return self._per_token[key]

    def speculate(self, b: int) -> bool:
        spec, plain = self.per_token(b, True), self.per_token(b, False)
        if spec is None or plain is None:
            return spec is None
        wins = spec < self.MARGIN * plain
        if self._winner.get(b) != wins:  # a new winner: re-measure the other side soon
            self._winner[b], self._interval[b], self._since[b] = wins, self.RETRY, 0
        self._since[b] += 1
        if self._since[b] >= self._interval[b]:
            self._since[b] = 0
            self._interval[b] = min(2 * self._interval[b], self.MAX_RETRY)
            self.samples[(b, not wins)] = []  # re-measured afresh, judged on this one iteration
            self._per_token.pop((b, not wins), None)
            self._probing.add((b, not wins))
            return not wins
        return wins

    def observe(self, b: int, speculated: bool, seconds: float, tokens: int) -> None:
        if tokens < 1:
            return
        window = self.samples.setdefault((b, speculated), [])
        window.append((seconds, tokens))
        del window[:-self.WINDOW]
        if len(window) >= self.MIN_SAMPLES:
            self._probing.discard((b, speculated))
        self._per_token.pop((b, speculated), None)

    def as_dict(self) -> dict[str, float | None]:
        return {f"{b}{'_spec' if spec else '_plain'}": self.per_token(b, spec) for b, spec in sorted(self.samples)}


def include_next(rule: SpecConfig, drafts: int, probs: list[float], top1: float, costs: DraftCosts) -> bool:
    """Whether draft token ``drafts + 1`` (just drafted, ``probs`` the calibrated agreement of drafts
    1..drafts+1, ``top1`` its top-1 probability) joins the verification."""
    if drafts >= rule.max_draft:
        return False
    if rule.stop is StopRule.FIXED:
        return drafts < rule.fixed
    if rule.stop is StopRule.TOP1:
        return top1 >= rule.top1
    prefix = np.cumprod(probs)  # P(drafts 1..n all accepted), n = 1..drafts+1
    expected = 1.0 + float(prefix[:drafts].sum())
    now, more = costs.round(drafts), costs.round(drafts + 1)
    return float(prefix[drafts]) * now > expected * (more - now)


def accept_greedy(drafts: list[int], full: np.ndarray) -> tuple[int, int]:
    """(accepted drafts n, the token after them): ``full`` [k + 1] are the full model's greedy tokens at
    the positions of drafts x_1..x_k and the one after."""
    n = 0
    while n < len(drafts) and drafts[n] == full[n]:
        n += 1
    return n, int(full[n])


def accept_sampled(drafts: list[int], q: list[np.ndarray], p: list[np.ndarray], rng: np.random.Generator
                   ) -> tuple[int, int]:
    """Speculative sampling: (accepted drafts n, the token after them). ``q[j]`` is the distribution draft
    x_{j+1} was drawn from, ``p[j]`` the full model's at its position; ``p`` has one more entry, for the
    position after the last draft."""
    for n, x in enumerate(drafts):
        if rng.random() * q[n][x] >= p[n][x]:  # reject: u >= p(x) / q(x)
            residual = np.maximum(p[n] - q[n], 0.0)
            total = residual.sum()
            # p == q up to rounding leaves no residual mass (rejection had probability ~0): draw from p
            dist = residual / total if total > 0 else p[n]
            return n, int(rng.choice(dist.shape[0], p=dist))
    return len(drafts), int(rng.choice(p[-1].shape[0], p=p[-1]))


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
