"""What ships and what its certificate says, in words."""
from __future__ import annotations

import enum
from dataclasses import dataclass

from calibration import certify as cert
from calibration.risk import NEVER_EXIT
from edge.runtime.engine_config import KVMode


class KVChoice(str, enum.Enum):
    """Which K/V mode of skipped layers the table is certified for."""

    AUTO = "auto"  # defer, and propagate instead when a direct test certifies it too
    DEFER = "defer"
    PROPAGATE = "propagate"


@dataclass
class Shipped:
    """The certificate of the configuration that ships: the walk's (defer, or propagate when asked for)
    or, when ``kv_mode=auto`` ships propagate, the direct test's."""

    kv_mode: KVMode
    lam: float
    certified: bool
    exact: bool  # the certified rule generated the certify continuations itself, in this mode
    n_units: int
    empirical_risk: float
    bound: float
    p_value: float
    reason: str  # why this K/V mode


def statement(s: Shipped, epsilon: float, delta: float, prompt_tokens: int, new_tokens: int, corpus_name: str,
              docs: int, lam_provisional: float) -> str:
    """The certificate in words: what it promises, about which distribution."""
    length = prompt_tokens + new_tokens
    dist = (f"prompts drawn i.i.d. from {corpus_name}: a document uniformly at random among the {docs} with at "
            f"least {length} tokens, then its {prompt_tokens} tokens from an offset uniformly at random among "
            f"those leaving {new_tokens} more; each prompt continued greedily for {new_tokens} tokens by "
            f"the engine with this table, skipped layers' K/V by {s.kv_mode.value}")
    if not s.certified:
        return (f"No threshold could be certified, so the table never exits: every token is the full model's and "
                f"the false-exit rate is 0. Distribution tested: {dist}. {s.reason}")
    text = (f"With probability at least {1 - delta:g} over the draw of the {s.n_units} certify prompts, the mean "
            f"over prompts of the false-exit rate (the fraction of a prompt's generated tokens, the first excepted, "
            f"that differ from the full model's greedy token on the same prefix) is at most {epsilon:g} for "
            f"{dist}. {s.reason}")
    if not s.exact:
        text += (f" Caveat: the certified threshold {s.lam:.3f} is stricter than the provisional threshold "
                 f"{lam_provisional:.3f} that generated the certify continuations; the certificate covers "
                 f"threshold {s.lam:.3f}'s decisions along those continuations, not along its own.")
    return text


def choose_shipped(choice: KVChoice, mode: KVMode, c: cert.Certificate, prop: cert.DirectTest | None, epsilon: float,
            delta: float) -> Shipped:
    """Which K/V mode ships and whose certificate covers it (see :class:`Shipped`)."""
    reason = (f"K/V mode {mode.value}: asked for (kv_mode={choice.value})." if choice is not KVChoice.AUTO
              else "kv_mode=auto: nothing was certified in defer mode, so propagate was not tested.")
    walk = Shipped(mode, c.lam, c.certified, c.exact, c.n_units, c.empirical_risk, c.bound, c.p_value, reason)
    if prop is None:
        return walk
    if choice is KVChoice.PROPAGATE:  # the walk stopped before the provisional rule: the direct test decides
        why = (f"kv_mode=propagate: the walk stopped at threshold {c.lam:.3f}, before the provisional rule, so its "
               f"losses were recomputed along another rule's continuations, which in propagate mode leaves out the "
               f"full-depth mismatches this rule's own exits cause; tested directly on {prop.n_units} other prompts "
               f"in propagate mode: false-exit rate {prop.mean:.4f}, bound {prop.bound:.4f}")
        if prop.passed:
            return Shipped(KVMode.PROPAGATE, c.lam, True, True, prop.n_units, prop.mean, prop.bound, prop.p_value,
                           f"{why} <= {epsilon:g}, which certifies it (one test, on prompts independent of those that "
                           f"chose the threshold).")
        return Shipped(KVMode.PROPAGATE, NEVER_EXIT, False, True, prop.n_units, prop.mean, prop.bound, prop.p_value,
                       f"{why} > {epsilon:g}: nothing is certified in propagate mode, so the table never exits "
                       f"(kv_mode=defer or auto certifies deferral).")
    if prop.passed and c.exact:
        return Shipped(KVMode.PROPAGATE, c.lam, True, True, prop.n_units, prop.mean, prop.bound, prop.p_value,
                       f"kv_mode=auto: the threshold was certified in defer mode on other prompts, then tested "
                       f"directly in propagate mode (bound {prop.bound:.4f} <= {epsilon:g}), which ships; "
                       f"both tests are one fixed sequence, so both hold together with probability >= "
                       f"{1 - delta:g}.")
    walk.reason = (f"kv_mode=auto: propagate was tested directly on {prop.n_units} other prompts and misses "
                   f"(false-exit rate {prop.mean:.4f}, bound {prop.bound:.4f} > {epsilon:g})"
                   + ("" if c.exact else "; it could not ship anyway, the defer walk having stopped before the "
                      "provisional threshold") + ", so defer ships.")
    return walk
