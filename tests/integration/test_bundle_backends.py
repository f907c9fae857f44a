"""Which backend serves a bundle (scheduler/serving/bundle.py): ONNX Runtime by default; the static-cache torch
backend on the bundle's own checkpoint (what a Jetson serves before its TensorRT engines exist) when the
file ``$SMARTEXIT_BACKEND_CONFIG`` names says so, in process and in a real tritonserver; bad choices
refused with the reason. The TensorRT choice needs a device: tests/jetson/test_trt_backend.py."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from edge.core.artifacts import Manifest
from edge.core.errors import ArtifactError, ConfigError

pytestmark = pytest.mark.integration

BUNDLE = Path("smartexit") / "1" / "bundle"
PROMPTS = ([5, 17, 301, 12, 9, 44, 2], [100, 7, 7, 31])


@pytest.fixture(scope="module")
def repo(served_run, repository_copy, tmp_path_factory) -> Path:
    return repository_copy(served_run, tmp_path_factory.mktemp("bundle_backends")) / "triton"


@pytest.fixture(scope="module")
def torch_choice(served_run, tmp_path_factory) -> Path:
    """A backend file: torch_static on the CPU, on the run's served checkpoint, each next decode segment
    launched before the decision is read (``pipeline``: the tokens must not change)."""
    path = tmp_path_factory.mktemp("choice") / "backend.json"
    ckpt = Manifest(served_run).served_checkpoint()
    path.write_text(json.dumps({"name": "torch_static", "checkpoint": str(ckpt), "device": "cpu", "pipeline": True}))
    return path


def generate(bundle: Path, prompt: list[int], mode: str) -> list:
    """One greedy request on the engine host over ``bundle`` in this process: its (token, exit layer) pairs."""
    from tests.integration.test_triton_model import in_process

    return [(t, e) for c in in_process(bundle, prompt, 10, mode) for t, e in zip(c.tokens, c.exit_layers)]


@pytest.mark.parametrize("mode", ["full", "bounded"])
def test_torch_static_serves_what_onnx_runtime_serves(repo, torch_choice, monkeypatch, mode):
    """The float model's exported graphs and its torch modules compute the same function (the export's
    parity gate held them within float32 rounding): the same greedy tokens and exit layers."""
    for prompt in PROMPTS:
        ort = generate(repo / BUNDLE, prompt, mode)
        monkeypatch.setenv("SMARTEXIT_BACKEND_CONFIG", str(torch_choice))
        got = generate(repo / BUNDLE, prompt, mode)
        monkeypatch.delenv("SMARTEXIT_BACKEND_CONFIG")
        assert got == ort


def test_the_bundle_carries_the_step_gate_setting_to_the_served_engine(repo):
    """`smartexit repo` records repo.exit_gate in the bundle (the tests' bundle turns it off, conftest); the host
    over it builds its engine with it, and an override turns it back on as a default repository has it."""
    from scheduler.serving.bundle import open_bundle

    info = json.loads((repo / BUNDLE / "bundle.json").read_text())
    assert info["host"]["exit_gate"] is False
    assert open_bundle(repo / BUNDLE).engine.step_gate is None
    host = open_bundle(repo / BUNDLE, exit_gate=True)
    assert host.engine.step_gate is not None
    pairs = [(t, e) for c in _host_generate(host, PROMPTS[0]) for t, e in zip(c.tokens, c.exit_layers)]
    assert len(pairs) == 10 and {e for _, e in pairs} <= set(info["model"]["exit_layers"]) | {info["model"]["num_layers"]}
    gate = host.engine.step_gate  # it measured the steps it ran (the first of a kind builds bindings, not counted)
    assert gate.share_checked(1) is not None


def test_the_bundle_carries_bounded_drafts_to_the_served_engine(repo):
    """`smartexit repo` records repo.bounded_drafts (the tests' bundle turns it off, conftest: their served tokens
    are compared with the engine's exits); on, as a default repository has it, a bounded request on a prompt that
    repeats itself drafts from its context on the ONNX Runtime graphs, beside its exit checks."""
    from scheduler.serving.bundle import open_bundle
    from tests.unit.edge.runtime.test_lookup_drafts import _FlatCosts

    info = json.loads((repo / BUNDLE / "bundle.json").read_text())
    assert info["host"]["bounded_drafts"] is False
    assert open_bundle(repo / BUNDLE).engine.cfg.bounded_drafts is False
    host = open_bundle(repo / BUNDLE, bounded_drafts=True)
    host.engine.call_costs = _FlatCosts()  # every draft pays: the regime does not depend on this machine's timing
    pairs = [(t, e) for c in _host_generate(host, [5, 17, 301, 12] * 4, 16) for t, e in zip(c.tokens, c.exit_layers)]
    assert len(pairs) == 16 and {e for _, e in pairs} <= set(info["model"]["exit_layers"]) | {info["model"]["num_layers"]}
    assert host.engine.source_stats["lookup"].rounds > 0, host.engine.source_stats["lookup"].as_dict()


def _host_generate(host, prompt: list[int], max_tokens: int = 10) -> list:
    import threading

    from edge.runtime.host_types import GenRequest

    chunks, done = [], threading.Event()

    def emit(chunk):
        chunks.append(chunk)
        if chunk.finish_reason is not None:
            done.set()
    host.start()
    try:
        host.submit(GenRequest("gated", list(prompt), max_tokens, mode="bounded"), emit)
        assert done.wait(60), "the gated engine did not finish"
    finally:
        host.stop()
    return chunks


@pytest.mark.parametrize("content, error, msg", [
    ("{not json", ConfigError, "not a readable JSON file"),
    ('{"name": "tvm"}', ConfigError, "'name' is one of onnxruntime, onnxruntime_portable, tensorrt, torch_static"),
    ('{"name": "tensorrt"}', ConfigError, "needs 'engines_dir'"),
    ('{"name": "torch_static", "checkpoint": "BUNDLE", "pipeline": "yes"}', ConfigError,
     "'pipeline' must be true or false"),
    ('{"name": "torch_static", "checkpoint": "BUNDLE"}', ArtifactError, "torch_static must load that one"),
])
def test_bad_backend_choices_are_refused(repo, tmp_path, monkeypatch, content, error, msg):
    path = tmp_path / "backend.json"
    path.write_text(content.replace("BUNDLE", str(repo / BUNDLE)))
    monkeypatch.setenv("SMARTEXIT_BACKEND_CONFIG", str(path))
    from scheduler.serving.bundle import open_bundle

    with pytest.raises(error, match=msg):
        open_bundle(repo / BUNDLE)


def test_tritonserver_serves_the_torch_static_backend(repo, torch_choice):
    """The Triton model loads the bundle on the backend the file names (tritonserver's environment, as
    the Jetson's systemd unit sets it) and streams the tokens the ONNX Runtime engine decides."""
    import numpy as np
    import tritonclient.grpc as grpcclient

    from scheduler.serving.tritonserver import TritonProcess

    prompt = PROMPTS[0]
    ref = generate(repo / BUNDLE, prompt, "full")
    tp = TritonProcess(repo, env={"SMARTEXIT_BACKEND_CONFIG": str(torch_choice)}).start(timeout_s=180)
    try:
        import queue

        got: queue.Queue = queue.Queue()
        client = grpcclient.InferenceServerClient(tp.grpc_url)
        client.start_stream(callback=lambda result=None, error=None: got.put((result, error)))
        inputs = []
        for name, arr in (("input_ids", np.asarray(prompt, np.int64)), ("max_tokens", np.asarray([10], np.int32)),
                          ("mode", np.array([b"full"], np.object_))):
            t = grpcclient.InferInput(name, list(arr.shape), "BYTES" if arr.dtype == object else
                                      {"int64": "INT64", "int32": "INT32"}[arr.dtype.name])
            t.set_data_from_numpy(arr)
            inputs.append(t)
        client.async_stream_infer("smartexit", inputs, request_id="torch-static")
        tokens, layers = [], []
        while True:
            result, error = got.get(timeout=60)
            assert error is None, error
            tokens += result.as_numpy("token_ids").tolist()
            layers += result.as_numpy("exit_layers").tolist()
            if result.as_numpy("finish_reason")[0]:
                break
        client.stop_stream()
        client.close()
        log = tp.log_path.read_text(errors="replace")
    finally:
        tp.stop()
    assert "on the torch_static backend" in log, log[-2000:]
    assert list(zip(tokens, layers)) == ref


def test_a_bench_can_serve_the_bundle_under_an_edited_rule(repo):
    """bench audit's broken rule: `open_bundle(rule_edit=...)` serves the bundle's table as edited (here every
    threshold dropped and routing off), with the certificate's epsilon kept for the audit to test; without an
    edit the host serves the calibrated table."""
    from scheduler.loadtest.bench_audit import broken
    from scheduler.serving.bundle import open_bundle

    calibrated = open_bundle(repo / BUNDLE)
    edited = open_bundle(repo / BUNDLE, rule_edit=broken)
    table, loose = calibrated.engine.rule.table, edited.engine.rule.table
    assert loose.route_min_lookup == 0 and set(loose.score_thresholds) == set(table.score_thresholds)
    assert all(v == float("-inf") for v in loose.score_thresholds.values())
    assert table.score_thresholds != loose.score_thresholds
    assert edited.audit.epsilon == calibrated.audit.epsilon == table.epsilon


def test_bench_audit_serves_its_traffics_in_processes_as_it_would_in_turn(repo):
    """`bench audit`'s traffics on hosts of their own, in spawned processes side by side (audit_runs): each
    traffic's audit (tokens audited, false exits per exit, the fallback and when it fired, the per-request
    losses) is what the same traffic gives served here in turn, keyed by its name whatever order they end in."""
    from scheduler.loadtest.bench_audit import AuditJob, BenchAuditConfig, audit_runs, broken

    cfg = BenchAuditConfig(run_dir="unused", max_tokens=8, min_tokens=10)
    prompts = [list(p) for p in PROMPTS] * 2
    jobs = {"long": AuditJob(prompts * 2, "a"), "broken": AuditJob(prompts, "b", rule_edit=broken)}
    keys = ("audited", "false", "exits", "fallback", "fired_after", "unit_losses")
    apart = audit_runs(repo / BUNDLE, jobs, cfg, workers=2)
    here = audit_runs(repo / BUNDLE, jobs, cfg, workers=1)
    assert list(apart) == list(here) == ["long", "broken"]
    for name in jobs:
        assert {k: apart[name][k] for k in keys} == {k: here[name][k] for k in keys}, name
    assert here["long"]["audited"] == 8 * 8 and here["broken"]["exits"] != here["long"]["exits"]
