"""Which K/V mode ships and whose certificate covers it (calibration/statement.py): with kv_mode=propagate, a walk
that stopped before the provisional rule is not a certificate of propagate mode (its losses were recomputed along
another rule's continuations, without the full-depth mismatches the rule's own approximate K/V cause), so the
direct test on fresh prompts decides, and a failed test ships a table that never exits."""
from __future__ import annotations

from types import SimpleNamespace

from calibration.certify import DirectTest
from calibration.risk import NEVER_EXIT
from calibration.statement import KVChoice, choose_shipped, statement
from edge.runtime.engine_config import KVMode

EPS, DELTA = 0.009, 0.05


def _walk(exact: bool, certified: bool = True) -> SimpleNamespace:
    """What choose_shipped reads of a calibration.certify.Certificate."""
    return SimpleNamespace(lam=0.974 if certified else NEVER_EXIT, certified=certified, exact=exact, n_units=1536,
                           empirical_risk=0.0063, bound=0.0090, p_value=0.04)


def test_propagate_with_an_exact_walk_ships_the_walk():
    ship = choose_shipped(KVChoice.PROPAGATE, KVMode.PROPAGATE, _walk(exact=True), None, EPS, DELTA)
    assert ship.kv_mode is KVMode.PROPAGATE and ship.certified and ship.lam == 0.974 and ship.n_units == 1536


def test_propagate_after_a_walk_that_stopped_early_ships_only_what_the_direct_test_certifies():
    # demo 65's artifacts, kv_mode=propagate (2026-12-05): the walk stopped at 0.974 (bound 0.0090) and the rule
    # erred on 2.28% of held-out tokens free-running; a direct test at that rate fails
    failed = DirectTest(n_units=640, mean=0.0228, p_value=0.9, bound=0.027, passed=False)
    ship = choose_shipped(KVChoice.PROPAGATE, KVMode.PROPAGATE, _walk(exact=False), failed, EPS, DELTA)
    assert not ship.certified and ship.lam == NEVER_EXIT and ship.kv_mode is KVMode.PROPAGATE
    assert ship.bound == 0.027 and ship.n_units == 640 and "never exits" in ship.reason
    text = statement(ship, EPS, DELTA, 64, 32, "split", 57, 0.943)
    assert text.startswith("No threshold could be certified") and "0.0228" in text
    passed = DirectTest(n_units=640, mean=0.002, p_value=0.01, bound=0.006, passed=True)
    ship = choose_shipped(KVChoice.PROPAGATE, KVMode.PROPAGATE, _walk(exact=False), passed, EPS, DELTA)
    assert ship.certified and ship.exact and ship.lam == 0.974 and ship.bound == 0.006 and ship.n_units == 640
    assert "Caveat" not in statement(ship, EPS, DELTA, 64, 32, "split", 57, 0.943)  # the test's own continuations


def test_auto_ships_defer_unless_propagate_passes_after_an_exact_walk():
    failed = DirectTest(n_units=640, mean=0.0228, p_value=0.9, bound=0.027, passed=False)
    ship = choose_shipped(KVChoice.AUTO, KVMode.DEFER, _walk(exact=True), failed, EPS, DELTA)
    assert ship.kv_mode is KVMode.DEFER and ship.certified and ship.lam == 0.974 and "defer ships" in ship.reason
    passed = DirectTest(n_units=640, mean=0.002, p_value=0.01, bound=0.006, passed=True)
    ship = choose_shipped(KVChoice.AUTO, KVMode.DEFER, _walk(exact=True), passed, EPS, DELTA)
    assert ship.kv_mode is KVMode.PROPAGATE
    assert choose_shipped(KVChoice.AUTO, KVMode.DEFER, _walk(exact=False), passed, EPS, DELTA).kv_mode is KVMode.DEFER
