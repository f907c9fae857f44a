"""The largest chunk under control (issue 29): a TensorRT engine takes prompt chunks up to its
optimisation profile's T (the repository's prefill budget, 128 by default), and AIMD, the default serving
policy, raises the budget up to 512. The backend states the chunk, the host clamps to it and reports it,
and every policy (fixed, AIMD, max-delay, learned) stays within it, live and simulated.

TensorRT itself needs a GPU (tests/jetson): here the real ``TensorRTBackend`` runs the exported portable
graphs (what its plans are built from) through ONNX Runtime behind a runner that refuses any shape outside
the engines' recorded profile, as ``TrtRunner`` does (edge/runtime/trt_runner.py)."""
from __future__ import annotations

import asyncio
import json
import threading

import numpy as np
import pytest

from edge.core.artifacts import sha256_file
from edge.core.errors import ConfigError
from edge.runtime.backend import make_backend
from edge.runtime.graphs import load_graphs_json
from edge.runtime.host import EngineHost
from edge.runtime.host_types import Chunk, GenRequest, HostConfig
from edge.runtime.engine_config import EngineConfig
from edge.runtime.portable_backend import ENGINES_JSON, OrtGraphRunner
from edge.runtime.rules import ConfidenceRule
from exporters.tensorrt import ENGINES_FORMAT, EngineBuildConfig, profile_shapes
from scheduler.control.policies import AIMD, ControlObservation, FixedBudget, MaxDelay, observation_from_stats
from scheduler.control.registry import make_policy
from scheduler.control.sim import Simulator
from scheduler.control.sim_config import SimConfig
from tests.unit.edge.runtime.test_engine import _model
from tests.unit.edge.runtime.test_ort_backend import _export
from tests.unit.scheduler.control.test_sim import FULL, _lm, _w

CHUNK = 128  # the profile's largest T: RepoConfig's prefill budget, which a Jetson builds its profiles for
PROFILE = EngineBuildConfig(max_batch=4, opt_batch=1, max_seq=CHUNK, opt_seq=1, max_past=512, opt_past=128)


class ProfileRunner(OrtGraphRunner):
    """ONNX Runtime in place of the TensorRT plans, refusing what they would refuse (a shape outside the
    engine's profile: TrtRunner.run's ConfigError); records the largest T each graph was given."""

    def __init__(self, graphs_dir, engines) -> None:
        super().__init__(graphs_dir, threads=1)
        self.engines = engines
        self.most_rows: dict[str, int] = {}

    def run(self, name, feeds):
        for k, arr in feeds.items():
            prof = self.engines[name]["shapes"][k]
            if len(arr.shape) != len(prof["max"]) or any(not lo <= d <= hi for d, lo, hi in
                                                         zip(arr.shape, prof["min"], prof["max"])):
                raise ConfigError(f"{name}: input {k!r} shape {arr.shape} is outside the engine's profile "
                                  f"{tuple(prof['min'])}..{tuple(prof['max'])}")
        if name == "embed" or name.startswith("segment_"):
            t = feeds["input_ids" if name == "embed" else "hidden"].shape[1]
            self.most_rows[name] = max(t, self.most_rows.get(name, 0))
        return super().run(name, feeds)


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    """A tiny model with a 512-token context, exported; engines.json as exporters/tensorrt.py build_engines
    writes it for a profile of largest chunk 128 (stand-in plan files)."""
    root = tmp_path_factory.mktemp("chunk")
    _, _, graphs = _export(root, _model(seed=11, max_position_embeddings=512))
    meta = load_graphs_json(graphs)
    engines_dir = root / "engines"
    engines_dir.mkdir()
    table = {}
    for name, g in meta["graphs"].items():
        (engines_dir / f"{name}.plan").write_bytes(name.encode())
        shapes = profile_shapes(name, g["inputs"], meta["model"], PROFILE)
        table[name] = {"file": f"{name}.plan", "sha256": sha256_file(engines_dir / f"{name}.plan"),
                       "onnx_sha256": g["sha256"],
                       "shapes": {k: dict(zip(("min", "opt", "max"), map(list, v))) for k, v in shapes.items()}}
    (engines_dir / ENGINES_JSON).write_text(json.dumps({"format": ENGINES_FORMAT, "engines": table}))
    return graphs, engines_dir


@pytest.fixture
def tensorrt(export, monkeypatch):
    """``make_backend("tensorrt", ...)``: the real TensorRTBackend, its plans run by a ProfileRunner."""
    graphs, engines_dir = export
    runners = []

    def runner(_engines_dir, engines):
        runners.append(ProfileRunner(graphs, engines))
        return runners[-1]

    monkeypatch.setattr("edge.runtime.trt_runner.require_tensorrt", lambda *a, **k: None)
    monkeypatch.setattr("edge.runtime.portable_backend.TrtGraphRunner", runner)
    backend = make_backend("tensorrt", graphs_dir=graphs, engines_dir=engines_dir)
    return backend, runners[0]


class InProcessClient:
    """The worker's Triton client (``control``), answered by an engine host in this process."""

    def __init__(self, host: EngineHost) -> None:
        self.host = host

    async def control(self, op: dict) -> dict:
        return self.host.control(op)


@pytest.mark.slow  # an export (~8 s on 2 cores) and a served run (engine-level clamp: edge/runtime/test_max_chunk.py)
def test_aimd_with_long_prompts_stays_within_the_tensorrt_profile(tensorrt):
    """The largest-chunk test. A host over the TensorRT backend (largest chunk 128), AIMD run every tick by
    the serving worker's own control step, 8 prompts of 300-400 tokens: AIMD raises the budget to the chunk
    and no further, every request completes, and no engine ever sees a call of more than 128 new rows."""
    from scheduler.serving.engine_host import control_step

    backend, runner = tensorrt
    assert backend.name == "tensorrt" and backend.max_chunk == CHUNK  # stated by the profile the plans were built with
    cfg = HostConfig(engine=EngineConfig(max_seqs=4, max_running=1, max_len=512, prefill_budget=32),
                     default_sla_ttft_ms=600_000.0, default_sla_tpot_ms=600_000.0)  # always comfortable: AIMD grows
    host = EngineHost(backend, cfg, ConfidenceRule(0.3)).start()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 300, int(n)).tolist() for n in rng.integers(300, 401, 8)]
    chunks: dict[str, list[Chunk]] = {}
    done, lock = threading.Event(), threading.Lock()

    def emit(c: Chunk) -> None:
        with lock:
            chunks.setdefault(c.request_id, []).append(c)
            if sum(v[-1].finish_reason is not None for v in chunks.values()) == len(prompts):
                done.set()

    policy, budgets = AIMD(), []
    seen = []  # what AIMD was shown and proposed
    act = policy.act
    policy.act = lambda obs: seen.append((obs, act(obs))) or seen[-1][1]
    try:
        for i, p in enumerate(prompts):
            host.submit(GenRequest(f"r{i}", p, 8), emit)
        client = InProcessClient(host)
        for _ in range(20_000):
            if done.is_set():
                break
            budgets.append(asyncio.run(control_step(client, policy, observation_from_stats))["prefill_budget"])
        assert done.wait(120), "requests did not finish"
        final = host.stats()
    finally:
        host.stop()
    assert host.error is None
    assert {rid: [t for c in cs for t in c.tokens] != [] and cs[-1].finish_reason for rid, cs in chunks.items()} == \
        {f"r{i}": "length" for i in range(len(prompts))}
    assert all(len([t for c in chunks[f"r{i}"] for t in c.tokens]) == 8 for i in range(len(prompts)))
    assert max(budgets) == CHUNK and final["prefill_budget"] <= CHUNK and final["max_chunk"] == CHUNK
    assert all(o.max_chunk == CHUNK and a.prefill_budget <= CHUNK for o, a in seen)  # AIMD saw it and respected it
    assert runner.most_rows["embed"] == CHUNK  # full 128-token chunks ran ...
    assert max(runner.most_rows.values()) == CHUNK  # ... and nothing longer reached any engine


def _obs(**kw) -> ControlObservation:
    base = dict(waiting=4, prefill_backlog_tokens=2000, running=2, free_slots=14, prefill_budget=128, max_running=8,
                max_seqs=16, num_layers=6, predicted_exit_layer=4.0, min_slack_ms=500.0, max_chunk=CHUNK)
    return ControlObservation(**{**base, **kw})


def test_every_heuristic_stays_within_the_chunk():
    assert FixedBudget(512, 16).act(_obs()).prefill_budget == CHUNK
    assert FixedBudget(64, 16).act(_obs()).prefill_budget == 64
    assert AIMD().act(_obs(prefill_budget=CHUNK)).prefill_budget == CHUNK  # comfortable: would grow, may not
    assert AIMD().act(_obs(prefill_budget=CHUNK, max_chunk=None)).prefill_budget == CHUNK + 32
    assert AIMD().act(_obs(prefill_budget=CHUNK, min_slack_ms=-1.0)).prefill_budget == CHUNK // 2
    release = _obs(prefill_backlog_tokens=4096)  # max-delay releases the whole backlog at its max budget
    assert MaxDelay().act(release).prefill_budget == CHUNK
    assert MaxDelay().act(_obs(prefill_backlog_tokens=4096, max_chunk=None)).prefill_budget == 512
    for name in ("fixed", "aimd", "maxdelay"):
        a = make_policy(name).act(_obs(prefill_budget=16, max_chunk=16))
        assert a.prefill_budget <= 16 and a.max_running <= 16


def test_learned_policy_stays_within_the_chunk():
    """The shipped network's observation has no max_chunk (its layout is fixed): its grid action is clamped."""
    learned = make_policy("ppo")
    budgets = set()
    for backlog in (0, 300, 5000):
        for slack in (None, -50.0, 400.0):
            learned.reset()
            a = learned.act(_obs(prefill_backlog_tokens=backlog, min_slack_ms=slack, max_chunk=16, prefill_budget=16))
            budgets.add(a.prefill_budget)
    assert budgets and max(budgets) <= 16


def test_observation_carries_the_chunk_and_the_simulator_clamps_too():
    """The simulator (training, evaluation) clamps as the host does and reports the same key; a host that
    reports no max_chunk is of another version."""
    cfg = SimConfig(max_chunk=64, prefill_budget=512)  # the initial value as recorded; applied clamped
    with pytest.raises(ConfigError, match="sim.max_chunk must be an integer >= 1"):
        SimConfig(max_chunk=0)
    s = Simulator(_lm(), FULL, cfg, _w([0.5], [300], [5]))
    assert s.observe()["prefill_budget"] == 64 and s.observe()["max_chunk"] == 64
    s.set(prefill_budget=512)
    o = observation_from_stats(s.observe())
    assert o.prefill_budget == 64 and o.max_chunk == 64
    stats = dict(s.observe())
    del stats["max_chunk"]
    with pytest.raises(ConfigError, match="lack 'max_chunk'"):
        observation_from_stats(stats)
