"""``bench projection`` on the GPU path (deploy/gpu_check.py's section 8): Qwen2.5-0.5B and Llama-3.2-1B
shapes, the replayed exit distribution forced (every token leaving at one exit: :class:`_LeaveAt`), projected
(d)/(c) at batch 1 and the check's cost in layers."""
from __future__ import annotations

import json
from typing import Any

from edge.pipeline.gpu_check.random_models import random_model
from edge.pipeline.gpu_check.windows import replay_ms, rotate


class _LeaveAt:
    """Every token leaves at exit ``layer`` (a forced exit, as ``bench projection`` replays them): a linear
    score of 1 there and -1 at every other check point."""

    def __init__(self, layer: int) -> None:
        self.layer = layer

    def linear(self, layer, num_features):
        import numpy as np

        return np.zeros(num_features), 1.0 if layer == self.layer else -1.0

    def decide(self, layer, stats, tokens, hidden):
        import numpy as np

        return np.full(tokens[layer].shape[0], layer == self.layer)


def projection_on_gpu(shapes: list[str], steps: int, window_s: float = 0.5, rounds: int = 2, prompt: int = 64,
                      device: str = "cuda", meter=None) -> dict[str, Any]:
    """``bench projection`` on the GPU path: at Qwen2.5-0.5B and Llama-3.2-1B shapes (random bf16 weights,
    edge/pipeline/bench/projection_shapes.py's SHAPES), the default replayed exit distribution (a calibrated
    bundled-ee run's certify walk, moved to each shape's relative depths) with a 256-token shortlist,
    the engine over ``torch_static`` with CUDA graphs, pipelined or not. At batch 1: decode tokens/s at full
    depth (mode full), with every token leaving at each exit k (forced, :class:`_LeaveAt`) and with every
    shortlist check paid and none leaving; projected (d)/(c) = t_full / sum_k f_k t_k (projection_replay.py's
    formula) and the check's cost in layers. At batch 16: the check's cost only. Forced exits: nothing
    about quality follows. The skipped layers' K/V are the engine's default's (propagated from the exit's
    hidden state, a K/V fill per step), which ``bench projection`` does not time; the demo ships deferral."""
    import numpy as np
    import torch

    from edge.pipeline.bench.projection_replay import DEFAULT_RUN, projected_speedup, scale_distribution
    from edge.pipeline.bench.projection_shapes import shape_config
    from edge.runtime.rules import NeverExit
    from edge.runtime.static_backend import StaticTorchBackend

    cuda = device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    tokens = sum(DEFAULT_RUN["counts"].values())
    base = {k: v / tokens for k, v in DEFAULT_RUN["counts"].items()}
    out: dict[str, Any] = {"replay": "DEFAULT_RUN (a calibrated bundled-ee run's certify walk)", "window_s": window_s,
                           "rounds": rounds, "shortlist": DEFAULT_RUN["shortlist"]}
    for shape in shapes:
        cfg = shape_config(shape)
        fraction = scale_distribution(base, DEFAULT_RUN["num_layers"], cfg.num_layers)
        exits = sorted(k for k in fraction if k < cfg.num_layers)
        model = random_model(cfg, exits, device, DEFAULT_RUN["shortlist"])
        plain = StaticTorchBackend(model, device=device, dtype="bfloat16", graphs=cuda)
        ahead = StaticTorchBackend(model, device=device, dtype="bfloat16", graphs=cuda, pipeline=True)
        rng = np.random.default_rng(2)
        row: dict[str, Any] = {"exit_fraction": fraction}
        for batch in (1, 16):
            prompts = [rng.integers(0, cfg.vocab_size, prompt).tolist() for _ in range(batch)]
            systems = {"full": (plain, None), "never": (plain, NeverExit()), "never_pipelined": (ahead, NeverExit())}
            if batch == 1:
                for k in exits:
                    systems[f"leave_{k}"] = (plain, _LeaveAt(k))
                    systems[f"leave_{k}_pipelined"] = (ahead, _LeaveAt(k))
            r = rotate(systems, [prompts], steps, window_s, rounds, meter, sync, cfg.num_layers)
            ms = {n: 1e3 * batch / v["decode_tokens_per_s"] for n, v in r.items()}  # ms per step
            res: dict[str, Any] = {"ms_per_step": ms,
                                   "mean_exit_layer": {n: v["mean_exit_layer"] for n, v in r.items()}}
            for n in ("never", "never_pipelined"):
                res[f"extra_ms_per_check{n[5:]}"] = (ms[n] - ms["full"]) / len(exits)
            if cuda:
                seg = plain._plans.get(("segment", len(exits), plain._bucket(batch)))  # the last segment: whole layers
                if seg is not None:
                    layer_ms = replay_ms(seg, sync) / len(plain.segments[-1])
                    res["layer_ms_graph_replay"] = layer_ms
                    for n in ("", "_pipelined"):
                        res[f"decision_cost_layers{n}"] = res[f"extra_ms_per_check{n}"] / layer_ms
            if batch == 1:
                for n in ("", "_pipelined"):
                    step = {k: ms[f"leave_{k}{n}"] for k in exits} | {cfg.num_layers: ms["never" + n]}
                    res[f"projected_speedup{n}"] = projected_speedup(ms["full"], step, fraction)
            row[str(batch)] = res
            shown = {k: v for k, v in res.items() if k not in ("ms_per_step", "mean_exit_layer")}
            print(f"projection {shape} batch {batch}: " + json.dumps(shown), flush=True)
        out[shape] = row
        del model, plain, ahead
        if cuda:
            torch.cuda.empty_cache()
    return out
