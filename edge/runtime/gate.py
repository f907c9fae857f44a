"""Whether a decode step that checks exits pays, at the batch size it runs at (issue 27).

An exit check costs every token that reaches it: on this engine a check point costs a token that does not
leave about one layer at batch 1 (the segment boundary, the check's nodes and the host's work; the decode
bench's ``decision_cost.engine_b1``), and a token that leaves saves the layers it skips. When too few
tokens leave, a step through the segments with their checks is slower than one call of every layer, and
a user who asked for exits pays for them. :class:`StepGate` measures both kinds of step per batch size, as
the engine runs them, and keeps to the cheaper: the engine's choice per step never costs more than it
saves (what it measured), at any batch size.

A full-depth step emits the full model's tokens, so the gate can only lower the false exits of a step;
what the certificate covers is the rule's decisions on the steps that check (docs/calibration.md).
"""
from __future__ import annotations

from edge.runtime.estimate import capped_ema


class StepGate:
    """Per batch size, the measured seconds of a decode step that checks exits and of one that runs every
    layer in one call (exponential moving averages; the first step of each kind at a batch size is not
    counted: it builds the backend's bindings), and which to run next.

    Untried, a kind is tried. Then the cheaper runs, and the dearer one is tried again every ``RETRY``
    steps of that batch size, for ``BURST`` steps in a row: what a checking step costs drifts with the text
    (how many tokens leave) and with the load, and a kind never run is never measured again. The first
    step of a kind after the other ran is not counted: its graphs' weights come back from memory into
    caches the other kind's evicted, a cost the kind does not pay while it runs (measured on the demo's
    model, batch 1: with single-step retries the checking estimate read 3.7 ms a step against the 3.0 ms
    the checking engine averaged alone, and the gate ran 96% of steps at full depth). An observation counts
    at most ``OUTLIER`` times the current estimate (a GC pause, a context switch)."""

    ALPHA = 0.1
    RETRY = 40
    BURST = 4
    OUTLIER = 3.0

    def __init__(self) -> None:
        self._est: dict[tuple[int, bool], float] = {}  # (batch, checks) -> seconds per step
        self._seen: dict[tuple[int, bool], int] = {}
        self._since: dict[int, int] = {}
        self._burst: dict[int, tuple[bool, int]] = {}  # batch -> (the kind being retried, steps left)
        self._cold: set[tuple[int, bool]] = set()  # (batch, kind) whose next observation is not counted
        self._asked: dict[int, list[int]] = {}  # batch -> [steps let check, steps run at full depth]

    def checks(self, b: int) -> bool:
        """Whether the next step at batch ``b`` (rows that may leave among them) should check exits."""
        choice = self._choose(b)
        self._asked.setdefault(b, [0, 0])[0 if choice else 1] += 1
        return choice

    def _choose(self, b: int) -> bool:
        for kind in (True, False):
            if (b, kind) not in self._est:
                return kind
        kind, left = self._burst.get(b, (False, 0))
        if left == 0:
            cheaper = self._est[(b, True)] <= self._est[(b, False)]
            n = self._since.get(b, 0) + 1
            if n < self.RETRY:
                self._since[b] = n
                return cheaper
            self._since[b] = 0  # a retry burst of the dearer kind starts, cold
            kind, left = not cheaper, self.BURST
            self._cold.add((b, kind))
        self._burst[b] = (kind, left - 1)
        if left == 1:  # the burst's last step: the kind that runs next starts cold
            self._cold.add((b, not kind))
        return kind

    def observe(self, b: int, checks: bool, seconds: float) -> None:
        """A decode step at batch ``b`` took ``seconds``: one that ran the checks (``checks``; the deferred
        rows it caught up included, they are what exits cost) or one call of every layer."""
        key = (b, checks)
        self._seen[key] = self._seen.get(key, 0) + 1
        if self._seen[key] == 1 or key in self._cold:
            self._cold.discard(key)
            return
        self._est[key] = capped_ema(self._est.get(key), seconds, self.ALPHA, self.OUTLIER)

    def estimate(self, b: int, checks: bool) -> float | None:
        """The measured seconds per step of that kind at batch ``b`` (None: not measured yet)."""
        return self._est.get((b, checks))

    def share_checked(self, b: int) -> float | None:
        """The share of the steps at batch ``b`` the gate was asked about that it let check (None: never asked)."""
        checked, skipped = self._asked.get(b, (0, 0))
        return checked / (checked + skipped) if checked + skipped else None
