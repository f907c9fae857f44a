"""Request arrival workloads: the Azure LLM code trace (read from where it lies) or synthetic arrivals.

The trace is another repository's data (AzurePublicDataset, CC-BY-4.0; "Splitwise", Patel et al.,
ISCA 2024); the project never carries a copy. ``load_workload`` reads a path the user names, else
the shared copy at ``../shared/data/traces/azure_llm_2023_code.csv`` where it exists, else it falls
back to a synthetic arrival process and says so in ``Workload.source``.
"""
from __future__ import annotations

import csv
import enum
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np

from edge.core.errors import ConfigError

SHARED_TRACE = Path(__file__).resolve().parents[2] / "shared" / "data" / "traces" / "azure_llm_2023_code.csv"
TRACE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


class Arrivals(str, enum.Enum):
    POISSON = "poisson"
    BURSTY = "bursty"   # two-state Markov-modulated Poisson process


@dataclass(frozen=True)
class Workload:
    """Requests in arrival order: arrival time (s from the first), prompt and output lengths."""
    arrival_s: np.ndarray        # [N] float64, non-decreasing, starts at 0
    prompt_tokens: np.ndarray    # [N] int64 >= 1
    output_tokens: np.ndarray    # [N] int64 >= 1
    source: str                  # the file read, or the synthetic process and its parameters

    def __len__(self) -> int:
        return len(self.arrival_s)


def read_trace(path: Path, limit: int | None = None) -> Workload:
    """Read an Azure-format CSV trace (TIMESTAMP, ContextTokens, GeneratedTokens).

    Raises:
        ConfigError: the file is missing, lacks a column, or holds a malformed row (named by line).
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"trace {path}: no such file")
    times, prompts, outputs = [], [], []
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in TRACE_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise ConfigError(f"trace {path}: missing column(s) {missing}; expected {list(TRACE_COLUMNS)}")
        for line, row in enumerate(reader, start=2):
            try:
                # the trace has 7 fractional digits; datetime takes at most 6
                stamp = row["TIMESTAMP"].strip()
                head, _, frac = stamp.partition(".")
                t = datetime.fromisoformat(f"{head}.{(frac + '000000')[:6]}" if frac else head)
                p, o = int(row["ContextTokens"]), int(row["GeneratedTokens"])
            except (ValueError, TypeError) as e:
                raise ConfigError(f"trace {path}, line {line}: {e}") from None
            if p < 1 or o < 1:
                raise ConfigError(f"trace {path}, line {line}: token counts must be >= 1, got {p}, {o}")
            times.append(t.timestamp())
            prompts.append(p)
            outputs.append(o)
            if limit is not None and len(times) >= limit:
                break
    if not times:
        raise ConfigError(f"trace {path}: no requests")
    t = np.asarray(times, dtype=np.float64)
    order = np.argsort(t, kind="stable")
    t = t[order] - t[order][0]
    return Workload(t, np.asarray(prompts, np.int64)[order], np.asarray(outputs, np.int64)[order],
                    source=f"trace {path}")


def synthetic(n: int, rate: float, kind: Arrivals = Arrivals.POISSON, seed: int = 0,
              prompt_mean: float = 256.0, output_mean: float = 64.0, burst_factor: float = 4.0,
              mean_dwell_s: float = 10.0) -> Workload:
    """Synthetic arrivals with lognormal prompt / output lengths.

    ``bursty`` is a two-state Markov-modulated Poisson process: a calm state and a burst state whose
    rate is ``burst_factor`` times the calm one, with exponential dwell times of mean
    ``mean_dwell_s`` in each, scaled so that the long-run mean rate is ``rate``.
    """
    if n < 1 or rate <= 0:
        raise ConfigError(f"synthetic workload needs n >= 1 and rate > 0, got n={n}, rate={rate}")
    rng = np.random.default_rng(seed)
    if kind is Arrivals.POISSON:
        gaps = rng.exponential(1.0 / rate, n)
    else:
        # equal mean dwell in both states: mean rate = (calm + burst) / 2 = rate
        calm = 2.0 * rate / (1.0 + burst_factor)
        rates, gaps, state, left = (calm, calm * burst_factor), [], 0, rng.exponential(mean_dwell_s)
        while len(gaps) < n:
            g = rng.exponential(1.0 / rates[state])
            if g > left:            # state switches before the next arrival (memoryless: redraw)
                state, left = 1 - state, rng.exponential(mean_dwell_s)
                continue
            left -= g
            gaps.append(g)
        gaps = np.asarray(gaps)
    t = np.concatenate([[0.0], np.cumsum(gaps[1:])])

    def lengths(mean: float) -> np.ndarray:
        sigma = 0.8
        return np.maximum(1, rng.lognormal(np.log(mean) - sigma ** 2 / 2, sigma, n)).astype(np.int64)

    return Workload(t, lengths(prompt_mean), lengths(output_mean),
                    source=f"synthetic {kind.value} arrivals, rate {rate}/s, seed {seed}")


def load_workload(trace: str | Path | None = None, n: int = 1000, rate: float = 2.0,
                  kind: Arrivals = Arrivals.POISSON, seed: int = 0) -> Workload:
    """The named trace, else the shared Azure trace where it exists, else synthetic arrivals.

    A trace the user names must exist (ConfigError otherwise); only the default falls back.
    """
    if trace is not None:
        return read_trace(Path(trace), limit=n)
    if SHARED_TRACE.is_file():
        return read_trace(SHARED_TRACE, limit=n)
    w = synthetic(n, rate, kind, seed)
    return Workload(w.arrival_s, w.prompt_tokens, w.output_tokens,
                    source=f"{w.source} (no trace at {SHARED_TRACE})")
