"""``smartexit calibrate``: threshold table with a certified false-exit bound, and its evaluation.

1. Collect exit signals teacher-forced on the calibration split.
2. Fit calibrators per exit and choose the shared threshold lambda by
   Learn-then-Test (Angelopoulos et al. 2021; as in CALM, Schuster et al. 2022).
3. Evaluate on the test split (or ``--eval-data DIR``), which calibration never
   saw: teacher-forced and in free-running greedy generation.
4. Compare with (a) a max-probability threshold tuned on the calibration split
   without a certificate (common practice) and (b) max-probability + LTT
   (CALM-like, no consistency signals), beside (c) Platt and (d) isotonic on all
   signals.

Everything is computed before anything is written; outputs go to
``<run_dir>/calibration/`` atomically and into the manifest.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from calibration.calibrators import (CalibratorKind, brier_score, expected_calibration_error, fit_calibrators,
                                     reliability_curve)
from calibration.collect import Collected, collect, top1_accuracy
from calibration.evaluate import EvalResult, evaluate_cascade, free_run
from calibration.risk import PValue, default_grid, false_exit_counts, learn_then_test, min_calibration_tokens
from calibration.signals import exit_targets
from calibration.table import ThresholdTable, TableRule
from edge.artifacts import atomic_dir, sha256_path
from edge.data import Split, heldout_prompts, load_split, load_text_dir
from edge.engine.engine import KVMode
from edge.distill import heldout_tokens
from edge.bundled import resolve_model
from edge.checkpoint import load_decoder
from edge.errors import CheckpointError, ConfigError
from edge.exits import read_exits_json
from edge.run import open_run

STAGE = "calibrate"
TOP1 = 0  # column of top1_prob in the signal matrix


@dataclass
class CalibrateConfig:
    run_dir: str = "artifacts/demo"
    epsilon: float = 0.009
    delta: float = 0.05
    calibrator: CalibratorKind = CalibratorKind.ISOTONIC  # the kind the written table uses
    pvalue: PValue = PValue.HOEFFDING_BENTKUS
    seq_len: int = 256
    calib_tokens: int = 100_000
    test_tokens: int = 50_000
    eval_data: str | None = None  # a folder of text files to evaluate on instead of the test split
    free_run_prompts: int = 32
    prompt_tokens: int = 64
    free_run_tokens: int = 64
    kv_mode: KVMode = KVMode.DEFER  # skipped layers' K/V in the free-running check (both are reported)
    seed: int = 0
    threads: int = 2

    def __post_init__(self) -> None:
        for name in ("epsilon", "delta"):
            v = getattr(self, name)
            if not 0.0 < v < 1.0:
                raise ConfigError(f"calibrate.{name} must be in (0, 1), got {v}")
        if self.calibrator is CalibratorKind.MAXPROB:
            raise ConfigError("calibrate.calibrator must be platt or isotonic (maxprob is the CALM-like baseline)")
        if self.calib_tokens < 1 or self.test_tokens < 1 or self.seq_len < 2:
            raise ConfigError("calibrate: calib_tokens, test_tokens >= 1 and seq_len >= 2 are required")


@dataclass
class System:
    """One exit rule compared in the report."""

    name: str
    certified: bool
    lam: float
    bound: float | None
    calib_rate: float
    test: EvalResult
    calibration_quality: dict[str, dict[str, float]] | None = None

    def row(self) -> dict[str, Any]:
        return {"system": self.name, "certified": self.certified, "lambda": self.lam,
                "false_exit_rate_calib": self.calib_rate, "bound": self.bound,
                "false_exit_rate_test": self.test.false_exit_rate, "layers_skipped_frac": self.test.layers_skipped_frac,
                "accuracy_loss_rel": self.test.accuracy_loss_rel, "exit_fraction": self.test.exit_fraction}


def _hand_tuned(cal: Collected, test: Collected, eps: float) -> System:
    """Loosest raw max-probability threshold whose *empirical* calibration rate is <= eps."""
    probs = {k: cal.signals[k][:, TOP1] for k in cal.exit_layers[:-1]}
    grid = default_grid()
    counts = false_exit_counts(probs, cal.correct(), grid, cal.final)  # grid is strict -> loose
    ok = counts / cal.n <= eps
    idx = int(np.flatnonzero(ok)[-1]) if ok.any() else None
    lam = float(grid[idx]) if idx is not None else 2.0
    rate = float(counts[idx] / cal.n) if idx is not None else 0.0
    test_probs = {k: test.signals[k][:, TOP1] for k in test.exit_layers[:-1]}
    return System("(a) max-prob, hand-tuned, no certificate", False, lam, None, rate,
                  evaluate_cascade(test, test_probs, lam))


def _ltt(name: str, kind: CalibratorKind, cal: Collected, test: Collected, cfg: CalibrateConfig):
    cals = fit_calibrators(cal.signals, exit_targets(cal.argmax), kind)
    probs = {k: c.predict(cal.signals[k]) for k, c in cals.items()}
    res = learn_then_test(probs, cal.correct(), cal.final, cfg.epsilon, cfg.delta, cfg.pvalue)
    test_probs = {k: c.predict(test.signals[k]) for k, c in cals.items()}
    test_correct = test.correct()
    quality = {str(k): {"ece": expected_calibration_error(test_probs[k], test_correct[k]),
                        "brier": brier_score(test_probs[k], test_correct[k])} for k in cals}
    system = System(name, res.certified, res.lam, res.bound, res.empirical_risk,
                    evaluate_cascade(test, test_probs, res.lam), quality)
    return system, cals, res, test_probs


def main(cfg: CalibrateConfig) -> int:
    t0 = time.time()
    run = open_run(cfg.run_dir, cfg.threads)
    manifest, ckpt, model, tok = run.manifest, run.path, run.model, run.tokenizer
    n_min = min_calibration_tokens(cfg.epsilon, cfg.delta, cfg.pvalue)
    if cfg.calib_tokens < n_min:
        raise ConfigError(f"calib_tokens={cfg.calib_tokens} is too few to certify epsilon={cfg.epsilon} at "
                          f"delta={cfg.delta}: at least {n_min} calibration tokens are needed")
    eval_docs = load_text_dir(cfg.eval_data) if cfg.eval_data else load_split(Split.TEST)
    cal = collect(model, heldout_tokens(tok, load_split(Split.CALIBRATION)), cfg.seq_len, cfg.calib_tokens)
    test = collect(model, heldout_tokens(tok, eval_docs), cfg.seq_len, cfg.test_tokens)
    print(f"collected signals: {cal.n} calibration tokens, {test.n} evaluation tokens", flush=True)

    systems = [_hand_tuned(cal, test, cfg.epsilon)]
    maxprob, *_ = _ltt("(b) max-prob + LTT (CALM-like)", CalibratorKind.MAXPROB, cal, test, cfg)
    systems.append(maxprob)
    chosen = None
    for kind, label in ((CalibratorKind.PLATT, "(c) all signals, Platt + LTT"),
                        (CalibratorKind.ISOTONIC, "(d) all signals, isotonic + LTT")):
        system, cals, res, test_probs = _ltt(label, kind, cal, test, cfg)
        systems.append(system)
        if kind is cfg.calibrator:
            chosen = (system, cals, res, test_probs)
    system, cals, res, test_probs = chosen

    table = ThresholdTable(
        checkpoint_sha256=sha256_path(ckpt), exit_layers=model.exit_layers, calibrator_kind=cfg.calibrator.value,
        lam=res.lam, score_thresholds={k: c.score_threshold(res.lam) for k, c in cals.items()}, calibrators=cals,
        certificate={
            "epsilon": cfg.epsilon, "delta": cfg.delta, "pvalue": cfg.pvalue.value, "n_calibration_tokens": cal.n,
            "certified": res.certified, "false_exit_rate_calib": res.empirical_risk, "bound": res.bound,
            "expected_exit_fraction": {str(k): v for k, v in res.exit_fraction.items()},
            "expected_layers_skipped_frac": res.layers_skipped_frac,
        },
    )
    prompts = heldout_prompts(tok, eval_docs, cfg.free_run_prompts, cfg.prompt_tokens, cfg.seed)
    runs = {mode: free_run(model, prompts, cfg.free_run_tokens, TableRule(table), mode) for mode in KVMode}
    fr = runs[cfg.kv_mode]

    base = _base_model_accuracy(ckpt, heldout_tokens(tok, eval_docs), cfg)
    test_correct = test.correct()
    curves = {f"exit {k}": reliability_curve(test_probs[k], test_correct[k]) for k in cals}
    metrics = {
        "epsilon": cfg.epsilon, "delta": cfg.delta, "pvalue": cfg.pvalue.value, "calibrator": cfg.calibrator.value,
        "n_calibration_tokens": cal.n, "n_test_tokens": test.n, "min_calibration_tokens": n_min,
        "eval_data": cfg.eval_data or "test split", "certified": res.certified, "lambda": res.lam,
        "bound": res.bound, "false_exit_rate_calib": res.empirical_risk,
        "false_exit_rate_test": system.test.false_exit_rate,
        "free_run_false_exit_rate_test": fr.false_exit_rate, "kv_mode": cfg.kv_mode.value,
        "free_run": asdict(fr), "free_run_by_kv_mode": {m.value: asdict(r) for m, r in runs.items()},
        "accuracy_full": system.test.accuracy_full, "accuracy_exit": system.test.accuracy_exit,
        "accuracy_loss_rel": system.test.accuracy_loss_rel, "layers_skipped_frac": system.test.layers_skipped_frac,
        **({"accuracy_base_model": base, "accuracy_loss_rel_vs_base_model": 1.0 - system.test.accuracy_exit / base}
           if base else {}),
        "exit_fraction": system.test.exit_fraction, "calibration_quality": system.calibration_quality,
        "comparison": [s.row() for s in systems],
    }
    _check_finite(metrics)

    out = Path(cfg.run_dir) / "calibration"
    with atomic_dir(out) as tmp:
        from calibration.plots import exit_depth_histogram, reliability_diagram

        table.save(tmp / "thresholds.json")
        reliability_diagram(curves, tmp / "reliability.png",
                            f"{cfg.calibrator.value} calibration on held-out tokens")
        exit_depth_histogram({s.name[:3]: {int(k): v for k, v in s.test.exit_fraction.items()} for s in systems},
                             tmp / "exit_depth.png", "exit depth on held-out tokens")
    manifest.record(STAGE, inputs={"checkpoint": ckpt}, config=asdict(cfg),
                    outputs={"thresholds": out / "thresholds.json", "reliability_png": out / "reliability.png",
                             "exit_depth_png": out / "exit_depth.png"},
                    metrics=metrics, seconds=time.time() - t0)
    print(f"threshold table: {out / 'thresholds.json'} (lambda {res.lam:.3f}, bound {res.bound:.4f} "
          f"<= eps {cfg.epsilon}: {res.certified})")
    print(f"test: false exits {system.test.false_exit_rate:.4f}, free-run {fr.false_exit_rate:.4f}, "
          f"accuracy loss {system.test.accuracy_loss_rel:.4f}, layers skipped {system.test.layers_skipped_frac:.3f}")
    return 0


def _base_model_accuracy(ckpt: Path, tokens, cfg: CalibrateConfig) -> float | None:
    """Full-depth accuracy, on the evaluation tokens, of the base model when the checkpoint's decoder
    was fine-tuned (``freeze_backbone=false`` here, or earlier as recorded in the model's
    ``lineage.json``); None otherwise. Accuracy loss is then reported against that model too, not
    only against the fine-tuned full depth."""
    source = read_exits_json(ckpt).get("source", {})
    if not source.get("backbone_finetuned"):
        return None
    try:
        base = load_decoder(resolve_model(source["base_model"]))
    except CheckpointError as exc:  # the base model moved: calibrate anyway, say what is missing
        print(f"note: no accuracy against the base model ({exc})", flush=True)
        return None
    return top1_accuracy(base, tokens, cfg.seq_len, cfg.test_tokens)


def _check_finite(metrics: dict[str, Any]) -> None:
    for key in ("bound", "false_exit_rate_test", "accuracy_full", "accuracy_exit"):
        v = metrics[key]
        if v is None or not np.isfinite(v):
            raise ConfigError(f"calibration produced a non-finite {key}: {v}")

