"""The reference generator asks the engine's own exit rules (one implementation of each rule), and
calibration's rule code imports no torch."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from calibration.calibrators import Calibrator, CalibratorKind
from calibration.signals import GATED_SIGNAL_NAMES, SIGNAL_NAMES
from calibration.table import TableRule, ThresholdTable
from edge.model.reference import reference_generate
from edge.runtime.engine import Engine
from edge.runtime.engine_config import EngineConfig, KVMode
from edge.runtime.request import Request
from edge.runtime.rules import ConfidenceRule
from edge.runtime.torch_backend import TorchBackend
from tests.unit.edge.runtime.test_engine import _model, _prompts


def _engine(m, rule, prompt, n=12):
    eng = Engine(TorchBackend(m), EngineConfig(max_seqs=1, max_len=128, kv_mode=KVMode.PROPAGATE), rule)
    got = []
    eng.submit(Request(prompt, n, on_token=lambda ev: got.append((ev.token, ev.exit_layer))))
    while eng.has_work:
        eng.step()
    return got


def _table_rule(m, gated: bool) -> TableRule:
    """A threshold table of random Platt calibrators that lets some tokens exit."""
    rng = np.random.default_rng(5)
    names = GATED_SIGNAL_NAMES if gated else SIGNAL_NAMES
    decision = m.exit_layers[:-1]
    cals = {k: Calibrator(CalibratorKind.PLATT).fit(rng.random((300, len(names))), (rng.random(300) < 0.5).astype(int))
            for k in decision}
    for c in cals.values():  # lean on the first signal (top-1 / gate probability) so decisions vary
        c.coef = np.array([4.0] + [0.3] * (len(names) - 1))
    thr = {k: 0.0 for k in decision}
    return TableRule(ThresholdTable("x", m.exit_layers, "platt", 0.5, thr, cals, signal_names=names))


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("kind", ["confidence", "table"])
def test_reference_generator_decides_as_the_engine_with_the_same_rule(kind, gated):
    m = _model(gate_hidden=8 if gated else 0)
    rule = ConfidenceRule(0.3 if not gated else 0.64) if kind == "confidence" else _table_rule(m, gated)
    layers = []
    for p in _prompts(2):
        ref = reference_generate(m, p, 12, rule=rule)
        got = _engine(m, rule, p)
        assert [t for t, _ in got] == ref.tokens
        assert [e for _, e in got] == ref.exit_layers
        layers += ref.exit_layers[1:]
    assert len(set(layers)) > 1, "the rule should let some tokens exit and keep others"


def test_calibration_rules_and_math_import_no_torch():
    code = ("import sys\n"
            "import calibration.table, calibration.certify, calibration.compare, calibration.evaluate\n"
            "import calibration.cascade, calibration.risk, calibration.signals, calibration.calibrators\n"
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:3]\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
