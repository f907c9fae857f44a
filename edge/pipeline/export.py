"""``smartexit export``: ONNX graphs of the run's multi-exit checkpoint, gated on parity with torch.

The export goes to ``<run_dir>/onnx``, and the same decoder without exit heads (one
segment, the final head: the no-exit baseline the benchmark compares with) to
``<run_dir>/onnx_full``; the parity reports (max abs diff per
graph and output, argmax agreement on held-out prompts) is recorded in the
manifest. A failed gate removes nothing that was there before, records
nothing, and stops the pipeline with the numbers (exit code 2).
"""
from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path


from edge.core.artifacts import sha256_path
from edge.core.data import Split, heldout_prompts, load_split
from edge.model.exits import ExitConfig, MultiExitModel
from edge.pipeline.run import open_run
from exporters.onnx_export import ExportConfig, export_onnx
from edge.compress.apply import quant_linears
from exporters.parity import (FUSED_RTOL, PARITY_ATOL, PARITY_RTOL, QUANT_RTOL, check_fused_parity, check_parity,
                              require_parity)

STAGE = "export"


@dataclass
class ExportStageConfig:
    run_dir: str = "artifacts/demo"
    opset: int = 17
    parity_prompts: int = 4
    prompt_tokens: int = 48
    atol: float = PARITY_ATOL
    rtol: float = PARITY_RTOL
    fused_rtol: float = FUSED_RTOL  # the fused ONNX Runtime graphs, relative to each output's scale
    quant_rtol: float = QUANT_RTOL  # a quantized model's graphs (both kinds), relative to each output's scale
    seed: int = 0
    threads: int = 2
    # mode exact's corpus drafts: an n-gram table of the training split (edge/model/ngram.py) in the exits
    # export; n-grams seen at least ngram_min_count times whose most frequent successor has ngram_min_share
    ngram_table: bool = True
    ngram_min_count: int = 2
    ngram_min_share: float = 0.5


def write_ngram_table(tok, folder: Path, min_count: int, min_share: float) -> dict[str, int]:
    """Build the corpus n-gram table from the training split only (the calibration and test splits are
    never drafted from) into ``folder``; returns the entries per n."""
    import numpy as np

    from edge.model.ngram import NGRAM_FILE, build_table, save_table

    docs = load_split(Split.TRAIN)
    seqs = [np.asarray(e.ids, np.int64) for e in tok.encode_batch([d.text for d in docs])]
    arrays = build_table(seqs, tok.get_vocab_size(), min_count, min_share)
    save_table(folder / NGRAM_FILE, arrays)
    return {k: int(len(v)) for k, v in arrays.items() if k.startswith("keys_")}


def full_depth(model: MultiExitModel) -> MultiExitModel:
    """The same decoder with no decision exits: one segment, the final head only (the no-exit baseline)."""
    return MultiExitModel(model.backbone, ExitConfig(layers=[model.num_layers], adapter_rank=0)).eval()


def main(cfg: ExportStageConfig) -> int:
    t0 = time.time()
    run = open_run(cfg.run_dir, cfg.threads)
    manifest, ckpt, model, tok = run.manifest, run.path, run.model, run.tokenizer
    prompts = heldout_prompts(tok, load_split(Split.TEST), cfg.parity_prompts, cfg.prompt_tokens, cfg.seed)
    full = full_depth(model)
    quantized = any(True for _ in quant_linears(model))  # a compressed model: tolerances of QUANT_RTOL
    outs, reports, counts = {}, {}, {}
    # export beside the final folders, gate both, and only then swap them in
    staging = Path(tempfile.mkdtemp(prefix=".onnx-staging.", dir=cfg.run_dir))
    try:
        for key, name, m in (("graphs", "onnx", model), ("graphs_full", "onnx_full", full)):
            exported = export_onnx(m, staging / name, ExportConfig(opset=cfg.opset), checkpoint_sha256=sha256_path(ckpt))
            reports[key] = check_parity(m, staging / name, prompts, atol=cfg.atol, rtol=cfg.rtol,
                                        scale_rtol=cfg.quant_rtol if quantized else None)
            require_parity(reports[key])
            if exported.fused:
                reports[f"{key}_fused"] = check_fused_parity(
                    m, staging / name, prompts, rtol=cfg.quant_rtol if quantized else cfg.fused_rtol,
                    allow_near_ties=quantized)
                require_parity(reports[f"{key}_fused"])
            counts[key] = len(exported.graphs) + len(exported.fused)
        ngram = (write_ngram_table(tok, staging / "onnx", cfg.ngram_min_count, cfg.ngram_min_share)
                 if cfg.ngram_table else None)
        for key, name in (("graphs", "onnx"), ("graphs_full", "onnx_full")):
            outs[key] = Path(cfg.run_dir) / name
            if outs[key].exists():
                shutil.rmtree(outs[key])
            (staging / name).rename(outs[key])
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    report = reports["graphs"]
    metrics = {"graphs": counts["graphs"], "graphs_full": counts["graphs_full"], "opset": cfg.opset,
               "parity": report.to_dict(), "parity_full": reports["graphs_full"].to_dict(),
               "parity_fused": reports["graphs_fused"].to_dict() if "graphs_fused" in reports else None,
               "fused_skipped": exported.fused_skipped, "ngram_table": ngram}
    manifest.record(STAGE, inputs={"checkpoint": ckpt}, config=asdict(cfg), outputs=outs,
                    metrics=metrics, seconds=time.time() - t0)
    worst = report.worst(1)[0]
    print(f"exported {counts['graphs']} ONNX graphs to {outs['graphs']} and the {counts['graphs_full']} "
          f"full-depth graphs (no exit heads, the baseline) to {outs['graphs_full']}; parity passed "
          f"(argmax agreement {report.argmax_agreement:.2%}, worst max abs diff {worst[0]}/{worst[1]} {worst[2]:.2e})")
    return 0
