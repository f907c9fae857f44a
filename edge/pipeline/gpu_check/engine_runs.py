"""The engine itself over ``torch_static`` on CUDA, graphs vs eager (deploy/gpu_check.py's section 5):
decode tokens/s at full depth and with every token exiting at the first decision exit (the exit-depth
ceiling), tokens of the captured run against the eager one, graphs captured, peak memory; and one engine
run of a batch of prompts, which the later sections' windows repeat."""
from __future__ import annotations

import time
from typing import Any


def engine_run(backend, rule, cfg, prompts: list[list[int]], steps: int, sync, mode=None):
    """One engine run of ``prompts`` (``steps`` tokens each, ``mode`` default bounded): decode seconds (from
    the step in which every request has its first token), each request's tokens in submission order, and
    the exit layers of the tokens emitted after that step."""
    from edge.runtime.engine import Engine
    from edge.runtime.request import Mode, Request

    eng = Engine(backend, cfg, rule)
    ids = [eng.submit(Request(p, steps, mode=mode or Mode.BOUNDED)) for p in prompts]
    seen: dict[int, list[int]] = {i: [] for i in ids}
    layers: list[int] = []
    t_first = None
    while eng.has_work:
        for ev in eng.step():
            seen[ev.request_id].append(ev.token)
            if t_first is not None:
                layers.append(ev.exit_layer)
        if t_first is None and all(seen.values()):
            sync()
            t_first = time.perf_counter()
    sync()
    return time.perf_counter() - t_first, [seen[i] for i in ids], layers


def engine_runs(model, batches: list[int], prompt: int, steps: int, dtype: str, device: str = "cuda") -> dict[str, Any]:
    """The engine over the static-cache backend on CUDA, eager and with CUDA graphs: decode tokens/s
    (after every request's first token) at full depth and exiting everything at the first decision exit.
    ``device`` "cpu": eager only (how the tests run it)."""
    import numpy as np
    import torch

    cuda = device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    from edge.runtime.engine_config import EngineConfig
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
                cfg = EngineConfig(max_seqs=batch, max_running=batch, max_len=prompt + steps + 2,
                                   prefill_budget=prompt * batch)
                for attempt in ("warm", "timed"):  # the first run captures the graphs
                    elapsed, seqs, _ = engine_run(backend, rule, cfg, prompts, steps, sync)
                row[f"{mode}_{name}_decode_tokens_per_s"] = sum(len(v) - 1 for v in seqs) / elapsed
                tokens[(mode, name)] = seqs
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
