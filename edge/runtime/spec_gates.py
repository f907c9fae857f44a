"""Whether speculation pays, measured as the engine runs: exit-draft rounds against a plain step
(:class:`ExitDraftGate`), and above batch 1 whole decode iterations that looked for drafts against plain ones
(:class:`SpeculationGate`); the algorithm is in edge/runtime/speculative.py."""
from __future__ import annotations


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
