"""Request arrival workloads: the Azure LLM code trace (read from where it lies) or synthetic arrivals.

The trace is another repository's data (AzurePublicDataset, CC-BY-4.0; "Splitwise", Patel et al.,
ISCA 2024); the project never carries a copy. ``load_workload`` reads a path the user names, else
the shared copy at ``../shared/data/traces/azure_llm_2023_code.csv`` where it exists, else it falls
back to a synthetic arrival process and says so in ``Workload.source``.

Besides the trace reader: synthetic Poisson, bursty (MMPP) and diurnal (sinusoidal-rate) arrivals,
lognormal or two-class mixed lengths, a reader for any CSV / JSONL file in the Azure or our simple
format, and transforms for load sweeps (``scale_rate``, ``rate_of``) and context windows
(``clip_lengths``).
"""
from __future__ import annotations

import csv
import enum
import json
import math
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from edge.core.errors import ConfigError

SHARED_TRACE = Path(__file__).resolve().parents[3] / "shared" / "data" / "traces" / "azure_llm_2023_code.csv"
TRACE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
# read_workload_file: each field under our simple name or the Azure trace's; the first present wins
FIELDS = {"arrival_s": ("arrival_s", "TIMESTAMP"),
          "prompt_tokens": ("prompt_tokens", "ContextTokens"),
          "output_tokens": ("output_tokens", "GeneratedTokens")}


class Arrivals(str, enum.Enum):
    POISSON = "poisson"
    BURSTY = "bursty"     # two-state Markov-modulated Poisson process
    DIURNAL = "diurnal"   # non-homogeneous Poisson, sinusoidal rate (a day compressed to period_s)


class Lengths(str, enum.Enum):
    LOGNORMAL = "lognormal"   # one lognormal per length
    MIXED = "mixed"           # two classes (short chat-like, long code-like), lognormal within each


@dataclass(frozen=True)
class LengthMix:
    """The two classes of ``Lengths.MIXED``: a share of short chat-like requests (short prompt, longer
    answer) and the rest long code-like ones (long context, short completion; the Azure code trace's
    shape: median context in the thousands, median output around ten tokens)."""
    short_share: float = 0.7
    short_prompt_mean: float = 64.0
    short_output_mean: float = 96.0
    long_prompt_mean: float = 768.0
    long_output_mean: float = 24.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.short_share <= 1.0:
            raise ConfigError(f"length mix: short_share must be in [0, 1], got {self.short_share}")
        for name in ("short_prompt_mean", "short_output_mean", "long_prompt_mean", "long_output_mean"):
            if not getattr(self, name) >= 1.0:
                raise ConfigError(f"length mix: {name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class Workload:
    """Requests in arrival order: arrival time (s from the first), prompt and output lengths."""
    arrival_s: np.ndarray        # [N] float64, non-decreasing, starts at 0
    prompt_tokens: np.ndarray    # [N] int64 >= 1
    output_tokens: np.ndarray    # [N] int64 >= 1
    source: str                  # the file read, or the synthetic process and its parameters

    def __len__(self) -> int:
        return len(self.arrival_s)


def _azure_time(stamp: str) -> float:
    """Seconds since the epoch of an Azure trace TIMESTAMP (``2023-11-16 18:17:03.9799600``)."""
    # the trace has 7 fractional digits; datetime takes at most 6
    head, _, frac = stamp.strip().partition(".")
    return datetime.fromisoformat(f"{head}.{(frac + '000000')[:6]}" if frac else head).timestamp()


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
                t = _azure_time(row["TIMESTAMP"])
                p, o = int(row["ContextTokens"]), int(row["GeneratedTokens"])
            except (ValueError, TypeError, AttributeError) as e:
                raise ConfigError(f"trace {path}, line {line}: {e}") from None
            if p < 1 or o < 1:
                raise ConfigError(f"trace {path}, line {line}: token counts must be >= 1, got {p}, {o}")
            times.append(t)
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


def _records(path: Path) -> tuple[Iterator[tuple[int, dict[str, Any]]], list[str] | None]:
    """(line, record) pairs of a CSV or JSONL file and, for CSV, its header; JSONL where the suffix
    says so (.jsonl / .ndjson / .json) or the first non-blank character is ``{``."""
    text = path.read_text()
    if not text.strip():
        raise ConfigError(f"workload {path}: empty file")
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson", ".json") or (suffix != ".csv" and text.lstrip().startswith("{")):
        def jsonl() -> Iterator[tuple[int, dict[str, Any]]]:
            for line, raw in enumerate(text.splitlines(), start=1):
                if not raw.strip():
                    continue
                try:
                    rec = json.loads(raw)
                except json.JSONDecodeError as e:
                    raise ConfigError(f"workload {path}, line {line}: expected one JSON object per line (JSONL), "
                                      f"got invalid JSON ({e.msg})") from None
                if not isinstance(rec, dict):
                    raise ConfigError(f"workload {path}, line {line}: expected one JSON object per line (JSONL), "
                                      f"got a {type(rec).__name__}")
                yield line, rec
        return jsonl(), None
    reader = csv.DictReader(text.splitlines())
    header = [h.strip() for h in (reader.fieldnames or [])]
    reader.fieldnames = header
    return ((line, row) for line, row in enumerate(reader, start=2)), header


def _keys_of(path: Path, present: list[str], where: str) -> dict[str, str]:
    """Which key each field is read from: the first of its names present."""
    keys = {}
    for field, names in FIELDS.items():
        found = [n for n in names if n in present]
        if not found:
            raise ConfigError(f"workload {path}, {where}: missing {' / '.join(repr(n) for n in names)} "
                              f"(expected fields {list(FIELDS)} or the Azure trace's {list(TRACE_COLUMNS)})")
        keys[field] = found[0]
    return keys


def _count(path: Path, line: int, key: str, value: Any) -> int:
    """A token count: a whole number >= 1 (JSON 12.0 is 12; 12.5, true and "x" are errors)."""
    where = f"workload {path}, line {line}, field {key!r}"
    if value is None or (isinstance(value, str) and not value.strip()):
        raise ConfigError(f"{where}: no value (expected a whole number of tokens)")
    if isinstance(value, bool):
        raise ConfigError(f"{where}: expected a whole number of tokens, got {value!r}")
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: expected a whole number of tokens, got {value!r}") from None
    if not math.isfinite(x) or x != int(x):
        raise ConfigError(f"{where}: expected a whole number of tokens, got {value!r}")
    if x < 1:
        raise ConfigError(f"{where}: token counts must be >= 1, got {value!r}")
    return int(x)


def _arrival(path: Path, line: int, key: str, value: Any) -> float:
    """An arrival time: seconds >= 0 (``arrival_s``) or an Azure datetime (``TIMESTAMP``)."""
    where = f"workload {path}, line {line}, field {key!r}"
    if key == "TIMESTAMP":
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a datetime like '2023-11-16 18:17:03.97996', got {value!r}")
        try:
            return _azure_time(value)
        except ValueError:
            raise ConfigError(f"{where}: expected a datetime like '2023-11-16 18:17:03.97996', got {value!r}") from None
    if value is None or (isinstance(value, str) and not value.strip()):
        raise ConfigError(f"{where}: no value (expected seconds, a number)")
    if isinstance(value, bool):
        raise ConfigError(f"{where}: expected seconds (a number), got {value!r}")
    try:
        t = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: expected seconds (a number), got {value!r}") from None
    if not math.isfinite(t):
        raise ConfigError(f"{where}: expected a finite number of seconds, got {value!r}")
    if t < 0:
        raise ConfigError(f"{where}: arrival times must be >= 0, got {value!r}")
    return t


def read_workload_file(path: str | Path, limit: int | None = None) -> Workload:
    """Read a workload from a CSV or JSONL file in the Azure trace's format or our simple one.

    Each request needs an arrival time, ``arrival_s`` (seconds, >= 0) or the Azure trace's
    ``TIMESTAMP`` (a datetime); a prompt length, ``prompt_tokens`` or ``ContextTokens``; and an output
    length, ``output_tokens`` or ``GeneratedTokens`` (whole numbers >= 1). Where both names of a field
    are present the simple one is read. Other columns / keys are ignored. JSONL: one object a line,
    blank lines skipped; the first object decides which names are read.

    Order: ``arrival_s`` must be non-decreasing in file order (a decrease is an error naming the line:
    a hand-written or generated file out of order is more likely a mistake than a wish); ``TIMESTAMP``
    rows are sorted, as ``read_trace`` does. Arrivals are shifted so the first is at 0.

    Args:
        path: the file (``.csv``; ``.jsonl`` / ``.ndjson`` / ``.json``; otherwise sniffed).
        limit: read at most this many requests (the first in file order).

    Returns:
        The workload; ``source`` is ``"trace <path>"``.

    Raises:
        ConfigError: the file is missing or empty, lacks a field, or holds a malformed value (named by
            file, line and field).
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"workload {path}: no such file")
    records, header = _records(path)
    keys = _keys_of(path, header, "header (line 1)") if header is not None else None
    times, prompts, outputs, prev = [], [], [], None
    for line, rec in records:
        if keys is None:
            keys = _keys_of(path, list(rec), f"line {line}")
        for field, key in keys.items():
            if key not in rec:
                raise ConfigError(f"workload {path}, line {line}: missing field {key!r} "
                                  f"(read as {field}, as in the first record)")
        t = _arrival(path, line, keys["arrival_s"], rec[keys["arrival_s"]])
        if keys["arrival_s"] == "arrival_s" and prev is not None and t < prev[1]:
            raise ConfigError(f"workload {path}, line {line}, field 'arrival_s': arrival times must not "
                              f"decrease, got {t} after {prev[1]} (line {prev[0]})")
        prev = (line, t)
        times.append(t)
        prompts.append(_count(path, line, keys["prompt_tokens"], rec[keys["prompt_tokens"]]))
        outputs.append(_count(path, line, keys["output_tokens"], rec[keys["output_tokens"]]))
        if limit is not None and len(times) >= limit:
            break
    if not times:
        raise ConfigError(f"workload {path}: no requests (a header but no rows)")
    t = np.asarray(times, dtype=np.float64)
    order = np.argsort(t, kind="stable")     # the identity for arrival_s (checked above)
    t = t[order] - t[order][0]
    return Workload(t, np.asarray(prompts, np.int64)[order], np.asarray(outputs, np.int64)[order],
                    source=f"trace {path}")


def _diurnal_times(rng: np.random.Generator, n: int, rate: float, amplitude: float, period_s: float,
                   phase: float) -> np.ndarray:
    """The first ``n`` arrivals of a Poisson process of rate ``rate * (1 + amplitude sin(2 pi t / period_s
    + phase))``, by thinning (Lewis & Shedler 1979): candidates at the peak rate, each kept with
    probability rate(t) / peak."""
    peak = rate * (1.0 + amplitude)
    out, t0 = [], 0.0
    while len(out) < n:
        m = max(64, 2 * (n - len(out)))     # candidates per round; about 1/(1+amplitude) are kept
        t = t0 + np.cumsum(rng.exponential(1.0 / peak, m))
        keep = rng.uniform(0.0, 1.0, m) * peak <= rate * (1.0 + amplitude * np.sin(2 * np.pi * t / period_s + phase))
        out.extend(t[keep][: n - len(out)])
        t0 = t[-1]
    return np.asarray(out)


def synthetic(n: int, rate: float, kind: Arrivals = Arrivals.POISSON, seed: int = 0,
              prompt_mean: float = 256.0, output_mean: float = 64.0, burst_factor: float = 4.0,
              mean_dwell_s: float = 10.0, *, period_s: float = 120.0, amplitude: float = 0.6,
              phase: float = 0.0, lengths: Lengths = Lengths.LOGNORMAL,
              mix: LengthMix = LengthMix()) -> Workload:
    """Synthetic arrivals with lognormal (or two-class mixed lognormal) prompt / output lengths.

    ``bursty`` is a two-state Markov-modulated Poisson process: a calm state and a burst state whose
    rate is ``burst_factor`` times the calm one, with exponential dwell times of mean
    ``mean_dwell_s`` in each, scaled so that the long-run mean rate is ``rate``.

    ``diurnal`` is a non-homogeneous Poisson process whose rate follows a day cycle compressed to
    ``period_s``: ``rate * (1 + amplitude * sin(2 pi t / period_s + phase))``, ``0 <= amplitude < 1``;
    its mean over whole periods is ``rate``. ``t`` counts from the process start; the first arrival
    (a fraction of a second later at usual rates) is then shifted to 0 like every workload's.

    ``lengths``: ``lognormal`` draws prompts of mean ``prompt_mean`` and outputs of mean
    ``output_mean``; ``mixed`` draws each request's class from ``mix`` (``prompt_mean`` and
    ``output_mean`` then unused). The default path draws exactly what it always drew, seed for seed.

    Raises:
        ConfigError: n < 1, rate <= 0, amplitude outside [0, 1), period_s <= 0.
    """
    if n < 1 or rate <= 0:
        raise ConfigError(f"synthetic workload needs n >= 1 and rate > 0, got n={n}, rate={rate}")
    kind, lengths = Arrivals(kind), Lengths(lengths)
    rng = np.random.default_rng(seed)
    detail = ""
    if kind is Arrivals.POISSON:
        gaps = rng.exponential(1.0 / rate, n)
    elif kind is Arrivals.BURSTY:
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
    else:
        if not 0.0 <= amplitude < 1.0 or not period_s > 0:
            raise ConfigError(f"diurnal arrivals need 0 <= amplitude < 1 and period_s > 0, "
                              f"got amplitude={amplitude}, period_s={period_s}")
        times = _diurnal_times(rng, n, rate, amplitude, period_s, phase)
        gaps = np.diff(times, prepend=0.0)
        detail = f" (amplitude {amplitude}, period {period_s} s, phase {phase})"
    t = np.concatenate([[0.0], np.cumsum(gaps[1:])])

    def lognormal(mean: float | np.ndarray, size: int) -> np.ndarray:
        sigma = 0.8
        return np.maximum(1, rng.lognormal(np.log(mean) - sigma ** 2 / 2, sigma, size)).astype(np.int64)

    if lengths is Lengths.LOGNORMAL:
        prompts, outputs = lognormal(prompt_mean, n), lognormal(output_mean, n)
    else:
        short = rng.uniform(0.0, 1.0, n) < mix.short_share
        prompts = lognormal(np.where(short, mix.short_prompt_mean, mix.long_prompt_mean), n)
        outputs = lognormal(np.where(short, mix.short_output_mean, mix.long_output_mean), n)
        detail += f", mixed lengths {mix.short_share:.0%} short"
    return Workload(t, prompts, outputs, source=f"synthetic {kind.value} arrivals, rate {rate}/s, seed {seed}{detail}")


def rate_of(w: Workload) -> float:
    """Mean arrival rate in requests per second: (N - 1) gaps over the span from first to last arrival.

    Raises:
        ConfigError: fewer than two requests, or all at the same instant (no span to divide by).
    """
    if len(w) < 2 or not w.arrival_s[-1] > w.arrival_s[0]:
        raise ConfigError(f"rate of {w.source}: needs two or more requests spread over time, got {len(w)}")
    return (len(w) - 1) / float(w.arrival_s[-1] - w.arrival_s[0])


def scale_rate(w: Workload, factor: float) -> Workload:
    """The same requests with arrivals time-compressed by ``factor``: load (rate) x factor, same order,
    same lengths. ``factor`` 2 halves every gap.

    Raises:
        ConfigError: factor not a finite number > 0.
    """
    if isinstance(factor, bool) or not isinstance(factor, (int, float, np.integer, np.floating)) \
            or not math.isfinite(factor) or factor <= 0:
        raise ConfigError(f"scale_rate: factor must be a finite number > 0, got {factor!r}")
    return replace(w, arrival_s=w.arrival_s / float(factor), source=f"{w.source}, rate x{factor:g}")


def clip_lengths(w: Workload, max_prompt: int, max_output: int) -> Workload:
    """Prompts clipped to ``max_prompt`` tokens and outputs to ``max_output`` (so that each request fits
    a context window of ``max_prompt + max_output``); arrivals unchanged.

    Raises:
        ConfigError: a limit is not a whole number >= 1.
    """
    for name, v in (("max_prompt", max_prompt), ("max_output", max_output)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ConfigError(f"clip_lengths: {name} must be a whole number >= 1, got {v!r}")
    return replace(w, prompt_tokens=np.minimum(w.prompt_tokens, max_prompt),
                   output_tokens=np.minimum(w.output_tokens, max_output),
                   source=f"{w.source}, clipped to {max_prompt} + {max_output} tokens")


def load_workload(trace: str | Path | None = None, n: int = 1000, rate: float = 2.0,
                  kind: Arrivals = Arrivals.POISSON, seed: int = 0) -> Workload:
    """The named file (``read_workload_file``: the Azure trace's format or our simple one), else the
    shared Azure trace where it exists, else synthetic arrivals.

    A trace the user names must exist (ConfigError otherwise); only the default falls back.
    """
    if trace is not None:
        return read_workload_file(Path(trace), limit=n)
    if SHARED_TRACE.is_file():
        return read_trace(SHARED_TRACE, limit=n)
    w = synthetic(n, rate, kind, seed)
    return Workload(w.arrival_s, w.prompt_tokens, w.output_tokens,
                    source=f"{w.source} (no trace at {SHARED_TRACE})")
