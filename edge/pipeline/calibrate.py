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

import enum
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from calibration import certify as cert
from calibration.calibrators import Calibrator, CalibratorKind, reliability_curve
from calibration.compare import baselines
from calibration.evaluate import evaluate_cascade
from calibration.pvalues import PValue, exceeds_pvalue, min_units
from calibration.risk import default_grid
from calibration.signals import GATED_SIGNAL_NAMES, SIGNAL_NAMES, exit_targets
from edge.model.candidates import lookup_feature, signal_names as candidate_signal_names
from edge.model.lookup import MAX_N
from calibration.table import ThresholdTable, TableRule
from calibration.units import check_amount, corpora, seeds
from edge.core.artifacts import atomic_dir, sha256_path
from edge.core.errors import ArtifactError, CheckpointError, ConfigError
from edge.model.exits import read_exits_json
from edge.model.windows import base_model_metrics
from calibration.freerun import FreeRun, Served, free_run, free_run_until, full_depth_run
from edge.pipeline.run import open_run
from calibration.statement import KVChoice, choose_shipped, statement
from edge.runtime.engine_config import KVMode
from edge.runtime.settings import EPSILON

STAGE = "calibrate"


class CalibBackend(str, enum.Enum):
    """Which engine the free runs and checks use."""

    AUTO = "auto"  # onnxruntime for a compressed checkpoint (its integer kernels are what serves), else torch
    TORCH = "torch"  # the torch model (float: its exported graphs match it within float rounding)
    ONNXRUNTIME = "onnxruntime"  # the export's fused graphs, as served (needs `smartexit export` first)


@dataclass
class CalibrateConfig:
    run_dir: str = "artifacts/demo"
    epsilon: float = EPSILON.default  # tolerated mean per-prompt false-exit rate (edge/runtime/settings.py)
    delta: float = 0.05  # probability that the certificate is wrong
    calibrator: CalibratorKind = CalibratorKind.ISOTONIC  # the kind the written table uses
    # candidate-shortlist models: only rows whose context lookup matched at least this many tokens are checked;
    # the others run every layer in one call (a part of the rule, fixed before the certify units are drawn)
    route_min_lookup: int = 0
    # ... and where the context matched fewer than 2 tokens, the lookup falls back to the export's corpus
    # n-gram table (the model's own continuations of training-split windows; a match of 3 tokens or more:
    # edge/model/lookup.py), where the run has a current export with one; the table written names it (its
    # sha256), the engine reads the same. Off by default: more tokens leave, but held out the rule erred near
    # eps (docs/runtime.md, stop 49)
    lookup_corpus: bool = False
    pvalue: PValue = PValue.BETTING
    kv_mode: KVChoice = KVChoice.AUTO
    backend: CalibBackend = CalibBackend.AUTO  # the engine the certificate is computed on
    prompt_tokens: int = 64  # a unit: a prompt of this many tokens ...
    new_tokens: int = 32  # ... continued for this many (the first, from the full-depth prefill, is not judged)
    fit_units: int = 256  # prompts the calibrators are fitted on
    certify_units: int = 640  # prompts Learn-then-Test runs on (at least min_units)
    propagate_units: int = 640  # fresh prompts for the direct test of propagate (kv_mode=auto)
    eval_units: int = 256  # evaluation prompts (teacher-forced windows and free-running prompts)
    eval_both_kv_modes: bool = False  # also run the evaluation prompts in the K/V mode not shipped
    # of the evaluation prompts, how many the reference models (the base model a fine-tuned decoder came from, the
    # float model a compressed one was made from) are read on, teacher-forced in torch, with the shipped rule's
    # accuracy on the same prompts beside them (a paired comparison); None: all of them
    reference_units: int | None = None
    calib_data: str | None = None  # a folder of text files to calibrate on instead of the shipped split
    heldout_percent: int = 30  # of calib_data's documents, held out for evaluation (by hash of the path)
    eval_data: str | None = None  # a folder of text files to evaluate on instead
    min_documents: int = 20  # documents of >= prompt_tokens + new_tokens tokens the units are drawn from
    batch: int = 128  # prompts per engine run
    seed: int = 0
    # torch intra-op threads. One: the stage is mostly small decode-step matmuls, where a second OpenMP
    # thread gains little and, on a CPU shared with other work, makes every op wait at a barrier for a
    # descheduled thread (measured on 2 shared cores: engine generation 4x and teacher-forced passes
    # 2x slower with 2 threads than with 1).
    threads: int = 1

    def __post_init__(self) -> None:
        self.epsilon = EPSILON.check(self.epsilon, "calibrate")
        if not 0.0 < self.delta < 1.0:
            raise ConfigError(f"calibrate.delta must be in (0, 1), got {self.delta}")
        self.calibrator, self.pvalue, self.kv_mode = (CalibratorKind(self.calibrator), PValue(self.pvalue),
                                                      KVChoice(self.kv_mode))
        self.backend = CalibBackend(self.backend)
        if self.calibrator is CalibratorKind.MAXPROB:
            raise ConfigError("calibrate.calibrator must be platt, isotonic or mlp (maxprob is the CALM-like baseline)")
        if self.prompt_tokens < 1 or self.new_tokens < 2:
            raise ConfigError("calibrate: prompt_tokens >= 1 and new_tokens >= 2 are required")
        if self.reference_units is not None and self.reference_units < 1:
            raise ConfigError(f"calibrate.reference_units must be >= 1 (or null: every evaluation prompt), got "
                              f"{self.reference_units}")
        for name in ("fit_units", "eval_units", "batch", "min_documents"):
            if getattr(self, name) < 1:
                raise ConfigError(f"calibrate.{name} must be >= 1, got {getattr(self, name)}")
        if self.fit_units < 2:
            raise ConfigError("calibrate.fit_units must be >= 2 (they are cross-fitted in two halves)")
        if self.pvalue is PValue.BINOMIAL and self.new_tokens > 2:
            raise ConfigError("calibrate.pvalue=binomial is exact for 0/1 losses only, but a prompt's false-exit "
                              f"rate over {self.new_tokens - 1} judged tokens takes values in [0, 1]: use betting "
                              "or hoeffding_bentkus (or new_tokens=2)")
        if not 0 <= self.route_min_lookup <= MAX_N:
            raise ConfigError(f"calibrate.route_min_lookup must be in [0, {MAX_N}] (the lookup's longest match), got "
                              f"{self.route_min_lookup}")
        if not 0 < self.heldout_percent < 100:
            raise ConfigError(f"calibrate.heldout_percent must be in (0, 100), got {self.heldout_percent}")


def _log(t0: float, msg: str) -> None:
    print(f"[calibrate {time.time() - t0:6.1f}s wall, {time.process_time():6.1f}s cpu] {msg}", flush=True)


def served_engine(choice: CalibBackend, manifest, ckpt: Path, model, threads: int) -> Served:
    """The engine calibration runs: torch over ``model``, or the export's ONNX Runtime graphs of ``ckpt``.

    Raises:
        ConfigError: onnxruntime asked for (or implied by a compressed checkpoint) without an export of
            this checkpoint.
    """
    from edge.runtime.backend import make_backend  # onnxruntime's module is imported only now

    compressed = "compressed_from" in read_exits_json(ckpt).get("source", {})
    if choice is CalibBackend.TORCH or (choice is CalibBackend.AUTO and not compressed):
        return Served.torch(model)
    try:
        graphs = manifest.verified_output("export", "graphs")
        backend = make_backend("onnxruntime", graphs_dir=graphs, checkpoint=ckpt, threads=threads)
    except (ArtifactError, CheckpointError, ConfigError) as exc:
        why = "a compressed model is calibrated on the graphs that serve it" if compressed else "backend=onnxruntime"
        raise ConfigError(f"calibrate: {why}, but there is no current export of {ckpt} ({exc}); run `smartexit "
                          f"export run_dir={manifest.run_dir}` first (or backend=torch)") from exc
    return Served(backend)


def corpus_table(cfg: CalibrateConfig, manifest, model) -> Any:
    """The export's corpus n-gram table for the context lookup to fall back to (``lookup_corpus``, a shortlist
    model, a current export that has one), else None: the rule then reads the context alone, and its table
    says so (a calibration before any export, on the torch model, is one)."""
    from edge.runtime.graphs import load_ngram_table

    if not (cfg.lookup_corpus and model.has_shortlist):
        return None
    try:
        return load_ngram_table(manifest.verified_output("export", "graphs"))
    except ArtifactError:
        return None


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


def check_sizes(cfg: CalibrateConfig, data: Any) -> int:
    """The fewest certify units that can certify ``cfg.epsilon`` at ``cfg.delta``; refuses settings and corpora
    too small for it.

    Raises:
        ConfigError: too few certify (or propagate-test) units, or too little text to draw them from.
    """
    n_min = min_units(cfg.epsilon, cfg.delta, cfg.pvalue)
    if cfg.certify_units < n_min:
        raise ConfigError(f"certify_units={cfg.certify_units} is too few to certify epsilon={cfg.epsilon} at "
                          f"delta={cfg.delta} with the {cfg.pvalue.value} p-value: at least {n_min} certify units "
                          f"(prompts) are needed, even with zero false exits")
    tests = cfg.kv_mode is not KVChoice.DEFER  # auto and propagate may test propagate directly
    if tests and cfg.propagate_units < n_min:
        raise ConfigError(f"propagate_units={cfg.propagate_units} is too few for the direct test of propagate "
                          f"(kv_mode={cfg.kv_mode.value}): at least {n_min} units are needed")
    length = cfg.prompt_tokens + cfg.new_tokens
    n_draw = cfg.fit_units + cfg.certify_units + (cfg.propagate_units if tests else 0)
    check_amount(data.calibration, data.calibration_name, length, n_draw, cfg.min_documents,
                 f"Certifying epsilon={cfg.epsilon} at delta={cfg.delta} ({cfg.pvalue.value}) needs at least "
                 f"{n_min} certify prompts; this run draws {cfg.fit_units} fit + {cfg.certify_units} certify"
                 + (f" + {cfg.propagate_units} propagate-test" if tests else ""))
    check_amount(data.evaluation, data.evaluation_name, length, 1, 1, "Evaluation needs")
    return n_min


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


def certificate_of(cfg: CalibrateConfig, ship: Any, c: Any, prop: Any, served: Any, data: Any, text: str, docs: int,
                   n_min: int) -> dict[str, Any]:
    """The threshold table's certificate: what was certified, on what, and how."""
    judged = cfg.new_tokens - 1
    return {
        "epsilon": cfg.epsilon, "delta": cfg.delta, "pvalue": cfg.pvalue.value, "statement": text,
        "unit": "prompt", "n_units": ship.n_units, "n_tokens": ship.n_units * judged, "min_units": n_min,
        "prompt_tokens": cfg.prompt_tokens, "new_tokens": cfg.new_tokens,
        "calibration_corpus": data.calibration_name, "calibration_documents": docs,
        "certified": ship.certified, "exact": ship.exact, "lambda_provisional": c.lam_provisional,
        "false_exit_rate_calib": ship.empirical_risk, "bound": ship.bound, "p_value": ship.p_value,
        "kv_mode_reason": ship.reason, "engine": served.backend.name, "reference": served.reference_name,
        "defer_walk": c.to_dict(),
        "propagate_test": None if prop is None else prop.to_dict(),
        "expected_exit_fraction": {str(k): v for k, v in c.exit_fraction.items()},
        "expected_layers_skipped_frac": c.layers_skipped_frac,
    }


def metrics_of(cfg: CalibrateConfig, ship: Any, c: Any, prop: Any, served: Any, data: Any, text: str, docs: int,
               n_min: int, fit: Any, test: Any, tf: Any, fr: Any, runs: dict[Any, Any], shipped: KVMode,
               base: float | None, flt: float | None, chosen: Any, systems: list[Any]) -> dict[str, Any]:
    """The manifest's metrics of the stage."""
    judged = cfg.new_tokens - 1
    length = cfg.prompt_tokens + cfg.new_tokens
    return {
        "epsilon": cfg.epsilon, "delta": cfg.delta, "pvalue": cfg.pvalue.value, "calibrator": cfg.calibrator.value,
        "engine": served.backend.name, "reference": served.reference_name,
        "certificate_statement": text, "certified": ship.certified, "certificate_exact": ship.exact,
        "lambda": ship.lam, "lambda_provisional": c.lam_provisional, "bound": ship.bound, "p_value": ship.p_value,
        "n_units": ship.n_units, "n_fit_units": fit.n_units, "n_eval_units": test.n_units, "min_units": n_min,
        "tokens_per_unit": judged, "prompt_tokens": cfg.prompt_tokens, "new_tokens": cfg.new_tokens,
        "n_calibration_tokens": ship.n_units * judged, "min_calibration_tokens": n_min * judged,
        "n_test_tokens": test.n,
        "calib_data": cfg.calib_data or "shipped calibration split", "calibration_corpus": data.calibration_name,
        "calibration_documents": docs, "eval_data": data.evaluation_name,
        "eval_documents": int(data.evaluation.eligible(length).size),
        "false_exit_rate_calib": ship.empirical_risk, "engine_agreement": c.agreement,
        "kv_mode_reason": ship.reason,
        "false_exit_rate_test": tf.false_exit_rate,
        "free_run_false_exit_rate_test": fr.false_exit_rate, "kv_mode": shipped.value,
        "lookup_corpus": served.lookup_table is not None,
        "kv_mode_choice": cfg.kv_mode.value, "propagate_test": None if prop is None else prop.to_dict(),
        "free_run": asdict(fr), "free_run_by_kv_mode": {m.value: r.to_dict() for m, r in runs.items()},
        "accuracy_full": tf.accuracy_full, "accuracy_exit": tf.accuracy_exit, "accuracy_loss_rel": tf.accuracy_loss_rel,
        "layers_skipped_frac": fr.layers_skipped_frac, "layers_skipped_frac_teacher_forced": tf.layers_skipped_frac,
        "exit_fraction": tf.exit_fraction, "calibration_quality": chosen.calibration_quality,
        "certify_walk": c.to_dict(), "comparison": [x.row() for x in systems],
    }


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
    fit_run = full_depth_run(served, fit_w.ids[:, :P], cfg.new_tokens, cfg.batch, desc="fit units, full depth")
    fit = fit_run.data
    cals = cert.fit(fit, cfg.calibrator, route)
    lam_p = cert.provisional_lambda(fit, cfg.calibrator, lams, cfg.epsilon, cfg.delta, cfg.pvalue,
                                    cfg.certify_units, s["crossfit"], route)
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
    base = _base_model_accuracy(ckpt, ev_w.ids[:n_ref], P)
    flt = _float_model_accuracy(manifest, ckpt, ev_w.ids[:n_ref], P)
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
    _check_finite(metrics)

    out = Path(cfg.run_dir) / "calibration"
    with atomic_dir(out) as tmp:
        from calibration.plots import exit_depth_histogram, reliability_diagram

        table.save(tmp / "thresholds.json")
        reliability_diagram(curves, tmp / "reliability.png", f"{cfg.calibrator.value} calibration on held-out text")
        exit_depth_histogram({x.name[:3]: {int(k): v for k, v in x.test.exit_fraction.items()} for x in systems},
                             tmp / "exit_depth.png", "exit depth on held-out text (teacher-forced)")
    inputs = {"checkpoint": ckpt}
    if served.model is None:  # the graphs the engine ran: a new export makes this table stale
        inputs["graphs"] = manifest.verified_output("export", "graphs")
    manifest.record(STAGE, inputs=inputs, config=asdict(cfg),
                    outputs={"thresholds": out / "thresholds.json", "reliability_png": out / "reliability.png",
                             "exit_depth_png": out / "exit_depth.png"},
                    metrics=metrics, seconds=time.time() - t0)
    for line in summary_lines(metrics, out, manifest.path, time.time() - t0):
        print(line)
    return 0


def summary_lines(metrics: dict[str, Any], out: Path, manifest_path: Path, seconds: float) -> list[str]:
    """The few numbers the stage ends with, and where its outputs are (the metrics have the rest)."""
    fr = metrics["free_run"]
    return [
        f"calibrate: done in {seconds:.0f} s",
        f"  certificate: certified {metrics['certified']}, lambda {metrics['lambda']:.3f} (K/V {metrics['kv_mode']}), "
        f"bound {metrics['bound']:.4f} {'<=' if metrics['bound'] <= metrics['epsilon'] else '>'} eps "
        f"{metrics['epsilon']} at delta {metrics['delta']} on "
        f"{metrics['n_units']} prompts",
        f"  held out ({metrics['n_eval_units']} prompts): false exits free-running {fr['false_exit_rate']:.4f}, "
        f"teacher-forced {metrics['false_exit_rate_test']:.4f}; accuracy loss {metrics['accuracy_loss_rel']:.4f}; "
        f"layers skipped {metrics['layers_skipped_frac']:.3f}",
        "  compared, teacher-forced (false exits / layers skipped): " + ", ".join(
            f"{row['system'][:3]} {row['false_exit_rate_test']:.4f} / {row['layers_skipped_frac']:.3f}"
            for row in metrics["comparison"]),
        f"  threshold table: {out / 'thresholds.json'}; plots: {out / 'reliability.png'}, "
        f"{out / 'exit_depth.png'}; all numbers: {manifest_path} (`smartexit report` renders them)",
    ]


def reference_metrics(base: float | None, flt: float | None, accuracy_exit: float, units: int) -> dict[str, Any]:
    """The shipped rule's accuracy against the reference models', on the same ``units`` evaluation prompts
    (``accuracy_exit``: the rule's there): the base model a fine-tuned decoder came from, the float model a compressed
    one was made from (None: no such model)."""
    out: dict[str, Any] = {}
    if base is not None:
        out |= {"accuracy_base_model": base,
                "accuracy_loss_rel_vs_base_model": 1.0 - accuracy_exit / base if base > 0 else 0.0}
    if flt is not None:  # a compressed model: its exits against the float model it was compressed from, full depth
        out |= {"accuracy_float_model": flt,
                "accuracy_loss_rel_vs_float_model": 1.0 - accuracy_exit / flt if flt > 0 else 0.0}
    if out:
        out |= {"reference_units": units, "accuracy_exit_reference_units": accuracy_exit}
    return out


def _agreement(run: FreeRun, probs: dict[int, np.ndarray], lam: float) -> float:
    """Fraction of judged tokens whose exit layer in the engine equals the teacher-forced cascade's at
    ``lam``: 1 up to float rounding in defer mode (exact K/V), lower in propagate mode."""
    from calibration.cascade import cascade

    tf = cascade(probs, lam, run.data.final).reshape(run.judged.shape)
    return float((tf == run.judged).mean())


def _base_model_accuracy(ckpt: Path, windows: np.ndarray, first: int) -> float | None:
    """Full-depth accuracy, on the evaluation tokens, of the base model when the checkpoint's decoder
    was fine-tuned (``freeze_backbone=false`` here, or earlier as recorded in the model's
    ``lineage.json``); None otherwise. Accuracy loss is then reported against that model too, not
    only against the fine-tuned full depth."""
    source = read_exits_json(ckpt).get("source", {})
    if not source.get("backbone_finetuned"):
        return None
    try:
        return base_model_metrics(source["base_model"], windows, first, batch=32)["base_heldout_top1"]
    except CheckpointError as exc:  # the base model moved: calibrate anyway, say what is missing
        print(f"note: no accuracy against the base model ({exc})", flush=True)
        return None


def _float_model_accuracy(manifest, ckpt: Path, windows: np.ndarray, first: int) -> float | None:
    """Full-depth accuracy, on the evaluation tokens, of the float model a compressed checkpoint was made
    from; None for a checkpoint that is not compressed."""
    where = float_model(manifest, ckpt)
    return None if where is None else base_model_metrics(str(where), windows, first, batch=32)["base_heldout_top1"]


def float_model(manifest, ckpt: Path) -> Path | None:
    """The float checkpoint the run's compressed checkpoint ``ckpt`` was made from: the run's distilled one, as
    its manifest records it (relative to the run folder, so found wherever the folder now lies, and hash-checked;
    :meth:`Manifest.served_checkpoint` has checked that ``compress`` read it). Not the path ``compress`` wrote
    into the checkpoint, which is relative to where that stage ran: a copied run failed on it after its whole
    certification. None for a checkpoint that is not compressed."""
    if "compressed_from" not in read_exits_json(ckpt).get("source", {}):
        return None
    return manifest.verified_output("distill", "checkpoint")


def _check_finite(metrics: dict[str, Any]) -> None:
    for key in ("bound", "false_exit_rate_test", "accuracy_full", "accuracy_exit"):
        v = metrics[key]
        if v is None or not np.isfinite(v):
            raise ConfigError(f"calibration produced a non-finite {key}: {v}")
