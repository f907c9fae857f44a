"""EngineConfig.prefill_together (offline runs: calibration's units): prompts of one
length in consecutive cache slots are prefilled in one call, and the engine's tokens, exit layers and cache are
what one call per prompt gives, on ONNX Runtime bit for bit (what lets calibration certify the engine that
serves, which prefills one prompt per call)."""
from __future__ import annotations

import numpy as np
import pytest

from edge.runtime.backend import make_backend
from edge.runtime.engine import Engine
from edge.runtime.engine_config import EngineConfig, KVMode
from edge.runtime.request import Request
from edge.runtime.rules import ConfidenceRule
from edge.runtime.torch_backend import TorchBackend
from tests.unit.edge.runtime.test_engine import CFG, _model, _run
from tests.unit.edge.runtime.test_ort_backend import _export


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    return _export(tmp_path_factory.mktemp("together"), _model(seed=13))


def _prompts():
    """Five prompts of 12 tokens (one call), one of 7 between them (its own call), two more of 12."""
    rng = np.random.default_rng(14)
    lengths = [12, 12, 12, 7, 12, 12, 12, 12]
    return [rng.integers(0, 300, n).tolist() for n in lengths]


def _counted(backend):
    """``backend`` with every ``full`` call's row count recorded in ``backend.full_rows``."""
    inner, backend.full_rows = backend.full, []

    def full(x, slots, start, rows=1):
        backend.full_rows.append(x.shape[0])
        return inner(x, slots, start, rows)

    backend.full = full
    return backend


def _engine(backend, together, kv_mode=KVMode.DEFER, budget=200):
    cfg = EngineConfig(max_seqs=8, max_running=8, max_len=64, prefill_budget=budget, kv_mode=kv_mode,
                       defer_exit_max_batch=None, prefill_together=together)
    return Engine(backend, cfg, ConfidenceRule(0.3))


@pytest.mark.parametrize("mode", list(KVMode))
def test_onnxruntime_tokens_and_cache_bit_for_bit(exported, mode):
    m, ckpt, graphs = exported
    one = _counted(make_backend("onnxruntime", graphs_dir=graphs, checkpoint=ckpt, threads=1))
    ref_engine = _engine(one, False, mode)
    ref = _run(ref_engine, _prompts(), max_tokens=10)
    many = _counted(make_backend("onnxruntime", graphs_dir=graphs, checkpoint=ckpt, threads=1))
    engine = _engine(many, True, mode)
    got = _run(engine, _prompts(), max_tokens=10)
    assert got == ref
    assert any(e < CFG.num_layers for seq in got for _, e in seq), "some tokens must exit for the test to mean anything"
    assert one.full_rows[:8] == [1] * 8, "the default prefills one prompt per call"
    assert many.full_rows[:3] == [3, 1, 4], f"one call per run of equal lengths, got {many.full_rows[:3]}"
    for j in range(CFG.num_layers):
        np.testing.assert_array_equal(engine.cache.keys[j], ref_engine.cache.keys[j], err_msg=f"keys of layer {j}")
        np.testing.assert_array_equal(engine.cache.values[j], ref_engine.cache.values[j],
                                      err_msg=f"values of layer {j}")


def test_backend_max_batch_bounds_a_call(exported):
    """A backend whose calls take at most 2 sequences (a TensorRT profile's largest batch) gets no more."""
    m, ckpt, graphs = exported
    backend = _counted(make_backend("onnxruntime", graphs_dir=graphs, checkpoint=ckpt, threads=1))
    backend.max_batch = 2
    ref = _run(_engine(_counted(make_backend("onnxruntime", graphs_dir=graphs, checkpoint=ckpt, threads=1)), False),
               _prompts(), max_tokens=4)
    got = _run(_engine(backend, True), _prompts(), max_tokens=4)
    assert got == ref
    assert backend.full_rows[:5] == [2, 1, 1, 2, 2], f"got {backend.full_rows[:5]}"


def test_a_backend_without_it_prefills_one_prompt_per_call(exported):
    """torch chains segment calls, which take one sequence's chunk at a time: the setting changes nothing there."""
    m = exported[0]
    backend = _counted(TorchBackend(m))
    assert not backend.prefills_together
    ref = _run(_engine(TorchBackend(m), False), _prompts(), max_tokens=6)
    assert _run(_engine(backend, True), _prompts(), max_tokens=6) == ref
    assert backend.full_rows[:8] == [1] * 8


def test_a_cancelled_prompt_is_not_prefilled_after_its_cancel(exported):
    """A callback that cancels a later prompt of the same step: that prompt gets no token and its slot is freed."""
    m, ckpt, graphs = exported
    engine = _engine(make_backend("onnxruntime", graphs_dir=graphs, checkpoint=ckpt, threads=1), True)

    ids: list[int] = []
    events = []

    def cancel_next(ev):
        events.append(ev)
        if ev.request_id == ids[0] and len(ids) > 1:
            engine.cancel(ids[1])

    ids += [engine.submit(Request(p, 4, on_token=cancel_next)) for p in _prompts()[:3]]
    while engine.has_work:
        engine.step()
    by_id = {i: [e for e in events if e.request_id == i] for i in ids}
    assert len(by_id[ids[0]]) == 4 and len(by_id[ids[2]]) == 4
    assert all(e.token < 0 for e in by_id[ids[1]]) and by_id[ids[1]][-1].finished
    assert engine.cache.free_slots == engine.cache.slots


def test_chunks_with_a_past_run_alone(exported):
    """A budget of 30 cuts the third prompt: its rest, which attends to its first chunk, is a call of its own."""
    m, ckpt, graphs = exported
    ref_engine = _engine(make_backend("onnxruntime", graphs_dir=graphs, checkpoint=ckpt, threads=1), False, budget=30)
    ref = _run(ref_engine, _prompts(), max_tokens=6)
    backend = _counted(make_backend("onnxruntime", graphs_dir=graphs, checkpoint=ckpt, threads=1))
    engine = _engine(backend, True, budget=30)
    assert _run(engine, _prompts(), max_tokens=6) == ref
    assert backend.full_rows[:2] == [2, 1], f"got {backend.full_rows[:2]}"
    for j in range(CFG.num_layers):
        np.testing.assert_array_equal(engine.cache.keys[j], ref_engine.cache.keys[j], err_msg=f"keys of layer {j}")
