"""``prefill_threads`` (OrtBackend, repo.prefill_threads): prompt chunks on a session of the graph of every layer
with a pool of its own, sleeping between calls, the engine's other calls on one thread each. The same numbers as
one shared pool (the kernels split a product's rows and columns among threads, never a sum), so the same tokens
and the same cache bit for bit; ONNX Runtime allows no session its own pool once a process runs the shared one,
and such a process keeps prompts on the shared pool and says so. Each case runs in a child process: pytest's
process has long had the shared pool."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from edge.core.errors import ConfigError
from exporters.triton import RepoConfig
from tests.unit.edge.runtime.test_engine import _model
from tests.unit.edge.runtime.test_ort_backend import _export

# argv: graphs, checkpoint, prefill_threads of the first backend, of the second. Prints one JSON line: per backend
# its tokens, a digest of its cache, the calls its prompt session ran, its prefill_threads, its layers
CHILD = r"""
import hashlib, json, sys, warnings
import numpy as np
from edge.runtime.backend import make_backend
from edge.runtime.engine import Engine
from edge.runtime.engine_config import EngineConfig, KVMode
from edge.runtime.request import Request
from edge.runtime.rules import ConfidenceRule

graphs, ckpt = sys.argv[1], sys.argv[2]
rng = np.random.default_rng(21)
prompts = [rng.integers(0, 300, n).tolist() for n in (40, 12, 29, 9, 33)]  # chunks of up to 16 rows: > 8
out = []
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for pt in map(int, sys.argv[3:]):
        be = make_backend("onnxruntime", graphs_dir=graphs, checkpoint=ckpt, threads=1, prefill_threads=pt)
        calls = [0]
        if be._prefill is not None:
            run = be._prefill.run_with_iobinding
            def counted(io, *a, _run=run, **k):
                calls[0] += 1
                return _run(io, *a, **k)
            be._prefill.run_with_iobinding = counted
        engine = Engine(be, EngineConfig(max_seqs=8, max_running=8, max_len=64, prefill_budget=16,
                                         kv_mode=KVMode.DEFER, defer_exit_max_batch=None), ConfidenceRule(0.3))
        ids = [engine.submit(Request(p, 10)) for p in prompts]
        toks = {}
        while engine.has_work:
            for e in engine.step():
                toks.setdefault(e.request_id, []).append([int(e.token), int(e.exit_layer)])
        h = hashlib.sha256()
        for k, v in zip(engine.cache.keys, engine.cache.values):
            h.update(k.tobytes()); h.update(v.tobytes())
        out.append({"tokens": [toks[i] for i in ids], "cache": h.hexdigest(), "prompt_calls": calls[0],
                    "prefill_threads": be.prefill_threads, "layers": be.num_layers})
print(json.dumps({"runs": out, "warnings": [str(w.message) for w in caught]}))
"""


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    return _export(tmp_path_factory.mktemp("prefill_threads"), _model(seed=17))


def _child(exported, *prefill_threads: int) -> dict:
    _, ckpt, graphs = exported
    out = subprocess.run([sys.executable, "-c", CHILD, str(graphs), str(ckpt), *map(str, prefill_threads)],
                         cwd=Path(__file__).parents[4], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_prompts_on_their_own_pool_give_the_same_tokens_and_cache_bit_for_bit(exported):
    got = _child(exported, 2, 0)
    own, shared = got["runs"]
    assert own["prefill_threads"] == 2 and shared["prefill_threads"] == 0
    # chunks of more than 8 rows (16 prompt tokens a step, first come first served) went through the prompt session
    assert own["prompt_calls"] >= 3 and shared["prompt_calls"] == 0
    assert own["tokens"] == shared["tokens"]
    assert own["cache"] == shared["cache"]
    assert any(e < own["layers"] for seq in own["tokens"] for _, e in seq), "some tokens must exit for the test to mean anything"
    assert not got["warnings"]


def test_a_process_with_the_shared_pool_keeps_prompts_on_it_and_says_so(exported):
    got = _child(exported, 0, 2)
    shared, asked = got["runs"]
    assert asked["prefill_threads"] == 0 and asked["prompt_calls"] == 0
    assert asked["tokens"] == shared["tokens"] and asked["cache"] == shared["cache"]
    assert any("shared pool" in w for w in got["warnings"]), got["warnings"]


def test_a_negative_count_is_refused():
    with pytest.raises(ConfigError, match="prefill_threads"):
        RepoConfig(prefill_threads=-1)
