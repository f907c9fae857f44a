"""Exit gates: AUROC helper, training learns a learnable target, checkpoints round-trip."""
from __future__ import annotations

import numpy as np
import torch

from edge.core.artifacts import atomic_dir
from edge.model.exits import load_multi_exit, save_multi_exit
from edge.training.gates import auroc, train_gates
from tests.unit.edge.runtime.test_engine import _model


def test_auroc_matches_sklearn_with_ties():
    from sklearn.metrics import roc_auc_score

    rng = np.random.default_rng(0)
    s = rng.integers(0, 5, 300).astype(float)  # many ties
    y = rng.random(300) < 0.3 + 0.1 * s
    assert abs(auroc(s, y) - roc_auc_score(y, s)) < 1e-12
    assert auroc(s, np.ones(300, bool)) == 0.5


def test_gates_learn_a_learnable_target():
    m = _model(seed=20, gate_hidden=16)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, generator=g)

    def data(n):
        x = torch.randn(n, 64, generator=g)
        return x, (x @ w > 0.3).float()

    metrics = train_gates(m, {k: data(4000) for k in (2, 4)}, {k: data(1000) for k in (2, 4)}, epochs=8)
    assert all(v["gate_auroc"] > 0.9 for v in metrics.values()), metrics


def test_gated_checkpoint_round_trip(tmp_path):
    m = _model(seed=21, gate_hidden=8)
    with atomic_dir(tmp_path / "ck") as tmp:
        save_multi_exit(m, tmp, tokenizer=None, metrics={}, source={})
    back = load_multi_exit(tmp_path / "ck")
    e = torch.randn(5, 64)
    assert back.gated and torch.equal(back.exit_gate(2, e), m.exit_gate(2, e))
