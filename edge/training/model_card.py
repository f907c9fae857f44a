"""Model card of the bundled tiny model, from ``training.json`` and a decode-time measurement.

"Compute, not dispatch, dominates decode time" is measured, not assumed: one
decode step (KV cache of ``past`` tokens) of the real model is timed against a
*skeleton* with the same graph (same layer count, same ops) but all widths
shrunk to a few units, whose time is almost pure framework dispatch. The
compute share is 1 - t(skeleton) / t(model).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from edge.core.artifacts import atomic_write_text
from edge.model.bundled import BUNDLED_DIR
from edge.model.checkpoint import load_decoder
from edge.model.config import ModelConfig
from edge.core.data import DATA_DIR
from edge.model.decoder import Decoder, attention_mask


@dataclass
class StepTiming:
    batch: int
    model_ms: float
    skeleton_ms: float

    @property
    def compute_share(self) -> float:
        return 1.0 - self.skeleton_ms / self.model_ms


def skeleton_config(cfg: ModelConfig) -> ModelConfig:
    """Same depth and op graph, negligible arithmetic."""
    return replace(cfg, vocab_size=16, hidden_size=8, num_heads=2, num_kv_heads=1, head_dim=4, intermediate_size=8)


@torch.no_grad()
def decode_step_ms(model: Decoder, batch: int, past: int, reps: int = 40) -> float:
    """Median wall time (ms) of one full-depth decode step at ``batch`` with ``past`` cached tokens."""
    cfg = model.cfg
    kv = [torch.randn(batch, cfg.num_kv_heads, past, cfg.head_dim) for _ in range(cfg.num_layers)]
    pos = torch.full((batch, 1), past)
    cos, sin = model.rope(pos)
    mask = attention_mask(pos, torch.arange(past + 1).unsqueeze(0).expand(batch, -1))
    ids = torch.zeros(batch, 1, dtype=torch.long)

    def step():
        h = model.embed(ids)
        for j, layer in enumerate(model.layers):
            h, _, _ = layer(h, cos, sin, kv[j], kv[j], mask)
        return model.head(h)

    return _median_ms(step, reps)


def _median_ms(step, reps: int, warmup: int = 5) -> float:
    """Median wall time of ``step()`` in ms over ``reps`` calls after ``warmup`` calls."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    times.sort()
    return 1e3 * times[len(times) // 2]


def ort_decode_step_ms(model: Decoder, batch: int, past: int, threads: int, reps: int = 40) -> float:
    """The same step in ONNX Runtime: the full-depth segment graph exported by ``exporters.onnx_export``
    and the LM head graph on its exit hidden state."""
    import tempfile

    import numpy as np
    import onnxruntime as ort

    from edge.model.exits import ExitConfig, MultiExitModel
    from edge.runtime.ortsession import session_options
    from exporters.onnx_config import ExportConfig
    from exporters.onnx_export import export_onnx

    cfg = model.cfg
    with tempfile.TemporaryDirectory() as tmp:
        full = MultiExitModel(model, ExitConfig(layers=[cfg.num_layers], adapter_rank=0)).eval()
        export_onnx(full, Path(tmp) / "g", ExportConfig(), checkpoint_sha256="timing-only")
        opts = session_options(ort, threads)
        sess = ort.InferenceSession(str(Path(tmp) / "g" / "segment_0.onnx"), opts, providers=["CPUExecutionProvider"])
        head = ort.InferenceSession(str(Path(tmp) / "g" / "head.onnx"), opts, providers=["CPUExecutionProvider"])

        def step() -> None:
            eh = sess.run(["exit_hidden"], feeds)[0]
            head.run(None, {"exit_hidden": eh})
        rng = np.random.default_rng(0)
        feeds = {"hidden": rng.standard_normal((batch, 1, cfg.hidden_size), np.float32),
                 "positions": np.full((batch, 1), past, np.int64),
                 "attn_mask": np.zeros((batch, 1, 1, past + 1), np.float32),
                 "exit_index": np.zeros(batch, np.int64)}
        for j in range(cfg.num_layers):
            for kind in ("key", "value"):
                feeds[f"past_{kind}_{j}"] = rng.standard_normal((batch, cfg.num_kv_heads, past, cfg.head_dim),
                                                                np.float32)
        return _median_ms(step, reps)


def measure(model: Decoder, batches=(1, 16), past: int = 256, threads: int = 2) -> dict[str, list[StepTiming]]:
    """Step timings of the model and its skeleton, in PyTorch eager and in ONNX Runtime."""
    skel = Decoder(skeleton_config(model.cfg)).eval()
    return {
        "PyTorch eager": [StepTiming(b, decode_step_ms(model, b, past), decode_step_ms(skel, b, past))
                          for b in batches],
        "ONNX Runtime (CPU)": [StepTiming(b, ort_decode_step_ms(model, b, past, threads),
                                          ort_decode_step_ms(skel, b, past, threads)) for b in batches],
    }


def write_model_card(folder: Path = BUNDLED_DIR, threads: int = 2) -> Path:
    torch.set_num_threads(threads)
    info = json.loads((folder / "training.json").read_text())
    s = info["summary"]
    c = s["config"]
    model = load_decoder(folder)
    cfg = model.cfg
    timings = measure(model, threads=threads)
    size_mb = sum(f.stat().st_size for f in folder.iterdir() if f.suffix in (".safetensors", ".json")) / 2**20
    split = s["split"]
    rows = "\n".join(f"| {rt} | {t.batch} | {t.model_ms:.2f} | {t.skeleton_ms:.2f} | {t.compute_share:.2f} |"
                     for rt, ts in timings.items() for t in ts)
    text = f"""# SmartExit tiny: model card

A 12-layer Llama-architecture decoder trained from scratch by this project, shipped so that
the pipeline runs with no download. It writes Python: it was trained on the source code of the
Python standard library.

| | |
| --- | --- |
| architecture | `LlamaForCausalLM`: {cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_heads} query / {cfg.num_kv_heads} key-value heads (GQA, head dim {cfg.head_dim}), SwiGLU MLP {cfg.intermediate_size}, RMSNorm, RoPE theta {cfg.rope.theta:g}, tied embeddings |
| parameters | {s['params']:,} |
| context window | {cfg.max_position_embeddings} tokens |
| tokenizer | byte-level BPE (`tokenizers`), {cfg.vocab_size} tokens, `<|endoftext|>` = id 0 |
| weights | `model.safetensors`, float16 ({size_mb:.1f} MB with config and tokenizer) |
| training | {c['steps']} steps x {c['batch_size']} sequences x {c['seq_len']} tokens = **{s['tokens_seen']:,} tokens seen**; AdamW (beta 0.9/0.95, wd {c['weight_decay']}), lr {c['lr']:g} with {c['warmup']} warm-up steps and a cosine decay towards {c['min_lr']:g} over a {c.get('schedule_steps', c['steps'])}-step horizon, stopped at step {c['steps']} (lr {info['log'][-1]['lr']:.2g} there), grad clip {c['grad_clip']}, seed {c['seed']}; {s['train_seconds'] / 60:.0f} min wall time on 2 CPU cores shared with other work |
| final training loss | {s['final_train_loss']:.3f} nats/token (mean of the last 20 steps) |
| held-out perplexity | **{s['heldout_ppl']:.3f}** (test split, {s['heldout_tokens']:,} tokens, windows of {c['seq_len']}) |
| held-out top-1 next-token accuracy | **{s['heldout_top1']:.4f}** |

![training loss](loss.png)

## Data

Every `.py` file of the CPython {split_python(folder)} standard library (site-packages excluded),
split by file: `bucket = int(sha256(relative path)[:8], 16) % 100`; buckets 0-3 calibration,
4-7 test, the rest train. Train: {split['train']['files']} files ({split['train']['bytes'] / 1e6:.1f} MB);
calibration: {split['calibration']['files']} files ({split['calibration']['bytes'] / 1e6:.2f} MB);
test: {split['test']['files']} files ({split['test']['bytes'] / 1e6:.2f} MB). The calibration and
test text ship in `edge/assets/data/` (xz JSON lines, file lists in `split.json`), so every machine
evaluates on the same bytes; training reads the interpreter's own files, so `make train-tiny`
reproduces these weights exactly only on Python {split_python(folder)}.

## Is decode time compute or dispatch?

One full-depth decode step with 256 cached tokens on this machine's CPU ({threads} threads),
median of 40: the real model against a skeleton with the same {cfg.num_layers}-layer graph and
every width shrunk to a few units, whose time is framework dispatch. Measured when the card
was written, in PyTorch eager (the reference) and in ONNX Runtime (the embedded runtime).

| runtime | batch | model (ms) | skeleton (ms) | compute share |
| --- | ---: | ---: | ---: | ---: |
{rows}

{_verdict(timings)}

Reproduce: `make train-tiny` (seeded; resumes from `runs/train-tiny/checkpoint.pt`).
"""
    return atomic_write_text(folder / "MODEL_CARD.md", text)


def split_python(folder: Path) -> str:
    return json.loads((DATA_DIR / "split.json").read_text())["python"]


def _verdict(timings: dict[str, list[StepTiming]]) -> str:
    lines = []
    for runtime, ts in timings.items():
        parts = "; ".join(f"batch {t.batch}: {100 * t.compute_share:.0f}% arithmetic" for t in ts)
        worst = min(t.compute_share for t in ts)
        head = ("per-token compute dominates decode time" if worst >= 0.6 else
                "compute is the larger share of decode time" if worst > 0.5 else
                "framework dispatch is a large share of decode time")
        lines.append(f"- {runtime}: {head} ({parts}).")
    return "\n".join(lines)


if __name__ == "__main__":
    print(write_model_card())
