"""The measured costs mode exact chooses its drafts by: a draft exit's draft step and verifications
(:class:`DraftCosts`, the calibrated stop rule's C(k)) and the graph of every layer by call shape
(:class:`CallCosts`, the lookup and corpus drafts' C(B, T)); the algorithm is in edge/runtime/speculative.py."""
from __future__ import annotations

import numpy as np

from edge.runtime.estimate import capped_ema


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
            self.step = capped_ema(self.step, seconds, self.ALPHA, self.OUTLIER)

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
    observation capped at ``OUTLIER`` times the estimate. A call of several rows (T > 1) is kept as its ratio
    to the same batch's plain step (T = 1) measured at the time, so a shape measured while the machine ran
    slower (another process's burst, a cold cache, a clock change) follows the plain step's estimate, which
    every plain step refreshes. Kept in seconds, a several-row shape measured in a slow phase stayed dear
    once the machine sped up, and since only its own rounds refresh it, lookup rounds could stop for good
    (this VM ran the same batch-1 work in 213-400 ms, process to process; in stop 62's second fresh-clone demo batch-1 mode
    exact ran no lookup round at all, 0.96x full depth, where a rerun of the bench on a copy of its
    artifacts ran 259: this is one way that happens, not shown to be the one). A shape not measured yet is estimated from the nearest measured
    one (the same B first) by the ratio of a growth model: ``ROW_GROWTH`` more per extra row (measured on
    ONNX Runtime CPU, 2 cores, the demo model at batch 1: T = 2, 4, 8 cost 1.07-1.16, 1.18-1.33 and
    1.42-1.68 of T = 1), ``BATCH_GROWTH`` more per extra sequence; a call of several rows of several
    sequences (a ``verify_{B}`` graph) ``BATCH_GROWTH`` more per extra row of the B * T (2-core AMD EPYC,
    INT8 demo model: C(4, 4) / C(4, 1) 1.8-2.0, C(2, 4) / C(2, 1) 1.2-1.5, C(8, 3) / C(8, 1) 2.0-2.3).
    Before any measurement the unit is one step at batch 1. Only ratios matter to the choices."""

    ALPHA = 0.2
    OUTLIER = 3.0
    ROW_GROWTH = 0.07
    BATCH_GROWTH = 0.1

    def __init__(self) -> None:
        self._est: dict[tuple[int, int], float] = {}  # seconds: plain steps, and T > 1 before B's plain step
        self._ratio: dict[tuple[int, int], float] = {}  # T > 1: seconds / the same B's plain step's estimate
        self._calls: dict[tuple[int, int], int] = {}

    @classmethod
    def fixed(cls, costs: dict[tuple[int, int], float]) -> "CallCosts":
        """Costs given, not measured (any unit), by (B, T); observations still refine them."""
        out = cls()
        for key, seconds in sorted(costs.items(), key=lambda kv: kv[0][1]):  # plain steps first
            out._calls[key] = 2
            b, t = key
            if t > 1 and (b, 1) in out._est:
                out._ratio[key] = float(seconds) / out._est[(b, 1)]
            else:
                out._est[key] = float(seconds)
        return out

    def _ema(self, table: dict[tuple[int, int], float], key: tuple[int, int], value: float) -> None:
        table[key] = capped_ema(table.get(key), value, self.ALPHA, self.OUTLIER)

    def observe(self, b: int, t: int, seconds: float) -> None:
        key = (b, t)
        self._calls[key] = self._calls.get(key, 0) + 1
        if self._calls[key] == 1:
            return
        if t > 1 and (b, 1) in self._est:
            self._est.pop(key, None)  # from now on a ratio to the plain step (seconds kept until it existed)
            self._ema(self._ratio, key, seconds / self._est[(b, 1)])
        else:
            self._ema(self._est, key, seconds)

    def _growth(self, b: int, t: int) -> float:
        if b > 1 and t > 1:  # several rows of several sequences (a verify graph): the rows' products grow with b * t
            return 1 + self.BATCH_GROWTH * (b * t - 1)
        return (1 + self.BATCH_GROWTH * (b - 1)) * (1 + self.ROW_GROWTH * (t - 1))

    def cost(self, b: int, t: int) -> float:
        """Seconds of a call of B = ``b`` sequences, T = ``t`` rows each (estimated where not measured)."""
        key = (b, t)
        if key in self._ratio:
            return self._est[(b, 1)] * self._ratio[key]
        if key in self._est:
            return self._est[key]
        known = list(self._est) + list(self._ratio)
        if not known:
            return self._growth(b, t)
        # the nearest measured shape: the same batch first, then the nearest batch
        ref = min(known, key=lambda k: (k[0] != b, abs(k[0] - b), abs(k[1] - t)))
        return self.cost(*ref) * self._growth(b, t) / self._growth(*ref)

    def as_dict(self) -> dict[str, float]:
        return {f"{b}x{t}": self.cost(b, t) for b, t in sorted(set(self._est) | set(self._ratio))}
