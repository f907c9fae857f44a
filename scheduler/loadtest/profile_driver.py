"""``smartexit profile``'s run: what one engine step did (its :class:`scheduler.control.latency.StepFeatures`
from the engine's state before and after it, and its wall time), whether the engine lets rows exit at a
decode batch, and the driver that keeps the engine busy through each scenario and records its steps and
the bounded requests' exit traces (:func:`run_profile`)."""
from __future__ import annotations

import gc
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from edge.core.errors import ConfigError
from edge.runtime.engine import Engine
from edge.runtime.engine_config import EngineConfig, KVMode
from edge.runtime.request import NO_TOKEN, Mode, Request, TokenEvent
from scheduler.control.latency import StepFeatures, combine, decode_features, prefill_features
from scheduler.loadtest.profile_config import Scenario

TRACE_HEAD = 64  # prompt ids kept per exit trace


# --------------------------------------------------------------------------- one step's features

@dataclass
class StepObservation:
    features: StepFeatures
    rows: list[tuple[int, int]]  # (request id, exit layer) of the step's decode rows
    seconds: float = 0.0


def step_features(decode_ctx: Mapping[int, int], prefilled_before: Mapping[int, int],
                  prefilled_after: Mapping[int, int], events: Sequence[TokenEvent],
                  segment_ends: Sequence[int]) -> StepObservation:
    """What one engine step did, from its state before and after.

    Args:
        decode_ctx: request id -> cached positions, for the sequences decoding before the step
        prefilled_before / prefilled_after: request id -> prompt tokens cached, for the sequences waiting
            or prefilling before the step (those admitted inside the step included)
        events: the step's token events; a token of a sequence not decoding before the step is a
            prefill's first token (full depth, counted with prefill), not a decode row
        segment_ends: the model's exit layers, ascending (the last is its depth)
    """
    rows = [(e.request_id, e.exit_layer) for e in events if e.request_id in decode_ctx and e.token != NO_TOKEN]
    decode = decode_features([layer for _, layer in rows], [decode_ctx[i] for i, _ in rows], segment_ends)
    chunks = [(start, prefilled_after[i] - start) for i, start in prefilled_before.items()
              if prefilled_after.get(i, start) > start]
    return StepObservation(combine(decode, prefill_features(chunks, segment_ends[-1])), rows)


def timed_step(engine: Engine) -> StepObservation:
    """``engine.step()``, timed, with its features."""
    decode_ctx = {s.id: s.length for s in engine.decoding}
    pending = engine.waiting + engine.prefilling  # the sequence objects outlive the step
    before = {s.id: s.prefilled for s in pending}
    t0 = time.perf_counter()
    events = engine.step()
    seconds = time.perf_counter() - t0
    obs = step_features(decode_ctx, before, {s.id: s.prefilled for s in pending}, events,
                        engine.backend.exit_layers)
    obs.seconds = seconds
    return obs


def exits_allowed(cfg: EngineConfig, batch: int) -> bool:
    """Whether the engine lets rows exit in a decode batch of ``batch`` (edge/runtime/exit_step.py ``_step``)."""
    limit = cfg.defer_exit_max_batch
    return not (cfg.kv_mode is KVMode.DEFER and limit is not None and batch > limit)


# --------------------------------------------------------------------------- the run

@dataclass
class Profile:
    steps: list[dict[str, Any]] = field(default_factory=list)  # group, seconds, features
    traces: dict[int, dict[str, Any]] = field(default_factory=dict)  # request id -> bounded request's trace

    def exit_fractions(self, layers: Sequence[int], only_allowed: bool = False) -> dict[str, float]:
        """Share of bounded decode tokens per exit layer (``only_allowed``: in steps that let rows exit)."""
        got = [e for t in self.traces.values() for e, ok in zip(t["exit_layers"], t["exits_allowed"])
               if ok or not only_allowed]
        return {str(layer): (got.count(layer) / len(got) if got else 0.0) for layer in layers}


class Driver:
    """Submits requests for a scenario from the prompt pool and steps the engine."""

    def __init__(self, engine: Engine, pool: list[list[int]], stop_ids: tuple[int, ...], seed: int) -> None:
        self.engine, self.pool, self.stop_ids = engine, [p for p in pool if p], stop_ids
        if not self.pool:
            raise ConfigError("profile: the prompt pool (the held-out test split) is empty")
        self.rng = np.random.default_rng(seed)
        self.profile = Profile()

    def _request(self, sc: Scenario) -> None:
        max_len = self.engine.cfg.max_len
        out = int(self.rng.integers(sc.max_tokens_min, min(sc.max_tokens_max, max_len - sc.prompt_min) + 1))
        n = int(self.rng.integers(sc.prompt_min, min(sc.prompt_max, max_len - out) + 1))
        doc = self.pool[int(self.rng.integers(len(self.pool)))]
        while len(doc) < n:  # a short document continues into others
            doc = doc + self.pool[int(self.rng.integers(len(self.pool)))]
        start = int(self.rng.integers(0, len(doc) - n + 1))
        prompt = doc[start:start + n]
        mode = Mode.FULL if self.rng.random() < sc.full_share else Mode.BOUNDED
        rid = self.engine.submit(Request(prompt, out, mode=mode, stop_ids=self.stop_ids))
        if mode is Mode.BOUNDED:
            self.profile.traces[rid] = {"prompt_len": n, "prompt_ids_head": prompt[:TRACE_HEAD], "exit_layers": [],
                                        "exits_allowed": []}

    def _top_up(self, sc: Scenario) -> None:
        e = self.engine
        while len(e.waiting) < 2 or len(e.waiting) + len(e.prefilling) + len(e.decoding) < sc.batch + 2:
            self._request(sc)

    def _drain(self) -> None:
        e = self.engine
        for s in e.waiting + e.prefilling + e.decoding:
            e.cancel(s.id)
        e.step()  # returns the cancel events; no work left

    def run(self, sc: Scenario, steps: int, group: int | None, fit: bool = True) -> None:
        """``steps`` busy steps of scenario ``sc``, recorded as ``group`` (None: warm-up, not recorded;
        ``fit`` False: only its exit traces are)."""
        e = self.engine
        e.set_prefill_budget(sc.prefill_budget)
        e.set_admission_limit(sc.batch)
        done = idle = 0
        while done < steps and idle < 3:
            self._top_up(sc)
            obs = timed_step(e)
            if obs.features.decode_rows == 0 and obs.features.prefill_calls == 0:
                idle += 1  # nothing ran (every request ended before it): not a step the model prices
                continue
            done += 1
            if group is not None:
                self._record(obs, group, fit)
        self._drain()

    def _record(self, obs: StepObservation, group: int, fit: bool) -> None:
        p = self.profile
        free = exits_allowed(self.engine.cfg, obs.features.decode_rows)
        bounded = sum(rid in p.traces for rid, _ in obs.rows)
        if fit:  # with what the features leave out, to judge them by: whether the decision exits' heads ran
            p.steps.append({"group": group, "seconds": obs.seconds, **asdict(obs.features),
                            "bounded_rows": bounded, "exits_allowed": free and bounded > 0})
        for rid, layer in obs.rows:
            if rid in p.traces:  # else mode full
                p.traces[rid]["exit_layers"].append(layer)
                p.traces[rid]["exits_allowed"].append(free)


def run_profile(engine: Engine, pool: list[list[int]], stop_ids: tuple[int, ...], scenarios: Sequence[Scenario],
                steps: int, warmup_steps: int, seed: int, trace_steps: int = 0) -> Profile:
    """Warm up, then record ``steps`` steps of every scenario (group = its index), then ``trace_steps``
    steps of bounded requests alone at the largest decode batch that may exit, for the exit traces only
    (with deferred K/V that is batch 1, which the scenarios visit too seldom to see many natural exits).

    The garbage collector is off while steps are timed and runs between scenarios (as ``timeit`` does):
    a collection's pause belongs to the interpreter's heap, not to the step it lands in, and in a
    process holding much else (a test session) it outlasts a small model's step."""
    d = Driver(engine, pool, stop_ids, seed)
    enabled = gc.isenabled()
    gc.disable()
    try:
        if warmup_steps:
            d.run(Scenario(prefill_budget=64, batch=min(4, engine.cfg.max_seqs), full_share=0.5,
                           max_tokens_max=min(64, engine.cfg.max_len // 2)), warmup_steps, None)
        for g, sc in enumerate(scenarios):
            gc.collect()
            d.run(sc, steps, g)
        if trace_steps:
            c = engine.cfg
            batch = c.max_seqs if exits_allowed(c, c.max_seqs) else c.defer_exit_max_batch
            d.run(Scenario(prefill_budget=128, batch=min(batch, c.max_seqs), prompt_max=min(384, c.max_len // 2),
                           max_tokens_max=min(64, c.max_len // 2)), trace_steps, len(scenarios), fit=False)
    finally:
        if enabled:
            gc.enable()
    return d.profile
