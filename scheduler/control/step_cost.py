"""What a simulated engine step costs on the served engine (``StepCost``): the fitted latency model's
coefficients (scheduler/control/latency.py) for the step's decode rows and prompt chunks, slowed as the served
engine is (``SimConfig.engine_slowdown``, ``prefill_slowdown`` and the front end's per-arrival terms), plus its
draft rounds (``round_ms``, ``round_ms_by_batch``) and the serving path's cost per delivered chunk
(``serve_chunk_ms``, ``serve_chunk_sq_ms``). All in seconds; the simulator (scheduler/control/sim.py) adds up
what a step did and asks this what it took.
"""
from __future__ import annotations

from scheduler.control.latency import LatencyModel
from scheduler.control.sim_config import SimConfig


class StepCost:
    """The seconds of one simulated step, from what it did; built once per simulation."""

    def __init__(self, latency: LatencyModel, cfg: SimConfig) -> None:
        self._w = {f: latency.coef[f] for f in latency.coef}
        self._ends = list(latency.exit_layers)
        self._slowdown = cfg.engine_slowdown
        kp = cfg.prefill_slowdown
        self._kp = cfg.engine_slowdown if kp is None else kp
        self._fd, self._fp = cfg.front_decode_per_arrival, cfg.front_prefill_per_arrival
        self._round_s = cfg.round_ms / 1e3
        self._round_s_by = {k: v / 1e3 for k, v in (cfg.round_ms_by_batch or {}).items()}
        self._chunk = cfg.serve_chunk_ms / 1e3
        self._chunk_sq = cfg.serve_chunk_sq_ms / 1e3

    def decode(self, deepest: int, rows: int, layer_rows: int, attn: float) -> float:
        """The batched decode of ``rows`` sequences (> 0) up to exit layer ``deepest``: ``layer_rows`` the sum of
        their exit layers, ``attn`` the sum of context length x layers run; unslowed."""
        w = self._w
        calls = next(i for i, e in enumerate(self._ends) if e >= deepest) + 1
        return (w["decode_calls"] * calls + w["decode_rows"] * rows
                + w["decode_layer_rows"] * layer_rows + w["decode_attn"] * attn / 1e3)

    def prefill(self, chunks: int, tokens: int, attn: float) -> float:
        """``chunks`` prompt chunks (> 0) of ``tokens`` tokens in all, ``attn`` their token pairs x layers; unslowed."""
        w = self._w
        return w["prefill_calls"] * chunks + w["prefill_tokens"] * tokens + w["prefill_attn"] * attn / 1e3

    def engine(self, decode: float, prefill: float, arrivals: int, bucket: str | None, rounds: int) -> float:
        """The served engine's time for a step of ``decode`` and ``prefill`` cost, ``arrivals`` requests having
        reached the engine in the last FRONT_WINDOW_S, and ``rounds`` draft rounds at decode batch ``bucket``."""
        a = arrivals
        return ((decode + self._w["one"]) * (self._slowdown + self._fd * a) + prefill * (self._kp + self._fp * a)
                + self._round_s_by.get(bucket, self._round_s) * rounds)

    def served(self, engine: float, sent: int) -> float:
        """The step's whole time: its ``engine`` time and the engine time lost to sending ``sent`` chunks."""
        return engine + self._chunk * sent + self._chunk_sq * sent * sent
