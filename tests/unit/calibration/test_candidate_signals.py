"""Calibration of a candidate-shortlist model: the signals teacher-forced collection records are the ones
the engine's checks compute, the MLP calibrator's score is what the graphs compute, and a threshold
table of it drives the engine (exits where its calibrated probability reaches lambda)."""
from __future__ import annotations

import numpy as np
import pytest

from calibration.calibrators import Calibrator, CalibratorKind
from calibration.collect import collect_engine, collect_units
from calibration.signals import exit_targets
from calibration.table import TableRule, ThresholdTable
from edge.runtime.backend import make_backend
from edge.model.candidates import CANDIDATE_SIGNAL_NAMES, NUM_NAMED, num_features, signal_names
from edge.runtime.engine import Engine
from edge.runtime.engine_config import EngineConfig
from edge.runtime.request import Request
from edge.model.lookup import Lookup
from edge.runtime.torch_backend import TorchBackend
from tests.tolerance import f32_rtol
from tests.unit.edge.runtime.test_candidates import _model
from tests.unit.edge.runtime.test_engine import CFG, _run
from tests.unit.edge.runtime.test_ort_backend import _export


def _seqs(n: int, length: int, seed: int) -> np.ndarray:
    """Rows with repeats, so that the context lookup matches."""
    rng = np.random.default_rng(seed)
    half = rng.integers(0, CFG.vocab_size, (n, length // 2))
    return np.concatenate([half, half[:, :length - length // 2]], axis=1)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    return _export(tmp_path_factory.mktemp("candsig"), _model(seed=3))


def test_teacher_forced_signals_are_the_engines(exported):
    """collect_units (torch, host reference) and collect_engine (the fused graphs' checks, one decode step
    per token) give the same candidate tokens at every exit and the same features within float32 rounding."""
    m, ckpt, graphs = exported
    seqs = _seqs(3, 24, seed=1)
    tf = collect_units(m, seqs, first=8)
    eng = collect_engine(make_backend("onnxruntime", graphs_dir=graphs, checkpoint=ckpt, threads=1), seqs, first=8)
    assert tf.n == eng.n == 3 * 15
    for k in m.exit_layers:
        assert np.array_equal(tf.argmax[k], eng.argmax[k]), f"exit {k}"
    for k in m.exit_layers[:-1]:
        assert tf.signals[k].shape == (tf.n, num_features(CFG.hidden_size))
        assert set(tf.argmax[k]) <= set(m.shortlist.tolist())
        # the top logit's scale: layers of dot products of length hidden
        tol = f32_rtol(CFG.hidden_size, CFG.num_layers) * max(1.0, float(np.abs(tf.signals[k]).max()))
        np.testing.assert_allclose(eng.signals[k], tf.signals[k], atol=tol, err_msg=f"exit {k}")
    assert tf.signals[1][:, CANDIDATE_SIGNAL_NAMES.index("lookup_len")].max() > 0, "the repeats must match"


def test_generated_continuations_read_their_lookup_as_the_engine_does(exported):
    """generate_engine (calibration's fit units in one pass) keeps the context lookup step by step as it
    generates; the features it records are the ones collect_engine reads from the finished rows (the lookup
    over the whole row, lookup_along), and its tokens are the full-depth engine's."""
    from calibration.collect import generate_engine
    from calibration.freerun import Served, free_run
    from edge.runtime.engine_config import KVMode
    from edge.runtime.rules import NeverExit

    m, ckpt, graphs = exported
    backend = make_backend("onnxruntime", graphs_dir=graphs, checkpoint=ckpt, threads=1)
    prompts = _seqs(3, 16, seed=7)  # repeats in the prompt: the lookup matches from the first step
    seqs, gen = generate_engine(backend, prompts, 9, batch=2)
    assert seqs[:, :16].tolist() == prompts.tolist()
    engine = free_run(Served(backend), prompts, 9, NeverExit(), KVMode.DEFER, batch=2)
    assert seqs.tolist() == engine.seqs.tolist()
    read = collect_engine(backend, seqs, first=16)
    for k in m.exit_layers:
        assert np.array_equal(gen.argmax[k], read.argmax[k]), f"exit {k}"
    for k in m.exit_layers[:-1]:
        tol = f32_rtol(CFG.hidden_size, CFG.num_layers) * max(1.0, float(np.abs(read.signals[k]).max()))
        np.testing.assert_allclose(gen.signals[k], read.signals[k], atol=tol, err_msg=f"exit {k}")
    lk = CANDIDATE_SIGNAL_NAMES.index("lookup_len")
    assert gen.signals[m.exit_layers[0]][:, lk].max() > 0, "the prompts' repeats must match"
    np.testing.assert_array_equal(gen.signals[m.exit_layers[0]][:, lk], read.signals[m.exit_layers[0]][:, lk])


def test_mlp_calibrator_score_form_and_round_trip():
    rng = np.random.default_rng(0)
    X = rng.standard_normal((3000, NUM_NAMED)) * np.arange(1, NUM_NAMED + 1)
    y = ((X[:, 0] > 0) != (X[:, 3] > 0)).astype(int)  # an interaction (xor) a linear score cannot rank
    mlp = Calibrator(kind=CalibratorKind.MLP).fit(X, y)
    iso = Calibrator(kind=CalibratorKind.ISOTONIC).fit(X, y)
    form = mlp.score_form()
    np.testing.assert_allclose(form(X.astype(np.float32)), mlp.score(X), rtol=1e-4, atol=1e-4)
    back = Calibrator.from_dict(mlp.to_dict())
    np.testing.assert_array_equal(back.predict(X), mlp.predict(X))
    from sklearn.metrics import roc_auc_score
    assert roc_auc_score(y, mlp.predict(X)) > 0.9 > 0.6 > roc_auc_score(y, iso.predict(X))


def test_mlp_table_drives_the_engine():
    """A table of MLP calibrators: the engine exits where the calibrated probability of the check's features
    reaches lambda (its graphs and the table agree), and lambda 1.01 exits nothing."""
    m = _model(seed=4)
    seqs = _seqs(40, 32, seed=2)
    data = collect_units(m, seqs, first=12)
    targets = exit_targets(data.argmax)
    cals = {k: Calibrator(kind=CalibratorKind.MLP).fit(data.signals[k], targets[k]) for k in m.exit_layers[:-1]}
    prompts = [s[:16].tolist() for s in _seqs(4, 32, seed=5)]
    first = m.exit_layers[0]
    low = float(np.quantile(cals[first].predict(data.signals[first]), 0.7))  # about 30% of tokens reach it there
    for lam, some in ((low, True), (1.01, False)):
        table = ThresholdTable("x", m.exit_layers, "mlp", lam, {k: c.score_threshold(lam) for k, c in cals.items()},
                               cals, signal_names=signal_names(CFG.hidden_size))
        rule = TableRule(table)
        out = _run(Engine(TorchBackend(m), EngineConfig(max_seqs=4, max_running=4, max_len=64), rule), prompts, 10)
        early = sum(e < m.num_layers for seq in out for _, e in seq)
        assert (early > 0) == some, (lam, early)
    with pytest.raises(Exception, match="not a linear score"):
        rule.linear(m.exit_layers[0], num_features(CFG.hidden_size))


def test_a_request_in_mode_full_keeps_no_lookup_and_changes_nothing_beside_checked_rows():
    """A mode-full row never checks or drafts, so the engine keeps no context lookup for it (pushing every token
    into one cost mode full on the exits graphs 2% at batch 8); in a batch with checked rows, its tokens and theirs
    are what they are when it does keep one."""
    m = _model(seed=4)
    data = collect_units(m, _seqs(40, 32, seed=2), first=12)
    targets = exit_targets(data.argmax)
    cals = {k: Calibrator(kind=CalibratorKind.MLP).fit(data.signals[k], targets[k]) for k in m.exit_layers[:-1]}
    lam = float(np.quantile(cals[m.exit_layers[0]].predict(data.signals[m.exit_layers[0]]), 0.7))
    rule = TableRule(ThresholdTable("x", m.exit_layers, "mlp", lam, {k: c.score_threshold(lam) for k, c in cals.items()},
                                    cals, signal_names=signal_names(CFG.hidden_size)))
    prompts = [s[:16].tolist() for s in _seqs(3, 32, seed=5)]

    def run(force_lookup: bool) -> tuple[int, dict[int, list]]:
        eng = Engine(TorchBackend(m), EngineConfig(max_seqs=3, max_running=3, max_len=64), rule)
        ids = [eng.submit(Request(prompts[0], 10, mode="full"))] + [eng.submit(Request(p, 10)) for p in prompts[1:]]
        got: dict[int, list] = {}
        first = True
        while eng.has_work:
            events = eng.step()
            if first:  # the prompts prefilled: the full row keeps no lookup, the checked rows do
                full_row = next(s for s in eng.decoding if s.id == ids[0])
                assert full_row.lookup is None
                assert all(s.lookup is not None for s in eng.decoding if s.id != ids[0])
                if force_lookup:  # what the engine kept before: the full row's index over its prompt and token
                    full_row.lookup = Lookup(full_row.req.prompt + full_row.tokens)
                first = False
            for ev in events:
                got.setdefault(ev.request_id, []).append((ev.token, ev.exit_layer))
        return ids[0], got

    (full_id, without), (_, with_lookup) = run(False), run(True)
    assert without == with_lookup
    assert all(e == m.num_layers for _, e in without[full_id])
    assert any(e < m.num_layers for rid, seq in without.items() if rid != full_id for _, e in seq), "checked rows exit"


def test_routing_checks_only_rows_with_a_lookup_match():
    """route_min_lookup: a row whose context lookup matched fewer tokens runs every layer, no check (the engine),
    and calibration's cascades never let such a token leave either."""
    from calibration import certify as cert

    m = _model(seed=4)
    seqs = _seqs(40, 32, seed=2)
    data = collect_units(m, seqs, first=12)
    targets = exit_targets(data.argmax)
    cals = {k: Calibrator(kind=CalibratorKind.ISOTONIC).fit(data.signals[k], targets[k]) for k in m.exit_layers[:-1]}
    col = CANDIDATE_SIGNAL_NAMES.index("lookup_len")
    probs = cert.calibrated(cals, data, route=0.5)  # matches of at least 2 of 4 tokens
    for k, p in probs.items():
        short = data.signals[k][:, col] < 0.5
        assert short.any() and (~short).any()
        assert np.all(p[short] == -1.0) and np.all(p[~short] >= 0.0)
    table = ThresholdTable("x", m.exit_layers, "isotonic", 0.0, {k: -np.inf for k in cals}, cals,
                           signal_names=signal_names(CFG.hidden_size), route_min_lookup=2)
    back = ThresholdTable.from_dict(table.to_dict())
    assert back.route_min_lookup == 2
    rule = TableRule(back)  # lambda 0: every checked row leaves at the first exit
    rng = np.random.default_rng(9)
    fresh = [rng.integers(0, CFG.vocab_size, 12).tolist() for _ in range(3)]  # no repeats: no lookup match
    out = _run(Engine(TorchBackend(m), EngineConfig(max_seqs=3, max_running=3, max_len=64), rule), fresh, 3)
    assert all(e == m.num_layers for seq in out for _, e in seq[:2]), "rows without a match are never checked"
    eng = Engine(TorchBackend(m), EngineConfig(max_seqs=3, max_running=3, max_len=64), rule)
    for p in fresh:
        eng.submit(Request(p, 4))
    eng.step()  # the prompts prefilled, first tokens out
    for seq in eng.decoding:  # give every sequence a context that repeats itself: its lookup matches 4 tokens
        seq.lookup = Lookup(seq.req.prompt + seq.tokens + seq.req.prompt + seq.tokens)
    layers = [ev.exit_layer for ev in eng.step()]
    assert layers == [m.exit_layers[0]] * 3, "rows with a match are checked (and at lambda 0 leave at once)"


def test_the_lookup_falls_back_to_the_corpus_table_and_everything_reads_the_same(exported, tmp_path):
    """Where the context matched fewer than CORPUS_BELOW tokens, the lookup feature is the corpus table's
    prediction from a match of CORPUS_MIN tokens or more (its match length the feature's); calibration's readings (generated and teacher-forced) record
    it alike, and an engine under a rule calibrated with a table reads exactly that table: none, or another,
    is a clear error."""
    from calibration.collect import generate_engine
    from edge.core.errors import ConfigError
    from edge.model.lookup import CORPUS_BELOW, CORPUS_MIN
    from edge.model.ngram import NgramTable, build_table, save_table

    m, ckpt, graphs = exported
    backend = make_backend("onnxruntime", graphs_dir=graphs, checkpoint=ckpt, threads=1)
    corpus = [s for s in np.random.default_rng(11).integers(0, CFG.vocab_size, (64, 40))]
    prompts = np.stack([row[:16] for row in corpus[:3]])
    seqs, _ = generate_engine(backend, prompts, 9, batch=2)  # the table knows the model's continuations too
    save_table(tmp_path / "ngram.npz", build_table(corpus + list(seqs), CFG.vocab_size, min_count=1))
    table = NgramTable.load(tmp_path / "ngram.npz")
    row = corpus[0]
    assert Lookup(row[:6].tolist()).predict()[1] < CORPUS_BELOW  # no repeat in the context ...
    assert Lookup(row[:6].tolist(), table).predict() == (int(row[6]), 4)  # ... the table's successor there
    short = next([x, int(row[0]), int(row[1])] for x in range(CFG.vocab_size)
                 if table.draft([x, int(row[0]), int(row[1])], 1)[1] == 2)  # the table knows 2 of these tokens only
    assert CORPUS_MIN > 2 and Lookup(short, table).predict() == Lookup(short).predict()  # too short: unused
    rep = [5, 6, 7, 8, 5, 6, 7]  # a repeat of 3: the context's own
    assert Lookup(rep, table).predict() == Lookup(rep).predict() == (8, 3)

    again, gen = generate_engine(backend, prompts, 9, batch=2, table=table)
    assert again.tolist() == seqs.tolist()
    read = collect_engine(backend, seqs, first=16, table=table)
    alone = collect_engine(backend, seqs, first=16)
    lk = CANDIDATE_SIGNAL_NAMES.index("lookup_len")
    first = m.exit_layers[0]
    np.testing.assert_array_equal(gen.signals[first][:, lk], read.signals[first][:, lk])
    assert (read.signals[first][:, lk] > alone.signals[first][:, lk]).any()
    for k in m.exit_layers:
        assert np.array_equal(read.argmax[k], alone.argmax[k])  # the feature changes, never the tokens

    data = collect_units(m, _seqs(40, 32, seed=2), first=12)
    targets = exit_targets(data.argmax)
    cals = {k: Calibrator(kind=CalibratorKind.MLP).fit(data.signals[k], targets[k]) for k in m.exit_layers[:-1]}
    rule = TableRule(ThresholdTable("x", m.exit_layers, "mlp", 0.9, {k: c.score_threshold(0.9) for k, c in cals.items()},
                                    cals, signal_names=signal_names(CFG.hidden_size), lookup_table_sha256=table.sha256))
    assert TableRule(ThresholdTable.from_dict(rule.table.to_dict())).lookup_table_sha256 == table.sha256
    cfg = EngineConfig(max_seqs=2, max_running=2, max_len=64)
    backend.ngram_table = table
    assert Engine(backend, cfg, rule)._lookup_table is table
    for other in (None, NgramTable(build_table(corpus[:2], CFG.vocab_size, min_count=1))):
        backend.ngram_table = other
        with pytest.raises(ConfigError, match="calibrated with the corpus n-gram table"):
            Engine(backend, cfg, rule)
