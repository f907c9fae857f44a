"""The interleaved capacity runs (scheduler/loadtest/capacity.py): the order the systems run in, what
each receives, and that comparisons are paired within a repeat. The real systems run in the stage's
integration test (tests/integration/test_serving.py) and in `make demo`."""
from __future__ import annotations

import asyncio

import pytest

from scheduler.control.outcomes import RequestResult
from scheduler.loadtest.capacity import (INPROCESS, SERVED, Run, base_id, busy_cpu_s, interleaved, level_report, order,
                                         tokens_ratio)
from scheduler.loadtest.loadgen import ScheduledRequest


def test_the_order_rotates_with_the_repeat():
    assert order(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert order(["a", "b", "c"], 1) == ["b", "c", "a"]
    assert order(["a", "b", "c"], 4) == ["b", "c", "a"]


def test_every_system_gets_every_level_in_every_repeat_rotated_after_its_warmup():
    log: list[tuple[str, str]] = []

    def sender(name):
        async def send(req: ScheduledRequest) -> RequestResult:
            log.append((name, req.request_id))
            await asyncio.sleep(0)
            r = RequestResult(req.request_id, req.arrival_s, len(req.prompt_ids), req.max_tokens, t_submit=0.0,
                              t_first_token=0.01, t_end=0.02, tokens=req.max_tokens,
                              token_times=[0.01] * req.max_tokens, finish_reason="length")
            return r
        return send

    reqs = [ScheduledRequest(0.0, [1, 2, 3], 4, f"cap-{i}") for i in range(3)]
    runs = asyncio.run(interleaved({"x": sender("x"), "y": sender("y")}, reqs, [1, 2], repeats=2, warmup=1))
    assert log[:2] == [("x", "warmup-x-0"), ("y", "warmup-y-0")]
    # which system ran each measured run, in order: repeat 0 x then y at each level, repeat 1 y then x
    firsts = [(name, rid.rsplit("-", 3)[1:]) for name, rid in log[2:] if rid.startswith("cap-0")]
    assert firsts == [("x", ["x", "c1", "r0"]), ("y", ["y", "c1", "r0"]), ("x", ["x", "c2", "r0"]),
                      ("y", ["y", "c2", "r0"]), ("y", ["y", "c1", "r1"]), ("x", ["x", "c1", "r1"]),
                      ("y", ["y", "c2", "r1"]), ("x", ["x", "c2", "r1"])]
    assert {name: {c: len(rs) for c, rs in per.items()} for name, per in runs.items()} == {
        "x": {1: 2, 2: 2}, "y": {1: 2, 2: 2}}
    assert all(len(run.results) == 3 and all(r.ok for r in run.results) for per in runs.values()
               for rs in per.values() for run in rs)
    # each run's span (the stamps' clock, ms): in the order the runs were made, none overlapping another
    spans = sorted(run.span for per in runs.values() for rs in per.values() for run in rs)
    assert all(a[0] <= a[1] <= b[0] for a, b in zip(spans, spans[1:]))


def _run(ttft_s: float, n: int = 4, cpu_s: float | None = 1.0) -> Run:
    results = [RequestResult(f"r{i}", 0.0, 8, n, t_submit=0.0, t_first_token=ttft_s, t_end=ttft_s + 0.01 * (n - 1),
                             tokens=n, token_times=[ttft_s + 0.01 * k for k in range(n)], finish_reason="length")
               for i in range(4)]
    return Run(results, cpu_s)


def test_comparisons_are_paired_within_a_repeat():
    """Repeat 1 is slow for both systems (a busy minute of the machine): paired, the overhead stays 10 ms
    in every repeat; unpaired medians would still agree here, but the spread is the pairs' spread."""
    local = [_run(0.020), _run(0.120), _run(0.021)]
    served = [_run(0.030), _run(0.130), _run(0.031)]
    lv = level_report({INPROCESS: local, SERVED: served}, 500.0, 50.0)
    over = lv["served_vs_inprocess_ttft_p50_overhead_ms"]
    assert over["median"] == pytest.approx(10.0) and over["min"] == pytest.approx(10.0)
    assert over["max"] == pytest.approx(10.0)
    assert lv[INPROCESS]["spread"]["ttft_p50_ms"]["max"] == pytest.approx(120.0)  # each system's own spread
    assert lv["served_vs_inprocess_cpu_ms_per_token"]["median"] == pytest.approx(0.0)


def test_the_machines_busy_cpu_counts_at_least_this_process_work():
    import time

    a, p0 = busy_cpu_s(), time.process_time()
    if a is None:
        pytest.skip("no /proc/stat on this machine")
    while time.process_time() - p0 < 0.3:  # 0.3 s of this process's CPU
        sum(i * i for i in range(10_000))
    b, used = busy_cpu_s(), time.process_time() - p0
    # the whole machine was busy at least as long as this process (less the clock ticks' granularity)
    assert b - a >= used - 0.05, (b - a, used)


def test_runs_of_two_systems_pair_by_the_request_not_by_the_system_or_position():
    """Each system's ids carry its name, level and repeat; the output-length check pairs the same request
    across systems whatever order the runs completed in, and a request that differs is counted."""
    def res(rid: str, tokens: int) -> RequestResult:
        return RequestResult(rid, 0.0, 8, 8, t_submit=0.0, t_first_token=0.01, t_end=0.02, tokens=tokens,
                             token_times=[0.01] * tokens, finish_reason="length")

    assert base_id("cap-12-triton_direct-c8-r2") == "cap-12"
    local = Run([res("cap-0-inprocess-c1-r0", 4), res("cap-1-inprocess-c1-r0", 6)], 1.0)
    served = Run([res("cap-1-served-c1-r0", 6), res("cap-0-served-c1-r0", 5)], 1.0)  # completed in another order
    lv = level_report({INPROCESS: [local], SERVED: [served]}, 500.0, 50.0)
    assert lv["served_vs_inprocess_same_output_lengths"]["median"] == pytest.approx(0.5)
    assert tokens_ratio([served], [local], 500.0, 50.0)["median"] == pytest.approx(
        lv["served_vs_inprocess_tokens_ratio"]["median"])


def test_the_report_names_the_way_the_stacks_tokens_come():
    """The price of serving's "tokens ..." names the stack the bench starts: Triton's core in the ingress for one
    device (the default), the worker's stream_via with triton_host worker or several replicas, and nothing it
    cannot know about a server it did not start."""
    from scheduler.loadtest.bench_serve_capacity import tokens_path
    from scheduler.loadtest.bench_serve_config import BenchServeConfig

    assert tokens_path(BenchServeConfig()) == "from Triton's core in the ingress replica"
    assert tokens_path(BenchServeConfig(serve={"triton_host": "worker"})) == "triton"
    assert tokens_path(BenchServeConfig(serve={"replicas": 2, "stream_via": "worker"})) == "worker"
    assert tokens_path(BenchServeConfig(url="http://127.0.0.1:1")) == "as the server is configured"
