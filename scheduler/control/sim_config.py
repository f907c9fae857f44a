"""The simulated server's settings (``SimConfig``: the engine host's limits, the SLA, the serving path's own
latency) and the decode batch buckets its draft rounds are counted by (``BATCH_BUCKETS``, ``batch_bucket``,
``round_summary``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from edge.core.errors import ConfigError
from edge.runtime.host_types import HostConfig
from edge.runtime.settings import MAX_RUNNING, MAX_SEQS, PREFILL_BUDGET, SLA_TPOT_MS, SLA_TTFT_MS

# decode batch sizes whose plain steps and draft rounds are counted apart (SimConfig.decode_rounds): a round of
# drafts pays by batch size (the engine's cost model and speculation gate decide it per batch)
BATCH_BUCKETS = ((1, 1), (2, 2), (3, 4), (5, 8), (9, None))
MAX_ROUND_TOKENS = 8  # the most tokens one sequence emits in a step (a verified round: drafts + 1)


def round_summary(probs: Sequence[float]) -> tuple[float, float]:
    """(the share of draft rounds, the mean tokens per step) of one batch bucket's SimConfig.decode_rounds."""
    return float(sum(probs[1:])), float(probs[0] + sum(j * p for j, p in enumerate(probs) if j))


def batch_bucket(b: int) -> str:
    """The BATCH_BUCKETS key of a decode batch of ``b`` sequences ("1", "2", "3-4", "5-8", "9+")."""
    for lo, hi in BATCH_BUCKETS:
        if b >= lo and (hi is None or b <= hi):
            return f"{lo}+" if hi is None else str(lo) if lo == hi else f"{lo}-{hi}"
    raise ConfigError(f"sim: a decode batch of {b} sequences")


BUCKET_KEYS = tuple(batch_bucket(lo) for lo, _ in BATCH_BUCKETS)  # "1", "2", "3-4", "5-8", "9+"


@dataclass
class SimConfig:
    """The simulated server: the engine host's limits, the SLA, the serving path's own latency."""

    max_seqs: int = MAX_SEQS.default
    max_waiting: int = 64
    prefill_budget: int = PREFILL_BUDGET.default  # initial knob values (the bundle's)
    max_running: int = MAX_RUNNING.default
    # the served SLA; a preset that trains or evaluates under tighter targets sets them in its YAML
    sla_ttft_ms: float = SLA_TTFT_MS.default
    sla_tpot_ms: float = SLA_TPOT_MS.default
    max_chunk: int | None = None    # the backend's largest chunk (Backend.max_chunk): the budget never exceeds it
    ttft_overhead_ms: float = 0.0   # the serving path's added latency to the first token (HTTP, Ray, Triton)
    token_overhead_ms: float = 0.0  # and to each later token
    # the front end's time per request before the engine sees it (HTTP, Ray Serve's proxy and ingress,
    # the hop to Triton), one request at a time: a FIFO queue in front of the engine's, whose delay
    # grows with load (a burst waits there too); fitted with the overheads by `smartexit profile`
    ingress_ms: float = 0.0
    # engine time lost per delivered chunk (one request's tokens of one step) when served, and per
    # chunk squared: Triton's python backend packs and sends each chunk on a responder thread of the
    # engine's own process, under the GIL the engine thread needs, and the stack's processes (Ray
    # Serve's proxy and ingress streaming each request, the client) share the 2 cores: the more streams
    # a step feeds, the more each costs (measured in the served engine's step log: scheduler/loadtest/serving_path.py)
    serve_chunk_ms: float = 0.0
    serve_chunk_sq_ms: float = 0.0
    # the served engine's decode step time / the profiled one (> 0): the stack's processes and threads
    # share the CPU and the GIL with the engine thread; measured by `smartexit profile`
    engine_slowdown: float = 1.0
    # the same for the prefill part of a step (None: engine_slowdown); measured apart because long
    # prompt chunks are one large ONNX Runtime call that holds no GIL, while decode is many short calls
    # with Python between them, each taking the GIL back from the stack's threads
    prefill_slowdown: float | None = None
    # added to the decode (prefill) slowdown per request that reached the engine in the last FRONT_WINDOW_S
    # seconds: the front end's work for each new request (HTTP, Ray Serve's proxy and ingress, the hop to
    # Triton, the stub's intake) shares the 2 cores with the engine, so the served step slows with the traffic
    # (measured in the served engine's step log, whose "a" is that count: scheduler/loadtest/serving_path.py)
    front_decode_per_arrival: float = 0.0
    front_prefill_per_arrival: float = 0.0
    # rows exit only while the decode batch holds at most this many sequences (None: any batch): the
    # engine's defer_exit_max_batch (edge/runtime/engine_config.py; 1 in the shipped defer mode on CPU)
    exit_max_batch: int | None = 1
    # what a decoding sequence does in a step, by decode batch (batch_bucket): the probability of a plain step
    # (one token, at its exit layer) and of a draft round emitting 1, 2, ... MAX_ROUND_TOKENS tokens at full depth
    # ([plain, round of 1, ..., round of MAX_ROUND_TOKENS]). The served engine drafts from the context and the corpus
    # where a round pays (mode exact, and mode bounded with repo.bounded_drafts): a round is a verification call
    # of its own (round_ms), outside the batched step. Counted in the served engine's step log (`smartexit
    # profile`); None: plain steps only
    decode_rounds: dict[str, list[float]] | None = None
    round_ms: float = 0.0  # engine time per draft round (fitted from the step log with the slowdowns)
    # the same per decode batch bucket where the step log measured rounds (round_ms elsewhere): at batch 2 the
    # ONNX backend verifies both sequences' drafts in one call (its verify graph), above it one call per round,
    # and each call's cost grows with its batch's context; one price for all batches put two rounds at batch 2
    # at 1.35x the served step (2026-12-05)
    round_ms_by_batch: dict[str, float] | None = None
    # the host's online false-exit audit (edge/runtime/host_audit.py): each early-exited token is sampled with
    # this probability and re-decoded at full depth as a one-token request over its whole prefix, one at
    # a time, admitted only when nothing waits and a slot is free; at most audit_max_pending queued
    audit_fraction: float = 0.0
    audit_max_pending: int = 64
    # the host's load shedding (edge/runtime/host.py, HostConfig.shed_late): a request still waiting when
    # its TTFT deadline passes is refused then (a 429: a miss, never dropped silently)
    shed_late: bool = HostConfig.shed_late
    seed: int = 0

    def __post_init__(self) -> None:
        for setting in (MAX_SEQS, PREFILL_BUDGET, MAX_RUNNING):
            setting.check(getattr(self, setting.name), "sim")
        if self.max_waiting < 1:
            raise ConfigError(f"sim.max_waiting must be >= 1, got {self.max_waiting}")
        if self.max_chunk is not None:
            PREFILL_BUDGET.check(self.max_chunk, "sim", "max_chunk")
        SLA_TTFT_MS.check(self.sla_ttft_ms, "sim")
        SLA_TPOT_MS.check(self.sla_tpot_ms, "sim")
        if not self.engine_slowdown > 0 or (self.prefill_slowdown is not None and not self.prefill_slowdown > 0):
            raise ConfigError(f"sim: engine_slowdown and prefill_slowdown must be > 0, got "
                              f"{self.engine_slowdown} and {self.prefill_slowdown}")
        if min(self.ttft_overhead_ms, self.token_overhead_ms, self.ingress_ms, self.serve_chunk_ms,
               self.serve_chunk_sq_ms, self.front_decode_per_arrival, self.front_prefill_per_arrival) < 0:
            raise ConfigError("sim: overheads, ingress_ms, serve_chunk_ms, serve_chunk_sq_ms and the per-arrival "
                              "slowdowns must be >= 0")
        if not 0.0 <= self.audit_fraction <= 1.0 or self.audit_max_pending < 0:
            raise ConfigError(f"sim: audit_fraction must be in [0, 1] and audit_max_pending >= 0, got "
                              f"{self.audit_fraction}, {self.audit_max_pending}")
        if self.exit_max_batch is not None and self.exit_max_batch < 1:
            raise ConfigError(f"sim: exit_max_batch must be >= 1 or None, got {self.exit_max_batch}")
        for key, probs in (self.decode_rounds or {}).items():
            p = np.asarray(probs, np.float64)
            if (key not in BUCKET_KEYS or p.ndim != 1
                    or not 1 <= p.size <= MAX_ROUND_TOKENS + 1 or (p < 0).any() or abs(p.sum() - 1) > 1e-6):
                raise ConfigError(f"sim: decode_rounds[{key!r}] must be the probabilities of a plain step and of rounds "
                                  f"of 1..{MAX_ROUND_TOKENS} tokens, summing to 1, for a batch bucket of "
                                  f"{list(BUCKET_KEYS)}; got {probs!r}")
        by = self.round_ms_by_batch or {}
        if self.round_ms < 0 or any(v < 0 for v in by.values()) \
                or not set(by) <= set(BUCKET_KEYS):
            raise ConfigError(f"sim: round_ms and round_ms_by_batch's values must be >= 0, the latter's keys batch "
                              f"buckets of {list(BUCKET_KEYS)}; got {self.round_ms}, {by}")
