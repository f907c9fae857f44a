"""The settings every stage shares, each defined once, with its bounds (STYLE 17).

A run records the value it used (the threshold table's ``epsilon``, the bundle's ``prefill_budget`` and
``max_running``, its SLA); everything downstream reads that record, and a default here is only where a
value is first chosen (a stage's config dataclass). Nothing below the stages falls back to a number of
its own: a reader without the recorded value raises an error that says where the value should come from.

Here because ``edge.runtime`` is the lowest layer every user imports (calibration, exporters, the
scheduler, the stages: pyproject.toml's layer contract); the module imports nothing of the project but
its error type.

- ``EPSILON``: the tolerated mean per-prompt false-exit rate a certificate promises
  (calibration/statement.py). One spelling, ``epsilon``: the key thresholds.json has always had (the
  shipped tables are hash-bound, so the file keeps its key), the ``calibrate`` config key, and
  :attr:`calibration.table.ThresholdTable.epsilon` in code.
- ``PREFILL_BUDGET``: prompt tokens per engine step (Sarathi-Serve's token budget; the control knob).
  ``PREFILL_BUDGETS``: the grid the profiler, the fixed-budget sweep and the learned policy's actions
  use; its ends are the adaptive policies' default range. A backend may state a largest chunk
  (``Backend.max_chunk``); the engine clamps every budget to it.
- ``MAX_SEQS`` (cache slots) and ``MAX_RUNNING`` (the admission limit, <= slots); ``MAX_RUNNING_GRID``:
  the learned policy's admission limits.
- ``SLA_TTFT_MS`` / ``SLA_TPOT_MS``: the serving default targets (time to first token, time per output
  token) for a request that names none. A preset that tests tighter targets (the serve and scheduler
  benchmarks, the scheduler's training) sets its own in its YAML file and says why there.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from edge.core.errors import ConfigError


@dataclass(frozen=True)
class IntSetting:
    """An integer setting: its name (the config key everywhere), default and bounds (inclusive)."""

    name: str
    default: int
    low: int = 1
    high: int | None = None

    def check(self, value: int, owner: str, key: str | None = None) -> int:
        """``value`` as an int if it is an integer (numpy's too) within the bounds.

        Raises:
            ConfigError: naming ``owner.key`` (``key`` defaults to the setting's name), the bounds and the value.
        """
        ok = isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= self.low
        if not ok or (self.high is not None and value > self.high):
            hi = "" if self.high is None else f" and <= {self.high}"
            raise ConfigError(f"{owner}.{key or self.name} must be an integer >= {self.low}{hi}, got {value!r}")
        return int(value)


@dataclass(frozen=True)
class FloatSetting:
    """A real setting: its name, default and bounds (``open``: both bounds excluded, else only ``low``)."""

    name: str
    default: float
    low: float = 0.0
    high: float | None = None
    open: bool = False

    def check(self, value: float, owner: str, key: str | None = None) -> float:
        """``value`` as a float if it is a finite number within the bounds.

        Raises:
            ConfigError: naming ``owner.key`` (``key`` defaults to the setting's name), the bounds and the value.
        """
        number = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
        if self.open:
            ok = number and self.low < value and (self.high is None or value < self.high)
            want = f"in ({self.low:g}, {self.high:g})" if self.high is not None else f"> {self.low:g}"
        else:
            ok = number and value > self.low and (self.high is None or value <= self.high)
            want = f"> {self.low:g}" + ("" if self.high is None else f" and <= {self.high:g}")
        if not ok:
            raise ConfigError(f"{owner}.{key or self.name} must be {want}, got {value!r}")
        return float(value)


# the certificate's bound: 0.9% of a prompt's tokens may differ from the full model's (the demo's table is
# certified at it: README, docs/runtime.md)
EPSILON = FloatSetting("epsilon", 0.009, 0.0, 1.0, open=True)

# prompt tokens per engine step: the repository's initial value, and the one the shipped learned policy was
# trained from (scheduler/assets/ppo/policy.json, env.sim.prefill_budget); the grid doubles from 16 to 512
PREFILL_BUDGET = IntSetting("prefill_budget", 128)
PREFILL_BUDGETS: tuple[int, ...] = (16, 32, 64, 128, 256, 512)

MAX_SEQS = IntSetting("max_seqs", 16)  # KV cache slots
MAX_RUNNING = IntSetting("max_running", 16)  # sequences holding a slot (<= max_seqs)
MAX_RUNNING_GRID: tuple[int, ...] = (4, 8, 16)

SLA_TTFT_MS = FloatSetting("sla_ttft_ms", 1000.0)
SLA_TPOT_MS = FloatSetting("sla_tpot_ms", 100.0)


def clamp_budget(budget: int, max_chunk: int | None) -> int:
    """``budget`` within a backend's largest chunk (``None``: no limit) and >= 1."""
    return max(1, int(budget) if max_chunk is None else min(int(budget), int(max_chunk)))
