"""The online false-exit audit catches traffic from another domain than the calibration text.

The bundled model (LayerSkip-trained, Python code) gets the demo's exit heads (configs/demo.yaml)
and a threshold table certified at eps 0.009 on its calibration split, as `make demo` does (fewer
prompts). Served through the engine host that Triton's model.py runs (the transport adds nothing to
the audit), held-out code stays within the certificate and the audit stays quiet; the same code with
its tokens shuffled, a word salad the demo's adapters are confidently wrong on at the first exit,
fires the fallback, and later ``bounded`` requests run at full depth.

Measured while choosing this test (2-core x86): the demo run's table: held-out code 0.43% false
exits, word salad 3.1% (13% at exit 3), fallback after 183 audited tokens (`smartexit bench audit`).
Heads distilled for 4 or 40 steps, or no adapters, with smaller calibrations (eps 0.02-0.05) do NOT
separate the two (0.3-2% on both): the calibrated rule is robust to this shift unless its adapters
are the demo's, which is why this test trains them in full (about 5 minutes).
"""
from __future__ import annotations

import threading
from pathlib import Path

import pytest

from calibration.table import TableRule, load_table
from edge.core.data import Split, heldout_prompts, load_split
from edge.pipeline.run_checkpoint import open_run
from edge.pipeline.cli import main as cli
from edge.runtime.audit import AuditConfig
from edge.runtime.engine import EngineConfig
from edge.runtime.host import EngineHost, GenRequest, HostConfig
from scheduler.bench_audit import word_salad

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def bundled_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("audit") / "run"
    root = Path(__file__).resolve().parents[2]
    assert cli(["distill", "--config", str(root / "configs" / "demo.yaml"), f"run_dir={run}", "eval_windows=4"]) == 0
    assert cli(["calibrate", f"run_dir={run}", "epsilon=0.009", "fit_units=256", "certify_units=640", "kv_mode=defer",
                "eval_units=16", "prompt_tokens=64", "new_tokens=32", "batch=128", "threads=2"]) == 0
    return run


def _host(run, eps: float) -> EngineHost:
    from edge.runtime.torch_backend import TorchBackend

    ckpt = open_run(run, threads=2)
    table = load_table(run / "calibration" / "thresholds.json", ckpt.path)
    backend = TorchBackend(ckpt.model)
    cfg = HostConfig(engine=EngineConfig(max_seqs=2, max_running=2, max_len=256, kv_mode=table.kv_mode),
                     audit=AuditConfig(fraction=1.0, eps=eps, min_tokens=100, max_pending=10_000))
    return EngineHost(backend, cfg, TableRule(table), eps=eps).start()


def _serve(host: EngineHost, prompts: list[list[int]], tag: str) -> dict:
    for i, p in enumerate(prompts):  # one at a time: the deferred-K/V table exits at batch 1
        done = threading.Event()
        host.submit(GenRequest(f"{tag}{i}", p, 48), lambda c, done=done: c.finish_reason and done.set())
        assert done.wait(120)
    for _ in range(600):  # the audits run in the spare capacity after the requests
        st = host.stats()["audit"]
        if st["pending"] == 0 and not host.engine.has_work:
            return st
        threading.Event().wait(0.1)
    raise AssertionError("audits did not drain")


def test_audit_quiet_in_domain_and_fires_on_another_domain(bundled_run):
    run = bundled_run
    ckpt = open_run(run, threads=2)
    table = load_table(run / "calibration" / "thresholds.json", ckpt.path)
    eps = table.certificate["epsilon"]
    tok = ckpt.tokenizer
    code = heldout_prompts(tok, load_split(Split.TEST), 24, 64, seed=0)
    salad = word_salad(code, seed=0)

    host = _host(run, eps)
    try:
        st = _serve(host, code, "code")
        assert st["audited"] >= 500 and not st["fallback"], st
    finally:
        host.stop()

    host = _host(run, eps)
    try:
        st = _serve(host, salad, "salad")
        assert st["fallback"] and st["fallback_events"] == 1, st
        assert st["lower"] > eps and st["rate"] > eps
        after = []
        host.submit(GenRequest("after", code[0], 16), lambda c: after.append(c))
        for _ in range(600):
            if after and after[-1].finish_reason:
                break
            threading.Event().wait(0.05)
        assert {layer for c in after for layer in c.exit_layers} == {table.exit_layers[-1]}
    finally:
        host.stop()
