"""``smartexit compress``: the distilled multi-exit model, quantized (and optionally pruned) by a recipe.

Between ``distill`` and ``export`` (distill -> compress -> export -> calibrate; DESIGN.md lists
calibrate before export, see docs/compression.md for why a quantized model reverses them), so that the
graphs are exported, and the thresholds calibrated on those graphs, for the model that is served. Writes the
compressed checkpoint to ``<run>/compressed`` (:mod:`edge.compress.checkpoint`) and
``<run>/compress/report.json``; every later stage loads it through ``Manifest.served_checkpoint``.

Recipes (:class:`Recipe`): ``none`` (the float model, copied), ``int8_ptq`` (every layer W8A8 after
training: per-channel weights, activation ranges from the observers, each group's observer picked by
measured output error), ``int8_mixed`` (the same, and the *critical* layers of the sensitivity analysis
fine-tuned by quantization-aware distillation), ``int8_mixed_sparse`` (and the layer-wise drift
penalty during QAT), ``int4`` (block-wise INT4 weights). ``prune=true`` first prunes MLP neurons
(and query heads) in the layers before each exit, with distillation recovery.

Data roles: everything fitted here (observers, sensitivity ranking, QAT, pruning importance and
recovery) reads the train split; the quality recorded here is measured on the test split; the
calibration split, which certifies the exit thresholds, is never read.
"""
from __future__ import annotations

import copy
import enum
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from edge.compress import qat
from edge.compress.apply import calibrate_activations, model_bytes, observe, quantize_head, quantize_layers
from edge.compress.checkpoint import save_compressed
from edge.compress.quality import Reference, evaluate
from edge.compress.quant import Observer, Precision, QuantSpec
from edge.compress.sensitivity import analyse
from edge.core.artifacts import Manifest, atomic_dir, atomic_write_json
from edge.core.data import Split, TokenCorpus, load_split
from edge.core.errors import ConfigError
from edge.model.exits import MultiExitModel, load_multi_exit, read_exits_json
from edge.model.tokenizer import load_tokenizer
from edge.training.distill import sample_train_tokens

STAGE = "compress"


class Recipe(str, enum.Enum):
    NONE = "none"
    INT8_PTQ = "int8_ptq"
    INT8_MIXED = "int8_mixed"
    INT8_MIXED_SPARSE = "int8_mixed_sparse"
    INT4 = "int4"


@dataclass
class CompressConfig:
    run_dir: str = "artifacts/demo"
    recipe: Recipe = Recipe.INT8_MIXED
    observer: str = "auto"  # auto (per group, by measured error) | minmax | percentile | mse
    extra_critical: int = 2  # most sensitive layers that join the exit-feeding layers in QAT
    qat_steps: int = 40
    qat_lr: float = 1e-5
    qat_batch: int = 4
    sparse_weight: float = 1.0  # int8_mixed_sparse: base lambda of the drift penalty
    block_size: int = 32  # int4: inputs per scale
    quantize_head: bool = True  # the LM head in W8A8 too (at batch 1 one head costs about two layers)
    prune: bool = False
    prune_mlp_fraction: float = 0.25
    prune_heads_per_group: int = 0
    prune_steps: int = 2
    prune_recovery_steps: int = 20
    seq_len: int = 128
    fit_tokens: int = 200_000  # train-split tokens drawn for observers, sensitivity, QAT, pruning
    calib_batches: int = 4  # observer batches of 8 windows
    sensitivity_windows: int = 16  # train-split windows the sensitivity ranking is measured on
    eval_windows: int = 24  # test-split windows for the recorded quality
    threads: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        self.recipe = Recipe(self.recipe)
        if self.observer != "auto":
            try:
                Observer(self.observer)
            except ValueError:
                raise ConfigError(f"compress.observer must be auto or one of {[o.value for o in Observer]}, "
                                  f"got {self.observer!r}") from None
        if min(self.seq_len, self.calib_batches, self.sensitivity_windows, self.eval_windows, self.qat_batch) < 1:
            raise ConfigError("compress: seq_len, calib_batches, sensitivity_windows, eval_windows and qat_batch "
                              "must be >= 1")
        if self.extra_critical < 0 or self.qat_steps < 0 or self.qat_lr <= 0 or self.sparse_weight < 0:
            raise ConfigError("compress: extra_critical >= 0, qat_steps >= 0, qat_lr > 0, sparse_weight >= 0")
        if not 0 <= self.prune_mlp_fraction < 1:
            raise ConfigError(f"compress.prune_mlp_fraction must be in [0, 1), got {self.prune_mlp_fraction}")
        QuantSpec(Precision.W4, self.block_size)  # validates the block size


def _log(t0: float, msg: str) -> None:
    print(f"[compress {time.time() - t0:6.1f}s] {msg}", flush=True)


def fit_windows(tok, cfg: CompressConfig) -> torch.Tensor:
    """Train-split token windows [N, seq_len] (the fit role)."""
    tokens = np.asarray(sample_train_tokens(tok, cfg.fit_tokens, cfg.seed + 1))
    n = len(tokens) // cfg.seq_len
    if n < cfg.calib_batches * 8 + cfg.sensitivity_windows:
        raise ConfigError(f"compress: {n} train windows of {cfg.seq_len} tokens are too few; raise fit_tokens")
    return torch.from_numpy(tokens[: n * cfg.seq_len].reshape(n, cfg.seq_len)).long()


def compress(model: MultiExitModel, windows: torch.Tensor, cfg: CompressConfig, t0: float | None = None
             ) -> tuple[MultiExitModel, dict]:
    """Apply ``cfg.recipe`` (and pruning) to a copy of ``model``, fitting on train ``windows`` [N, T].
    Returns the compressed model and what was decided and measured on the way."""
    t0 = time.time() if t0 is None else t0
    info: dict = {"recipe": cfg.recipe.value}
    student = copy.deepcopy(model).eval()
    calib = [windows[8 * i:8 * (i + 1)] for i in range(cfg.calib_batches)]
    fit_ref = Reference(model, windows[-cfg.sensitivity_windows:])
    if cfg.prune:
        from edge.compress.prune import prune_near_exits
        from edge.compress.prune_config import PruneConfig

        pcfg = PruneConfig(mlp_fraction=cfg.prune_mlp_fraction, heads_per_group=cfg.prune_heads_per_group,
                           steps=cfg.prune_steps, recovery_steps=cfg.prune_recovery_steps, seq_len=cfg.seq_len,
                           seed=cfg.seed)
        info["prune"] = prune_near_exits(student, model, windows[: -cfg.sensitivity_windows], pcfg).to_dict()
        _log(t0, "pruned near the exits")
    if cfg.recipe is Recipe.NONE:
        return student, info
    spec = QuantSpec(Precision.W8A8)
    if cfg.recipe is Recipe.INT4:  # W4 layers; the LM head in W8A8 (as llama.cpp's 4-bit types keep it wider)
        quantize_layers(student, {j: QuantSpec(Precision.W4, cfg.block_size) for j in range(model.num_layers)})
        if cfg.quantize_head:
            quantize_head(student, spec)
            observe(student, calib)
            info["activation_ranges"] = [asdict(c) for c in calibrate_activations(student)]
        return student, info
    if cfg.recipe in (Recipe.INT8_MIXED, Recipe.INT8_MIXED_SPARSE):
        sens = analyse(student, fit_ref, calib, spec, cfg.extra_critical)
        info["sensitivity"] = sens.to_dict()
        _log(t0, f"sensitivity: ranking {sens.ranking}, critical {sens.critical}")
    quantize_layers(student, {j: spec for j in range(model.num_layers)})
    if cfg.quantize_head:
        quantize_head(student, spec)
    observe(student, calib)
    choices = calibrate_activations(student, None if cfg.observer == "auto" else Observer(cfg.observer))
    info["activation_ranges"] = [asdict(c) for c in choices]
    _log(t0, f"post-training ranges: {len(choices)} groups, observers "
             f"{ {o: sum(c.observer == o for c in choices) for o in {c.observer for c in choices}} }")
    if cfg.recipe in (Recipe.INT8_MIXED, Recipe.INT8_MIXED_SPARSE):
        sparse = cfg.sparse_weight if cfg.recipe is Recipe.INT8_MIXED_SPARSE else 0.0
        qcfg = qat.QATConfig(steps=cfg.qat_steps, batch_size=cfg.qat_batch, lr=cfg.qat_lr, sparse_weight=sparse,
                             seed=cfg.seed)
        res = qat.train(student, model, windows[cfg.calib_batches * 8: -cfg.sensitivity_windows], sens.critical,
                        qcfg, sens.weights())
        info["qat"] = res.to_dict()
        _log(t0, f"QAT of layers {sens.critical}: loss {np.mean(res.losses[:5]):.5f} -> {np.mean(res.losses[-5:]):.5f}, "
                 f"grid drift {max(res.drift.values()):.3f} at most")
    return student, info


def main(cfg: CompressConfig) -> int:
    t0 = time.time()
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    manifest = Manifest(cfg.run_dir)
    src = manifest.verified_output("distill", "checkpoint")
    model, tok = load_multi_exit(src), load_tokenizer(src)
    windows = fit_windows(tok, cfg)
    ref = Reference(model, torch.from_numpy(TokenCorpus(tok, load_split(Split.TEST)).draw(
        cfg.eval_windows, cfg.seq_len, cfg.seed).ids))
    student, info = compress(model, windows, cfg, t0)
    before, after = evaluate(model, ref), evaluate(student, ref)
    bytes_fp, bytes_c = model_bytes(model), model_bytes(student)
    metrics = {
        "recipe": cfg.recipe.value, "pruned": cfg.prune,
        "model_bytes": bytes_c, "model_bytes_fp32": bytes_fp, "model_bytes_ratio": bytes_c / bytes_fp,
        "quality_fp32": before.to_dict(), "quality": after.to_dict(),
        "top1_loss_rel": (before.top1 - after.top1) / before.top1 if before.top1 > 0 else None,
        "perplexity_ratio": after.perplexity / before.perplexity,
        "data": {"fit": Split.TRAIN.value, "evaluate": Split.TEST.value},
    }
    _log(t0, f"{cfg.recipe.value}: {bytes_fp / 2**20:.1f} -> {bytes_c / 2**20:.1f} MiB; held-out top-1 "
             f"{before.top1:.4f} -> {after.top1:.4f}, perplexity {before.perplexity:.3f} -> {after.perplexity:.3f}, "
             f"KL per exit {', '.join(f'{k}: {v:.4f}' for k, v in after.kl_vs_reference.items())}")
    out = Path(cfg.run_dir) / "compressed"
    with atomic_dir(out) as tmp:
        save_compressed(student, tmp, tokenizer=src / "tokenizer.json", recipe=asdict(cfg) | {"recipe": cfg.recipe.value},
                        metrics=metrics, source={**read_exits_json(src).get("source", {}),
                                                 "compressed_from": str(src)})
    report = Path(cfg.run_dir) / "compress" / "report.json"
    report.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(report, {"config": asdict(cfg) | {"recipe": cfg.recipe.value}, "metrics": metrics, **info})
    manifest.record(STAGE, inputs={"checkpoint": src}, config=asdict(cfg) | {"recipe": cfg.recipe.value},
                    outputs={"checkpoint": out, "report": report}, metrics=metrics, seconds=time.time() - t0)
    _log(t0, f"wrote {out}")
    return 0
