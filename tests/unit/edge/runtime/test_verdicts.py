"""Deferral's free verdicts (edge/runtime/request.py, ``Verdict``): a row that left early owes its skipped layers,
the engine computes them with the sequence's next token and runs the last layer's head on that row too, so every
greedy early exit is judged by the full model one step later. The verdicts must be the full model's tokens on
the exits' own prefixes (teacher-forced here), every greedy exit gets exactly one, and an exit whose layers never
run (the request ended first: its last tokens left early, a stop id, a cancel) is reported unjudged rather than
dropped."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from edge.runtime.engine import Engine
from edge.runtime.engine_config import EngineConfig, KVMode
from edge.runtime.request import Mode, Request, Verdict
from edge.runtime.rules import ConfidenceRule
from edge.runtime.torch_backend import TorchBackend
from tests.unit.edge.runtime.test_engine import _model, _prompts

torch.set_num_threads(1)


def _teacher_forced(m, prompt, tokens):
    """The full model's greedy token after each prefix prompt + tokens[:i]."""
    with torch.no_grad():
        logits = m.backbone(torch.tensor([list(prompt) + list(tokens[:-1])])).logits[0]
    return logits[len(prompt) - 1:].argmax(-1).tolist()


def _serve(eng, prompts, max_tokens, **kw):
    """Run ``prompts`` to the end; (tokens with exit layers per request, verdicts per request)."""
    got: dict[int, list[tuple[int, int]]] = {}
    verdicts: dict[int, list[Verdict]] = {}
    ids = [eng.submit(Request(p, max_tokens, on_verdict=lambda v: verdicts.setdefault(v.request_id, []).append(v),
                              **kw)) for p in prompts]
    while eng.has_work:
        for e in eng.step():
            if e.token >= 0:
                got.setdefault(e.request_id, []).append((e.token, e.exit_layer))
    return [got[i] for i in ids], [verdicts.get(i, []) for i in ids]


@pytest.mark.parametrize("batch,limit", [(1, 1), (3, None)])
def test_every_greedy_exit_is_judged_by_the_full_model(batch, limit):
    """Batch 1 (the owed rows ride with the next token) and batch 3 with exits allowed there (the owed rows run
    in catch-up calls): each early exit gets one verdict, equal to the full model's token on its prefix, and
    the engine's counts agree with a teacher-forced check of the same output."""
    m = _model(seed=2)
    prompts = _prompts(6, seed=5)
    eng = Engine(TorchBackend(m), EngineConfig(max_seqs=batch, max_running=batch, max_len=96, kv_mode=KVMode.DEFER,
                                               defer_exit_max_batch=limit), ConfidenceRule(0.3))
    outs, verdicts = _serve(eng, prompts, 24)
    last = m.backbone.cfg.num_layers
    exits = false = judged = 0
    for p, seq, vs in zip(prompts, outs, verdicts):
        tokens = [t for t, _ in seq]
        ref = _teacher_forced(m, p, tokens)
        by_index = {v.index: v for v in vs}
        assert len(by_index) == len(vs)  # one verdict per exit
        for i, (t, e) in enumerate(seq):
            if e == last:
                assert i not in by_index  # a token at full depth is not an exit: nothing to judge
                continue
            exits += 1
            v = by_index[i]
            assert (v.token, v.exit_layer) == (t, e)
            if v.full_token is None:  # the request ended before its owed layers ran: only exits came after it
                assert all(e2 < last for _, e2 in seq[i:]), (i, seq)
                continue
            judged += 1
            assert v.full_token == ref[i], (p, i, seq)
            false += int(v.false_exit)
    assert exits > 10 and judged > 10 and false > 0, (exits, judged, false)  # the regime ran, errors included
    assert eng.verdict_counts == {"judged": judged, "false": false, "unjudged": exits - judged}


def test_sampled_and_full_requests_get_no_verdicts():
    """A sampled token's exit is a draw, not an argmax the full model's argmax could judge; mode full never exits."""
    m = _model(seed=2)
    prompts = _prompts(3, seed=5)
    for kw in (dict(temperature=0.8, seed=1), dict(mode=Mode.FULL)):
        eng = Engine(TorchBackend(m), EngineConfig(max_seqs=1, max_running=1, max_len=96, kv_mode=KVMode.DEFER),
                     ConfidenceRule(0.3))
        _, verdicts = _serve(eng, prompts, 16, **kw)
        assert verdicts == [[], [], []] and eng.verdict_counts == {"judged": 0, "false": 0, "unjudged": 0}


def test_a_cancelled_request_reports_its_owed_exits_unjudged():
    """A request cancelled while it owes an exit's layers: that exit is reported unjudged, and nothing after."""
    m = _model(seed=2)
    eng = Engine(TorchBackend(m), EngineConfig(max_seqs=1, max_running=1, max_len=96, kv_mode=KVMode.DEFER),
                 ConfidenceRule(0.0))  # every token leaves at the first exit
    seen: list[Verdict] = []
    rid = eng.submit(Request(_prompts(1, seed=5)[0], 20, on_verdict=seen.append))
    while not any(e.exit_layer < m.backbone.cfg.num_layers for e in eng.step() if e.token >= 0):
        pass
    assert eng.cancel(rid)
    assert [v.full_token for v in seen][-1] is None and eng.verdict_counts["unjudged"] == 1
    n = len(seen)
    while eng.has_work:
        eng.step()
    assert len(seen) == n


def test_propagate_gives_no_verdicts():
    """Propagation fills the skipped layers' K/V from the exit state at once: no row runs them later, no verdict."""
    m = _model(seed=2)
    eng = Engine(TorchBackend(m), EngineConfig(max_seqs=1, max_running=1, max_len=96, kv_mode=KVMode.PROPAGATE),
                 ConfidenceRule(0.3))
    outs, verdicts = _serve(eng, _prompts(3, seed=5), 16)
    assert any(e < m.backbone.cfg.num_layers for seq in outs for _, e in seq)
    assert verdicts == [[], [], []]


def _audited_host(verdicts: bool, fraction: float = 0.0):
    """A host that audits and never falls back (these tests count; the per-token trigger after 10,000 tokens)."""
    from edge.runtime.audit import AuditConfig
    from edge.runtime.host import EngineHost
    from edge.runtime.host_types import HostConfig

    cfg = HostConfig(engine=EngineConfig(max_seqs=2, max_running=1, max_len=96, kv_mode=KVMode.DEFER),
                     audit=AuditConfig(fraction=fraction, verdicts=verdicts, min_tokens=10_000, max_pending=10_000,
                                       trigger="lower"))
    return EngineHost(TorchBackend(_model(seed=2)), cfg, ConfidenceRule(0.3), epsilon=0.5).start()


def _serve_audited(verdicts: bool, prompts, max_tokens: int, settled):
    """Serve ``prompts`` on an audited host, wait until ``settled(audit stats)`` (the re-decodes run in spare
    capacity after the requests); (the streamed chunks, the audit's stats, its per-request losses)."""
    from edge.runtime.host_types import GenRequest
    from tests.unit.edge.runtime.test_host import Sink

    host, sink = _audited_host(verdicts), Sink(len(prompts))
    try:
        for i, p in enumerate(prompts):
            host.submit(GenRequest(f"r{i}", p, max_tokens), sink)
        assert sink.done.wait(60)
        deadline = time.monotonic() + 60
        while not settled(host.stats()["audit"]) and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.2)  # the last re-decode's verdict
        return sink, host.stats()["audit"], list(host.audit.unit_losses)
    finally:
        host.stop()


def _checked(m, prompt, sink, rid: str) -> tuple[int, int, int]:
    """(false exits, exits, tokens) of what ``rid`` streamed, checked against the full model teacher-forced."""
    tokens = sink.tokens(rid)
    layers = [e for c in sink.chunks[rid] for e in c.exit_layers]
    ref = _teacher_forced(m, prompt, tokens)
    last = m.backbone.cfg.num_layers
    return (sum(t != r for t, r, e in zip(tokens, ref, layers) if e < last), sum(e < last for e in layers),
            len(tokens))


def test_the_host_audits_every_token_from_the_engines_verdicts():
    """Served with deferral, the audit counts every token of every greedy bounded request: its false exits are
    exactly those a teacher-forced check of the streamed output finds, and only the exits the engine could not
    judge were re-decoded. With the verdicts off and no sampling, nothing is audited."""
    m = _model(seed=2)
    prompts = _prompts(6, seed=5)
    for verdicts in (True, False):
        sink, st, _ = _serve_audited(verdicts, prompts, 24, lambda a: not a["pending"])
        if not verdicts:
            assert st["audited"] == 0 and not st["engine_verdicts"] and st["verdict_counts"]["judged"] == 0
            continue
        checked = [_checked(m, p, sink, f"r{i}") for i, p in enumerate(prompts)]
        false, exits = sum(c[0] for c in checked), sum(c[1] for c in checked)
        counts = st["verdict_counts"]
        assert st["engine_verdicts"] and st["audited"] == 6 * 24 and st["false"] == false > 0, (st, false)
        assert counts["judged"] + counts["unjudged"] == exits and counts["unjudged"] > 0, counts
        assert st["dropped"] == 0 and st["pending"] == 0


def test_no_head_row_for_requests_that_do_not_ask():
    """The verdict's head row is paid only for requests with ``on_verdict``: without it, no decode call runs the
    head on a deferred row (the benches' and calibration's engines judge nothing)."""
    m = _model(seed=2)
    eng = Engine(TorchBackend(m), EngineConfig(max_seqs=1, max_running=1, max_len=96, kv_mode=KVMode.DEFER),
                 ConfidenceRule(0.3))
    calls = []
    seg = eng.backend.segment
    eng.backend.segment = lambda i, x, *a, **kw: calls.append((x.shape[1], kw.get("rows", 1))) or seg(i, x, *a, **kw)
    eng.submit(Request(_prompts(1, seed=5)[0], 24))
    exited = 0
    while eng.has_work:
        exited += sum(0 <= e.exit_layer < m.backbone.cfg.num_layers for e in eng.step())
    deferred = [c for c in calls if c[0] > 1]  # decode calls carrying owed rows
    assert exited > 3 and deferred and all(r == 1 for _, r in deferred), (exited, calls)
    assert eng.verdict_counts == {"judged": 0, "false": 0, "unjudged": 0}


def test_requests_audited_whole_feed_the_certificates_test():
    """Each request whose every exit was judged is one unit of the per-request test: its rate is its false exits
    over its tokens after the first, equal to a teacher-forced check of what was streamed, and the p-value is
    the certificate's betting test on those rates in completion order."""
    from calibration.pvalues import PValue, pvalues

    m = _model(seed=2)
    prompts = _prompts(8, seed=7)
    sink, st, losses = _serve_audited(True, prompts, 20, lambda a: a["requests"]["requests"] >= len(prompts))
    want = [f / (n - 1) for f, _, n in (_checked(m, p, sink, f"r{i}") for i, p in enumerate(prompts))]
    assert sorted(losses) == pytest.approx(sorted(want)) and max(want) > 0  # the regime has false exits
    units = st["requests"]
    assert units["requests"] == 8 and units["incomplete"] == 0 and units["mean"] == pytest.approx(np.mean(want))
    assert units["p_value"] == pytest.approx(float(pvalues(np.array(losses), 0.5, PValue.BETTING, seed=None)[0]))


def test_the_per_request_test_needs_enough_clean_requests():
    """At eps 0.009, delta 0.05 the betting test needs a few hundred requests without a false exit before it
    certifies, and a server whose requests err at twice eps never gets there."""
    from edge.runtime.audit import AuditEstimate

    clean, bad = AuditEstimate(epsilon=0.009, delta=0.05), AuditEstimate(epsilon=0.009, delta=0.05)
    for n in range(1, 1001):
        clean.record_unit(0.0)
        bad.record_unit(1 / 32 if n % 2 else 0.0)  # a mean of 1.6%
        if n == 100:
            assert not clean.units()["certified"]
    assert clean.units()["certified"] and clean.units()["p_value"] <= 0.05
    assert not bad.units()["certified"] and bad.units()["mean"] == pytest.approx(1 / 64)
    clean.reset()
    assert clean.units() == {"requests": 0, "mean": 0.0, "p_value": 1.0, "certified": False, "incomplete": 0,
                             "exceeds_p_value": 1.0}


def test_the_requests_trigger_reads_requests_as_units_and_holds_its_level():
    """The fallback of a host that audits whole requests tests H0: mean per-request rate <= eps by betting,
    anytime-valid. Errors clustered in a few requests (the fresh-clone demo's case: 16 false exits in the
    first 31 requests' 977 tokens, mostly in three) fire the per-token lower bound, not it; requests at five
    times eps fire it within a few dozen; and servers whose requests err at eps on average (clustered) fall
    back at most delta of the time over 1000 requests each, read after every request."""
    from edge.core.betting import Betting
    from edge.core.errors import ConfigError
    from edge.runtime.audit import AuditEstimate, Trigger

    with pytest.raises(ConfigError, match="resolve trigger=auto"):
        AuditEstimate(epsilon=0.009, delta=0.05, trigger=Trigger.AUTO)
    tokens = AuditEstimate(epsilon=0.009, delta=0.05, trigger=Trigger.LOWER, min_tokens=100)
    units = AuditEstimate(epsilon=0.009, delta=0.05, trigger=Trigger.REQUESTS, min_tokens=100)
    falses = [6, 5, 3, 1, 1] + [0] * 26  # 16 false exits in 31 requests of 31 judged tokens
    fired = {"tokens": None, "units": None}
    for i, f in enumerate(falses):
        for est, name in ((tokens, "tokens"), (units, "units")):
            for t in range(31):
                if est.record(1, t < f) and fired[name] is None:
                    fired[name] = i
            if est.record_unit(f / 31) and fired[name] is None:
                fired[name] = i
    assert fired["tokens"] is not None and tokens.bounds()[0] > 0.009  # the per-token bound reads a cluster
    assert fired["units"] is None and not units.fallback and units.exceeds_p_value() > 0.05
    assert units.units()["mean"] == pytest.approx(16 / 961)

    bad = AuditEstimate(epsilon=0.009, delta=0.05, trigger=Trigger.REQUESTS)
    rng = np.random.default_rng(0)
    n = next(i for i in range(1, 201) if bad.record_unit(float(rng.binomial(31, 0.045)) / 31))
    assert bad.fallback and bad.fallback_events == 1 and 3 <= n <= 60, n
    assert not bad.record_unit(1.0) and bad.fallback_events == 1  # fired once

    # 400 servers at once (Betting's hypotheses), each request erring at 0.9% on average, clustered: a request
    # is "bad" (rate 9%) one time in ten, clean otherwise; the mirror test's p-value read after every request
    servers, eps = 400, 0.009
    test = Betting(np.full(servers, 1.0 - eps), prior_mean=1.0 - eps / 2)
    for _ in range(1000):
        loss = np.where(rng.random(servers) < 0.1, rng.binomial(31, 0.09, servers) / 31, 0.0)
        test.update(1.0 - loss)
    assert float(np.mean(test.p_value <= 0.05)) <= 0.05 + 3 * np.sqrt(0.05 * 0.95 / servers)


def test_a_host_that_audits_whole_requests_falls_back_on_the_requests_test():
    """trigger=auto: requests as units where deferral's verdicts audit whole requests, the per-token bound where
    tokens are sampled; trigger=requests where requests are not audited whole is a clear error. A rule that
    exits every token at the first exit of a random model errs on most tokens: the requests' test fires after a
    few requests and later bounded requests run at full depth."""
    from edge.core.errors import ConfigError
    from edge.runtime.audit import AuditConfig, Trigger
    from edge.runtime.host import EngineHost
    from edge.runtime.host_types import GenRequest, HostConfig
    from tests.unit.edge.runtime.test_host import Sink

    def host(kv_mode, **audit):
        cfg = HostConfig(engine=EngineConfig(max_seqs=2, max_running=1, max_len=96, kv_mode=kv_mode),
                         audit=AuditConfig(max_pending=10_000, **audit))
        return EngineHost(TorchBackend(_model(seed=2)), cfg, ConfidenceRule(0.0), epsilon=0.05)

    assert host(KVMode.PROPAGATE, fraction=0.5).audit.trigger is Trigger.LOWER
    with pytest.raises(ConfigError, match="trigger=requests needs requests audited whole"):
        host(KVMode.PROPAGATE, fraction=0.5, trigger="requests")
    h = host(KVMode.DEFER)
    assert h.audit.trigger is Trigger.REQUESTS
    h.start()
    try:
        sink = Sink(12)
        for i in range(12):  # one at a time: deferral exits at batch 1
            h.submit(GenRequest(f"r{i}", _prompts(1, seed=i)[0], 16), sink)
            deadline = time.monotonic() + 30
            while f"r{i}" not in sink.chunks or sink.chunks[f"r{i}"][-1].finish_reason is None:
                assert time.monotonic() < deadline
                time.sleep(0.01)
        deadline = time.monotonic() + 30
        while not h.stats()["audit"]["fallback"] and time.monotonic() < deadline:
            time.sleep(0.02)
        st = h.stats()["audit"]
        assert st["fallback"] and st["fallback_events"] == 1 and st["trigger"] == "requests", st
        assert st["requests"]["exceeds_p_value"] <= 0.05 and st["requests"]["mean"] > 0.05
        after = Sink(1)
        h.submit(GenRequest("later", [3, 4, 5], 8), after)
        assert after.done.wait(30)
        assert all(layer == h.num_layers for c in after.chunks["later"] for layer in c.exit_layers)
    finally:
        h.stop()
