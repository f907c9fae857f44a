"""On a CUDA GPU: the static-cache torch backend with its decode calls captured as CUDA graphs decodes
exactly what the same backend decodes eagerly on that GPU (same kernels, replayed), through batches of
changing size, padding rows, exits with K/V propagated, and rows over scattered slots; and it does
capture (one graph per segment, head and K/V fill per batch bucket in use)."""
from __future__ import annotations

import pytest

from edge.runtime.engine import Engine
from edge.runtime.engine_config import EngineConfig
from edge.runtime.rules import ConfidenceRule
from edge.runtime.static_backend import StaticTorchBackend
from tests.unit.edge.runtime.test_engine import _model, _prompts, _run

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_captured_graphs_decode_what_eager_decodes(dtype):
    prompts = _prompts(7, seed=3)
    cfg = EngineConfig(max_seqs=4, max_running=4, max_len=128, prefill_budget=16, defer_exit_max_batch=None)
    runs = {}
    for graphs in (False, True):
        backend = StaticTorchBackend(_model(seed=1), device="cuda", dtype=dtype, graphs=graphs)
        runs[graphs] = _run(Engine(backend, cfg, ConfidenceRule(0.3)), prompts)
        if graphs:
            assert backend.captured >= 3, "decode calls should have been captured"
    assert runs[True] == runs[False]
    assert any(e < 6 for row in runs[True] for _, e in row), "the rule should make some tokens exit"


def test_captured_shortlist_checks_decide_what_eager_ones_do():
    """A shortlist model: the candidate logits computed in the captured segment graph (exit hidden and
    logits copied to the host as one array) give the eager run's tokens and exit layers; some tokens leave."""
    from tests.unit.edge.runtime.test_candidates import _model as _listed

    prompts = _prompts(6, seed=4)
    cfg = EngineConfig(max_seqs=4, max_running=4, max_len=128, prefill_budget=16, defer_exit_max_batch=None)
    runs = {}
    for graphs in (False, True):
        backend = StaticTorchBackend(_listed(seed=2), device="cuda", graphs=graphs)
        runs[graphs] = _run(Engine(backend, cfg, ConfidenceRule(6.75)), prompts)  # on the top candidate logit
    assert runs[True] == runs[False]
    assert any(e < 6 for row in runs[True] for _, e in row), "the rule should make some tokens exit"


@pytest.mark.parametrize("listed", [False, True], ids=["full_head", "shortlist"])
def test_pipelined_captured_decode_decides_what_eager_does(listed):
    """``pipeline`` on the GPU (each next segment's graph launched before the decision's pinned copy is
    read, an event between): the eager run's tokens and exit layers; segments launched ahead were wasted
    where rows left (counted)."""
    from tests.unit.edge.runtime.test_candidates import _model as _listed

    prompts = _prompts(6, seed=4)
    cfg = EngineConfig(max_seqs=4, max_running=4, max_len=128, prefill_budget=16, defer_exit_max_batch=None)
    rule = ConfidenceRule(6.75 if listed else 0.3)
    make = (lambda: _listed(seed=2)) if listed else (lambda: _model(seed=1))
    eager = _run(Engine(StaticTorchBackend(make(), device="cuda", graphs=False), cfg, rule), prompts)
    backend = StaticTorchBackend(make(), device="cuda", graphs=True, pipeline=True)
    assert _run(Engine(backend, cfg, rule), prompts) == eager
    assert backend.wasted_segments > 0 and backend.captured >= 3
