"""What exits cost and save on the GPU (deploy/gpu_check.py's section 6), through the engine over
``torch_static`` with CUDA graphs: decision cost in layer-equivalents at each batch, tokens/s and NVML joules
per token of full depth, of every check paid and none leaving, of an uncalibrated confidence rule and of
every token leaving first, rotated windows; the script runs it on both models."""
from __future__ import annotations

import json
from typing import Any

from edge.pipeline.gpu_check.windows import replay_ms, rotate


def engine_exit_costs(model, batches: list[int], prompt: int, steps: int, dtype: str, window_s: float = 1.5,
                      rounds: int = 3, device: str = "cuda", meter=None, shortlist: int = 256) -> dict[str, Any]:
    """What exits cost and save on the GPU, through the engine over ``torch_static`` with CUDA graphs.

    Four rules on the same prompts, rotated for ``rounds`` rounds, each run repeated for ``window_s``
    seconds (one energy window on ``meter`` when given): ``full`` (requests in mode full: no check point
    decides, the engine's full-depth path; not rule None, which is the never rule), ``never``
    (every check point decides and no token leaves: what a decision costs a token that stays),
    ``conf_0.9`` (an uncalibrated top-1 >= 0.9 rule, labelled so: no certificate covers it) and
    ``exit_first`` (every token leaves at the first exit: the exit-depth ceiling). Per rule: decode
    tokens/s, the mean exit layer and the share of tokens that left early, joules per token (NVML) where
    there is a meter. Decision cost in layer-equivalents = (never - full seconds per step at this batch,
    per check point) / one layer's time at this batch, the layer timed as a replay of the second segment's captured
    graph divided by its layers (GPU work and launch, no host work); the full head's replay in layers too.
    ``never_pipelined`` and ``exit_first_pipelined``: the same on a backend that launches each next segment
    before reading the decision (``pipeline``): what that hides of a check, and what it wastes where every
    token leaves. With ``shortlist`` > 0, ``never_shortlist`` (and pipelined): the same weights whose check
    points decide over a ``shortlist``-token candidate set (as the demo ships: exits.shortlist 256; ids
    0..K-1, which is all timing needs) instead of the full head, every check paid and none leaving; the
    candidate logits come from the segment's graph, the rest of the check runs on the host
    (edge.runtime.backend_host.host_candidates).
    ``device`` "cpu" (tests): eager, no layer timing."""
    import numpy as np
    import torch

    from edge.model.exits import ExitConfig, MultiExitModel
    from edge.runtime.rules import ConfidenceRule, NeverExit
    from edge.runtime.static_backend import StaticTorchBackend

    cuda = device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    vocab = model.backbone.cfg.vocab_size
    depth = model.backbone.cfg.num_layers
    rng = np.random.default_rng(1)
    backend = StaticTorchBackend(model, device=device, dtype=dtype, graphs=cuda)
    ahead = StaticTorchBackend(model, device=device, dtype=dtype, graphs=cuda, pipeline=True)
    systems = {"full": (backend, None), "never": (backend, NeverExit()), "never_pipelined": (ahead, NeverExit()),
               "conf_0.9": (backend, ConfidenceRule(0.9)), "exit_first": (backend, ConfidenceRule(0.0)),
               "exit_first_pipelined": (ahead, ConfidenceRule(0.0))}
    if shortlist:
        listed = MultiExitModel(model.backbone, ExitConfig(layers=list(model.exit_layers), adapter_rank=0,
                                                           shortlist=shortlist))
        listed = listed.to(device=next(model.parameters()).device).eval()
        systems["never_shortlist"] = (StaticTorchBackend(listed, device=device, dtype=dtype, graphs=cuda), NeverExit())
        systems["never_shortlist_pipelined"] = (StaticTorchBackend(listed, device=device, dtype=dtype, graphs=cuda,
                                                                   pipeline=True), NeverExit())
    rules = list(systems)
    out: dict[str, Any] = {"rules": rules, "window_s": window_s, "rounds": rounds, "shortlist": shortlist,
                           "defer_exit_max_batch": None}  # exits at every batch (deferral), not only at 1
    checks = len(backend.exit_layers) - 1
    if meter is not None:
        from edge.energy.detect import measure_idle

        out["idle_watts"] = measure_idle(meter, 2.0).mean_watts
    for batch in batches:
        prompts = [rng.integers(0, vocab, prompt).tolist() for _ in range(batch)]
        row: dict[str, Any] = rotate(systems, [prompts], steps, window_s, rounds, meter, sync, depth)
        sec_tok = {name: 1.0 / r["decode_tokens_per_s"] for name, r in row.items()}
        # a step carries ``batch`` tokens; what the check points add to a step, per check point
        never = [n for n in rules if n.startswith("never")]  # every check paid, none leaving: a check's price
        for n in never:
            row[f"extra_ms_per_step_per_check{n[5:]}"] = 1e3 * batch * (sec_tok[n] - sec_tok["full"]) / checks
        row["speedup_vs_full"] = {name: row[name]["decode_tokens_per_s"] / row["full"]["decode_tokens_per_s"]
                                  for name in rules if name != "full"}
        if meter is not None and row["full"]["joules_per_token"]:
            row["energy_ratio_vs_full"] = {name: row[name]["joules_per_token"] / row["full"]["joules_per_token"]
                                           for name in rules if name != "full" and row[name]["joules_per_token"]}
        if cuda:
            bucket = backend._bucket(batch)
            seg = backend._plans.get(("segment", 1, bucket))
            head = backend._plans.get(("head", 0, bucket))
            if seg is not None:
                layer_ms = replay_ms(seg, sync) / len(backend.segments[1])
                row["layer_ms_graph_replay"] = layer_ms
                for n in never:
                    row[f"decision_cost_layers{n[5:]}"] = row[f"extra_ms_per_step_per_check{n[5:]}"] / layer_ms
                if head is not None:
                    row["head_replay_layers"] = replay_ms(head, sync) / layer_ms
        out[str(batch)] = row
        print(f"exit costs batch {batch}: " + json.dumps({k: v for k, v in row.items() if not isinstance(v, dict)}),
              flush=True)
    out["captured"] = sum(b.captured for b in {id(b): b for b, _ in systems.values()}.values())
    out["wasted_segments_pipelined"] = ahead.wasted_segments  # launched ahead of a check where rows left
    return out
