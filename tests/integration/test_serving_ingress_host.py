"""The serving stack with ``serve.triton_host: ingress``: the ingress replica runs Triton's core in its own process
(scheduler/serving/engine_host.py, scheduler/serving/triton_core.py) and streams from it, with no tritonserver and
no worker replica. Driven over HTTP as clients drive it; the cases that differ from a worker-hosted stack
(tests/integration/test_serving.py): what runs, where the tokens come from, the policy switched on the ingress,
a disconnect, overload, and the model's stub dying mid-stream. What each test proves is in its docstring."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import pytest

from tests.integration.test_serving import (MAX_INFLIGHT, MAX_TOKENS_LIMIT, MODEL, PROMPT, _start, _stream_error,
                                            _stream_started, completion, disconnect_settled, health, metrics,
                                            request, sample, wait_for)

pytestmark = pytest.mark.integration


def _cmdline(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _parent(pid: int) -> int:
    return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])


class TestIngressHostsTriton:
    """One stack, ``triton_host: ingress``, ``max_inflight`` 4."""

    @pytest.fixture(scope="class")
    def stack(self, served_run, repository_copy, find_processes, tmp_path_factory, free_port):
        yield from _start(served_run, repository_copy, find_processes, tmp_path_factory, free_port(), "serving_core",
                          triton_host="ingress", hang_restart_s=5.0)

    def test_the_ingress_serves_http_and_runs_the_model_stub_itself(self, stack, find_processes, find_listener):
        """No tritonserver runs: the process listening on the stack's port is the ingress replica (direct
        ingress), the model's python-backend stub is its child (the core in its process started it), and no
        worker replica was deployed."""
        from ray import serve

        procs = find_processes(stack.repo)
        assert [p.name for p in procs] == ["triton_python_backend_stub"], procs
        owner = find_listener(stack.cfg.port)
        assert owner is not None and "Ingress" in owner, owner
        ingress_cmd = open(f"/proc/{_parent(procs[0].pid)}/cmdline", "rb").read().replace(b"\0", b" ").decode()
        assert "Ingress" in ingress_cmd, ingress_cmd
        assert set(serve.status().applications["smartexit"].deployments) == {"Ingress", "Hub"}

    def test_tokens_come_from_the_core_and_streaming_equals_not_streaming(self, stack):
        """A greedy completion streamed and not streamed gives the same text; both count as ``via="core"``
        streams, none over gRPC or through a worker; /health answers 200 with the ingress as its one replica."""
        before = metrics(stack.url)
        status, _, body = completion(stack.url, max_tokens=24, temperature=0)
        assert status == 200 and body["usage"]["completion_tokens"] == 24
        status, _, raw = request(stack.url, "POST", "/v1/completions",
                                 {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "stream": True})
        assert status == 200
        events = [json.loads(e) for e in raw.decode().split("\n") if e.startswith("data: {")
                  for e in [e[len("data: "):]]]
        assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == body["choices"][0]["text"]
        after = metrics(stack.url)
        grew = {via: sample(after, "smartexit_streams", "smartexit_streams_total", via=via)
                - sample(before, "smartexit_streams", "smartexit_streams_total", via=via)
                for via in ("core", "triton", "worker")}
        assert grew == {"core": 2, "triton": 0, "worker": 0}
        status, state = health(stack.url)
        assert status == 200 and state["ready"] and len(state["replicas"]) == 1

    def test_the_control_policy_is_switched_on_the_ingress(self, stack):
        """``stack.set_policy`` reaches the ingress (it hosts the control loop): a fixed budget is set in the
        engine by the next tick, /metrics shows it; a field outside the policy's is refused."""
        from edge.core.errors import ConfigError
        from scheduler.serving.stack import set_policy

        with pytest.raises(ConfigError, match="set_policy changes only"):
            set_policy({"port": 9})
        try:
            state = set_policy({"policy": "fixed", "policy_kwargs": {"prefill_budget": 40, "max_running": 3}})
            assert state["policy"] == "fixed"
            wait_for(lambda: sample(metrics(stack.url), "smartexit_prefill_budget_tokens",
                                    "smartexit_prefill_budget_tokens") == 40, timeout=10,
                     what="the fixed budget in the engine's stats")
        finally:
            set_policy({})

    def test_overload_answers_429_and_every_request_is_served_or_refused_once(self, stack):
        """Twice ``max_inflight`` concurrent streams of MAX_TOKENS_LIMIT tokens: each answers 200 with its
        tokens or 429 with Retry-After, some of each; afterwards nothing is in flight."""
        import aiohttp

        async def one(session):
            body = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS_LIMIT, "temperature": 0}
            async with session.post(stack.url + "/v1/completions", json=body) as r:
                return r.status, r.headers.get("Retry-After"), await r.json()

        async def burst():
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
                return await asyncio.gather(*(one(s) for _ in range(2 * MAX_INFLIGHT + 2)))
        results = asyncio.run(burst())
        codes = sorted(status for status, _, _ in results)
        assert set(codes) <= {200, 429} and 200 in codes and 429 in codes, codes
        assert all(int(ra) >= 1 and b["error"]["code"] == "too_many_requests" for st, ra, b in results if st == 429)
        assert all(b["usage"]["completion_tokens"] > 0 for st, _, b in results if st == 200)
        wait_for(lambda: sample(metrics(stack.url), "smartexit_inflight_requests", "smartexit_inflight_requests") == 0,
                 timeout=10, what="nothing in flight after the burst")

    def test_client_disconnect_frees_the_engine_slot(self, stack):
        """A client that closes a long stream after its first event: the engine runs no sequence soon after
        (the stats the ingress's control loop reads), the request is recorded once (499 or 200), nothing
        stays in flight, and the next request is served."""
        before = metrics(stack.url)
        conn, resp, _ = _stream_started(stack.url, timeout=60)
        conn.sock.close()
        resp.close()
        conn.close()

        disconnect_settled(stack.url, before, timeout=10)

    @pytest.mark.slow
    def test_the_model_stub_killed_mid_stream_is_recovered_behind_the_same_front_end(self, stack, find_processes):
        """SIGKILL of the model's stub while a stream is in flight: the stream, which had started, ends with one
        SSE error event and one [DONE], no finish_reason; within 60 s requests succeed again on the same base URL,
        from a new stub, with the same ingress replica (the Ray app was not restarted)."""
        (stub,) = find_processes(stack.repo)
        _, before = health(stack.url)
        conn, resp, first = _stream_started(stack.url, timeout=60)
        os.kill(stub.pid, signal.SIGSTOP)  # the request stays unfinished until the stub dies
        os.kill(stub.pid, signal.SIGKILL)
        error = _stream_error(first, resp, conn)
        assert error["code"] in ("unavailable", "internal_error"), error

        t0 = time.monotonic()
        wait_for(lambda: completion(stack.url, max_tokens=4, temperature=0)[0] == 200, timeout=60, interval=0.5,
                 what="a successful request after the stub's death")
        recovery_s = time.monotonic() - t0
        (new,) = find_processes(stack.repo)
        assert new.pid != stub.pid and new.name == "triton_python_backend_stub"
        wait_for(lambda: health(stack.url)[0] == 200, timeout=10, interval=0.1, what="/health answering 200")
        assert set(health(stack.url)[1]["replicas"]) == set(before["replicas"])
        assert recovery_s < 60

    @pytest.mark.slow
    def test_the_ingress_replica_killed_is_replaced_on_the_same_port(self, stack, find_processes):
        """SIGKILL of the ingress replica itself (what a crash of Triton's core inside it would do, HTTP connections
        to its port closed just before): Serve starts a new replica, which binds the same port despite the old
        connections' TIME_WAIT (scheduler/serving/rebind.py) and starts its own core; within 60 s requests succeed
        on the same base URL from one new stub, the dead replica's gone with it."""
        def ingress_pids():
            return [int(p) for p in os.listdir("/proc")
                    if p.isdigit() and "ServeReplica:smartexit:Ingress" in _cmdline(int(p))]

        def served():
            try:
                return completion(stack.url, max_tokens=4, temperature=0, timeout=10)[0] == 200
            except OSError:  # nothing listens on the port yet
                return False

        assert completion(stack.url, max_tokens=4, temperature=0)[0] == 200  # a connection the server closes first
        (old_stub,) = find_processes(stack.repo)
        (pid,) = ingress_pids()
        os.kill(pid, signal.SIGKILL)
        wait_for(served, timeout=60, interval=0.5, what="a successful request from the replacement ingress")
        wait_for(lambda: [p.pid for p in find_processes(stack.repo)] not in ([], [old_stub.pid]) and
                 len(find_processes(stack.repo)) == 1, timeout=15, what="one new stub, the old one gone")
        assert ingress_pids() and pid not in ingress_pids()


@pytest.mark.slow
def test_smartexit_serve_stops_everything_on_sigterm(served_run, repository_copy, find_processes, free_port,
                                                     tmp_path):
    """``smartexit serve`` (the ingress hosting Triton's core, the default) serves a completion once it prints
    its ready line; SIGTERM makes it exit 0, and no model stub serving the repository stays behind (the core
    started it from inside the ingress replica, not as a process of ours)."""
    import subprocess
    import sys
    from pathlib import Path

    from tests.integration.test_triton_model import _wait_for_line

    run = repository_copy(served_run, tmp_path / "serve_all")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "edge.pipeline.cli", "serve", f"run_dir={run}",
                             f"serve.port={port}", f"serve.model_name={MODEL}",
                             f"serve.max_tokens_limit={MAX_TOKENS_LIMIT}"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=Path(__file__).parents[2])
    try:
        _wait_for_line(proc, "SmartExit serving at", timeout=180)
        assert [p.name for p in find_processes(run / "triton")] == ["triton_python_backend_stub"]
        status, _, body = completion(f"http://127.0.0.1:{port}", max_tokens=4, temperature=0)
        assert status == 200 and body["usage"]["completion_tokens"] == 4
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(90) == 0
        assert "serving stack stopped" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    wait_for(lambda: not find_processes(run / "triton"), timeout=15, what="no model stub after the stop")
