"""The online false-exit audit stays quiet while the served rule holds its certificate and falls back
to full depth when the rule's error rises above eps.

The bundled model (LayerSkip-trained, Python code) gets the demo's exits (configs/demo.yaml: a candidate
shortlist, checks after layers 1, 2 and 4) and a threshold table certified at eps 0.009 on its
calibration split, as `make demo` does (fewer prompts). Served through the engine host that Triton's
model.py runs (the transport adds nothing to the audit), held-out code stays within the certificate and
the audit stays quiet. Then the same held-out code is served with the table's thresholds dropped (every
row checked, every check exiting at the first exit): what a domain the rule has not seen would do to its
error, made certain; the audit fires, and later ``bounded`` requests run at full depth.

Why not another domain's text, as this test once served: the earlier softmax rule's adapters were
confidently wrong on token-shuffled code (3.1% false exits, fallback after 183 audited tokens), but the
shortlist rule that ships since issue 27 exits there mostly on tokens its context lookup predicts and
made no false exit in 1,152 audited tokens of it (the fresh-clone demo's `bench audit`, 2026-12-02):
robust to that shift, it gives the audit nothing to catch.
"""
from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path

import pytest

from calibration.table import TableRule, load_table
from edge.core.data import Split, heldout_prompts, load_split
from edge.pipeline.run import open_run
from edge.pipeline.cli import main as cli
from edge.runtime.audit import AuditConfig
from edge.runtime.engine_config import EngineConfig
from edge.runtime.host import EngineHost
from edge.runtime.host_types import GenRequest, HostConfig

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def bundled_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("audit") / "run"
    root = Path(__file__).resolve().parents[2]
    assert cli(["distill", "--config", str(root / "configs" / "demo.yaml"), f"run_dir={run}", "eval_windows=4"]) == 0
    assert cli(["calibrate", "--config", str(root / "configs" / "calibrate.yaml"), f"run_dir={run}", "epsilon=0.009",
                "fit_units=256", "certify_units=640", "kv_mode=defer",
                "eval_units=16", "prompt_tokens=64", "new_tokens=32", "batch=128", "threads=2"]) == 0
    return run


def _host(run, table=None) -> EngineHost:
    """The host over ``table`` (default: the run's), auditing against its certificate's epsilon."""
    from edge.runtime.torch_backend import TorchBackend

    ckpt = open_run(run, threads=2)
    table = table or load_table(run / "calibration" / "thresholds.json", ckpt.path)
    backend = TorchBackend(ckpt.model)
    cfg = HostConfig(engine=EngineConfig(max_seqs=2, max_running=2, max_len=256, kv_mode=table.kv_mode),
                     audit=AuditConfig(fraction=1.0, min_tokens=100, max_pending=10_000))
    return EngineHost(backend, cfg, TableRule(table), epsilon=table.epsilon).start()


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


def test_audit_quiet_while_certified_and_fires_when_the_rule_errs(bundled_run):
    run = bundled_run
    ckpt = open_run(run, threads=2)
    table = load_table(run / "calibration" / "thresholds.json", ckpt.path)
    assert table.route_min_lookup > 0 and table.certificate["certified"]  # the demo's composite rule
    epsilon = table.epsilon
    tok = ckpt.tokenizer
    code = heldout_prompts(tok, load_split(Split.TEST), 24, 64, seed=0)
    # every row checked, every check exits: the first exit's agreement with the last layer is about 0.4
    loose = replace(table, score_thresholds={k: float("-inf") for k in table.score_thresholds}, route_min_lookup=0)

    host = _host(run)
    try:
        st = _serve(host, code, "code")
        assert st["audited"] >= 500 and not st["fallback"], st
    finally:
        host.stop()

    host = _host(run, loose)  # the same certificate (epsilon), a rule that breaks it
    try:
        st = _serve(host, code, "loose")
        assert st["fallback"] and st["fallback_events"] == 1, st
        assert st["lower"] > epsilon and st["rate"] > epsilon and st["epsilon"] == epsilon
        after = []
        host.submit(GenRequest("after", code[0], 16), lambda c: after.append(c))
        for _ in range(600):
            if after and after[-1].finish_reason:
                break
            threading.Event().wait(0.05)
        assert {layer for c in after for layer in c.exit_layers} == {table.exit_layers[-1]}
    finally:
        host.stop()
