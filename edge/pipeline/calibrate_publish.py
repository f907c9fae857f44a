"""What the ``calibrate`` stage (:mod:`edge.pipeline.calibrate`) leaves behind: the threshold table's certificate,
the manifest's metrics and record of the stage, ``<run_dir>/calibration/`` (the table and its plots, written
atomically) and the summary lines it prints."""
from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from calibration.table import ThresholdTable
from edge.core.artifacts import atomic_dir
from edge.core.errors import ConfigError
from edge.pipeline.calibrate_config import CalibrateConfig
from edge.runtime.engine_config import KVMode

STAGE = "calibrate"


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


def publish_results(cfg: CalibrateConfig, manifest: Any, ckpt: Path, served: Any, table: ThresholdTable,
                    curves: dict[str, Any], systems: list[Any], metrics: dict[str, Any], t0: float) -> None:
    """Refuses non-finite metrics, then writes ``<run_dir>/calibration/`` (the threshold table, the reliability
    diagram of ``curves``, the exit depths of the compared ``systems``), records the stage in the manifest and
    prints the summary lines."""
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


def _check_finite(metrics: dict[str, Any]) -> None:
    for key in ("bound", "false_exit_rate_test", "accuracy_full", "accuracy_exit"):
        v = metrics[key]
        if v is None or not np.isfinite(v):
            raise ConfigError(f"calibration produced a non-finite {key}: {v}")
