"""The Triton client: error parsing, tensors and responses (pure), and the wire behaviour against an
in-process fake of the ``smartexit`` model's gRPC stream (a test double, not tritonserver: the real
server is the integration tier's)."""
from __future__ import annotations

import asyncio
import inspect
import json
import pickle

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import deserialize_bytes_tensor, serialize_byte_tensor

from scheduler.serving.api import GenerationRequest, backend_error
from scheduler.serving.triton_client import (Chunk, TritonClient, TritonRejected, TritonUnavailable, control_tensors,
                                           decode_chunk, decode_control, error_from_message, error_to_dict,
                                           generation_tensors)


# -- pure ----------------------------------------------------------------------------------------------
def test_rejection_json_is_parsed_with_or_without_a_server_prefix():
    body = {"code": "invalid_request", "message": "max_tokens must be >= 1", "field": "max_tokens",
            "retry_after_s": None}
    for msg in (json.dumps(body), "Failed to process the request(s), message: " + json.dumps(body)):
        err = error_from_message(msg)
        assert isinstance(err, TritonRejected)
        assert (err.code, err.message, err.field, err.retry_after_s) == ("invalid_request", body["message"],
                                                                         "max_tokens", None)


def test_overloaded_gets_a_retry_after_even_when_the_model_gives_none():
    assert error_from_message(json.dumps({"code": "overloaded", "message": "queue full"})).retry_after_s == 1.0
    err = error_from_message(json.dumps({"code": "overloaded", "message": "q", "retry_after_s": 2.5}))
    assert (err.code, err.retry_after_s) == ("overloaded", 2.5)


@pytest.mark.parametrize("msg", ["Request for unknown model: 'smartexit' is not found",
                                 "Stub process 'smartexit_0_0' is not healthy.",
                                 '{"code": "teapot", "message": "x"}', "{not json}", ""])
def test_answers_outside_the_protocol_mean_unavailable(msg):
    assert isinstance(error_from_message(msg), TritonUnavailable)


def test_errors_pickle_and_round_trip_through_the_worker_dict():
    rej = TritonRejected("overloaded", "queue full", None, 3.0)
    back = pickle.loads(pickle.dumps(rej))  # Ray moves exceptions between processes by pickling
    assert (back.code, back.message, back.retry_after_s) == ("overloaded", "queue full", 3.0)
    assert str(pickle.loads(pickle.dumps(TritonUnavailable("down")))) == "down"
    assert (backend_error(error_to_dict(rej)).status, backend_error(error_to_dict(rej)).retry_after_s) == (429, 3.0)
    bad = backend_error(error_to_dict(TritonRejected("invalid_request", "bad top_p", "top_p")))
    assert (bad.status, bad.param) == (400, "top_p")
    assert backend_error(error_to_dict(TritonRejected("internal", "boom"))).status == 500
    down = backend_error(error_to_dict(TritonUnavailable("connection refused")))
    assert (down.status, down.headers()) == (503, {"Retry-After": "1"})


def test_generation_tensors_follow_the_wire_table():
    t = generation_tensors([5, 6, 7], 4, 0.5, 0.9, seed=3, stop_ids=[0], mode="exact", sla_ttft_ms=200.0,
                           sla_tpot_ms=20.0)
    dtypes = {k: (v.dtype, v.shape) for k, v in t.items()}
    assert dtypes == {"input_ids": (np.int64, (3,)), "max_tokens": (np.int32, (1,)),
                      "temperature": (np.float32, (1,)), "top_p": (np.float32, (1,)), "seed": (np.int64, (1,)),
                      "stop_ids": (np.int64, (1,)), "mode": (np.object_, (1,)), "sla_ttft_ms": (np.float32, (1,)),
                      "sla_tpot_ms": (np.float32, (1,))}
    assert t["mode"][0] == b"exact"
    assert set(generation_tensors([1], 1)) == {"input_ids", "max_tokens", "temperature", "top_p"}  # optional left out
    assert json.loads(control_tensors({"op": "stats"})["control"][0]) == {"op": "stats"}


def test_the_front_end_payload_is_exactly_generates_arguments():
    req = GenerationRequest("completion", "m", [1, 2], 4, 1.0, 1.0, None, (), False, False, "bounded", 1e3, 1e2)
    params = set(inspect.signature(TritonClient.generate).parameters) - {"self"}
    assert set(req.payload("cmpl-1", [0])) == params


class _Result:
    def __init__(self, **arrays):
        self._a = arrays

    def as_numpy(self, name):
        return self._a.get(name)


def test_decode_chunk_and_control():
    r = _Result(token_ids=np.array([4, 9], np.int64), exit_layers=np.array([3, 12], np.int32),
                finish_reason=np.array([b"length"], dtype=object))
    assert decode_chunk(r) == Chunk([4, 9], [3, 12], "length")
    empty_final = _Result(token_ids=np.zeros(0, np.int64), exit_layers=np.zeros(0, np.int32),
                          finish_reason=np.array([b"cancelled"], dtype=object))
    assert decode_chunk(empty_final) == Chunk([], [], "cancelled")
    with pytest.raises(TritonUnavailable, match="2 token_ids but 1 exit_layers"):
        decode_chunk(_Result(token_ids=np.array([1, 2]), exit_layers=np.array([3]),
                             finish_reason=np.array([b""], dtype=object)))
    with pytest.raises(TritonUnavailable, match="finish_reason 'exploded'"):
        decode_chunk(_Result(token_ids=np.array([1]), exit_layers=np.array([3]),
                             finish_reason=np.array([b"exploded"], dtype=object)))
    assert decode_control(_Result(control_out=np.array([b'{"cancelled": true}'], dtype=object))) == {"cancelled": True}
    with pytest.raises(TritonUnavailable, match="control_out"):
        decode_control(_Result(control_out=np.array([b"[1]"], dtype=object)))


# -- against a fake model stream --------------------------------------------------------------------------
def _tensor(name: str, arr: np.ndarray, datatype: str):
    raw = serialize_byte_tensor(arr).item() if datatype == "BYTES" else arr.tobytes()
    return service_pb2.ModelInferResponse.InferOutputTensor(name=name, datatype=datatype, shape=list(arr.shape)), raw


def _response(rid: str, **outputs) -> service_pb2.ModelStreamInferResponse:
    kinds = {"token_ids": "INT64", "exit_layers": "INT32", "finish_reason": "BYTES", "control_out": "BYTES"}
    resp = service_pb2.ModelInferResponse(model_name="smartexit", id=rid)
    for name, arr in outputs.items():
        out, raw = _tensor(name, arr, kinds[name])
        resp.outputs.append(out)
        resp.raw_output_contents.append(raw)
    return service_pb2.ModelStreamInferResponse(infer_response=resp)


class FakeModel(service_pb2_grpc.GRPCInferenceServiceServicer):
    """Streams ``max_tokens`` one-token steps (token i+100, exit layer 3), ``delay_s`` apart; a prompt
    starting with 999 is rejected as overloaded, one starting with 666 ends with the host's "error"
    finish (its engine thread died); records control ops."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s, self.controls, self.requests = delay_s, [], []

    async def ModelStreamInfer(self, request_iterator, context):
        async for req in request_iterator:
            inputs = {t.name: raw for t, raw in zip(req.inputs, req.raw_input_contents)}
            if "control" in inputs:
                op = json.loads(deserialize_bytes_tensor(inputs["control"])[0])
                self.controls.append(op)
                answer = {"cancelled": True} if op["op"] == "cancel" else {"running": 0, "waiting": 0}
                yield _response(req.id, control_out=np.array([json.dumps(answer).encode()], dtype=object))
                continue
            ids = np.frombuffer(inputs["input_ids"], np.int64)
            n = int(np.frombuffer(inputs["max_tokens"], np.int32)[0])
            self.requests.append({"id": req.id, "ids": ids.tolist(), "inputs": sorted(inputs)})
            if ids[0] == 999:
                err = json.dumps({"code": "overloaded", "message": "queue full", "field": None, "retry_after_s": 2})
                yield service_pb2.ModelStreamInferResponse(error_message=err)
                continue
            last = b"error" if ids[0] == 666 else b"length"
            for i in range(n):
                await asyncio.sleep(self.delay_s)
                yield _response(req.id, token_ids=np.array([100 + i], np.int64), exit_layers=np.array([3], np.int32),
                                finish_reason=np.array([last if i == n - 1 else b""], dtype=object))


async def _with_server(model: FakeModel, body):
    server = grpc.aio.server()
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(model, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = TritonClient(f"127.0.0.1:{port}", timeout_s=5.0)
    try:
        return await body(client)
    finally:
        await client.close()
        await server.stop(None)


def test_generate_streams_each_step_and_sends_the_wire_inputs():
    model = FakeModel()

    async def body(client):
        return [c async for c in client.generate("r1", [5, 6], 3, temperature=0.0, stop_ids=[0], mode="full")]

    chunks = asyncio.run(_with_server(model, body))
    assert chunks == [Chunk([100], [3], ""), Chunk([101], [3], ""), Chunk([102], [3], "length")]
    assert model.requests == [{"id": "r1", "ids": [5, 6], "inputs": ["input_ids", "max_tokens", "mode", "stop_ids",
                                                                    "temperature", "top_p"]}]
    assert model.controls == []  # finished normally: nothing to cancel


def test_a_rejection_raises_typed_and_is_not_cancelled():
    model = FakeModel()

    async def body(client):
        with pytest.raises(TritonRejected) as info:
            async for _ in client.generate("r2", [999], 3):
                pass
        return info.value

    err = asyncio.run(_with_server(model, body))
    assert (err.code, err.retry_after_s) == ("overloaded", 2)
    assert model.controls == []


def test_an_engine_error_finish_is_an_internal_rejection_after_the_tokens():
    model = FakeModel()

    async def body(client):
        got = []
        with pytest.raises(TritonRejected) as info:
            async for c in client.generate("r5", [666], 3):
                got.append(c)
        return got, info.value

    got, err = asyncio.run(_with_server(model, body))
    assert got == [Chunk([100], [3], ""), Chunk([101], [3], "")] and err.code == "internal"
    assert model.controls == []  # the request is over: nothing to cancel


def test_closing_the_stream_early_sends_cancel_for_the_request():
    model = FakeModel(delay_s=0.05)

    async def body(client):
        gen = client.generate("r3", [5], 50)
        first = await gen.__anext__()
        await gen.aclose()  # what the worker does when the HTTP client goes away
        return first

    assert asyncio.run(_with_server(model, body)) == Chunk([100], [3], "")
    assert model.controls == [{"op": "cancel", "request_id": "r3"}]


def test_control_returns_the_json_answer():
    model = FakeModel()
    out = asyncio.run(_with_server(model, lambda c: c.control({"op": "stats"})))
    assert out == {"running": 0, "waiting": 0} and model.controls == [{"op": "stats"}]


def test_no_server_is_unavailable_and_not_ready():
    async def body():
        with grpc_socket() as port:
            client = TritonClient(f"127.0.0.1:{port}", timeout_s=2.0)
            try:
                assert await client.ready() is False
                with pytest.raises(TritonUnavailable, match="UNAVAILABLE"):
                    async for _ in client.generate("r4", [1], 2):
                        pass
                with pytest.raises(TritonUnavailable):
                    await client.control({"op": "stats"})
            finally:
                await client.close()

    asyncio.run(body())


class grpc_socket:
    """A local port nothing listens on (bound then released)."""

    def __enter__(self) -> int:
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    def __exit__(self, *exc) -> None:
        return None


# -- the worker's supervision of its tritonserver (the deployment's class, fakes around it) ---------------
class FakeProc:
    """A TritonProcess that is dead until restarted; ``fail`` restarts raise first."""

    def __init__(self, fail: int = 0) -> None:
        self.alive, self.fail, self.restarts, self.stops, self.grpc_url = False, fail, 0, 0, "127.0.0.1:1"

    def stop(self) -> None:
        self.stops += 1
        self.alive = False

    def restart(self, timeout_s: float = 180.0):
        self.restarts += 1
        if self.fail:
            self.fail -= 1
            raise RuntimeError("tritonserver exited with code 1")
        self.alive = True
        return self


class StatsClient:
    url = "127.0.0.1:1"

    async def control(self, op):
        return {"waiting": 0, "running": 0, "prefill_budget": 64, "max_running": 4}


class FakeHub:
    def __init__(self):
        self.pushes = []
        self.push = self

    def remote(self, replica, ready, stats, route=None):
        self.pushes.append(ready)
        self.routes = getattr(self, "routes", []) + [route]

        async def done():
            return None
        return done()


class KeepPolicy:
    def act(self, obs):
        return type("Action", (), {"prefill_budget": 64, "max_running": 4})()


def worker(proc: FakeProc):
    from scheduler.serving import worker as worker_module
    from scheduler.serving.config import ServeConfig
    w = object.__new__(worker_module.Worker.func_or_class)  # the class Serve runs, without its constructor
    w._cfg = ServeConfig(control_tick_s=0.01, restart_backoff_s=0.01, restart_backoff_max_s=0.04)
    w._hub, w._policy, w._observe, w._replica, w._node = FakeHub(), KeepPolicy(), (lambda s: s), "w0", "n0"
    w._proc, w._client, w._stats, w._ready, w._restarting, w._backoff_s = proc, StatsClient(), None, True, False, 0.01
    w._generation = w._acted = 0
    return w


def test_a_dead_tritonserver_is_restarted_with_backoff_and_requests_meanwhile_get_503():
    proc = FakeProc(fail=2)
    w = worker(proc)

    async def main():
        w._loop = asyncio.create_task(w._run())
        await asyncio.sleep(0.005)
        during = [c async for c in w.generate({"request_id": "r"})]  # while it is down
        for _ in range(200):
            if w._ready:
                break
            await asyncio.sleep(0.01)
        w.check_health()  # the loop is alive
        w._loop.cancel()
        return during

    during = asyncio.run(main())
    assert during[0]["error"]["kind"] == "unavailable" and "restarting" in during[0]["error"]["message"]
    assert proc.restarts == 3 and w._ready and not w._restarting
    assert w._backoff_s == 0.01  # reset by the first good tick
    # the route the ingress streams by: none while the server restarts, its address once it answers
    assert None in w._hub.routes and w._hub.routes[-1] == ("127.0.0.1:1", "n0")
    assert w._hub.pushes[0] is False and w._hub.pushes[-1] is True
    assert backend_error(during[0]["error"]).status == 503
    w.__del__()  # Serve's shutdown hook: the tritonserver goes with the replica, once
    w.__del__()
    assert proc.stops == 1


def test_check_health_fails_when_the_control_loop_died():
    w = worker(FakeProc())

    async def main():
        async def boom():
            raise ValueError("policy bug")
        w._loop = asyncio.create_task(boom())
        await asyncio.sleep(0)
        with pytest.raises(RuntimeError, match="control loop stopped.*policy bug"):
            w.check_health()

    asyncio.run(main())


def test_a_server_relaunched_on_the_same_port_is_reached_within_a_second():
    """A tritonserver relaunched on its old port (the worker's restart) is reached within a second by a
    client whose channel saw it die: with gRPC's default reconnect backoff (1 s growing 1.6x to 120 s) the
    channel failed every call at once for 2-3 s after a 6-s outage, and the ingress answered 503 meanwhile
    although the worker reported the server ready (stop 72's CI). Real gRPC, a fake model."""
    async def body():
        server = grpc.aio.server()
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(FakeModel(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        client = TritonClient(f"127.0.0.1:{port}", timeout_s=2.0)
        try:
            assert await client.control({"op": "stats"}) == {"running": 0, "waiting": 0}
            await server.stop(None)
            t0 = asyncio.get_running_loop().time()
            while asyncio.get_running_loop().time() - t0 < 6.0:  # the outage: calls fail, the backoff grows
                with pytest.raises(TritonUnavailable):
                    await client.control({"op": "stats"})
                await asyncio.sleep(0.25)
            server = grpc.aio.server()
            service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(FakeModel(), server)
            assert server.add_insecure_port(f"127.0.0.1:{port}") == port
            await server.start()
            t1 = asyncio.get_running_loop().time()
            while True:
                try:
                    await client.control({"op": "stats"})
                    return asyncio.get_running_loop().time() - t1
                except TritonUnavailable:
                    await asyncio.sleep(0.05)
        finally:
            await client.close()
            await server.stop(None)

    assert asyncio.run(body()) < 1.0
