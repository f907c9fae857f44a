"""EngineHost: the engine on its own thread behaves as the engine does, and its control, cancel,
overload and audit paths work (torch backend, a tiny random model built here)."""
from __future__ import annotations

import collections

import threading
import time

import numpy as np
import pytest

from edge.runtime.audit import AuditConfig, AuditEstimate, clopper_pearson
from edge.runtime.engine import Engine
from edge.runtime.engine_config import EngineConfig
from edge.runtime.request import Request
from edge.runtime.host import EngineHost
from edge.runtime.host_types import Chunk, GenRequest, HostConfig, HostError
from edge.runtime.rules import ConfidenceRule
from edge.runtime.torch_backend import TorchBackend
from tests.unit.edge.runtime.test_engine import _model, _prompts


class Sink:
    """Collects chunks per request; ``done`` fires when every expected request has finished."""

    def __init__(self, n: int) -> None:
        self.chunks: dict[str, list[Chunk]] = {}
        self.n, self.done, self.lock = n, threading.Event(), threading.Lock()

    def __call__(self, chunk: Chunk) -> None:
        with self.lock:
            self.chunks.setdefault(chunk.request_id, []).append(chunk)
            if sum(c[-1].finish_reason is not None for c in self.chunks.values()) == self.n:
                self.done.set()

    def tokens(self, rid: str) -> list[int]:
        return [t for c in self.chunks[rid] for t in c.tokens]


def _host(rule=None, epsilon=None, **kw) -> EngineHost:
    cfg = HostConfig(engine=EngineConfig(max_seqs=4, max_running=4, max_len=128), **kw)
    return EngineHost(TorchBackend(_model()), cfg, rule, epsilon=epsilon).start()


def test_host_streams_what_the_engine_generates():
    prompts = _prompts(5, seed=3)
    ref = Engine(TorchBackend(_model()), EngineConfig(max_seqs=4, max_running=4, max_len=128), ConfidenceRule(0.5))
    ids = [ref.submit(Request(p, 10)) for p in prompts]
    want = {i: [] for i in ids}
    while ref.has_work:
        for ev in ref.step():
            if ev.token >= 0:
                want[ev.request_id].append(ev.token)
    host, sink = _host(ConfidenceRule(0.5)), Sink(len(prompts))
    try:
        for i, p in enumerate(prompts):
            host.submit(GenRequest(f"r{i}", p, 10), sink)
        assert sink.done.wait(60)
    finally:
        host.stop()
    for i, rid in enumerate(ids):
        assert sink.tokens(f"r{i}") == want[rid]
        assert sink.chunks[f"r{i}"][-1].finish_reason == "length"
        assert all(c.finish_reason is None for c in sink.chunks[f"r{i}"][:-1])
    st = host.stats()
    assert st["tokens_total"] == 50 and st["finished_total"] == 5 and st["running"] == 0


def test_a_request_that_cannot_start_ends_with_an_error_and_the_engine_goes_on(monkeypatch):
    """Whatever makes one request fail to start on the engine thread (here the engine's submit raising, as a
    negative seed once did inside numpy) ends that request with an ``error`` chunk; the thread, and every
    other request, go on, and the stats count it."""
    host, sink = _host(), Sink(2)
    real = host.engine.submit

    def submit(req):
        if req.prompt[0] == 7:
            raise ValueError("expected non-negative integer")
        return real(req)

    monkeypatch.setattr(host.engine, "submit", submit)
    try:
        host.submit(GenRequest("bad", [7, 1, 2], 4), sink)
        host.submit(GenRequest("good", [1, 2, 3], 4), sink)
        assert sink.done.wait(60)
        assert [c.finish_reason for c in sink.chunks["bad"]] == ["error"] and sink.tokens("bad") == []
        assert sink.chunks["good"][-1].finish_reason == "length" and len(sink.tokens("good")) == 4
        assert host.alive
        st = host.stats()
        assert st["start_failed_total"] == 1 and st["engine_alive"] is True
    finally:
        host.stop()
    assert host.stats()["engine_alive"] is False


@pytest.mark.parametrize("kw,field", [(dict(prompt=[]), "prompt"), (dict(max_tokens=0), "max_tokens"),
                                      (dict(prompt=[1] * 125, max_tokens=8), "prompt"),
                                      (dict(prompt=[1, 999]), "prompt"), (dict(top_p=0.0), "top_p"),
                                      (dict(temperature=-1.0), "temperature"), (dict(mode="fast"), "mode"),
                                      (dict(sla_tpot_ms=0.0), "sla_tpot_ms"),
                                      # a negative seed passed these checks and then killed the engine thread
                                      (dict(seed=-5, temperature=0.8), "seed"), (dict(seed=True), "seed"),
                                      (dict(temperature=float("nan")), "temperature"),
                                      (dict(temperature=float("inf")), "temperature")])
def test_bad_requests_name_the_field(kw, field):
    host = _host()
    try:
        args = dict(request_id="x", prompt=[1, 2, 3], max_tokens=4) | kw
        with pytest.raises(HostError) as err:
            host.submit(GenRequest(**args), lambda c: None)
        assert err.value.code == "invalid_request" and err.value.field == field
    finally:
        host.stop()


def test_overload_is_refused_with_retry_after_and_nothing_is_lost():
    host = _host(max_waiting=2)
    sink = Sink(0)
    accepted, refused = [], 0
    try:
        for i in range(40):
            try:
                host.submit(GenRequest(f"r{i}", [1, 2, 3, 4], 30), sink)
                accepted.append(f"r{i}")
            except HostError as exc:
                assert exc.code == "overloaded" and exc.retry_after_s >= 1
                refused += 1
        sink.n = len(accepted)
        assert refused > 0 and sink.done.wait(60)
    finally:
        host.stop()
    assert sorted(sink.chunks) == sorted(accepted)
    assert all(len(sink.tokens(r)) == 30 for r in accepted)  # each answered once, in full
    assert host.stats()["rejected_total"] == refused


@pytest.mark.parametrize("shed", [True, False])
def test_a_request_waiting_past_its_ttft_deadline_is_shed_once_not_lost(shed):
    """One slot runs a long request; four more wait behind it, two with a 1 ms TTFT target that passes
    while they wait. With shed_late they end at once with finish reason "shed" (no token, a
    retry_after_s) and count in shed_total; the others, and the long one, run to their end. Without it,
    every request is served in full (late)."""
    host = _host(shed_late=shed)
    host.control({"op": "set", "max_running": 1})
    sink = Sink(5)
    try:
        host.submit(GenRequest("long", [5, 6, 7], 60), sink)
        for i, ttft in enumerate((1.0, 60_000.0, 1.0, 60_000.0)):
            host.submit(GenRequest(f"r{i}", [1, 2, 3], 4, sla_ttft_ms=ttft), sink)
        assert sink.done.wait(60)
    finally:
        host.stop()
    ends = {rid: cs[-1] for rid, cs in sink.chunks.items()}
    assert all(sum(c.finish_reason is not None for c in cs) == 1 for cs in sink.chunks.values())  # one end each
    assert ends["long"].finish_reason == "length" and len(sink.tokens("long")) == 60
    for rid in ("r1", "r3"):
        assert ends[rid].finish_reason == "length" and len(sink.tokens(rid)) == 4
    st = host.stats()
    for rid in ("r0", "r2"):
        if shed:
            assert ends[rid].finish_reason == "shed" and sink.tokens(rid) == [] and ends[rid].retry_after_s >= 1
        else:
            assert ends[rid].finish_reason == "length" and len(sink.tokens(rid)) == 4
    assert st["shed_total"] == (2 if shed else 0) and st["shed_late"] is shed
    assert st["sla_met_total"] <= 3  # a shed request is a miss


def test_shedding_is_a_control_setting():
    host = _host()
    try:
        assert host.stats()["shed_late"] is False
        assert host.control({"op": "set", "shed_late": True})["shed_late"] is True
        with pytest.raises(HostError, match="shed_late must be true or false"):
            host.control({"op": "set", "shed_late": 1})
    finally:
        host.stop()


def test_cancel_and_control():
    host, sink = _host(), Sink(1)
    try:
        host.submit(GenRequest("long", [5, 6, 7], 100), sink)
        st = host.control({"op": "set", "prefill_budget": 7, "max_running": 2})
        assert st["prefill_budget"] == 7 and st["max_running"] == 2
        assert host.control({"op": "cancel", "request_id": "long"}) == {"cancelled": True}
        assert sink.done.wait(30)
        assert sink.chunks["long"][-1].finish_reason == "cancelled"
        assert host.control({"op": "cancel", "request_id": "long"}) == {"cancelled": False}
        assert host.stats()["free_slots"] == 4
        for bad in ({"op": "set", "prefill_budget": 0}, {"op": "nope"}, {"op": "set", "max_running": "2"}):
            with pytest.raises(HostError):
                host.control(bad)
    finally:
        host.stop()


def test_stats_report_slack_and_predicted_depth():
    host, sink = _host(ConfidenceRule(0.3)), Sink(1)
    try:
        host.submit(GenRequest("a", [5, 6, 7], 120, sla_ttft_ms=5000, sla_tpot_ms=1000), sink)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            st = host.stats()
            req = [r for r in st["requests"] if r["id"] == "a"]
            if req and req[0]["tokens"] >= 2:
                break
        assert req and 0 < req[0]["slack_ms"] <= 5000 + 1000 * req[0]["tokens"]
        assert 2 <= req[0]["predicted_exit_layer"] <= 6 and st["min_slack_ms"] <= req[0]["slack_ms"]
    finally:
        host.stop()


def test_audit_catches_a_rule_that_exits_falsely():
    """A rule that exits every token at the first exit of a random model is wrong most of the time:
    the audit, re-decoding a sample at full depth, finds it and sends later bounded requests to full depth."""
    audit = AuditConfig(fraction=0.5, min_tokens=20, seed=1)
    host = _host(ConfidenceRule(0.0), epsilon=0.05, audit=audit)
    try:
        sink = Sink(6)
        for i in range(6):
            host.submit(GenRequest(f"r{i}", _prompts(1, seed=i)[0], 20), sink)
        assert sink.done.wait(60)
        deadline = time.monotonic() + 30
        while not host.stats()["audit"]["fallback"] and time.monotonic() < deadline:
            time.sleep(0.05)
        st = host.stats()["audit"]
        assert st["fallback"] and st["fallback_events"] == 1 and st["lower"] > 0.05
        assert st["exits"]["2"]["false"] > 0
        after = Sink(1)
        host.submit(GenRequest("later", [3, 4, 5], 8), after)
        assert after.done.wait(30)
        assert all(layer == 6 for c in after.chunks["later"] for layer in c.exit_layers)
    finally:
        host.stop()


def test_audit_of_the_full_model_finds_nothing():
    host = _host(ConfidenceRule(1.1), epsilon=0.05, audit=AuditConfig(fraction=1.0, min_tokens=5))
    try:
        sink = Sink(3)
        for i in range(3):
            host.submit(GenRequest(f"r{i}", [1 + i, 2, 3], 10), sink)
        assert sink.done.wait(30)
        st = host.stats()["audit"]
        assert st["audited"] == 30 and st["false"] == 0 and not st["fallback"]
    finally:
        host.stop()


def test_clopper_pearson_matches_known_values():
    lo, up = clopper_pearson(0, 333, 0.05)
    assert lo == 0.0 and up == pytest.approx(1 - 0.05 ** (1 / 333), rel=1e-6)  # zero failures: 1 - delta^(1/n)
    lo, up = clopper_pearson(10, 100, 0.05)
    assert 0.05 < lo < 0.1 < up < 0.17
    est = AuditEstimate(epsilon=0.01, delta=0.05, min_tokens=10)
    assert not any(est.record(3, False) for _ in range(500))
    fired = [est.record(3, True) for _ in range(30)]
    assert fired.count(True) == 1 and est.fallback and np.isclose(est.as_dict()["rate"], 30 / 530)


def test_merge_chunks_keeps_each_requests_order_and_end():
    from edge.runtime.host_types import merge_chunks

    chunks = [Chunk("a", [1], [3]), Chunk("b", [7], [12]), Chunk("a", [2, 3], [9, 12]),
              Chunk("b", [], [], "cancelled"), Chunk("a", [4], [3], "length")]
    out = merge_chunks(chunks)
    assert [c.request_id for c in out] == ["a", "b"]
    assert (out[0].tokens, out[0].exit_layers, out[0].finish_reason) == ([1, 2, 3, 4], [3, 9, 12, 3], "length")
    assert (out[1].tokens, out[1].finish_reason) == ([7], "cancelled")
    assert chunks[0].tokens == [1]  # the inputs are not changed


def test_stats_count_tokens_on_time_and_late_and_the_sla_met():
    """A generous SLA: every token on time and the request met; an impossible one: every token late
    and one violation (counted once), not met. The counters are what the scheduler's reward and its
    fallback guard read."""
    host = _host()
    try:
        for rid, ttft, tpot in (("easy", 60_000, 60_000), ("hard", 1e-3, 1e-3)):
            sink = Sink(1)
            host.submit(GenRequest(rid, [5, 6, 7], 6, sla_ttft_ms=ttft, sla_tpot_ms=tpot), sink)
            assert sink.done.wait(60)
            st = host.stats()
            if rid == "easy":
                assert (st["tokens_on_time_total"], st["tokens_late_total"], st["violations_total"]) == (6, 0, 0)
                assert st["sla_met_total"] == 1 and st["recent_ttft_p95_ms"] > 0
            else:
                assert (st["tokens_on_time_total"], st["tokens_late_total"], st["violations_total"]) == (6, 6, 1)
                assert st["sla_met_total"] == 1
        assert st["arrival_rate_rps"] > 0 and st["oldest_waiting_slack_ms"] is None
        assert st["tokens_on_time_total"] + st["tokens_late_total"] == st["tokens_total"]
    finally:
        host.stop()


def test_step_log_records_every_step_as_the_counters_do(tmp_path):
    """HostConfig.step_log: one line per engine step with its decode rows and prefill chunks; the
    stats' time counters add up what the lines say, and every prompt token is in a prefill chunk."""
    import json

    log = tmp_path / "steps.jsonl"
    prompts = _prompts(5, seed=4)
    host, sink = _host(step_log=str(log)), Sink(len(prompts))
    try:
        for i, p in enumerate(prompts):
            host.submit(GenRequest(f"r{i}", p, 6), sink)
        assert sink.done.wait(60)
        st = host.stats()
    finally:
        host.stop()
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert len(lines) == st["steps_total"] > 0
    assert sum(x["c"] for x in lines) == st["chunks_total"]
    assert sum(x["s"] for x in lines) == pytest.approx(st["step_seconds_total"], rel=1e-3)
    assert sum(n for x in lines for _, n in x["p"]) == sum(len(p) for p in prompts)
    # each request's first token comes from its prefill; the other 5 are decode rows
    assert sum(len(x["d"]) for x in lines) == 5 * len(prompts)
    assert all(ctx >= 1 and layer >= 1 for x in lines for ctx, layer in x["d"])
    # the requests live at each step and those that reached the engine in the last FRONT_WINDOW_S seconds
    # (all five were submitted at once: some step soon after sees all of them, none sees more)
    assert max(x["a"] for x in lines) == len(prompts) and all(0 <= x["a"] <= len(prompts) for x in lines)
    assert max(x["n"] for x in lines) == len(prompts) and all(0 <= x["n"] <= len(prompts) for x in lines)
    # ``i``: the request id of each ``k`` entry, in its order: each request's 5 decode tokens under one id
    assert all(len(x["i"]) == len(x["k"]) == len(set(x["i"])) for x in lines)
    per_request = collections.Counter()
    for x in lines:
        for (n, _), rid in zip(x["k"], x["i"]):
            per_request[rid] += n
    assert sorted(per_request.values()) == [5] * len(prompts)
