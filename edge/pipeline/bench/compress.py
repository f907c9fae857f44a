"""``smartexit bench compress``: the compression recipes side by side on ONNX Runtime CPU, and llama.cpp
at the same bit-width.

Per recipe (``none`` = the distilled float model; ``shipped`` = the run's compressed model, as
``compress`` made it; any other :class:`edge.pipeline.compress.Recipe` is fitted here on the train
split, and ``+prune`` is the shipped recipe after pruning near the exits): weight bytes and ONNX bytes,
held-out quality (top-1, perplexity, each exit's agreement with its last layer, KL to the float model's
same exit), the fused graphs' parity with the torch model, decode tokens/s with exits at each batch
size (one engine per recipe, the run's exit rule, the K/V mode its certificate covers; repeats
interleaved across recipes so that drift hits all alike) and the held-out false-exit rate of each
recipe under that rule. Only the shipped recipe carries a *certified* bound (calibration ran on it);
the others are measured under the same thresholds, not re-certified, and the report says so.

llama.cpp (when ``make llamacpp`` built it): the same weights converted to GGUF and quantized by
llama.cpp itself to q8_0 (INT8) and q4_0 (INT4), batch-1 decode interleaved with ours, and its
held-out perplexity and top-1 on the same windows.

Token importance: its FLOPs saved and quality effect in prefill (torch; not yet in the served engine).
"""
from __future__ import annotations

import copy
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from edge.compress.apply import model_bytes, precision_of
from edge.compress.checkpoint import load_served, read_compress_json
from edge.compress.quality import Reference, evaluate
from edge.core.artifacts import Manifest, atomic_write_json, atomic_write_text
from edge.core.data import Split, TokenCorpus, load_split
from edge.core.errors import ConfigError
from edge.model.exits import MultiExitModel, load_multi_exit
from edge.model.tokenizer import load_tokenizer
from edge.pipeline.bench.decode_measure import false_exits
from edge.runtime.batch import run_batch
from edge.pipeline.bench.float_graphs import float_graphs
from edge.pipeline.bench.llamacpp_gguf import SAME_PRECISION
from edge.pipeline.bench.quiesce import settle
from calibration.freerun import Served
from edge.pipeline.compress import CompressConfig, Recipe, compress, fit_windows
from edge.pipeline.run import open_run
from edge.runtime.backend import make_backend
from edge.runtime.graphs import NGRAM_TABLE, load_ngram_table
from edge.runtime.rules import NeverExit
from exporters.onnx_config import ExportConfig
from exporters.onnx_export import export_onnx
from exporters.fused_parity import FUSED_RTOL, check_fused_parity
from exporters.parity import QUANT_RTOL

STAGE = "bench_compress"
SHIPPED, NONE, PRUNED = "shipped", "none", "+prune"


@dataclass
class CompressBenchConfig:
    run_dir: str = "artifacts/demo"
    recipes: list[str] = field(default_factory=lambda: [NONE, SHIPPED])
    batch_sizes: list[int] = field(default_factory=lambda: [1, 16])
    prompt_tokens: int = 64
    new_tokens: int = 32
    batch1_prompts: int = 4
    repeats: int = 3
    eval_windows: int = 24
    false_exit_prompts: int = 16  # held-out prompts whose exits are judged against the recipe's own full depth
    memory: bool = True  # peak resident memory of each recipe's engine (a fresh process each)
    llamacpp: bool = True
    peer_types: list[str] = field(default_factory=lambda: ["q8_0", "q4_0"])
    token_importance: bool = True
    ti_skip_from_layer: int = 6
    ti_keep_fraction: float = 0.5
    ti_score: str = "combined"
    ti_windows: int = 16
    threads: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        allowed = {NONE, SHIPPED, PRUNED} | {r.value for r in Recipe}
        bad = [r for r in self.recipes if r not in allowed]
        if bad or not self.recipes:
            raise ConfigError(f"bench.recipes must be a non-empty list of {sorted(allowed)}, got {self.recipes}")
        if not self.batch_sizes or min(self.batch_sizes) < 1 or self.repeats < 1 or self.new_tokens < 2:
            raise ConfigError("bench compress: batch_sizes >= 1, repeats >= 1 and new_tokens >= 2 are required")


def _log(t0: float, msg: str) -> None:
    print(f"[bench compress {time.time() - t0:6.1f}s] {msg}", flush=True)


def onnx_bytes(graphs_dir: Path) -> int:
    """Bytes of the fused graphs the CPU engine loads (segments, head, K/V fills)."""
    return sum(p.stat().st_size for p in (graphs_dir / "fused").glob("*.onnx*"))


def build_models(cfg: CompressBenchConfig, manifest: Manifest, t0: float) -> tuple[dict[str, MultiExitModel], dict]:
    distilled = manifest.verified_output("distill", "checkpoint")
    fp = load_multi_exit(distilled)
    served = manifest.served_checkpoint()
    meta = read_compress_json(served)
    shipped_recipe = (meta or {}).get("recipe", {})
    models, fitted = {}, {}
    windows = None
    for name in cfg.recipes:
        if name == NONE:
            models[name] = fp
        elif name == SHIPPED:
            models[name] = load_served(served)
        else:
            if windows is None:
                windows = fit_windows(load_tokenizer(distilled), CompressConfig(seed=cfg.seed))
            base = {k: v for k, v in shipped_recipe.items() if k in CompressConfig.__dataclass_fields__}
            base.pop("run_dir", None)
            ccfg = CompressConfig(**{**base, "prune": True} if name == PRUNED else {**base, "recipe": name, "prune": False})
            models[name], fitted[name] = compress(fp, windows, ccfg, t0)
            _log(t0, f"fitted {name}")
    return models, {"shipped_recipe": shipped_recipe, "fitted": fitted}


def recipe_rows(cfg: CompressBenchConfig, manifest: Manifest, models: dict[str, MultiExitModel], ref: Reference,
                prompts_parity: list[list[int]], work: Path, t0: float) -> tuple[dict[str, dict[str, Any]], dict, dict]:
    """Per recipe: bytes, held-out quality, its graphs (exported and parity-gated here unless the run's own or the
    float model's) and an ONNX Runtime backend over them. Returns (rows, backends, graphs by recipe)."""
    rows: dict[str, dict[str, Any]] = {}
    backends, graphs_of = {}, {}
    for name, m in models.items():
        q = evaluate(m, ref)
        quantized = precision_of(m) != "fp32"
        if name == SHIPPED:  # the run's own export, gated by the export stage
            graphs = manifest.verified_output("export", "graphs")
            fused = manifest.stage("export")["metrics"].get("parity_fused") or {}
            passed, ties, worst = fused.get("passed"), fused.get("near_ties", 0), None
        elif name == NONE:  # the float model's graphs, shared with the energy benchmark (gated when exported)
            graphs = float_graphs(manifest, prompts_parity)["exits"]
            passed, ties, worst = True, 0, None
        else:
            graphs = work / name
            export_onnx(m, graphs, ExportConfig(), checkpoint_sha256="bench")
            par = check_fused_parity(m, graphs, prompts_parity, rtol=QUANT_RTOL if quantized else FUSED_RTOL,
                                     allow_near_ties=quantized)
            passed, ties, worst = par.passed, par.near_ties, par.worst(3)
        rows[name] = {"precision": precision_of(m), "model_bytes": model_bytes(m), "onnx_bytes": onnx_bytes(graphs),
                      "quality": q.to_dict(), "parity_passed": passed, "parity_near_ties": ties, "parity_worst": worst}
        backends[name] = make_backend("onnxruntime", graphs_dir=graphs, threads=cfg.threads)
        graphs_of[name] = graphs
        _log(t0, f"{name}: {rows[name]['precision']}, {rows[name]['model_bytes'] / 2**20:.1f} MiB, top-1 {q.top1:.4f}, "
                 f"perplexity {q.perplexity:.3f}, parity {'passed' if passed else 'FAILED'}")
    return rows, backends, graphs_of


def measure_speed(cfg: CompressBenchConfig, run: Any, models: dict[str, MultiExitModel], peers: dict[str, Any],
                  backends: dict[str, Any], t0: float) -> tuple[dict[str, dict[str, list[float]]], dict[str, list[int]]]:
    """Decode tokens/s per recipe and batch size (and the llama.cpp peers at batch 1), recipes interleaved per
    repeat; the exit layers seen at batch 1."""
    rule, kv_mode = run.rule, run.kv_mode
    speed: dict[str, dict[str, list[float]]] = {n: {} for n in [*models, *peers]}
    exits_seen: dict[str, list[int]] = {n: [] for n in models}
    for b in cfg.batch_sizes:
        n_prompts = cfg.batch1_prompts if b == 1 else b
        prompts = run.prompts(n_prompts, cfg.prompt_tokens, cfg.seed)
        groups = [prompts[i:i + b] for i in range(0, len(prompts), b)]
        for name in models:  # warm-up
            run_batch(backends[name], rule, groups[0], 4, kv_mode)
        for _ in range(cfg.repeats):
            for name in models:
                settle()  # the last system's threads stop spinning first (edge/pipeline/bench/quiesce.py)
                secs = 0.0
                for g in groups:
                    res = run_batch(backends[name], rule, g, cfg.new_tokens, kv_mode)
                    secs += res.seconds
                    if b == 1:
                        exits_seen[name] += [e for seq in res.exit_layers for e in seq]
                speed[name].setdefault(str(b), []).append(n_prompts * cfg.new_tokens / secs)
            if b == 1:
                for qt, peer in peers.items():
                    settle()
                    secs = sum(peer.generate(p, cfg.new_tokens).seconds for p in prompts)
                    speed[qt].setdefault("1", []).append(n_prompts * cfg.new_tokens / secs)
        _log(t0, f"batch {b}: " + ", ".join(f"{n} {np.median(v[str(b)]):.0f} tok/s" for n, v in speed.items()
                                            if str(b) in v))
    return speed, exits_seen


def judge_exits(cfg: CompressBenchConfig, run: Any, models: dict[str, MultiExitModel], backends: dict[str, Any],
                rows: dict[str, dict[str, Any]], speed: dict[str, dict[str, list[float]]],
                exits_seen: dict[str, list[int]]) -> None:
    """Each recipe's engine at full depth against its torch model, and its exits against its own full depth."""
    rule, kv_mode = run.rule, run.kv_mode
    judged = run.prompts(cfg.false_exit_prompts, cfg.prompt_tokens, cfg.seed + 3)
    for name, m in models.items():
        # the served engine at full depth against the torch model it was exported from: tokens where they differ
        # without any exit (for a quantized model: near ties rounded apart; 0 for float graphs). Diagnostic only:
        # calibration certifies, and the rows below judge, the engine against its own full depth
        full = run_batch(backends[name], NeverExit(), judged, cfg.new_tokens, kv_mode)
        gap, gap_total = false_exits(Served.torch(m), judged, full, kv_mode)
        rows[name]["full_depth_mismatch_vs_torch"] = gap / max(gap_total, 1)
        # exits judged as calibration judges them: against the served engine itself at full depth
        res = run_batch(backends[name], rule, judged, cfg.new_tokens, kv_mode)
        wrong, total = false_exits(Served(backends[name]), judged, res, kv_mode)
        nl = m.num_layers
        rows[name].update({
            "tokens_per_s": {k: float(np.median(v)) for k, v in speed[name].items()},
            "false_exit_rate_heldout": wrong / max(total, 1), "false_exit_tokens": total,
            "layers_skipped_frac": float(np.mean([(nl - e) / nl for e in exits_seen[name]])) if exits_seen[name] else 0.0,
        })


def main(cfg: CompressBenchConfig) -> int:
    t0 = time.time()
    run = open_run(cfg.run_dir, cfg.threads)
    manifest, served, thresholds, table, tok = run.manifest, run.path, run.thresholds, run.table, run.tokenizer
    models, info = build_models(cfg, manifest, t0)
    test = load_split(Split.TEST)
    ref = Reference(models.get(NONE) or load_multi_exit(manifest.verified_output("distill", "checkpoint")),
                    torch.from_numpy(TokenCorpus(tok, test).draw(cfg.eval_windows, 128, cfg.seed).ids))
    work = Path(cfg.run_dir) / "bench" / "compress_graphs"
    shutil.rmtree(work, ignore_errors=True)
    rows, backends, graphs_of = recipe_rows(cfg, manifest, models, ref, run.prompts(3, 32, cfg.seed + 7), work, t0)
    # every recipe runs the run's rule, whose context lookup may fall back to the run's export's corpus table
    export_dir = Path(manifest.verified_output("export", "graphs"))
    corpus = load_ngram_table(export_dir)
    for backend in backends.values():
        backend.ngram_table = corpus
    peers = _peers(cfg, manifest, tok, ref, rows, t0) if cfg.llamacpp else {}
    speed, exits_seen = measure_speed(cfg, run, models, peers, backends, t0)
    if cfg.memory:  # a fresh process per recipe, at the largest batch
        from edge.pipeline.bench.engine_memory import peak_rss_mib

        b = max(cfg.batch_sizes)
        prompts = run.prompts(b, cfg.prompt_tokens, cfg.seed)
        for name in models:
            rows[name]["peak_rss_mib"] = peak_rss_mib(graphs_of[name], thresholds, served, prompts, cfg.new_tokens,
                                                      cfg.threads, None if corpus is None else export_dir / NGRAM_TABLE)
            rows[name]["peak_rss_batch"] = b
    judge_exits(cfg, run, models, backends, rows, speed, exits_seen)
    for qt in peers:
        rows[f"llamacpp_{qt}"].update({"tokens_per_s": {k: float(np.median(v)) for k, v in speed[qt].items()}})
        peers[qt].close()
    summary = _summary(cfg, rows, table, info, manifest.stage("calibrate").get("metrics", {}))
    if cfg.token_importance:
        summary["token_importance"] = _token_importance(cfg, models.get(NONE) or load_multi_exit(
            manifest.verified_output("distill", "checkpoint")), tok, test)
    out = Path(cfg.run_dir) / "bench"
    result = {"config": asdict(cfg), "rows": rows, "summary": summary, **info}
    atomic_write_json(out / "compress.json", result)
    from edge.pipeline.bench.compress_report import render_markdown, plot

    atomic_write_text(out / "compress.md", render_markdown(result))
    plot(result, out / "compress.png")
    shutil.rmtree(work, ignore_errors=True)
    manifest.record(STAGE, inputs={"checkpoint": served, "thresholds": thresholds}, config=asdict(cfg),
                    outputs={"json": out / "compress.json", "markdown": out / "compress.md"},
                    metrics=summary, seconds=time.time() - t0)
    _log(t0, f"wrote {out / 'compress.json'}: " + ", ".join(f"{k} {v:.3f}" for k, v in summary.items()
                                                          if isinstance(v, float)))
    return 0


def _peers(cfg: CompressBenchConfig, manifest: Manifest, tok, ref: Reference, rows: dict, t0: float) -> dict:
    """llama.cpp at each of ``cfg.peer_types`` on the distilled weights, with its held-out quality."""
    from edge.pipeline.bench import llamacpp, llamacpp_gguf, llamacpp_peer, llamacpp_quality, llamacpp_tokenizer

    why = llamacpp.available()
    if why is not None:
        _log(t0, f"llama.cpp skipped: {why}")
        return {}
    distilled = manifest.verified_output("distill", "checkpoint")
    src = llamacpp_gguf.cached_gguf(cfg.run_dir, distilled, "f32")
    llamacpp_tokenizer.verify_tokenizer(distilled, src)
    peers = {}
    for qt in cfg.peer_types:
        gguf = llamacpp_gguf.cached_quantized_gguf(cfg.run_dir, distilled, qt)
        peer = llamacpp_peer.LlamaCppPeer(gguf, cfg.threads)
        pq = llamacpp_quality.peer_perplexity(peer, ref.windows.numpy())
        rows[f"llamacpp_{qt}"] = {"precision": qt, "gguf_bytes": llamacpp_gguf.gguf_bytes(gguf),
                                  "tensor_types": llamacpp_gguf.tensor_type_counts(
                                      llamacpp_gguf.gguf_tensor_types(gguf)),
                                  "quality": pq.to_dict()}
        peers[qt] = peer
        _log(t0, f"llama.cpp {qt}: {rows[f'llamacpp_{qt}']['gguf_bytes'] / 2**20:.1f} MiB, {pq.to_dict()}")
    return peers


def _summary(cfg: CompressBenchConfig, rows: dict, table, info: dict, calib: dict) -> dict[str, Any]:
    s: dict[str, Any] = {}
    if NONE in rows:
        base = rows[NONE]
        for name, r in rows.items():
            if name.startswith("llamacpp") or name == NONE:
                continue
            key = "" if name == SHIPPED else f"_{name}"
            b1 = base["quality"]["top1"]
            s[f"accuracy_loss_rel_full_depth{key}"] = ((b1 - r["quality"]["top1"]) / b1 if b1 > 0
                                                       else 0.0 if r["quality"]["top1"] == 0 else None)
            s[f"model_bytes_ratio{key}"] = r["model_bytes"] / base["model_bytes"]
            for b in r.get("tokens_per_s", {}):
                s[f"speedup_vs_fp32_b{b}{key}"] = r["tokens_per_s"][b] / base["tokens_per_s"][b]
    if SHIPPED in rows:
        # the float model at full depth vs the served compressed model with its certified exits, on the
        # calibration stage's held-out evaluation prompts (teacher-forced); else the full-depth loss
        s["accuracy_loss_rel"] = calib.get("accuracy_loss_rel_vs_float_model", s.get("accuracy_loss_rel_full_depth"))
        s["false_exit_bound"] = table.certificate.get("bound")
        if NONE in rows and rows[SHIPPED].get("peak_rss_mib") and rows[NONE].get("peak_rss_mib"):
            s["peak_rss_ratio_vs_fp32"] = rows[SHIPPED]["peak_rss_mib"] / rows[NONE]["peak_rss_mib"]
        s["false_exit_rate_heldout"] = rows[SHIPPED]["false_exit_rate_heldout"]
        s["full_depth_mismatch_vs_torch"] = rows[SHIPPED]["full_depth_mismatch_vs_torch"]
        peer = SAME_PRECISION.get(rows[SHIPPED]["precision"])
        if peer and f"llamacpp_{peer}" in rows and "1" in rows[SHIPPED]["tokens_per_s"]:
            s["speedup_vs_llamacpp_same_bits_b1"] = (rows[SHIPPED]["tokens_per_s"]["1"]
                                                     / rows[f"llamacpp_{peer}"]["tokens_per_s"]["1"])
            s["llamacpp_same_bits"] = peer
            s["perplexity_vs_llamacpp_same_bits"] = (rows[SHIPPED]["quality"]["perplexity"]
                                                     / rows[f"llamacpp_{peer}"]["quality"]["perplexity"])
    return s


def _token_importance(cfg: CompressBenchConfig, model: MultiExitModel, tok, test) -> dict[str, Any]:
    from edge.compress.token_importance import TokenImportanceConfig, evaluate_token_importance

    windows = TokenCorpus(tok, test).draw(cfg.ti_windows, cfg.prompt_tokens * 2 + 32, cfg.seed + 11).ids
    out = {}
    for score in (cfg.ti_score, "recency"):
        tcfg = TokenImportanceConfig(skip_from_layer=cfg.ti_skip_from_layer, keep_fraction=cfg.ti_keep_fraction,
                                     score=score)
        out[score] = evaluate_token_importance(copy.deepcopy(model), windows, tcfg, continuation=32).to_dict()
    return out
