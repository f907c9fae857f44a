"""``smartexit calibrate``: a threshold table whose false-exit bound holds for the regime that ships.

1. Draw prompts i.i.d. from the calibration corpus (the shipped calibration
   split, or the calibration part of ``--calib-data DIR``): fit units,
   certify units and propagate-test units, independent draws.
2. Fit units: the engine continues them at full depth; calibrators (Platt,
   isotonic; max-probability as the CALM-like baseline) are fitted on those
   tokens, and a provisional threshold is chosen by cross-fitting.
3. Certify units: the engine continues them with the provisional rule in the
   K/V mode to certify (``defer`` unless ``kv_mode=propagate``); every
   generated token is checked against the full model on the same prefix;
   Learn-then-Test over the mean per-prompt false-exit rate
   (:mod:`calibration.certify`). With ``kv_mode=auto``, the chosen rule is then
   run in ``propagate`` mode on fresh units and shipped that way only if that
   direct test certifies it too. With ``kv_mode=propagate``, a walk that stopped
   before the provisional rule certified a stricter rule on the provisional
   rule's continuations, whose recomputed losses leave out the full-depth
   mismatches the stricter rule's own approximate K/V cause (2.3% free-running
   held out against a bound of 0.90%, 2026-12-05): that rule ships only if the
   same direct test on fresh units certifies it, and otherwise nothing does.
4. Evaluate on the evaluation corpus (the test split, the held-out part of
   ``--calib-data``, or ``--eval-data DIR``), which calibration never saw:
   teacher-forced on natural text, and free-running in both K/V modes.
5. Compare (a) a max-probability threshold tuned without a certificate, (b)
   max-probability + LTT (CALM-like), (c) Platt and (d) isotonic on all signals.

Every engine run and every check runs on the engine that will be served
(``backend``): a compressed model on the ONNX Runtime graphs ``smartexit
export`` wrote, each generated token judged against those graphs at full depth
(:class:`calibration.freerun.Served`); a float model on the torch reference,
which its graphs match within float rounding.

Everything is computed before anything is written; outputs go to
``<run_dir>/calibration/`` atomically and into the manifest.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from calibration import certify as cert
from calibration.calibrators import Calibrator, CalibratorKind
from calibration.compare import baselines
from calibration.evaluate import evaluate_cascade
from calibration.metrics import reliability_curve
from calibration.mlp_score import fit_pool
from calibration.pvalues import PValue, exceeds_pvalue
from calibration.risk import default_grid
from calibration.signals import GATED_SIGNAL_NAMES, SIGNAL_NAMES, exit_targets
from edge.model.candidates import lookup_feature, signal_names as candidate_signal_names
from calibration.table import ThresholdTable, TableRule
from calibration.units import corpora, seeds
from edge.core.artifacts import sha256_path
from edge.core.errors import ConfigError
from calibration.freerun import FreeRun, free_run, free_run_until, full_depth_run
from edge.pipeline.calibrate_config import CalibrateConfig, check_sizes
from edge.pipeline.calibrate_engine import corpus_table, served_engine
from edge.pipeline.calibrate_publish import certificate_of, metrics_of, publish_results
from edge.pipeline.calibrate_reference import base_model_accuracy, float_model_accuracy, reference_metrics
from edge.pipeline.run import open_run
from calibration.statement import KVChoice, choose_shipped, statement
from edge.runtime.engine_config import KVMode


def _log(t0: float, msg: str) -> None:
    print(f"[calibrate {time.time() - t0:6.1f}s wall, {time.process_time():6.1f}s cpu] {msg}", flush=True)


def _table(ckpt: Path, model, kind: CalibratorKind, lam: float, cals: dict[int, Calibrator], kv_mode: KVMode,
           certificate: dict[str, Any] | None = None, route: int = 0, lookup: Any = None) -> ThresholdTable:
    """``lookup``: the corpus table the context lookup falls back to (:attr:`Served.lookup_table`), or None."""
    return ThresholdTable(checkpoint_sha256=sha256_path(ckpt), exit_layers=model.exit_layers,
                          calibrator_kind=kind.value, lam=lam,
                          score_thresholds={k: c.score_threshold(lam) for k, c in cals.items()},
                          calibrators=cals, certificate=certificate or {}, kv_mode=kv_mode.value,
                          signal_names=signal_names(model), route_min_lookup=route if model.has_shortlist else 0,
                          lookup_table_sha256=lookup.sha256 if lookup is not None and model.has_shortlist else None)


def signal_names(model) -> tuple[str, ...]:
    """The signals the model's decision exits give: softmax, gate or candidate-check ones."""
    if model.has_shortlist:
        return candidate_signal_names(model.backbone.cfg.hidden_size)
    return GATED_SIGNAL_NAMES if model.gated else SIGNAL_NAMES


def propagate_test(cfg: CalibrateConfig, served: Any, data: Any, s: dict[str, Any], ckpt: Path, model: Any, cals: Any,
                   c: Any, anytime: bool) -> Any:
    """The chosen rule in propagate mode on fresh units. With ``kv_mode=auto``: one more hypothesis of the same
    fixed sequence, tested only if the walk reached the provisional rule (else the sequence stopped). With
    ``kv_mode=propagate``: when the walk stopped before the provisional rule (its certificate is not about the
    rule's own continuations, and in propagate mode those differ in more than the exits: the later tokens read
    the exited ones' approximate K/V), the certified rule's one test, on units independent of those that chose
    it. None when not tested."""
    length, P = cfg.prompt_tokens + cfg.new_tokens, cfg.prompt_tokens
    if not c.certified or cfg.kv_mode is KVChoice.DEFER or (cfg.kv_mode is KVChoice.PROPAGATE and c.exact):
        return None
    prop_rule = TableRule(_table(ckpt, model, cfg.calibrator, c.lam, cals, KVMode.PROPAGATE,
                                 route=cfg.route_min_lookup, lookup=served.lookup_table))

    def decided(r: FreeRun) -> bool:
        x = r.unit_losses()
        return anytime and (cert.direct_test(x, cfg.epsilon, cfg.delta, cfg.pvalue, None).passed
                            or exceeds_pvalue(x, cfg.epsilon, cfg.pvalue, None) <= cfg.delta)

    prop_w = data.calibration.draw(cfg.propagate_units, length, s["propagate"])
    prop_run, _ = free_run_until(served, prop_w.ids[:, :P], cfg.new_tokens, prop_rule, KVMode.PROPAGATE,
                                 cfg.batch, decided, desc="propagate-test units")
    return cert.direct_test(prop_run.unit_losses(), cfg.epsilon, cfg.delta, cfg.pvalue,
                            None if anytime else s["order"])


def main(cfg: CalibrateConfig) -> int:
    t0 = time.time()
    run = open_run(cfg.run_dir, cfg.threads)
    manifest, ckpt, model, tok = run.manifest, run.path, run.model, run.tokenizer
    route = float(lookup_feature(np.array(cfg.route_min_lookup))) if model.has_shortlist else 0.0
    if cfg.calibrator is CalibratorKind.MLP and not model.has_shortlist:
        raise ConfigError("calibrate.calibrator=mlp needs a model with a candidate shortlist (exits.shortlist > 0): "
                          "only its graphs compute a non-linear score; use platt or isotonic")
    served = served_engine(cfg.backend, manifest, ckpt, model, cfg.threads)
    served.lookup_table = corpus_table(cfg, manifest, model)
    if served.lookup_table is not None:  # the engine's lookup reads the rule's table from its backend (torch too)
        served.backend.ngram_table = served.lookup_table
    _log(t0, f"engine: {served.backend.name}; tokens judged against {served.reference_name}"
             + ("; the context lookup falls back to the export's corpus table" if served.lookup_table else ""))
    data = corpora(tok, cfg.calib_data, cfg.eval_data, cfg.heldout_percent)
    n_min = check_sizes(cfg, data)
    length = cfg.prompt_tokens + cfg.new_tokens
    s = seeds(cfg.seed)
    lams = default_grid()
    mode = KVMode.PROPAGATE if cfg.kv_mode is KVChoice.PROPAGATE else KVMode.DEFER
    P = cfg.prompt_tokens

    # 1-2. fit units: full-depth continuations, calibrators, provisional threshold
    fit_w = data.calibration.draw(cfg.fit_units, length, s["fit"])
    with fit_pool(fit_workers(cfg, model)) as pool:
        fit_run = full_depth_run(served, fit_w.ids[:, :P], cfg.new_tokens, cfg.batch, desc="fit units, full depth")
        fit = fit_run.data
        cals = cert.fit(fit, cfg.calibrator, route, pool)
        lam_p = cert.provisional_lambda(fit, cfg.calibrator, lams, cfg.epsilon, cfg.delta, cfg.pvalue,
                                        cfg.certify_units, s["crossfit"], route, pool)
    _log(t0, f"fit: {fit.n_units} prompts, {fit.n} tokens; provisional lambda {lam_p:.3f}")

    # 3. certify units: the engine with the provisional rule in the mode to certify. With the betting
    # p-value (anytime-valid) the draw stops as soon as the whole walk has passed.
    anytime = cfg.pvalue is PValue.BETTING
    prov_rule = TableRule(_table(ckpt, model, cfg.calibrator, lam_p, cals, mode, route=cfg.route_min_lookup,
                                 lookup=served.lookup_table))

    def walk_done(r: FreeRun) -> bool:
        if not anytime or r.data.n_units < n_min:
            return False
        return cert.certify(cert.calibrated(cals, r.data, route), r.data, lams, cfg.epsilon, cfg.delta, cfg.pvalue, None,
                            lam_p, observed=r.unit_losses()).exact

    cert_w = data.calibration.draw(cfg.certify_units, length, s["certify"])
    cert_run, _ = free_run_until(served, cert_w.ids[:, :P], cfg.new_tokens, prov_rule, mode, cfg.batch, walk_done,
                                 desc=f"certify units, {mode.value}")
    probs = cert.calibrated(cals, cert_run.data, route)
    c = cert.certify(probs, cert_run.data, lams, cfg.epsilon, cfg.delta, cfg.pvalue, None if anytime else s["order"],
                     lam_p, observed=cert_run.unit_losses())
    c.agreement = _agreement(cert_run, probs, lam_p)
    _log(t0, f"certify: {c.n_units} prompts ({mode.value}), lambda {c.lam:.3f}, mean {c.empirical_risk:.4f}, "
             f"bound {c.bound:.4f}, exact {c.exact}")

    # with kv_mode=auto, the chosen rule in propagate mode on fresh units: one more hypothesis of the same
    # fixed sequence, shipped only if the walk reached the provisional rule (else the sequence stopped)
    prop = propagate_test(cfg, served, data, s, ckpt, model, cals, c, anytime)
    ship = choose_shipped(cfg.kv_mode, mode, c, prop, cfg.epsilon, cfg.delta)
    shipped = ship.kv_mode
    if prop is not None:
        _log(t0, f"propagate test: {prop.n_units} prompts, mean {prop.mean:.4f}, bound {prop.bound:.4f}; "
                 f"ships {shipped.value}" + ("" if ship.certified else ", certified nothing: the table never exits"))

    # 4. evaluation units: natural text teacher-forced, and free-running in both modes
    ev_w = data.evaluation.draw(cfg.eval_units, length, s["eval"])
    test = served.reference(ev_w.ids, P)
    rule = TableRule(_table(ckpt, model, cfg.calibrator, ship.lam, cals, shipped, route=cfg.route_min_lookup,
                            lookup=served.lookup_table))
    modes = list(KVMode) if cfg.eval_both_kv_modes else [shipped]
    runs = {m: free_run(served, ev_w.ids[:, :P], cfg.new_tokens, rule, m, cfg.batch, desc=f"evaluation units, {m.value}")
            for m in modes}
    fr = runs[shipped].summary()
    _log(t0, f"evaluation: {test.n_units} prompts, free-running {fr.false_exit_rate:.4f} ({shipped.value})")

    # 5. comparison
    systems = baselines(fit, cert_run.data, test, lams, cfg.epsilon, cfg.delta, cfg.pvalue,
                        None if anytime else s["order"], gated=model.gated, candidates=model.has_shortlist, route=route,
                        fitted={cfg.calibrator: cals})
    chosen = next(x for x in systems if x.name.startswith(
        {CalibratorKind.ISOTONIC: "(d)", CalibratorKind.MLP: "(e)"}.get(cfg.calibrator, "(c)")))
    tf = evaluate_cascade(test, cert.calibrated(cals, test, route), ship.lam)
    n_ref = min(cfg.reference_units or test.n_units, test.n_units)
    base = base_model_accuracy(ckpt, ev_w.ids[:n_ref], P)
    flt = float_model_accuracy(manifest, ckpt, ev_w.ids[:n_ref], P)
    tf_ref = tf
    if n_ref < test.n_units:  # the rule on the prompts the reference models were read on (unit u is ev_w's row u)
        sub = test.select_units(np.arange(n_ref))
        tf_ref = evaluate_cascade(sub, cert.calibrated(cals, sub, route), ship.lam)

    docs = int(data.calibration.eligible(length).size)
    text = statement(ship, cfg.epsilon, cfg.delta, cfg.prompt_tokens, cfg.new_tokens, data.calibration_name, docs,
                     c.lam_provisional)
    certificate = certificate_of(cfg, ship, c, prop, served, data, text, docs, n_min)
    table = _table(ckpt, model, cfg.calibrator, ship.lam, cals, shipped, certificate, cfg.route_min_lookup,
                   served.lookup_table)
    tc = exit_targets(test.argmax)
    tp = cert.calibrated(cals, test)  # the calibrators' quality on every token (routing aside)
    curves = {f"exit {k}": reliability_curve(tp[k], tc[k]) for k in cals}
    metrics = metrics_of(cfg, ship, c, prop, served, data, text, docs, n_min, fit, test, tf, fr, runs, shipped,
                         base, flt, chosen, systems) | reference_metrics(base, flt, tf_ref.accuracy_exit, n_ref)
    publish_results(cfg, manifest, ckpt, served, table, curves, systems, metrics, t0)
    return 0


def fit_workers(cfg: CalibrateConfig, model: Any) -> int:
    """Processes for the mlp calibrator's networks (:func:`calibration.mlp_score.fit_pool`): ``cfg.fit_workers``, or
    with 0 one per core up to the largest round of fits (cross-fitting's two folds of every decision exit: no more
    can run at once); 1 (none) for the other kinds, which fit in process."""
    if cfg.calibrator is not CalibratorKind.MLP:
        return 1
    return cfg.fit_workers or min(os.cpu_count() or 1, 2 * (len(model.exit_layers) - 1))


def _agreement(run: FreeRun, probs: dict[int, np.ndarray], lam: float) -> float:
    """Fraction of judged tokens whose exit layer in the engine equals the teacher-forced cascade's at
    ``lam``: 1 up to float rounding in defer mode (exact K/V), lower in propagate mode."""
    from calibration.cascade import cascade

    tf = cascade(probs, lam, run.data.final).reshape(run.judged.shape)
    return float((tf == run.judged).mean())

