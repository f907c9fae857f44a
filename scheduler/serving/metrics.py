"""The front end's Prometheus metrics (``GET /metrics``), in one ``CollectorRegistry``.

Names follow Prometheus conventions: base units in the name (``_seconds``, ``_tokens``), counters
end in ``_total``. Request metrics are recorded by the ingress as requests finish; the per-replica
gauges (queue, running, prefill budget, admission limit, audit, power) are read from the latest
stats snapshot each worker pushed to the hub (``EngineHost.stats()``, keys in docs/serving.md).

The live dashboard (scheduler/serving/dashboard.py) reads the same object: the recent finished
requests (:attr:`ServeMetrics.finished`, raw latencies rather than histogram buckets) and the
exit-layer counts.
"""
from __future__ import annotations

import time
from collections import Counter as Tally
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = CONTENT_TYPE_LATEST  # the text exposition format render() writes
# 1 ms .. 60 s, about three buckets a decade: TPOT of a tiny model on a GPU is ~1 ms, a queued
# request on a Jetson can wait tens of seconds.
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                     30.0, 60.0)

# stats key -> (gauge name, help) for the per-replica scheduler gauges
REPLICA_GAUGES = {
    "waiting": ("smartexit_queue_length", "Requests waiting for admission on the replica's engine."),
    "running": ("smartexit_running_sequences", "Sequences the replica's engine is decoding."),
    "prefill_budget": ("smartexit_prefill_budget_tokens", "Prompt tokens the engine may prefill per step."),
    "max_running": ("smartexit_admission_limit", "Most sequences the engine may run at once (policy-set)."),
}
# the worker's ``power`` stats key (scheduler/serving/dashboard.py LivePower.reading) -> (gauge, help)
POWER_GAUGES = {
    "watts": ("smartexit_power_watts", "Power the replica's device draws (its meter's summed rails)."),
    "temperature_c": ("smartexit_device_temperature_celsius", "The replica's device temperature, where its "
                      "power meter reports one."),
}
FINISHED_KEPT = 4096  # finished requests remembered for the dashboard's percentiles (a few minutes at full load)
# counters (the ``_total`` suffix is the exposition's): where the engine thread's time goes
REPLICA_COUNTERS = {
    "steps_total": ("smartexit_engine_steps", "Engine iterations run."),
    "step_seconds_total": ("smartexit_engine_step_seconds", "Seconds the engine thread spent in engine steps."),
    "emit_seconds_total": ("smartexit_engine_emit_seconds", "Seconds the engine thread spent handing a step's "
                           "tokens to the serving path."),
    "chunks_total": ("smartexit_engine_chunks", "Token chunks handed to the serving path (one per request "
                     "per step)."),
}


@dataclass(frozen=True)
class Finished:
    """One finished request as the dashboard needs it (times in seconds, on the metrics' clock)."""
    t: float
    status: str
    ttft_s: float | None
    tpot_s: float | None
    counted: bool  # counts toward SLA attainment: served (200) or refused / failed by the server (429, 5xx)
    met: bool      # served within its TTFT and TPOT targets


class ServeMetrics:
    """Request metrics plus the workers' stats, rendered in the text exposition format.

    Args:
        exit_layers: the model's exit layers (the exit-layer histogram's buckets).
        num_layers: the model's depth (added as the last bucket: full-depth tokens).
        window_s: the sliding window of ``smartexit_tokens_per_second``.
        clock: seconds, monotonic (injected by tests).
        sla_ttft_ms, sla_tpot_ms: the server's default SLA targets; when given, exported as the gauges
            ``smartexit_sla_{ttft,tpot}_target_seconds`` (the line a Grafana panel draws).
    """

    def __init__(self, exit_layers: Sequence[int], num_layers: int | None = None, window_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic, sla_ttft_ms: float | None = None,
                 sla_tpot_ms: float | None = None) -> None:
        self.registry = r = CollectorRegistry()
        self.clock, self.window_s = clock, window_s
        self._window: deque[tuple[float, int]] = deque()  # (time, tokens) of recent completions' chunks
        self._replicas: dict[str, dict[str, Any]] = {}
        self.finished: deque[Finished] = deque(maxlen=FINISHED_KEPT)
        self.exit_counts: Tally[int] = Tally()  # tokens per exit layer since the start
        self.requests = Counter("smartexit_requests", "HTTP generation requests by response status.",
                                ["status"], registry=r)
        self.ttft = Histogram("smartexit_ttft_seconds", "Time to first token (arrival to first token).",
                              buckets=LATENCY_BUCKETS_S, registry=r)
        self.tpot = Histogram("smartexit_time_per_output_token_seconds",
                              "Mean time per output token after the first, per request.",
                              buckets=LATENCY_BUCKETS_S, registry=r)
        self.e2e = Histogram("smartexit_e2e_latency_seconds", "Arrival to last token, per request.",
                             buckets=LATENCY_BUCKETS_S, registry=r)
        self.sla_violations = Counter("smartexit_sla_violations", "Requests that missed their TTFT or "
                                      "TPOT target.", registry=r)
        self.tokens = Counter("smartexit_generated_tokens", "Tokens generated for clients.", registry=r)
        self.tps = Gauge("smartexit_tokens_per_second", f"Generated tokens per second over the last "
                         f"{window_s:g} s.", registry=r)
        self.tps.set_function(self.tokens_per_second)
        buckets = sorted(set(exit_layers) | ({num_layers} if num_layers else set()))
        self.exit_layer = Histogram("smartexit_exit_layer", "Layer each generated token exited at.",
                                    buckets=[float(b) for b in buckets], registry=r)
        self.inflight = Gauge("smartexit_inflight_requests", "Generation requests the front end is serving.",
                              registry=r)
        self.streams = Counter("smartexit_streams", "Generation streams opened, by the way their tokens come: "
                               "straight from a tritonserver (triton), through a worker replica (worker), or from "
                               "Triton's core in the ingress (core).",
                               ["via"], registry=r)
        for kind, target_ms in (("ttft", sla_ttft_ms), ("tpot", sla_tpot_ms)):
            if target_ms is not None:
                Gauge(f"smartexit_sla_{kind}_target_seconds", f"The server's default {kind.upper()} target "
                      "(a request may carry its own).", registry=r).set(target_ms / 1e3)
        r.register(_ReplicaCollector(self))

    # -- request side ------------------------------------------------------------------------------
    def record_tokens(self, exit_layers: Iterable[int]) -> None:
        """Count a chunk's tokens as they stream (tokens/s, exit-layer histogram, token counter)."""
        n = 0
        for layer in exit_layers:
            self.exit_layer.observe(layer)
            self.exit_counts[layer] += 1
            n += 1
        if n:
            self.tokens.inc(n)
            self._window.append((self.clock(), n))
            self._prune()

    def record_request(self, status: int | str, ttft_s: float | None = None, e2e_s: float | None = None,
                       completion_tokens: int = 0, sla_ttft_ms: float | None = None,
                       sla_tpot_ms: float | None = None) -> bool:
        """Record a finished request; returns whether it violated its SLA.

        TPOT is the mean over tokens after the first, ``(e2e - ttft) / (tokens - 1)`` (vLLM's
        definition); a request violates its SLA when its TTFT or that mean exceeds the target.
        """
        status = str(status)
        self.requests.labels(status=status).inc()
        # the server's refusals and failures miss their SLA; a client's bad request or disconnect does not count
        counted = status == "200" or status == "429" or status.startswith("5")
        if ttft_s is None or e2e_s is None:
            self.finished.append(Finished(self.clock(), status, None, None, counted, status == "200"))
            return False
        self.ttft.observe(ttft_s)
        self.e2e.observe(e2e_s)
        tpot = (e2e_s - ttft_s) / (completion_tokens - 1) if completion_tokens > 1 else None
        if tpot is not None:
            self.tpot.observe(tpot)
        violated = ((sla_ttft_ms is not None and ttft_s * 1e3 > sla_ttft_ms)
                    or (sla_tpot_ms is not None and tpot is not None and tpot * 1e3 > sla_tpot_ms))
        if violated:
            self.sla_violations.inc()
        self.finished.append(Finished(self.clock(), status, ttft_s, tpot, counted, status == "200" and not violated))
        return violated

    def tokens_per_second(self) -> float:
        self._prune()
        return sum(n for _, n in self._window) / self.window_s

    def _prune(self) -> None:
        horizon = self.clock() - self.window_s
        while self._window and self._window[0][0] < horizon:
            self._window.popleft()

    # -- worker side -------------------------------------------------------------------------------
    def set_replica_stats(self, stats_by_replica: Mapping[str, Mapping[str, Any]]) -> None:
        """Replace the per-replica snapshots (replica id -> ``EngineHost.stats()``)."""
        self._replicas = {str(k): dict(v) for k, v in stats_by_replica.items() if v}

    @property
    def replicas(self) -> dict[str, dict[str, Any]]:
        """The per-replica snapshots last set (replica id -> stats)."""
        return self._replicas

    def render(self) -> bytes:
        """The registry in the Prometheus text exposition format."""
        return generate_latest(self.registry)


class _ReplicaCollector:
    """Gauges and counters read from the workers' latest stats at scrape time."""

    def __init__(self, owner: ServeMetrics) -> None:
        self._owner = owner

    def describe(self):  # no samples at registration: the snapshots arrive later
        return []

    def collect(self):
        replicas = self._owner._replicas
        for family, table in ((GaugeMetricFamily, REPLICA_GAUGES), (CounterMetricFamily, REPLICA_COUNTERS)):
            for key, (name, doc) in table.items():
                fam = family(name, doc, labels=["replica"])
                for rid, stats in sorted(replicas.items()):
                    if _number(stats.get(key)):
                        fam.add_metric([rid], float(stats[key]))
                yield fam
        rate = GaugeMetricFamily("smartexit_audit_false_exit_rate", "Audited false-exit rate of an exit.",
                                 labels=["replica", "exit"])
        upper = GaugeMetricFamily("smartexit_audit_false_exit_upper_bound", "Upper confidence bound on an "
                                  "exit's false-exit rate (the risk bound the audit checks).",
                                  labels=["replica", "exit"])
        audited = CounterMetricFamily("smartexit_audit_tokens", "Tokens audited against the full model.",
                                      labels=["replica"])
        fallbacks = CounterMetricFamily("smartexit_audit_fallbacks", "Times the audit forced full-depth "
                                        "fallback.", labels=["replica"])
        units = CounterMetricFamily("smartexit_audit_requests", "Requests audited whole (every token judged): the "
                                    "units of the per-request test.", labels=["replica"])
        pvalue = GaugeMetricFamily("smartexit_audit_request_p_value", "p-value of H0: the served requests' mean "
                                   "false-exit rate exceeds epsilon (the certificate's betting test; <= delta: "
                                   "certified on this traffic).", labels=["replica"])
        exceeds = GaugeMetricFamily("smartexit_audit_request_exceeds_p_value", "p-value of H0: the served requests' "
                                    "mean false-exit rate is at most epsilon (the fallback's test where requests are "
                                    "audited whole; <= delta: fallback).", labels=["replica"])
        for rid, stats in sorted(replicas.items()):
            audit = stats.get("audit")
            if not isinstance(audit, Mapping):
                continue
            exits = audit.get("exits") if isinstance(audit.get("exits"), Mapping) else {}
            total = 0.0
            for layer, row in sorted(exits.items(), key=lambda kv: int(kv[0])):
                if not isinstance(row, Mapping):
                    continue
                if _number(row.get("rate")):
                    rate.add_metric([rid, str(layer)], float(row["rate"]))
                if _number(row.get("upper")):
                    upper.add_metric([rid, str(layer)], float(row["upper"]))
                total += float(row["audited"]) if _number(row.get("audited")) else 0.0
            audited.add_metric([rid], total)
            if _number(audit.get("fallback_events")):
                fallbacks.add_metric([rid], float(audit["fallback_events"]))
            req = audit.get("requests")
            if isinstance(req, Mapping) and _number(req.get("requests")) and _number(req.get("p_value")):
                units.add_metric([rid], float(req["requests"]))
                pvalue.add_metric([rid], float(req["p_value"]))
                if _number(req.get("exceeds_p_value")):
                    exceeds.add_metric([rid], float(req["exceeds_p_value"]))
        yield from (rate, upper, audited, fallbacks, units, pvalue, exceeds)
        yield from _scheduler_families(replicas)
        yield from _power_families(replicas)


def _scheduler_families(replicas: Mapping[str, Mapping[str, Any]]):
    """The control policy's state (the worker adds ``scheduler`` to the stats it pushes): which policy
    is in control, the learned policy's fallbacks to the heuristic, its online updates."""
    active = GaugeMetricFamily("smartexit_scheduler_active_policy", "1 for the policy in control of the "
                               "replica's engine (the learned one, or the heuristic it fell back to).",
                               labels=["replica", "policy"])
    fallbacks = CounterMetricFamily("smartexit_scheduler_fallbacks", "Times the guard handed control from the "
                                    "learned policy to the heuristic (its SLA attainment fell below the "
                                    "heuristic's).", labels=["replica"])
    updates = CounterMetricFamily("smartexit_scheduler_online_updates", "Online PPO updates of the learned "
                                  "policy from live transitions.", labels=["replica"])
    for rid, stats in sorted(replicas.items()):
        sched = stats.get("scheduler")
        if not isinstance(sched, Mapping):
            continue
        if isinstance(sched.get("active"), str):
            active.add_metric([rid, sched["active"]], 1.0)
        if _number(sched.get("fallbacks")):
            fallbacks.add_metric([rid], float(sched["fallbacks"]))
        if _number(sched.get("updates")):
            updates.add_metric([rid], float(sched["updates"]))
    yield from (active, fallbacks, updates)


def _power_families(replicas: Mapping[str, Mapping[str, Any]]):
    """Power and temperature of each replica's device (the worker adds ``power`` to its stats when
    ``serve.power_meter`` is set); no family at all where no replica reports a reading."""
    for key, (name, doc) in POWER_GAUGES.items():
        fam = GaugeMetricFamily(name, doc, labels=["replica", "meter"])
        for rid, stats in sorted(replicas.items()):
            power = stats.get("power")
            if isinstance(power, Mapping) and _number(power.get(key)):
                fam.add_metric([rid, str(power.get("meter", ""))], float(power[key]))
        if fam.samples:
            yield fam


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)
