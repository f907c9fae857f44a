"""One short check on a machine with a CUDA GPU (run by deploy/gpu_check.sh; under 10 minutes).

The product path on a GPU without TensorRT engines (a Jetson before ``make jetson-engines``, a discrete
GPU) is the engine over the static-cache torch backend (edge/runtime/static_backend.py), its decode
calls captured as CUDA graphs. This script measures it and what its numbers are made of, on the
bundled model (edge/assets/tiny-ee, float32):

1. the decode step of the torch decoder on CUDA, at full depth and stopping at each exit (layers after
   the exit get their K/V by state propagation, as the engine does: CALM, Schuster et al. 2022), at
   batch 1 and 16: milliseconds per step and tokens/s;
2. that the CUDA run decodes the same greedy tokens as the CPU (full depth, batch 1);
3. one energy window of the full-depth decode on NVML (edge.energy: the GPU's energy counter), with
   the idle draw before it;
4. the static-cache decode step (edge/runtime/static_decode.py) eager and captured as CUDA graphs (one
   per segment and K/V fill, per batch bucket): ms per step at full depth and after each exit, the
   captured tokens against the eager ones, on the bundled model (exits after 3, 6, 9, float32) and on
   a random-weight model of Llama-3.1-8B's shape (bf16, exits after 8, 16, 24), with peak memory;
5. the engine itself over ``torch_static`` on CUDA, graphs vs eager: decode tokens/s at full depth and
   with every token exiting at the first decision exit (the exit-depth ceiling), tokens of the captured
   run against the eager one, graphs captured, peak memory; on both models.

Writes ``<out>/gpu_check.json``. Exit codes: 0 done, 2 no CUDA GPU (the JSON says why).
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing it


def prefill(bb, ids):
    """Full-depth prefill of ids [B, P] (causal, no past): next token [B, 1] and per-layer K/V [B, KV, P, hd]."""
    import torch

    b, p = ids.shape
    positions = torch.arange(p, device=ids.device).expand(b, p)
    cos, sin = bb.rope(positions)
    h = bb.embed(ids)
    keys, values = [], []
    for layer in bb.layers:
        h, k, v = layer(h, cos, sin, None, None, None)  # mask None: the fused causal kernel
        keys.append(k)
        values.append(v)
    return bb.head(h)[:, -1:].argmax(-1), keys, values


def decode_step(bb, token, pos: int, keys: list, values: list, exit_at: int):
    """One token [B, 1] at position ``pos`` through layers 0..exit_at-1; deeper layers get K/V from the exit's
    hidden state (state propagation); the next token is the argmax of norm + LM head at the exit."""
    import torch

    b = token.shape[0]
    positions = torch.full((b, 1), pos, device=token.device)
    cos, sin = bb.rope(positions)
    mask = torch.zeros((b, 1, 1, pos + 1), device=token.device)  # [B, 1, T, P+T]: a decode query sees every key
    h = bb.embed(token)
    for j, layer in enumerate(bb.layers):
        if j < exit_at:
            h, k, v = layer(h, cos, sin, keys[j], values[j], mask)
        else:
            k, v = layer.kv_only(h, cos, sin)
        keys[j] = torch.cat((keys[j], k), dim=2)
        values[j] = torch.cat((values[j], v), dim=2)
    return bb.head(h).argmax(-1)


def run_decode(bb, ids, steps: int, exit_at: int, sync) -> tuple[float, list[list[int]]]:
    """Seconds for ``steps`` decode steps after a prefill of ``ids``, and the tokens."""
    import torch

    with torch.no_grad():
        token, keys, values = prefill(bb, ids)
        sync()
        tokens = [token]
        t0 = time.perf_counter()
        for i in range(steps):
            token = decode_step(bb, token, ids.shape[1] + i, keys, values, exit_at)
            tokens.append(token)
        sync()
        seconds = time.perf_counter() - t0
    return seconds, torch.cat(tokens, dim=1).tolist()


def nvml_window(bb, ids, steps: int, exit_at: int, sync) -> dict[str, Any]:
    """Energy of one full-depth decode window on NVML; the reason instead where it cannot measure."""
    from edge.core.errors import SmartExitError

    try:  # edge.energy is imported here: its NVML meter needs the 'gpu' extra (nvidia-ml-py)
        from edge.energy.detect import measure_idle, open_meter

        meter = open_meter("nvml", interval_s=0.05)
    except (ImportError, SmartExitError) as exc:  # no meter: the reason is the result
        return {"available": False, "reason": f"{type(exc).__name__}: {exc}"}
    with meter:
        idle = measure_idle(meter, 2.0)
        meter.start()
        seconds, tokens = run_decode(bb, ids, steps, exit_at, sync)
        window = meter.stop()
    n = len(tokens) * steps
    return {"available": True, "idle": idle.to_dict(), "window": window.to_dict(), "tokens": n,
            "joules_per_token": None if window.joules is None else window.joules / n, "seconds": seconds}


def static_graphs(model, batches: list[int], prompt: int, steps: int, sync) -> dict[str, Any]:
    """The static-cache decode step eager and as CUDA graphs, per batch bucket: ms per step at full depth
    and exiting after each decision exit (the rest's K/V propagated), and whether replayed graphs give
    the eager tokens."""
    import torch

    from edge.runtime.static_decode import StaticDecode

    vocab = model.backbone.cfg.vocab_size
    nseg = len(model.exit_layers)
    out: dict[str, Any] = {}
    for batch in batches:
        ids = torch.randint(0, vocab, (batch, prompt), device=next(model.parameters()).device)
        row: dict[str, Any] = {}
        tokens = {}
        for mode in ("eager", "graphs"):
            torch.cuda.reset_peak_memory_stats()
            sd = StaticDecode(model, batch, prompt + steps + 2)
            first = sd.prefill(ids)
            if mode == "graphs":
                sd.capture()
            for last in [nseg - 1, *range(nseg - 1)]:  # full depth first, then exiting after each decision exit
                sd.pos.fill_(prompt)  # the same positions each time: the prompt's K/V stay
                tok, seq = first, []
                sync()
                t0 = time.perf_counter()
                for _ in range(steps):
                    tok = sd.step(tok, None if last == nseg - 1 else last)
                    seq.append(tok)
                sync()
                key = "full" if last == nseg - 1 else f"exit_{model.exit_layers[last]}"
                row[f"{mode}_{key}_ms_per_step"] = 1e3 * (time.perf_counter() - t0) / steps
                tokens[(mode, key)] = torch.stack(seq, 1).tolist()
            row[f"{mode}_peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
        row["graphs_equal_eager_tokens"] = all(tokens[("graphs", k)] == tokens[("eager", k)]
                                               for m, k in tokens if m == "eager")
        row["graph_speedup_full"] = row["eager_full_ms_per_step"] / row["graphs_full_ms_per_step"]
        out[str(batch)] = row
        print(f"static decode batch {batch}: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items()
                                                           if isinstance(v, float)), flush=True)
    return out


def engine_runs(model, batches: list[int], prompt: int, steps: int, dtype: str, device: str = "cuda") -> dict[str, Any]:
    """The engine over the static-cache backend on CUDA, eager and with CUDA graphs: decode tokens/s
    (after every request's first token) at full depth and exiting everything at the first decision exit.
    ``device`` "cpu": eager only (how the tests run it)."""
    import numpy as np
    import torch

    cuda = device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    from edge.runtime.engine import Engine, EngineConfig, Request
    from edge.runtime.rules import ConfidenceRule
    from edge.runtime.static_backend import StaticTorchBackend

    vocab = model.backbone.cfg.vocab_size
    rng = np.random.default_rng(0)
    out: dict[str, Any] = {}
    for batch in batches:
        prompts = [rng.integers(0, vocab, prompt).tolist() for _ in range(batch)]
        row: dict[str, Any] = {}
        tokens = {}
        for graphs in (False, True) if cuda else (False,):
            mode = "graphs" if graphs else "eager"
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            backend = StaticTorchBackend(model, device=device, dtype=dtype, graphs=graphs)
            for name, rule in (("full", None), ("exit_first", ConfidenceRule(0.0))):
                for attempt in ("warm", "timed"):  # the first run captures the graphs
                    eng = Engine(backend, EngineConfig(max_seqs=batch, max_running=batch, max_len=prompt + steps + 2,
                                                       prefill_budget=prompt * batch), rule)
                    ids = [eng.submit(Request(p, steps)) for p in prompts]
                    seen: dict[int, list[int]] = {i: [] for i in ids}
                    t_first = None
                    while eng.has_work:
                        for ev in eng.step():
                            seen[ev.request_id].append(ev.token)
                        if t_first is None and all(seen.values()):
                            sync()
                            t_first = time.perf_counter()
                    sync()
                    elapsed = time.perf_counter() - t_first
                n = sum(len(v) - 1 for v in seen.values())
                row[f"{mode}_{name}_decode_tokens_per_s"] = n / elapsed
                tokens[(mode, name)] = [seen[i] for i in ids]
            row[f"{mode}_captured"] = backend.captured
            if cuda:
                row[f"{mode}_peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
            del backend
        if not cuda:
            out[str(batch)] = row
            continue
        row["graphs_equal_eager_tokens"] = all(tokens[("graphs", k)] == tokens[("eager", k)] for k in ("full", "exit_first"))
        row["graph_speedup_full"] = row["graphs_full_decode_tokens_per_s"] / row["eager_full_decode_tokens_per_s"]
        row["exit_first_vs_full_graphs"] = (row["graphs_exit_first_decode_tokens_per_s"]
                                            / row["graphs_full_decode_tokens_per_s"])
        out[str(batch)] = row
        print(f"engine torch_static batch {batch}: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items()
                                                                 if isinstance(v, float)), flush=True)
    return out


def llama8b_shape(dev):
    """A random-weight model of Llama-3.1-8B's shape in bf16 with exits after 8, 16, 24 (norm + shared head)."""
    import torch

    from edge.model.config import ModelConfig
    from edge.model.decoder import Decoder
    from edge.model.exits import ExitConfig, MultiExitModel

    cfg = ModelConfig(vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                      intermediate_size=14336, max_position_embeddings=8192)
    torch.manual_seed(0)
    with torch.device(dev):
        dec = Decoder(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for p in dec.parameters():
            p.normal_(0.0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    return MultiExitModel(dec.eval(), ExitConfig(layers=[8, 16, 24, 32], adapter_rank=0)).to(dev).eval()


def _guarded(fn, *args) -> Any:
    """One section's result, or its error (the other sections' numbers are kept)."""
    import traceback

    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - a check script records what failed and goes on
        traceback.print_exc()
        return {"error": f"{type(exc).__name__}: {exc}"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="artifacts/gpu_check")
    ap.add_argument("--exits", default="3,6,9", help="exit layers to time besides full depth")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--skip-8b", action="store_true", help="skip the Llama-3.1-8B-shaped random model")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import torch

    result: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                              "cuda_available": torch.cuda.is_available(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ")}
    if not torch.cuda.is_available():
        result["skipped"] = "no CUDA GPU visible to torch (torch.cuda.is_available() is False)"
        (out / "gpu_check.json").write_text(json.dumps(result, indent=2) + "\n")
        print(result["skipped"])
        return 2
    from edge.model.bundled import BUNDLED_EE_DIR
    from edge.model.checkpoint import load_decoder

    dev = torch.device("cuda")
    result["device"] = {"name": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability())}
    cpu_model = load_decoder(BUNDLED_EE_DIR).eval()
    bb = load_decoder(BUNDLED_EE_DIR).eval().to(dev)
    depth = bb.cfg.num_layers
    g = torch.Generator().manual_seed(0)
    sync = torch.cuda.synchronize
    timings = {}
    for batch in (int(b) for b in args.batches.split(",")):
        ids = torch.randint(0, bb.cfg.vocab_size, (batch, args.prompt), generator=g).to(dev)
        run_decode(bb, ids, 4, depth, sync)  # warm-up: kernels, allocator
        row = {}
        for exit_at in sorted({*(int(e) for e in args.exits.split(",")), depth}):
            seconds, _ = run_decode(bb, ids, args.steps, exit_at, sync)
            row[str(exit_at)] = {"ms_per_step": 1e3 * seconds / args.steps,
                                 "tokens_per_s": batch * args.steps / seconds}
        for k, v in row.items():
            v["speedup_vs_full"] = row[str(depth)]["ms_per_step"] / v["ms_per_step"]
        timings[str(batch)] = row
        print(f"batch {batch}: " + ", ".join(f"exit {k}: {v['ms_per_step']:.2f} ms/step" for k, v in row.items()))
    result["decode_ms_by_batch_and_exit"] = timings
    ids = torch.randint(0, bb.cfg.vocab_size, (1, args.prompt), generator=g)
    _, on_cpu = run_decode(cpu_model, ids, 32, depth, lambda: None)
    _, on_gpu = run_decode(bb, ids.to(dev), 32, depth, sync)
    result["greedy_tokens_cuda_vs_cpu"] = {"compared": len(on_cpu[0]),
                                           "equal": sum(a == b for a, b in zip(on_cpu[0], on_gpu[0]))}
    big = torch.randint(0, bb.cfg.vocab_size, (16, args.prompt), generator=g).to(dev)
    result["nvml_energy_full_depth_b16"] = nvml_window(bb, big, args.steps, depth, sync)
    from edge.model.exits import ExitConfig, MultiExitModel

    batches = [int(b) for b in args.batches.split(",")]
    exits = sorted({*(int(e) for e in args.exits.split(",") if int(e) < depth), depth})
    tiny = MultiExitModel(bb, ExitConfig(layers=exits, adapter_rank=0)).to(dev).eval()
    result["static_cache_graphs_bundled"] = static_graphs(tiny, batches, args.prompt, args.steps, sync)
    result["engine_torch_static_bundled"] = _guarded(engine_runs, tiny, batches, args.prompt, args.steps, "float32")
    (out / "gpu_check.json").write_text(json.dumps(result, indent=2, default=str) + "\n")  # partial, kept if 8B fails
    if not args.skip_8b:
        del tiny
        big8 = llama8b_shape(dev)
        result["static_cache_graphs_llama8b_shape"] = _guarded(static_graphs, big8, batches, args.prompt, 32, sync)
        result["engine_torch_static_llama8b_shape"] = _guarded(engine_runs, big8, batches, args.prompt, 32, "bfloat16")
    (out / "gpu_check.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"wrote {out / 'gpu_check.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
