"""``smartexit export``: ONNX graphs of the run's multi-exit checkpoint, gated on parity with torch.

The export goes to ``<run_dir>/onnx``; the parity report (max abs diff per
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


from edge.artifacts import sha256_path
from edge.data import Split, heldout_prompts, load_split
from edge.run import open_run
from exporters.onnx_export import ExportConfig, export_onnx
from exporters.parity import PARITY_ATOL, PARITY_RTOL, check_parity, require_parity

STAGE = "export"


@dataclass
class ExportStageConfig:
    run_dir: str = "artifacts/demo"
    opset: int = 17
    parity_prompts: int = 4
    prompt_tokens: int = 48
    atol: float = PARITY_ATOL
    rtol: float = PARITY_RTOL
    seed: int = 0
    threads: int = 2


def main(cfg: ExportStageConfig) -> int:
    t0 = time.time()
    run = open_run(cfg.run_dir, cfg.threads)
    manifest, ckpt, model, tok = run.manifest, run.path, run.model, run.tokenizer
    prompts = heldout_prompts(tok, load_split(Split.TEST), cfg.parity_prompts, cfg.prompt_tokens, cfg.seed)
    out = Path(cfg.run_dir) / "onnx"
    # export beside the final folder, gate, and only then swap it in
    staging = Path(tempfile.mkdtemp(prefix=".onnx-staging.", dir=cfg.run_dir))
    try:
        graphs = staging / "onnx"
        exported = export_onnx(model, graphs, ExportConfig(opset=cfg.opset), checkpoint_sha256=sha256_path(ckpt))
        report = check_parity(model, graphs, prompts, atol=cfg.atol, rtol=cfg.rtol)
        require_parity(report)
        if out.exists():
            shutil.rmtree(out)
        graphs.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    metrics = {"graphs": len(exported.graphs), "opset": cfg.opset, "export_seconds": exported.seconds,
               "parity": report.to_dict()}
    manifest.record(STAGE, inputs={"checkpoint": ckpt}, config=asdict(cfg), outputs={"graphs": out},
                    metrics=metrics, seconds=time.time() - t0)
    worst = report.worst(1)[0]
    print(f"exported {len(exported.graphs)} ONNX graphs to {out}; parity passed (argmax agreement "
          f"{report.argmax_agreement:.2%}, worst max abs diff {worst[0]}/{worst[1]} {worst[2]:.2e})")
    return 0
