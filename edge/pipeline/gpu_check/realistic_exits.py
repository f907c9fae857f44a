"""Exits as they are used (deploy/gpu_check.py's section 7): the bundled model with the demo's check points
and shortlist on real text, a quarter of the tokens leaving, pipelined or not (the bundled model only)."""
from __future__ import annotations

import json
from typing import Any

from edge.pipeline.gpu_check.windows import rotate


def realistic_exits(bb, batches: list[int], steps: int, dtype: str, window_s: float = 1.5, rounds: int = 3,
                    device: str = "cuda", meter=None, prompts_n: int = 16, prompt_tokens: int = 64,
                    exits: tuple[int, ...] = (1, 2, 4), shortlist: int = 256, leave: float = 0.25) -> dict[str, Any]:
    """Exits as they are used, pipelined or not: the bundled model ``bb`` with the demo's check points
    (after 1, 2 and 4 of 12: configs/demo.yaml) deciding over its shortlist (the ``shortlist`` tokens the
    shipped calibration split uses most, as distill chooses them), on real text (the first
    ``prompt_tokens`` tokens of ``prompts_n`` documents of the shipped test split, the bundled tokenizer),
    with a rule on the top candidate logit whose threshold lets about ``leave`` of the tokens leave (the
    (1 - leave) quantile, teacher-forced, of each position's best top candidate logit over the check
    points). Not a certified rule (no certificate covers a threshold picked so); what it measures is the
    price of checks and what leaving saves under a realistic mix of exits, the measurement the pipeline's
    default waits for (docs/runtime.md). Systems: ``full`` (mode full), ``rule``, ``rule_pipelined``."""
    import numpy as np
    import torch

    from edge.core.data import Split, load_split
    from edge.model.bundled import BUNDLED_EE_DIR
    from edge.model.exits import ExitConfig, MultiExitModel, choose_shortlist
    from edge.model.tokenizer import load_tokenizer
    from edge.runtime.rules import ConfidenceRule
    from edge.runtime.static_backend import StaticTorchBackend

    cuda = device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    tok = load_tokenizer(BUNDLED_EE_DIR)
    depth, vocab = bb.cfg.num_layers, bb.cfg.vocab_size
    calib = np.concatenate([tok.encode(d.text).ids for d in load_split(Split.CALIBRATION)])
    docs = [tok.encode(d.text).ids for d in load_split(Split.TEST)]
    prompts = [ids[:prompt_tokens] for ids in docs if len(ids) >= prompt_tokens + steps][:prompts_n]
    dev = next(bb.parameters()).device
    model = MultiExitModel(bb, ExitConfig(layers=[*exits, depth], adapter_rank=0, shortlist=shortlist))
    model = model.to(dev).eval()  # its exit norms are made on the host: beside the backbone, on its device
    with torch.no_grad():
        model.shortlist.copy_(choose_shortlist(calib, shortlist, vocab).to(dev))
        rows = model.shortlist_rows().to(dev)  # [K, D]
        ids = torch.tensor(prompts, device=rows.device)
        hs = bb(ids).hidden_states
        best = torch.stack([(model.exit_hidden(e, hs[e]).float() @ rows.T).max(-1).values for e in exits]).amax(0)
    threshold = float(np.quantile(best.cpu().numpy(), 1.0 - leave))
    rule = ConfidenceRule(threshold)  # for a shortlist model: the top candidate logit against the threshold
    ahead = StaticTorchBackend(model, device=device, dtype=dtype, graphs=cuda, pipeline=True)
    systems = {"full": (StaticTorchBackend(model, device=device, dtype=dtype, graphs=cuda), None),
               "rule": (StaticTorchBackend(model, device=device, dtype=dtype, graphs=cuda), rule),
               "rule_pipelined": (ahead, rule)}
    out: dict[str, Any] = {"exit_layers": [*exits, depth], "shortlist": shortlist, "threshold": threshold,
                           "leave_asked": leave, "prompts": len(prompts), "prompt_tokens": prompt_tokens,
                           "window_s": window_s, "rounds": rounds}
    if meter is not None:
        from edge.energy.detect import measure_idle

        out["idle_watts"] = measure_idle(meter, 2.0).mean_watts
    for batch in batches:
        groups = [prompts[j:j + batch] for j in range(0, len(prompts) - batch + 1, batch)]
        wasted = ahead.wasted_segments
        row = rotate(systems, groups, steps, window_s, rounds, meter, sync, depth)
        row["speedup_vs_full"] = {n: row[n]["decode_tokens_per_s"] / row["full"]["decode_tokens_per_s"]
                                  for n in ("rule", "rule_pipelined")}
        if row["full"]["joules_per_token"]:
            row["energy_ratio_vs_full"] = {n: row[n]["joules_per_token"] / row["full"]["joules_per_token"]
                                           for n in ("rule", "rule_pipelined") if row[n]["joules_per_token"]}
        row["wasted_segments_pipelined"] = ahead.wasted_segments - wasted  # its warm-up run included
        out[str(batch)] = row
        print(f"realistic exits batch {batch}: " + json.dumps({k: v for k, v in row.items()}), flush=True)
    return out
