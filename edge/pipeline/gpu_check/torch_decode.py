"""The decode step of the torch decoder on CUDA (deploy/gpu_check.py's sections 1-3), at full depth and
stopping at each exit (layers after the exit get their K/V by state propagation, as the engine does: CALM,
Schuster et al. 2022): a full-depth prefill, one decode step, a timed run of them; section 1 (milliseconds
per step and tokens/s by batch and exit), section 2 (the CUDA run's greedy tokens against the CPU's, full
depth, batch 1) and section 3 (one energy window of the full-depth decode on NVML, edge.energy: the GPU's
energy counter, with the idle draw before it)."""
from __future__ import annotations

import time
from typing import Any

from edge.pipeline.gpu_check.harness import open_nvml


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


def decode_by_exit(bb, batches: list[int], prompt: int, steps: int, exits: str, g, dev, sync) -> dict[str, Any]:
    """Section 1: ms per decode step and tokens/s per batch, at full depth and stopping at each of ``exits``
    (the --exits option's comma-separated layers), random prompts of ``prompt`` tokens drawn from ``g``."""
    import torch

    depth = bb.cfg.num_layers
    timings = {}
    for batch in batches:
        ids = torch.randint(0, bb.cfg.vocab_size, (batch, prompt), generator=g).to(dev)
        run_decode(bb, ids, 4, depth, sync)  # warm-up: kernels, allocator
        row = {}
        for exit_at in sorted({*(int(e) for e in exits.split(",")), depth}):
            seconds, _ = run_decode(bb, ids, steps, exit_at, sync)
            row[str(exit_at)] = {"ms_per_step": 1e3 * seconds / steps,
                                 "tokens_per_s": batch * steps / seconds}
        for v in row.values():
            v["speedup_vs_full"] = row[str(depth)]["ms_per_step"] / v["ms_per_step"]
        timings[str(batch)] = row
        print(f"batch {batch}: " + ", ".join(f"exit {k}: {v['ms_per_step']:.2f} ms/step" for k, v in row.items()),
              flush=True)
    return timings


def greedy_cuda_vs_cpu(cpu_model, bb, prompt: int, g, dev, sync) -> dict[str, int]:
    """Section 2: the greedy tokens of a full-depth decode on the device (``bb``) against the CPU's
    (``cpu_model``, the same weights), batch 1, one random prompt drawn from ``g``."""
    import torch

    depth = bb.cfg.num_layers
    ids = torch.randint(0, bb.cfg.vocab_size, (1, prompt), generator=g)
    _, on_cpu = run_decode(cpu_model, ids, 32, depth, lambda: None)
    _, on_gpu = run_decode(bb, ids.to(dev), 32, depth, sync)
    return {"compared": len(on_cpu[0]), "equal": sum(a == b for a, b in zip(on_cpu[0], on_gpu[0]))}


def nvml_window(bb, ids, steps: int, exit_at: int, sync) -> dict[str, Any]:
    """Energy of one full-depth decode window on NVML; the reason instead where it cannot measure."""
    meter, reason = open_nvml()
    if meter is None:  # no meter: the reason is the result
        return {"available": False, "reason": reason}
    from edge.energy.detect import measure_idle

    with meter:
        idle = measure_idle(meter, 2.0)
        meter.start()
        seconds, tokens = run_decode(bb, ids, steps, exit_at, sync)
        window = meter.stop()
    n = len(tokens) * steps
    return {"available": True, "idle": idle.to_dict(), "window": window.to_dict(), "tokens": n,
            "joules_per_token": None if window.joules is None else window.joules / n, "seconds": seconds}
