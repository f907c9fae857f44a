"""The ``calibrate`` stage's settings (:mod:`edge.pipeline.calibrate`): the engine it certifies on, the unit counts
of each draw (fit, certify, propagate-test, evaluation), checked alone when made and against the corpus they are
drawn from (:func:`check_sizes`) before any engine runs."""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from calibration.calibrators import CalibratorKind
from calibration.pvalues import PValue, min_units
from calibration.statement import KVChoice
from calibration.units import check_amount
from edge.core.errors import ConfigError
from edge.model.lookup import MAX_N
from edge.runtime.settings import EPSILON


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
    # processes for the mlp calibrator's networks (calibration.mlp_score.fit_pool; 0: one per core, at most two per
    # decision exit; 1: none, in this process): the same networks either way; nine fits took 22-23 s in process,
    # 14-15 s in two processes on the 2-core Intel VM (stop 68)
    fit_workers: int = 0

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
        if self.fit_workers < 0:
            raise ConfigError(f"calibrate.fit_workers must be >= 0 (0: one per core), got {self.fit_workers}")
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
