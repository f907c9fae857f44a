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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from edge.core.artifacts import sha256_path
from edge.core.errors import ConfigError
from edge.core.data import Split, heldout_prompts, load_split
from edge.model.exits import ExitConfig, MultiExitModel
from edge.pipeline.run import open_run
from exporters.onnx_config import ExportConfig
from exporters.onnx_export import export_onnx
from edge.compress.apply import quant_linears
from exporters.fused_parity import FUSED_RTOL, check_fused_parity
from exporters.parity import PARITY_ATOL, PARITY_RTOL, QUANT_RTOL, check_parity, require_parity

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
    # export; n-grams of the text seen at least ngram_min_count times whose most frequent successor has
    # ngram_min_share, under those of the model's own greedy continuations (ngram_new_tokens each) of
    # ngram_windows training windows of ngram_window_tokens (0 windows: the text alone), both from a seeded
    # ngram_text_share of the training documents (1: all). ~33 s on a 2-core AMD EPYC VM, 45 s with windows of 64
    # tokens, which drafted no better; half the documents saved 7 s more but drafted 5% slower (docs/runtime.md)
    ngram_table: bool = True
    ngram_min_count: int = 2
    ngram_min_share: float = 0.5
    ngram_windows: int = 2048
    ngram_window_tokens: int = 16
    ngram_new_tokens: int = 32
    ngram_text_share: float = 1.0

    def __post_init__(self) -> None:
        if self.ngram_windows < 0 or self.ngram_window_tokens < 1 or self.ngram_new_tokens < 1:
            raise ConfigError(f"export: ngram_windows ({self.ngram_windows}) must be >= 0, ngram_window_tokens "
                              f"({self.ngram_window_tokens}) and ngram_new_tokens ({self.ngram_new_tokens}) >= 1")
        if not 0.0 < self.ngram_text_share <= 1.0:
            raise ConfigError(f"export: ngram_text_share must be in (0, 1], got {self.ngram_text_share}")


def text_ngrams(tok, min_count: int, min_share: float, seed: int = 0, text_share: float = 1.0
                ) -> tuple[list["np.ndarray"], dict[str, "np.ndarray"]]:
    """The training split's token sequences (a seeded ``text_share`` of its documents) and their n-gram table
    (:func:`write_ngram_table`'s text part). Encoding the split is most of it (29.6 MB of text: 12 s on both cores
    of the 2-core Intel VM, 24 CPU-s), and the tokenizer leaves the GIL while it encodes, so the export runs this in
    a thread of its own beside the graphs' export."""
    import numpy as np

    from edge.model.ngram import TEXT_ORDER, build_table

    docs = load_split(Split.TRAIN)
    if text_share < 1.0:
        pick = np.random.default_rng(seed).permutation(len(docs))[:max(1, round(text_share * len(docs)))]
        docs = [docs[i] for i in sorted(pick)]
    seqs = [np.asarray(e.ids, np.int64) for e in tok.encode_batch([d.text for d in docs])]
    return seqs, build_table(seqs, tok.get_vocab_size(), min_count, min_share, order=TEXT_ORDER)


def write_ngram_table(tok, folder: Path, min_count: int, min_share: float,
                      continue_with: Callable[[list[list[int]], int], list[list[int]]] | None = None,
                      windows: int = 0, window_tokens: int = 16, new_tokens: int = 32, seed: int = 0,
                      text_share: float = 1.0,
                      text: tuple[list["np.ndarray"], dict[str, "np.ndarray"]] | None = None) -> dict[str, int]:
    """Build the corpus n-gram table from the training split only (the calibration and test splits are
    never drafted from) into ``folder``; returns the entries per n (and the windows continued).

    ``continue_with(prompts, n)``: the model's greedy continuations of ``n`` tokens; given with ``windows``
    > 0, the table is the n-grams of those continuations of that many training windows (each window's
    last tokens and its continuation: what the model writes, not what the text did), over the text's
    n-grams where the continuations know no successor (edge/model/ngram.py). ``text_share``: the share of the
    training documents (a seeded draw) both are taken from, for a corpus too large to encode whole. ``text``:
    :func:`text_ngrams` of the same settings, already computed (None: computed here)."""
    import numpy as np

    from edge.model.ngram import NGRAM_FILE, build_table, merge_tables, order_for, save_table, training_windows

    seqs, arrays = text if text is not None else text_ngrams(tok, min_count, min_share, seed, text_share)
    vocab = tok.get_vocab_size()
    continued = 0
    if continue_with is not None and windows > 0:
        prompts = training_windows(seqs, windows, window_tokens, new_tokens, seed)
        outs = continue_with(prompts, new_tokens)
        keep = order_for(vocab)  # each continuation with the window's last n tokens before it
        own = build_table([np.asarray(p[-keep:] + list(o), np.int64) for p, o in zip(prompts, outs)], vocab,
                          min_count=1, min_share=0.5)
        arrays, continued = merge_tables(own, arrays), len(prompts)
    save_table(folder / NGRAM_FILE, arrays)
    return {**{k: int(len(v)) for k, v in arrays.items() if k.startswith("keys_")}, "model_windows": continued}


def greedy_continuations(graphs_full: Path, model: MultiExitModel, threads: int, batch: int = 128
                         ) -> Callable[[list[list[int]], int], list[list[int]]]:
    """``continue_with`` for :func:`write_ngram_table`: the full-depth export's greedy continuations on ONNX
    Runtime (its fused graphs), else the torch model's (an export without them)."""
    from edge.runtime.backend import make_backend
    from edge.runtime.batch import run_batch
    from edge.runtime.engine_config import KVMode
    from edge.runtime.graphs import load_graphs_json
    from edge.runtime.rules import NeverExit

    backend = (make_backend("onnxruntime", graphs_dir=graphs_full, threads=threads)
               if load_graphs_json(graphs_full).get("fused") else make_backend("torch", model=model))

    def continue_with(prompts: list[list[int]], n: int) -> list[list[int]]:
        out: list[list[int]] = []
        for i in range(0, len(prompts), batch):
            out += run_batch(backend, NeverExit(), prompts[i:i + batch], n, KVMode.PROPAGATE).tokens
        return out

    return continue_with


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
    # the n-gram table's text part beside the graphs' export (text_ngrams)
    text_pool = ThreadPoolExecutor(1, thread_name_prefix="text-ngrams")
    text = (text_pool.submit(text_ngrams, tok, cfg.ngram_min_count, cfg.ngram_min_share, cfg.seed,
                             cfg.ngram_text_share) if cfg.ngram_table else None)
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
        ngram = (write_ngram_table(tok, staging / "onnx", cfg.ngram_min_count, cfg.ngram_min_share,
                                   greedy_continuations(staging / "onnx_full", full, cfg.threads)
                                   if cfg.ngram_windows else None, cfg.ngram_windows,
                                   cfg.ngram_window_tokens, cfg.ngram_new_tokens, cfg.seed, cfg.ngram_text_share,
                                   text.result())
                 if text is not None else None)
        for key, name in (("graphs", "onnx"), ("graphs_full", "onnx_full")):
            outs[key] = Path(cfg.run_dir) / name
            if outs[key].exists():
                shutil.rmtree(outs[key])
            (staging / name).rename(outs[key])
    finally:
        text_pool.shutdown(cancel_futures=True)
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
