"""Online false-exit audit: a running estimate of the served false-exit rate, with confidence bounds.

The threshold table certifies the false-exit rate on the distribution it was calibrated on; served
traffic drifts. The server re-decodes a random fraction of the tokens it served in mode ``bounded``
at full depth (:mod:`edge.runtime.host_audit`) and feeds the verdicts here. A token that reached the last
layer cannot exit falsely: it is counted as audited and correct at no cost, so the pooled rate is
the per-token rate the certificate speaks of (false exits / tokens), not a rate among exited tokens.

Bounds are exact one-sided Clopper-Pearson bounds at level ``delta`` (Clopper & Pearson, 1934),
treating audited tokens as independent draws. Tokens of one request are correlated; sampling a small
fraction across many requests weakens that, but the bound is an estimate of drift, not a new
certificate.

With deferral (the K/V mode that ships) the engine judges exits itself (:class:`edge.runtime.request.Verdict`):
a row that left early has its skipped layers computed with the sequence's next token, and the last layer's
head on that row gives the full model's token on the exit's own prefix, for one more head row. The host then
counts every token of every audited request: a token at full depth as correct, an exit by its verdict, and
an exit the engine could not judge (the request ended before its owed layers ran) by a re-decode, queued
whatever ``fraction`` says, since those exits are not a random sample (measured on the demo model: 10% of
them false against 3% of the judged ones). The audit is then complete, not a sample, and costs a re-decode
only per request that ends on exits.

Requests as units. With every token of a request judged (the verdicts above, and its unjudged exits
re-decoded), the request's own false-exit rate is known exactly, and requests are the units the certificate
is about (a prompt's continuation). The host feeds each completed request's rate to the certificate's own
test, the betting p-value of H0: mean > epsilon (:class:`edge.core.betting.Betting`), in completion order:
anytime-valid, so it may be read after every request. Its p-value at or under delta says that the served
traffic's mean per-request false-exit rate is within epsilon with confidence 1 - delta, on that traffic,
which is a certificate for the served composite (gate, drafts and all), not an estimate; it needs on the
order of ln(1/delta)/epsilon requests (333 at eps 0.009, delta 0.05) before it can say so.

Trigger. Where requests are audited whole (deferral's verdicts: ``trigger="auto"``, the default, picks
``"requests"`` there), the fallback fires on the mirror image of that test: the betting test of H0: the
served requests' mean false-exit rate is at most epsilon, one request at a time (:class:`Betting` on
1 - rate against 1 - epsilon), when its p-value reaches delta. It is anytime-valid (read after every
request, a server within its certificate falls back with probability at most delta over its whole life)
and takes requests as the units, as the certificate does: a wrong token tends to be followed by more in
the same request, and a per-token bound reads such a cluster as evidence. Measured (a fresh-clone demo's
`bench audit`, the shipped rule, eps 0.9%): the per-token lower bound fired after 58 in-domain held-out
requests (26 false exits in 1,853 tokens) although all 400 erred at 0.55% (per-request mean 0.57%); the
requests' test did not fire (p-value of mean > eps 0.97 after 400). A rule that breaks its certificate by
far is caught in a few requests (every check exiting at the first exit of a random model: within 12).

Where tokens are sampled (``fraction``, without deferral), the per-token bounds decide (``"auto"`` picks
``"lower"``). An upper bound starts at 1 (no evidence yet) and needs about ln(1/delta)/eps clean tokens
to fall under eps (333 at eps 0.009, delta 0.05); with a true rate of half eps it crosses eps again
every few hundred audited tokens by chance. So that fallback fires on the *lower* bound: when even the
optimistic end of the interval is above eps, the rate exceeds eps with confidence 1 - delta at that
token count (per test: read after every token, it is not anytime-valid, and tokens of one request are
not independent). ``trigger="upper"`` (fall back as soon as the upper bound, after ``min_tokens``, is
above eps) is the cautious alternative. Both bounds are exported.

The bound tested, ``epsilon``, is the threshold table's (:attr:`calibration.table.ThresholdTable.epsilon`,
handed to :class:`edge.runtime.host.EngineHost`): the audit has no eps of its own.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from scipy.stats import beta as beta_dist

from edge.core.betting import Betting
from edge.core.errors import ConfigError


class Trigger(str, enum.Enum):
    AUTO = "auto"     # REQUESTS where requests are audited whole (deferral's verdicts), else LOWER
    REQUESTS = "requests"  # fall back when the requests' mean rate exceeds eps (anytime-valid betting test)
    LOWER = "lower"   # fall back when the per-token rate exceeds eps with confidence 1 - delta
    UPPER = "upper"   # fall back while the per-token rate is not shown to be below eps (after min_tokens)


@dataclass
class AuditConfig:
    fraction: float = 0.0       # of the tokens served in mode bounded (greedy requests), re-decoded at full depth
    # with deferral, take the engine's own verdict on every early exit (edge.runtime.request.Verdict: the full
    # model's token, computed with the owed layers at the cost of one head row) and count every token of an
    # audited request; only the exits the engine could not judge are re-decoded, all of them. Without
    # deferral (or False), ``fraction`` samples tokens as before.
    verdicts: bool = True
    delta: float = 0.05
    trigger: Trigger = Trigger.AUTO
    min_tokens: int = 200       # audited tokens before a per-token trigger may fire
    max_pending: int = 64       # queued audits; beyond it a sample is dropped (counted)
    seed: int = 0

    def __post_init__(self) -> None:
        self.trigger = Trigger(self.trigger)
        if not 0.0 <= self.fraction <= 1.0:
            raise ConfigError(f"audit.fraction must be in [0, 1], got {self.fraction}")
        if not 0.0 < self.delta < 1.0:
            raise ConfigError(f"audit.delta must be in (0, 1), got {self.delta}")
        if self.min_tokens < 1 or self.max_pending < 1:
            raise ConfigError("audit.min_tokens and audit.max_pending must be >= 1")

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "audit") -> AuditConfig:
        """The audit settings of a config or a bundle's recorded host settings.

        Raises:
            ConfigError: an unknown key (a bound of its own among them: the bound is the threshold table's
                epsilon), a bad value.
        """
        unknown = sorted(set(d) - set(cls.__dataclass_fields__))
        if unknown:
            raise ConfigError(f"{source}: unknown audit setting(s) {unknown}; expected some of "
                              f"{sorted(cls.__dataclass_fields__)} (the bound the audit tests is the threshold "
                              f"table's epsilon, not a setting of its own)")
        return cls(**d)


def clopper_pearson(k: int, n: int, delta: float) -> tuple[float, float]:
    """One-sided (lower, upper) bounds on a binomial rate from k successes in n, each at level delta."""
    if n <= 0:
        return 0.0, 1.0
    lower = 0.0 if k == 0 else float(beta_dist.ppf(delta, k, n - k + 1))
    upper = 1.0 if k == n else float(beta_dist.ppf(1.0 - delta, k + 1, n - k))
    return lower, upper


@dataclass
class _Count:
    audited: int = 0
    false: int = 0


@dataclass
class AuditEstimate:
    """Verdicts so far, per exit layer and pooled; ``fallback`` once the trigger has fired. ``epsilon``:
    the certified false-exit rate the trigger tests; None: no bound to test (nothing is audited: a host
    whose rule has no certificate), the trigger never fires."""

    epsilon: float | None
    delta: float
    trigger: Trigger = Trigger.LOWER  # as the host resolved it (never AUTO)
    min_tokens: int = 200
    per_exit: dict[int, _Count] = field(default_factory=dict)
    fallback: bool = False
    fallback_events: int = 0
    fired_after: int | None = None  # audited tokens when the trigger last fired
    # per-request false-exit rates of requests audited whole (every token judged), in completion order, and the
    # certificate's own test on them (edge.core.betting.Betting, H0: mean > epsilon; anytime-valid)
    unit_losses: list[float] = field(default_factory=list)
    incomplete_units: int = 0  # audited requests one of whose exits could not be judged (a re-decode dropped)
    _units: Any = None
    _exceeds: Any = None  # the mirror test, H0: mean <= epsilon (Betting on 1 - loss): the REQUESTS trigger

    def __post_init__(self) -> None:
        self.trigger = Trigger(self.trigger)
        if self.trigger is Trigger.AUTO:
            raise ConfigError("AuditEstimate: resolve trigger=auto first (requests where requests are audited "
                              "whole, else lower)")

    def record(self, exit_layer: int, false_exit: bool) -> bool:
        """Add one audited token; returns True when this verdict fires the fallback."""
        c = self.per_exit.setdefault(exit_layer, _Count())
        c.audited += 1
        c.false += bool(false_exit)
        if not self.fallback and self._alarm():
            self._fire()
            return True
        return False

    def record_unit(self, loss: float) -> bool:
        """One request audited whole: its false exits over its judged tokens (all but the first, the prefill's).
        Returns True when this request fires the fallback (the REQUESTS trigger)."""
        if self.epsilon is None:
            return False
        if self._units is None:
            self._units = Betting(self.epsilon)
            # H0: mean <= eps as 1 - loss against 1 - eps; its prior a request at eps / 2, as the other's
            self._exceeds = Betting(1.0 - self.epsilon, prior_mean=1.0 - self.epsilon / 2)
        self.unit_losses.append(float(loss))
        self._units.update(float(loss))
        self._exceeds.update(1.0 - float(loss))
        if self.trigger is Trigger.REQUESTS and not self.fallback and self.exceeds_p_value() <= self.delta:
            self._fire()
            return True
        return False

    def exceeds_p_value(self) -> float:
        """The p-value of H0: the requests' mean false-exit rate is at most epsilon (1: no request yet)."""
        return 1.0 if self._exceeds is None else float(self._exceeds.p_value[0])

    def _fire(self) -> None:
        self.fallback = True
        self.fallback_events += 1
        self.fired_after = self.audited

    def units(self) -> dict[str, Any]:
        """The served traffic's test: requests, their mean false-exit rate, the p-value of H0: mean > epsilon
        (the calibration's betting test, in completion order) and whether it is <= delta."""
        n = len(self.unit_losses)
        p = 1.0 if self._units is None else float(self._units.p_value[0])
        return {"requests": n, "mean": sum(self.unit_losses) / n if n else 0.0, "p_value": p,
                "certified": p <= self.delta, "incomplete": self.incomplete_units,
                "exceeds_p_value": self.exceeds_p_value()}

    def reset(self) -> None:
        """Start over (an operator's decision after re-calibrating); the event count stays."""
        self.per_exit.clear()
        self.fallback = False
        self.unit_losses, self._units, self._exceeds, self.incomplete_units = [], None, None, 0

    @property
    def audited(self) -> int:
        return sum(c.audited for c in self.per_exit.values())

    @property
    def false(self) -> int:
        return sum(c.false for c in self.per_exit.values())

    def bounds(self) -> tuple[float, float]:
        """Pooled (lower, upper) bounds on the per-token false-exit rate."""
        return clopper_pearson(self.false, self.audited, self.delta)

    def _alarm(self) -> bool:
        if self.epsilon is None or self.audited < self.min_tokens or self.trigger is Trigger.REQUESTS:
            return False
        lower, upper = self.bounds()
        return (lower if self.trigger is Trigger.LOWER else upper) > self.epsilon

    def as_dict(self) -> dict:
        lower, upper = self.bounds()
        n, k = self.audited, self.false
        exits = {}
        for layer, c in sorted(self.per_exit.items()):
            lo, up = clopper_pearson(c.false, c.audited, self.delta)
            exits[str(layer)] = {"audited": c.audited, "false": c.false,
                                 "rate": c.false / c.audited if c.audited else 0.0, "upper": up, "lower": lo}
        return {"epsilon": self.epsilon, "delta": self.delta, "trigger": self.trigger.value, "audited": n, "false": k,
                "rate": k / n if n else 0.0, "upper": upper, "lower": lower, "fallback": self.fallback,
                "fallback_events": self.fallback_events, "fired_after": self.fired_after, "exits": exits,
                "requests": self.units()}
