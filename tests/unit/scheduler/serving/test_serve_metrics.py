"""The front end's Prometheus metrics, read back through prometheus_client's own exposition parser."""
from __future__ import annotations

import math

from prometheus_client.parser import text_string_to_metric_families

from scheduler.serving.metrics import LATENCY_BUCKETS_S, ServeMetrics

STATS = {  # EngineHost.stats() keys the metrics read (docs/serving.md)
    "waiting": 3, "running": 5, "prefill_budget": 256, "max_running": 8, "tokens_total": 1000,
    "steps_total": 400, "step_seconds_total": 2.5, "emit_seconds_total": 0.02, "chunks_total": 900,
    "audit": {"fraction": 0.05, "epsilon": 0.1, "delta": 0.05, "fallback": False, "fallback_events": 2, "pending": 0,
              "exits": {"3": {"audited": 40, "false": 2, "rate": 0.05, "upper": 0.12, "lower": 0.01},
                        "6": {"audited": 10, "false": 0, "rate": 0.0, "upper": 0.26, "lower": 0.0}},
              "requests": {"requests": 12, "mean": 0.004, "p_value": 0.4, "certified": False, "incomplete": 0,
                           "exceeds_p_value": 0.7}},
}


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def families(m: ServeMetrics) -> dict:
    return {f.name: f for f in text_string_to_metric_families(m.render().decode())}


def samples(fam, name: str) -> dict:
    return {tuple(sorted(s.labels.items())): s.value for s in fam.samples if s.name == name}


def test_names_follow_prometheus_conventions():
    fams = families(ServeMetrics([3, 6], num_layers=12))
    # prometheus_client's own *_created series (creation timestamps) are left as the library writes them
    types = {name: f.type for name, f in fams.items() if not name.endswith("_created")}
    assert types == {
        "smartexit_requests": "counter", "smartexit_ttft_seconds": "histogram",
        "smartexit_time_per_output_token_seconds": "histogram", "smartexit_e2e_latency_seconds": "histogram",
        "smartexit_sla_violations": "counter", "smartexit_generated_tokens": "counter",
        "smartexit_tokens_per_second": "gauge", "smartexit_exit_layer": "histogram",
        "smartexit_inflight_requests": "gauge", "smartexit_streams": "counter", "smartexit_queue_length": "gauge",
        "smartexit_running_sequences": "gauge", "smartexit_prefill_budget_tokens": "gauge",
        "smartexit_admission_limit": "gauge", "smartexit_audit_false_exit_rate": "gauge",
        "smartexit_audit_false_exit_upper_bound": "gauge", "smartexit_audit_tokens": "counter",
        "smartexit_audit_fallbacks": "counter", "smartexit_audit_requests": "counter",
        "smartexit_audit_request_p_value": "gauge", "smartexit_audit_request_exceeds_p_value": "gauge",
        "smartexit_scheduler_active_policy": "gauge",
        "smartexit_scheduler_fallbacks": "counter", "smartexit_scheduler_online_updates": "counter",
        "smartexit_engine_steps": "counter", "smartexit_engine_step_seconds": "counter",
        "smartexit_engine_emit_seconds": "counter", "smartexit_engine_chunks": "counter"}
    for name, f in fams.items():
        if name.endswith("_created"):
            continue
        for s in f.samples:  # counters expose *_total; histograms *_bucket / _sum / _count
            if f.type == "counter":
                assert s.name in (f"{name}_total", f"{name}_created"), s.name
    assert set(samples(fams["smartexit_ttft_seconds"], "smartexit_ttft_seconds_bucket")) == {
        (("le", b),) for b in [*(repr(float(x)) for x in LATENCY_BUCKETS_S), "+Inf"]}
    assert min(LATENCY_BUCKETS_S) == 0.001 and max(LATENCY_BUCKETS_S) == 60.0


def test_requests_latencies_and_sla_violations():
    m = ServeMetrics([3, 6], num_layers=12)
    # 11 tokens: TTFT 0.2 s, then 10 more over 0.5 s -> TPOT 0.05 s
    assert m.record_request(200, ttft_s=0.2, e2e_s=0.7, completion_tokens=11, sla_ttft_ms=1000, sla_tpot_ms=100) is False
    assert m.record_request(200, ttft_s=1.5, e2e_s=1.6, completion_tokens=2, sla_ttft_ms=1000, sla_tpot_ms=100) is True
    assert m.record_request(200, ttft_s=0.1, e2e_s=3.1, completion_tokens=11, sla_ttft_ms=1000, sla_tpot_ms=100) is True
    m.record_request(429)
    m.record_request(200, ttft_s=0.05, e2e_s=0.05, completion_tokens=1, sla_ttft_ms=1000, sla_tpot_ms=100)
    f = families(m)
    assert samples(f["smartexit_requests"], "smartexit_requests_total") == {(("status", "200"),): 4.0,
                                                                            (("status", "429"),): 1.0}
    assert samples(f["smartexit_sla_violations"], "smartexit_sla_violations_total") == {(): 2.0}
    assert samples(f["smartexit_ttft_seconds"], "smartexit_ttft_seconds_count") == {(): 4.0}
    tpot = f["smartexit_time_per_output_token_seconds"]
    assert samples(tpot, "smartexit_time_per_output_token_seconds_count") == {(): 3.0}  # 1-token requests have none
    assert math.isclose(samples(tpot, "smartexit_time_per_output_token_seconds_sum")[()], 0.05 + 0.1 + 0.3)
    assert samples(f["smartexit_e2e_latency_seconds"], "smartexit_e2e_latency_seconds_bucket")[(("le", "1.0"),)] == 2


def test_tokens_exit_layers_and_the_sliding_rate():
    clock = Clock()
    m = ServeMetrics([3, 6], num_layers=12, window_s=10.0, clock=clock)
    m.record_tokens([3, 3, 6, 12])
    clock.t += 5
    m.record_tokens([3])
    f = families(m)
    assert samples(f["smartexit_generated_tokens"], "smartexit_generated_tokens_total") == {(): 5.0}
    assert samples(f["smartexit_tokens_per_second"], "smartexit_tokens_per_second") == {(): 0.5}
    buckets = samples(f["smartexit_exit_layer"], "smartexit_exit_layer_bucket")
    assert buckets == {(("le", "3.0"),): 3.0, (("le", "6.0"),): 4.0, (("le", "12.0"),): 5.0, (("le", "+Inf"),): 5.0}
    clock.t += 6  # the first chunk left the window
    assert samples(families(m)["smartexit_tokens_per_second"], "smartexit_tokens_per_second") == {(): 0.1}
    clock.t += 100
    assert m.tokens_per_second() == 0.0


def test_replica_gauges_and_audit_come_from_the_workers_stats():
    m = ServeMetrics([3, 6], num_layers=12)
    m.set_replica_stats({"w1": STATS, "w2": {**STATS, "waiting": 0, "audit": None}, "w3": {}})
    f = families(m)
    assert samples(f["smartexit_queue_length"], "smartexit_queue_length") == {(("replica", "w1"),): 3.0,
                                                                              (("replica", "w2"),): 0.0}
    assert samples(f["smartexit_running_sequences"], "smartexit_running_sequences")[(("replica", "w1"),)] == 5
    assert samples(f["smartexit_prefill_budget_tokens"], "smartexit_prefill_budget_tokens")[(("replica", "w1"),)] == 256
    assert samples(f["smartexit_admission_limit"], "smartexit_admission_limit")[(("replica", "w2"),)] == 8
    assert samples(f["smartexit_audit_false_exit_rate"], "smartexit_audit_false_exit_rate") == {
        (("exit", "3"), ("replica", "w1")): 0.05, (("exit", "6"), ("replica", "w1")): 0.0}
    assert samples(f["smartexit_audit_false_exit_upper_bound"], "smartexit_audit_false_exit_upper_bound")[
        (("exit", "6"), ("replica", "w1"))] == 0.26
    assert samples(f["smartexit_audit_tokens"], "smartexit_audit_tokens_total") == {(("replica", "w1"),): 50.0}
    assert samples(f["smartexit_audit_fallbacks"], "smartexit_audit_fallbacks_total") == {(("replica", "w1"),): 2.0}
    assert samples(f["smartexit_audit_requests"], "smartexit_audit_requests_total") == {(("replica", "w1"),): 12.0}
    assert samples(f["smartexit_audit_request_p_value"], "smartexit_audit_request_p_value") == {
        (("replica", "w1"),): 0.4}
    assert samples(f["smartexit_audit_request_exceeds_p_value"], "smartexit_audit_request_exceeds_p_value") == {
        (("replica", "w1"),): 0.7}
    assert samples(f["smartexit_engine_step_seconds"], "smartexit_engine_step_seconds_total")[(("replica", "w1"),)] == 2.5
    assert samples(f["smartexit_engine_chunks"], "smartexit_engine_chunks_total") == {
        (("replica", "w1"),): 900.0, (("replica", "w2"),): 900.0}
    m.set_replica_stats({})  # every worker gone: the families stay, empty
    assert samples(families(m)["smartexit_queue_length"], "smartexit_queue_length") == {}


def test_malformed_stats_are_skipped_not_fatal():
    m = ServeMetrics([3])
    m.set_replica_stats({"w": {"waiting": "many", "running": True, "audit": {"exits": {"3": "x", "4": {"rate": None}},
                                                                                 "fallback_events": None}}})
    f = families(m)
    assert samples(f["smartexit_queue_length"], "smartexit_queue_length") == {}
    assert samples(f["smartexit_running_sequences"], "smartexit_running_sequences") == {}
    assert samples(f["smartexit_audit_tokens"], "smartexit_audit_tokens_total") == {(("replica", "w"),): 0.0}


def test_scheduler_state_comes_from_the_workers_stats():
    m = ServeMetrics([3, 6], num_layers=12)
    m.set_replica_stats({"a": {**STATS, "scheduler": {"active": "heuristic", "fallbacks": 2, "updates": 7}},
                         "b": {**STATS, "scheduler": "garbage"}})
    fams = families(m)
    assert samples(fams["smartexit_scheduler_active_policy"], "smartexit_scheduler_active_policy") == {
        (("policy", "heuristic"), ("replica", "a")): 1.0}
    assert samples(fams["smartexit_scheduler_fallbacks"], "smartexit_scheduler_fallbacks_total") == {
        (("replica", "a"),): 2.0}
    assert samples(fams["smartexit_scheduler_online_updates"], "smartexit_scheduler_online_updates_total") == {
        (("replica", "a"),): 7.0}
