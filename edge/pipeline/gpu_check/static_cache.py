"""The static-cache decode step (edge/runtime/static_decode.py) eager and captured as CUDA graphs
(deploy/gpu_check.py's section 4; one graph per segment and K/V fill, per batch bucket): ms per step at full
depth and after each exit, the captured tokens against the eager ones, with peak memory; the script runs it
on the bundled model (exits after 3, 6, 9, float32) and on a random-weight model of Llama-3.1-8B's shape
(bf16, exits after 8, 16, 24)."""
from __future__ import annotations

import time
from typing import Any


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
