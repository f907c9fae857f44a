"""Load generation: schedules fit the model and are seeded, the driver is open loop, streams parse."""
from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from edge.core.errors import ConfigError
from edge.runtime.host_types import Chunk, HostError
from scheduler.loadtest.loadgen import ScheduledRequest, build_schedule, map_lengths, run_open_loop, window
from scheduler.control.outcomes import RequestResult
from scheduler.loadtest.senders import (HttpSender, InProcessSender, SSEDecoder, StreamReader, completion_body, error_from_body,
                               parse_chunk)
from scheduler.control.workload import SHARED_TRACE, Workload, read_trace, synthetic

POOL = [list(range(k * 1000, k * 1000 + n)) for k, n in enumerate([40, 600, 90, 1200, 300])]


def _workload(n: int = 200, seed: int = 0) -> Workload:
    return synthetic(n, rate=4.0, seed=seed, prompt_mean=2000.0, output_mean=40.0)


# --------------------------------------------------------------------------- schedule

@pytest.mark.parametrize("ctx,max_out", [(512, 64), (256, 200), (128, 1)])
def test_lengths_fit_the_context_window(ctx, max_out):
    w = _workload(2000)
    p, o = map_lengths(w.prompt_tokens, w.output_tokens, ctx, max_out)
    assert p.min() >= 1 and o.min() >= 1 and o.max() <= max_out
    assert np.all(p + o <= ctx)
    # outputs are the workload's own where they fit
    keep = w.output_tokens <= max_out
    assert np.array_equal(o[keep], w.output_tokens[keep])


def test_prompt_scale_maps_the_percentile_to_the_budget():
    prompts = np.arange(1, 1001)
    p, _ = map_lengths(prompts, np.ones(1000, np.int64), 512, 64, prompt_percentile=100.0)
    assert p[-1] == 448 and p[499] == round(500 * 448 / 1000)
    assert np.all(np.diff(p) >= 0)  # proportional: order preserved


@pytest.mark.skipif(not SHARED_TRACE.is_file(), reason=f"shared trace absent ({SHARED_TRACE})")
def test_azure_trace_fits_the_bundled_context():
    w = read_trace(SHARED_TRACE)
    p, o = map_lengths(w.prompt_tokens, w.output_tokens, 512, 64)
    assert np.all(p + o <= 512) and np.median(p) > 20  # not all squeezed to a few tokens


def test_schedule_is_seeded_and_cut_from_the_pool():
    w = _workload()
    a = build_schedule(w, POOL, 512, 64, 1.0, seed=3, duration_s=20.0)
    b = build_schedule(w, POOL, 512, 64, 1.0, seed=3, duration_s=20.0)
    c = build_schedule(w, POOL, 512, 64, 1.0, seed=4, duration_s=20.0)
    assert a == b and [r.prompt_ids for r in a] != [r.prompt_ids for r in c]
    for r in a:
        assert len(r.prompt_ids) + r.max_tokens <= 512
        stream = POOL[r.prompt_ids[0] // 1000]
        start = stream.index(r.prompt_ids[0])
        assert stream[start:start + len(r.prompt_ids)] == r.prompt_ids  # a contiguous window of one stream
    assert len({r.request_id for r in a}) == len(a)


def test_arrivals_scale_and_window():
    w = _workload()
    base = build_schedule(w, POOL, 512, 64, 1.0, seed=0, duration_s=1e9)
    fast = build_schedule(w, POOL, 512, 64, 0.5, seed=0, duration_s=1e9)
    assert np.allclose([r.arrival_s for r in fast], [0.5 * r.arrival_s for r in base])
    idx, t = window(w.arrival_s, 2.0, start_s=5.0, duration_s=10.0)
    assert np.all((t >= 0) & (t < 10.0)) and np.allclose(t, (w.arrival_s[idx] - 5.0) * 2.0)
    assert np.all((w.arrival_s[idx] >= 5.0) & (w.arrival_s[idx] < 10.0))
    idx3, _ = window(w.arrival_s, 1.0, max_requests=3)
    assert list(idx3) == [0, 1, 2]
    # the length scale comes from the whole workload, not the window
    few = build_schedule(w, POOL, 512, 64, 1.0, seed=0, max_requests=5)
    assert [len(r.prompt_ids) for r in few] == [len(r.prompt_ids) for r in base[:5]]


@pytest.mark.parametrize("kwargs,msg", [
    (dict(context_window=64, max_output=64), "context_window > max_output"),
    (dict(time_scale=0.0), "time_scale must be > 0"),
    (dict(start_s=1e9), "no request"),
])
def test_schedule_errors(kwargs, msg):
    args = dict(context_window=512, max_output=64, time_scale=1.0, seed=0)
    start = kwargs.pop("start_s", 0.0)
    args.update(kwargs)
    with pytest.raises(ConfigError, match=msg):
        build_schedule(_workload(), POOL, start_s=start, duration_s=10.0, **args)


def test_pool_too_short_is_named():
    with pytest.raises(ConfigError, match="no held-out stream has"):
        build_schedule(_workload(), [[1, 2, 3]], 512, 64, 1.0, seed=0, duration_s=10.0)


# --------------------------------------------------------------------------- open-loop driver

def test_driver_is_open_loop_against_slow_sends():
    """Ten requests 40 ms apart, each taking 0.6 s: a closed loop would need 6 s and fire late."""
    schedule = [ScheduledRequest(0.04 * i, [1, 2, 3], 4, f"r{i}") for i in range(10)]
    live, peak = 0, 0

    async def slow_send(req):
        nonlocal live, peak
        r = RequestResult(req.request_id, req.arrival_s, 3, req.max_tokens, t_submit=time.perf_counter())
        live += 1
        peak = max(peak, live)
        await asyncio.sleep(0.6)
        live -= 1
        r.t_first_token = r.t_end = time.perf_counter()
        r.tokens, r.finish_reason = 1, "length"
        return r

    t = time.perf_counter()
    results = asyncio.run(run_open_loop(schedule, slow_send))
    wall = time.perf_counter() - t
    assert peak == 10 and wall < 0.36 + 0.6 + 0.5
    lag = [r.t_submit - r.arrival_s for r in results]
    # asyncio.sleep wakes within a few ms; 50 ms leaves room for a loaded 2-core machine
    assert min(lag) >= -1e-3 and max(lag) < 0.05, lag
    assert [r.request_id for r in results] == [f"r{i}" for i in range(10)]
    assert all(r.ok and abs(r.e2e_s - 0.6) < 0.1 for r in results)


def test_a_send_that_raises_is_a_client_error():
    async def broken(req):
        raise RuntimeError("boom")

    (r,) = asyncio.run(run_open_loop([ScheduledRequest(0.0, [1], 2, "x")], broken))
    assert not r.ok and r.error_kind == "client" and "boom" in r.error and r.t_submit is not None


# --------------------------------------------------------------------------- results

def test_result_latencies_and_sla():
    # binary-exact times, so the boundaries are exact too
    r = RequestResult("a", 0.0, 10, 5, t_submit=1.0, t_first_token=1.25, t_end=1.75, tokens=5, finish_reason="length")
    assert r.ok and r.ttft_s == 0.25 and r.e2e_s == 0.75 and r.tpot_s == 0.125
    assert r.sla_met(250, 125) and not r.sla_met(249, 125) and not r.sla_met(250, 124)
    one = RequestResult("b", 0.0, 10, 1, t_submit=0.0, t_first_token=0.1, t_end=0.1, tokens=1)
    assert one.tpot_s is None and one.sla_met(100, 1)  # one token: only TTFT applies
    bad = RequestResult("c", 0.0, 10, 1, t_submit=0.0, t_end=0.1, error_kind="http_429")
    assert not bad.ok and bad.ttft_s is None and not bad.sla_met(1e9, 1e9)


def test_completion_body():
    body = completion_body(ScheduledRequest(0.0, [5, 6], 7), "smartexit", "bounded", 500.0, 50.0)
    assert body == {"model": "smartexit", "prompt": [5, 6], "max_tokens": 7, "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True}, "mode": "bounded",
                    "sla": {"ttft_ms": 500.0, "tpot_ms": 50.0}}
    assert "sla" not in completion_body(ScheduledRequest(0.0, [5], 1), "m", "full", None, None)


# --------------------------------------------------------------------------- server-sent events

STREAM = (b": keep-alive\r\n\r\n"
          b'data: {"id":"c1","object":"text_completion","choices":[{"index":0,"text":"def","exit_layers":[3],'
          b'"finish_reason":null}]}\r\n\r\n'
          b'data: {"id":"c1","choices":[{"index":0,"text":" f(x)","exit_layers":[9,12],"finish_reason":null}]}\n\n'
          b'data: {"id":"c1","choices":[{"index":0,"text":":","exit_layers":[12],"finish_reason":"length"}]}\n\n'
          b'data: {"id":"c1","choices":[],"usage":{"prompt_tokens":4,"completion_tokens":4,"total_tokens":8}}\n\n'
          b"data: [DONE]\n\n")


@pytest.mark.parametrize("cut", [1, 7, 50, len(STREAM)])
def test_stream_reader_on_a_canned_stream(cut):
    r = RequestResult("r", 0.0, 4, 4, t_submit=0.0)
    reader = StreamReader(r)
    pieces = [STREAM[i:i + cut] for i in range(0, len(STREAM), cut)]
    ended = False
    for k, piece in enumerate(pieces):
        ended = reader.feed(1.0 + k, piece)
    assert ended
    reader.close(100.0)
    # the first token counts when its event is complete (the blank line after it arrived)
    end = STREAM.index(b'"finish_reason":null}]}\r\n\r\n') + len(b'"finish_reason":null}]}\r\n\r\n')
    first = (end - 1) // cut
    assert r.ok and r.tokens == 4 and r.exit_layers == [3, 9, 12, 12] and r.finish_reason == "length"
    assert r.t_first_token == 1.0 + first and len(r.token_times) == 4


def test_sse_decoder_fields():
    dec = SSEDecoder()
    evs = dec.feed(b"event: error\ndata: line one\ndata:line two\nid: 3\n\ndata: x")
    assert [(e.event, e.data) for e in evs] == [("error", "line one\nline two")]
    assert dec.feed(b"\n\n")[0].data == "x"


def test_usage_count_wins_over_counted_chunks():
    r = RequestResult("r", 0.0, 4, 9, t_submit=0.0)
    reader = StreamReader(r)
    reader.feed(0.5, b'data: {"choices":[{"text":"abc","finish_reason":"stop"}]}\n\n'
                     b'data: {"choices":[],"usage":{"completion_tokens":3}}\n\ndata: [DONE]\n\n')
    reader.close(0.6)
    assert r.ok and r.tokens == 3 and r.exit_layers == [] and r.t_first_token == 0.5


def test_stream_errors():
    r = RequestResult("r", 0.0, 4, 9, t_submit=0.0)
    reader = StreamReader(r)
    assert reader.feed(0.2, b'data: {"choices":[{"text":"a","exit_layers":[3]}]}\n\n'
                            b'data: {"error": {"message": "engine stopped", "code": "internal"}}\n\n')
    reader.close(0.3)
    assert not r.ok and r.error_kind == "stream_internal" and "engine stopped" in r.error and r.t_end == 0.2

    t = RequestResult("t", 0.0, 4, 9, t_submit=0.0)
    StreamReader(t).close(1.0)
    assert t.error_kind == "stream_truncated"

    d = RequestResult("d", 0.0, 4, 9, t_submit=0.0)
    rd = StreamReader(d)
    # the server sends the engine's deadline as OpenAI's "length" and names it in smartexit_finish_reason
    rd.feed(0.1, b'data: {"choices":[{"text":"a","exit_layers":[3],"finish_reason":"length",'
                 b'"smartexit_finish_reason":"deadline"}]}\n\ndata: [DONE]\n\n')
    rd.close(0.2)
    assert d.error_kind == "deadline" and d.tokens == 1

    assert parse_chunk("{not json").error.startswith("malformed")


def test_error_bodies():
    assert error_from_body(429, b'{"error": {"message": "queue full", "type": "overloaded", "code": 429}}') == \
        ("http_429", "429: queue full")
    assert error_from_body(503, b'{"detail": "no replica"}') == ("http_503", "no replica")
    assert error_from_body(500, b"Internal Server Error") == ("http_500", "Internal Server Error")
    assert error_from_body(502, b"") == ("http_502", "HTTP 502")


def test_http_sender_against_a_stub_server():
    """HttpSender over real HTTP (an aiohttp stub on loopback, not the SmartExit server): model discovery,
    a streamed completion with the request body as sent, and a 429 with an OpenAI error body."""
    from aiohttp import web

    bodies = []

    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": "smartexit-tiny", "object": "model"}]})

    async def completions(request):
        body = await request.json()
        bodies.append((body, request.headers.get("Authorization")))
        if body["max_tokens"] == 99:
            return web.json_response({"error": {"message": "at its limit", "code": "too_many_requests"}}, status=429)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for k in range(body["max_tokens"]):
            await asyncio.sleep(0.01)
            last = k == body["max_tokens"] - 1
            chunk = {"choices": [{"index": 0, "text": "x", "exit_layers": [3 + k],
                                  "finish_reason": "length" if last else None}]}
            await resp.write(f"data: {__import__('json').dumps(chunk)}\n\n".encode())
        await resp.write(b'data: {"choices":[],"usage":{"completion_tokens":%d}}\n\ndata: [DONE]\n\n'
                         % body["max_tokens"])
        return resp

    async def main():
        app = web.Application()
        app.router.add_get("/v1/models", models)
        app.router.add_post("/v1/completions", completions)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            async with HttpSender(f"http://127.0.0.1:{port}/", "", "bounded", 500.0, 50.0, api_key="k") as send:
                send.model = (await send.models())[0]
                return await run_open_loop([ScheduledRequest(0.0, [1, 2], 3, "a"),
                                            ScheduledRequest(0.01, [4], 99, "b")], send)
        finally:
            await runner.cleanup()

    ok, refused = asyncio.run(main())
    assert ok.ok and ok.http_status == 200 and ok.tokens == 3 and ok.exit_layers == [3, 4, 5]
    assert 0 < ok.ttft_s < ok.e2e_s and ok.tpot_s is not None
    assert refused.error_kind == "http_429" and "at its limit" in refused.error
    body, auth = bodies[0]
    assert body["model"] == "smartexit-tiny" and body["prompt"] == [1, 2] and auth == "Bearer k"


# --------------------------------------------------------------------------- in-process sender

class _FakeHost:
    """Emits each request's tokens from another thread, like the engine thread, one token per chunk."""

    def __init__(self, reject=False, finish="length"):
        self.reject, self.finish, self.seen = reject, finish, []

    def submit(self, req, emit):
        if self.reject:
            raise HostError("overloaded", "4 requests are waiting (limit 4)", retry_after_s=1.0)
        self.seen.append(req)

        def work():
            for i in range(req.max_tokens):
                time.sleep(0.005)
                last = i == req.max_tokens - 1
                emit(Chunk(req.request_id, [7], [3 + i], self.finish if last else None))

        threading.Thread(target=work, daemon=True).start()


def test_inprocess_sender_hands_chunks_across_threads():
    host = _FakeHost()
    send = InProcessSender(host, "bounded", 500.0, 50.0)
    schedule = [ScheduledRequest(0.01 * i, [1, 2], 4, f"r{i}") for i in range(3)]
    results = asyncio.run(run_open_loop(schedule, send))
    assert all(r.ok and r.tokens == 4 and r.exit_layers == [3, 4, 5, 6] for r in results)
    assert all(0 < r.ttft_s <= r.e2e_s and r.tpot_s is not None for r in results)
    assert host.seen[0].sla_ttft_ms == 500.0 and host.seen[0].mode == "bounded" and host.seen[0].prompt == [1, 2]


def test_inprocess_sender_errors():
    (r,) = asyncio.run(run_open_loop([ScheduledRequest(0.0, [1], 2, "x")], InProcessSender(_FakeHost(reject=True))))
    assert r.error_kind == "overloaded" and "waiting" in r.error
    (d,) = asyncio.run(run_open_loop([ScheduledRequest(0.0, [1], 2, "y")],
                                     InProcessSender(_FakeHost(finish="deadline"))))
    assert d.error_kind == "deadline" and d.tokens == 2


def test_inprocess_run_on_a_real_host():
    """The schedule on an EngineHost (tiny random torch model): every request completes with its tokens,
    and an invalid one (prompt + output beyond max_len) is refused with the host's error code."""
    from edge.runtime.engine_config import EngineConfig
    from edge.runtime.host import EngineHost
    from edge.runtime.host_types import HostConfig
    from edge.runtime.rules import ConfidenceRule
    from edge.runtime.torch_backend import TorchBackend
    from tests.unit.edge.runtime.test_engine import _model, _prompts

    host = EngineHost(TorchBackend(_model()), HostConfig(engine=EngineConfig(max_seqs=4, max_running=4, max_len=64)),
                      ConfidenceRule(0.5)).start()
    schedule = [ScheduledRequest(0.02 * i, p, 6, f"r{i}") for i, p in enumerate(_prompts(6, seed=1))]
    schedule.append(ScheduledRequest(0.2, list(range(60)), 10, "too-long"))
    try:
        results = asyncio.run(run_open_loop(schedule, InProcessSender(host, "bounded", 1000.0, 100.0, timeout_s=60)))
    finally:
        host.stop()
    *good, bad = results
    assert all(r.ok and r.tokens == 6 and len(r.exit_layers) == 6 and r.finish_reason == "length" for r in good)
    assert bad.error_kind == "invalid_request"


def test_closed_loop_keeps_exactly_concurrency_requests_in_flight():
    """Each of c clients sends its next request when its last finished: never more than c at once,
    every request sent once, results in request order."""
    import asyncio

    from scheduler.loadtest.loadgen import ScheduledRequest, run_closed_loop
    from scheduler.control.outcomes import RequestResult

    active, peak, order = [0], [0], []

    async def send(req):
        active[0] += 1
        peak[0] = max(peak[0], active[0])
        order.append(req.request_id)
        await asyncio.sleep(0.01)
        active[0] -= 1
        r = RequestResult(req.request_id, req.arrival_s, len(req.prompt_ids), req.max_tokens)
        r.t_submit = r.t_first_token = r.t_end = 0.0
        return r

    reqs = [ScheduledRequest(0.0, [1, 2], 4, f"r{i}") for i in range(10)]
    out = asyncio.run(run_closed_loop(reqs, send, 3))
    assert peak[0] == 3 and sorted(order) == sorted(r.request_id for r in reqs)
    assert [r.request_id for r in out] == [r.request_id for r in reqs]
