"""Triton's core in this process (scheduler/serving/triton_core.py) on a real repository: the same chunks,
control answers and errors as tritonserver over gRPC on the same repository, an early close that cancels the
request in the engine, a stopped core refused, and the environment the model's stub needed given back."""
from __future__ import annotations

import asyncio
import os
from pathlib import Path

import numpy as np
import pytest

from edge.core.errors import ConfigError

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def repo(served_run, repository_copy, tmp_path_factory) -> Path:
    return repository_copy(served_run, tmp_path_factory.mktemp("triton_core")) / "triton"


@pytest.fixture(scope="module")
def core(repo):
    from scheduler.serving.triton_core import TritonCore

    before = os.environ.get("SMARTEXIT_PYTHONPATH")
    c = TritonCore(repo).start(timeout_s=120)
    yield c
    c.stop()
    assert os.environ.get("SMARTEXIT_PYTHONPATH") == before  # the stub's environment given back


@pytest.fixture(scope="module")
def server(repo):
    from scheduler.serving.tritonserver import TritonProcess

    tp = TritonProcess(repo).start(timeout_s=120)
    yield tp
    tp.stop()


def _collect(client, request_id: str, prompt: list[int], max_tokens: int, **kw) -> list:
    async def go():
        return [c async for c in client.generate(request_id, prompt, max_tokens, **kw)]
    return asyncio.run(go())


PROMPT = [5, 17, 33, 90, 120, 7, 7, 19, 250, 41, 8, 3]


@pytest.mark.parametrize("mode", ["bounded", "full", "exact"])
def test_the_core_streams_what_tritonserver_streams(core, server, mode):
    """Greedy generations give the same tokens and exit layers through the core as over gRPC to a
    tritonserver on the same repository (the same model, bundle and graphs), streamed in several chunks whose
    last alone has the finish reason."""
    from scheduler.serving.triton_client import TritonClient
    from scheduler.serving.triton_core import TritonCoreClient

    got = _collect(TritonCoreClient(core), f"core-{mode}", PROMPT, 24, mode=mode)

    async def over_grpc():
        client = TritonClient(server.grpc_url)
        try:
            return [c async for c in client.generate(f"grpc-{mode}", PROMPT, 24, mode=mode)]
        finally:
            await client.close()
    want = asyncio.run(over_grpc())
    tokens = lambda chunks: [t for c in chunks for t in c.token_ids]  # noqa: E731
    layers = lambda chunks: [x for c in chunks for x in c.exit_layers]  # noqa: E731
    assert len(tokens(got)) == 24
    assert tokens(got) == tokens(want) and layers(got) == layers(want)
    assert len(got) >= 2
    assert [c.finish_reason for c in got] == [""] * (len(got) - 1) + ["length"]


def test_control_ops_and_rejections_as_over_grpc(core):
    """``stats`` answers the engine's keys; a malformed request is the model's JSON error naming the field
    (TritonRejected, as over gRPC), an unknown op too; a tensor no Triton type fits is refused before sending."""
    from scheduler.serving.triton_client import TritonRejected
    from scheduler.serving.triton_core import TritonCoreClient

    client = TritonCoreClient(core)
    stats = asyncio.run(client.control({"op": "stats"}))
    assert stats["engine_alive"] is True and stats["num_layers"] >= 2 and "audit" in stats
    with pytest.raises(TritonRejected) as err:
        _collect(client, "empty", [], 4)
    assert err.value.field == "input_ids"
    with pytest.raises(TritonRejected):
        asyncio.run(client.control({"op": "no-such-op"}))

    async def bad_dtype():
        core.submit({"input_ids": np.array([1.0, 2.0], dtype=np.float64)})
    with pytest.raises(ConfigError, match="float64"):
        asyncio.run(bad_dtype())


def test_an_early_close_cancels_the_request_in_the_engine(core):
    """Leaving a generation after its first chunk sends the cancel op: the engine runs nothing afterwards."""
    from scheduler.serving.triton_core import TritonCoreClient

    client = TritonCoreClient(core)

    async def leave_early():
        gen = client.generate("early", PROMPT, 200)
        async for _ in gen:
            break
        await gen.aclose()
        for _ in range(100):
            if (await client.control({"op": "stats"}))["running"] == 0:
                return True
            await asyncio.sleep(0.05)
        return False
    assert asyncio.run(leave_early())


def test_finished_requests_leave_nothing_behind(core):
    """Every request of this module answered and released: no response queue and no input kept (the inputs
    live until the core releases the request, the queue until its final response)."""
    import time

    deadline = time.monotonic() + 10
    while (core._calls or core._inputs) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert core._calls == {} and core._inputs == {}


def test_a_stopped_core_and_a_folder_without_the_model_are_refused(repo, tmp_path):
    from scheduler.serving.triton_client import TritonUnavailable
    from scheduler.serving.triton_core import TritonCore, TritonCoreClient

    with pytest.raises(ConfigError, match="not a SmartExit model repository"):
        TritonCore(tmp_path)
    stopped = TritonCore(repo)
    assert not asyncio.run(TritonCoreClient(stopped).ready())
    with pytest.raises(TritonUnavailable, match="not running"):
        _collect(TritonCoreClient(stopped), "x", PROMPT, 2)
