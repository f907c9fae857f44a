"""A backend's largest chunk (``Backend.max_chunk``, STYLE 19): the backend refuses a longer call, the
engine clamps its prefill budget to it and never sends a longer prompt chunk, the host reports it and
clamps a ``set``; the TensorRT backend states its profile's largest T, read from what its builds
recorded (exporters/tensorrt.py's shapes, or the trtexec command line of edge/jetson/engines.py).
The online audit tests the threshold table's epsilon and nothing else. Torch backend, tiny random model."""
from __future__ import annotations

import logging

import numpy as np
import pytest

from calibration.table import ThresholdTable
from edge.core.errors import ArtifactError, ConfigError
from edge.runtime.audit import AuditConfig, AuditEstimate
from edge.runtime.engine import Engine
from edge.runtime.engine_config import EngineConfig
from edge.runtime.request import Request
from edge.runtime.host import EngineHost
from edge.runtime.host_types import HostConfig
from edge.runtime.portable_backend import profile_max_batch, profile_max_chunk
from edge.runtime.torch_backend import TorchBackend
from exporters.tensorrt import EngineBuildConfig, profile_shapes, trtexec_argv
from tests.unit.edge.runtime.test_engine import _model

MODEL = {"hidden_size": 64, "num_kv_heads": 2, "head_dim": 16}
INPUTS = {"embed": ["input_ids"], "segment_0": ["hidden", "positions", "attn_mask", "past_key_0", "past_value_0",
                                                "past_key_1", "past_value_1", "exit_index"],
          "kvfill_1": ["hidden", "positions"], "head": ["exit_hidden"]}  # a graphs.json's graphs (the export's names)


class Chunked(TorchBackend):
    """The torch reference with a largest chunk, as a TensorRT profile states one; records T of every call."""

    def __init__(self, model, max_chunk: int) -> None:
        super().__init__(model)
        self.max_chunk = max_chunk
        self.rows: list[int] = []

    def _segment(self, i, x, slots, start, prev, decide, rows, draft, lookup):
        self.rows.append(x.shape[1])
        return super()._segment(i, x, slots, start, prev, decide, rows, draft, lookup)


def test_backend_refuses_a_call_longer_than_its_largest_chunk():
    b = Chunked(_model(), 8)
    Engine(b, EngineConfig(max_seqs=1, max_len=32, prefill_budget=8))  # attaches a cache
    ok = b.full(np.zeros((1, 8), np.int64), np.array([0]), np.array([0]))
    assert ok.token.shape == (1,)
    with pytest.raises(ConfigError, match="9 new rows exceeds the torch backend's largest chunk 8"):
        b.full(np.zeros((1, 9), np.int64), np.array([0]), np.array([0]))


def test_engine_clamps_its_budget_and_every_chunk(caplog):
    """A configured budget above the chunk is clamped (with a warning), as is every later one; prompts of
    any length prefill in chunks of at most max_chunk, even when cfg.prefill_budget is written directly."""
    backend = Chunked(_model(), 16)
    with caplog.at_level(logging.WARNING, logger="smartexit.engine"):
        eng = Engine(backend, EngineConfig(max_seqs=2, max_running=2, max_len=128, prefill_budget=100))
    assert eng.stats().prefill_budget == 16 and eng.stats().max_chunk == 16 and "clamped" in caplog.text
    assert eng.set_prefill_budget(512) == 16 and eng.set_prefill_budget(5) == 5
    eng.cfg.prefill_budget = 512  # around the setter: the prefill loop still keeps each call within the chunk
    ids = [eng.submit(Request(list(range(1, 1 + n)), 4)) for n in (70, 45)]
    done = {}
    while eng.has_work:
        for ev in eng.step():
            if ev.finished:
                done[ev.request_id] = ev.finish_reason
    assert done == {i: "length" for i in ids}
    assert max(backend.rows) == 16 and 16 in backend.rows  # long prompts ran in full chunks, none longer


def test_reference_and_onnxruntime_state_no_limit():
    assert TorchBackend(_model()).max_chunk is None
    eng = Engine(TorchBackend(_model()), EngineConfig(max_len=64, prefill_budget=512))
    assert eng.stats().prefill_budget == 512 and eng.stats().max_chunk is None


def test_host_clamps_a_set_and_reports_the_chunk():
    host = EngineHost(Chunked(_model(), 128), HostConfig(engine=EngineConfig(max_seqs=2, max_running=2, max_len=128)))
    st = host.control({"op": "set", "prefill_budget": 512, "max_running": 2})
    assert (st["prefill_budget"], st["max_chunk"]) == (128, 128)
    assert host.control({"op": "set", "prefill_budget": 48})["prefill_budget"] == 48


def _profile_engines(build: EngineBuildConfig, recorded: str) -> dict:
    """engines.json entries as the two builders write them: ``shapes`` (exporters/tensorrt.py build_engines)
    or the trtexec ``argv`` (edge/jetson/engines.py build_all); profiles from the real profile_shapes."""
    out = {}
    for name, inputs in INPUTS.items():
        shapes = profile_shapes(name, inputs, MODEL, build)
        out[name] = ({"file": f"{name}.plan", "shapes": {k: {"min": list(v[0]), "opt": list(v[1]), "max": list(v[2])}
                                                          for k, v in shapes.items()}}
                     if recorded == "shapes" else
                     {"file": f"{name}.plan", "argv": trtexec_argv(f"{name}.onnx", f"{name}.plan", shapes, build)})
    return out


@pytest.mark.parametrize("recorded", ["shapes", "argv"])
def test_tensorrt_profile_states_its_largest_chunk(recorded):
    """What TensorRTBackend sets as its max_chunk: the profile's max T, as built (max_seq: the repo's
    prefill budget on a Jetson, edge/jetson/engines.py build_config)."""
    assert profile_max_chunk(_profile_engines(EngineBuildConfig(max_seq=128), recorded)) == 128
    engines = _profile_engines(EngineBuildConfig(max_seq=256), recorded)
    engines["segment_0"] = _profile_engines(EngineBuildConfig(max_seq=64), recorded)["segment_0"]
    assert profile_max_chunk(engines) == 64  # the graph that accepts least bounds every call


@pytest.mark.parametrize("recorded", ["shapes", "argv"])
def test_tensorrt_profile_states_its_largest_batch(recorded):
    """What TensorRTBackend sets as its max_batch (the most sequences an engine that prefills them together
    puts in one call): the profile's max B, the smallest over the graphs."""
    engines = _profile_engines(EngineBuildConfig(max_batch=16, opt_batch=4), recorded)
    assert profile_max_batch(engines) == 16
    engines["embed"] = _profile_engines(EngineBuildConfig(max_batch=8, opt_batch=4), recorded)["embed"]
    assert profile_max_batch(engines) == 8


def test_tensorrt_engines_without_a_recorded_profile_refused():
    engines = _profile_engines(EngineBuildConfig(max_seq=128), "shapes")
    del engines["embed"]["shapes"]
    with pytest.raises(ArtifactError, match="engines.json: the engine of graph 'embed' records no optimisation "
                                            "profile.*make jetson-engines"):
        profile_max_chunk(engines)


def test_audit_tests_the_tables_epsilon_only():
    """No made-up bound: an audit without the certificate's epsilon is refused, a bound of the audit's own is
    an unknown setting, and without one the trigger never fires."""
    cfg = HostConfig(engine=EngineConfig(max_seqs=2, max_running=2, max_len=64), audit={"fraction": 0.5})
    with pytest.raises(ConfigError, match=r"audit.fraction=0.5: the audit tests the certificate's epsilon"):
        EngineHost(TorchBackend(_model()), cfg)
    assert EngineHost(TorchBackend(_model()), cfg, epsilon=0.02).stats()["audit"]["epsilon"] == 0.02
    with pytest.raises(ConfigError, match=r"host.epsilon must be in \(0, 1\)"):
        EngineHost(TorchBackend(_model()), cfg, epsilon=1.0)
    with pytest.raises(ConfigError, match=r"repo.audit: unknown audit setting\(s\) \['eps'\].*table's epsilon"):
        AuditConfig.from_dict({"fraction": 0.05, "eps": 0.01}, "repo.audit")
    est = AuditEstimate(epsilon=None, delta=0.05, min_tokens=1)
    assert not any(est.record(2, True) for _ in range(50)) and est.as_dict()["epsilon"] is None


def test_threshold_table_epsilon_is_the_certificates():
    table = ThresholdTable("x", [2, 6], "platt", 0.5, {}, {}, certificate={"epsilon": 0.009, "delta": 0.05})
    assert table.epsilon == 0.009
    with pytest.raises(ConfigError, match="certificate records no 'epsilon'.*smartexit calibrate"):
        _ = ThresholdTable("x", [2, 6], "platt", 0.5, {}, {}, certificate={"delta": 0.05}).epsilon
