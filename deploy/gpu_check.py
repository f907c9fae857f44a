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
   run against the eager one, graphs captured, peak memory; on both models;
6. what exits cost and save there (:func:`engine_exit_costs`): decision cost in layer-equivalents at
   each batch, tokens/s and NVML joules per token of full depth, of every check paid and none leaving,
   of an uncalibrated confidence rule and of every token leaving first, rotated windows; on both models;
7. exits as they are used (:func:`realistic_exits`): the bundled model with the demo's check points and
   shortlist on real text, a quarter of the tokens leaving, pipelined or not (the bundled model only).
8. ``bench projection`` on this path (:func:`projection_on_gpu`): Qwen2.5-0.5B and Llama-3.2-1B shapes,
   the replayed exit distribution forced, projected (d)/(c) at batch 1 and the check's cost in layers.

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
    meter, reason = _open_nvml()
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


def _engine_run(backend, rule, cfg, prompts: list[list[int]], steps: int, sync, mode=None):
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
                    elapsed, seqs, _ = _engine_run(backend, rule, cfg, prompts, steps, sync)
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


def _replay_ms(plan, sync, n: int = 200) -> float:
    """Milliseconds per replay of a captured decode plan (its inputs as they are), after 10 warm-ups."""
    for _ in range(10):
        plan()
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        plan()
    sync()
    return 1e3 * (time.perf_counter() - t0) / n


def _rotate(systems: dict[str, tuple], groups: list[list[list[int]]], steps: int, window_s: float, rounds: int,
            meter, sync, depth: int) -> dict[str, Any]:
    """Engine runs of each system (name -> (backend, rule); "full": requests in mode full) on prompt groups
    (one group per run, cycled; a group is one batch), rotated for ``rounds`` rounds, each system's window
    repeated for ``window_s`` seconds (one energy window on ``meter``). Per system: decode tokens/s (after
    every request's first token), tokens, mean exit layer, share of tokens that left early, median
    joules per token over its windows (None without a meter)."""
    import numpy as np

    from edge.runtime.engine_config import EngineConfig
    from edge.runtime.request import Mode

    batch = len(groups[0])
    longest = max(len(p) for g in groups for p in g)
    cfg = EngineConfig(max_seqs=batch, max_running=batch, max_len=longest + steps + 2,
                       prefill_budget=longest * batch, defer_exit_max_batch=None)
    turn = {"n": 0}

    def run(name: str) -> tuple[float, int, list[int]]:
        """One engine run: decode seconds (after every request's first token), decode tokens, exit layers."""
        backend, rule = systems[name]
        prompts = groups[turn["n"] % len(groups)]
        turn["n"] += 1
        seconds, _, layers = _engine_run(backend, rule, cfg, prompts, steps, sync,
                                         Mode.FULL if name == "full" else Mode.BOUNDED)
        return seconds, len(layers), layers

    names = list(systems)
    for name in names:  # warm-up: graphs captured, allocator settled
        run(name)
    acc = {name: {"seconds": 0.0, "tokens": 0, "layers": [], "joules": []} for name in names}
    for rnd in range(rounds):
        for name in (names if rnd % 2 == 0 else names[::-1]):
            a = acc[name]
            turn["n"] = 0  # every system's window starts at the same group
            if meter is not None:
                meter.start()
            t0, tokens = time.perf_counter(), 0
            while True:
                sec, n, layers = run(name)
                a["seconds"] += sec
                a["tokens"] += n
                a["layers"] += layers
                tokens += n
                if time.perf_counter() - t0 >= window_s:
                    break
            if meter is not None:
                m = meter.stop()
                if m.joules is not None:
                    a["joules"].append(m.joules / tokens)
    row: dict[str, Any] = {}
    for name, a in acc.items():
        layers = np.array(a["layers"])
        row[name] = {"decode_tokens_per_s": a["tokens"] / a["seconds"], "tokens": a["tokens"],
                     "mean_exit_layer": float(layers.mean()), "left_early": float((layers < depth).mean()),
                     "joules_per_token": float(np.median(a["joules"])) if a["joules"] else None}
    return row


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
    (edge.runtime.backend.host_candidates).
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
        row: dict[str, Any] = _rotate(systems, [prompts], steps, window_s, rounds, meter, sync, depth)
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
                layer_ms = _replay_ms(seg, sync) / len(backend.segments[1])
                row["layer_ms_graph_replay"] = layer_ms
                for n in never:
                    row[f"decision_cost_layers{n[5:]}"] = row[f"extra_ms_per_step_per_check{n[5:]}"] / layer_ms
                if head is not None:
                    row["head_replay_layers"] = _replay_ms(head, sync) / layer_ms
        out[str(batch)] = row
        print(f"exit costs batch {batch}: " + json.dumps({k: v for k, v in row.items() if not isinstance(v, dict)}),
              flush=True)
    out["captured"] = sum(b.captured for b in {id(b): b for b, _ in systems.values()}.values())
    out["wasted_segments_pipelined"] = ahead.wasted_segments  # launched ahead of a check where rows left
    return out


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
        row = _rotate(systems, groups, steps, window_s, rounds, meter, sync, depth)
        row["speedup_vs_full"] = {n: row[n]["decode_tokens_per_s"] / row["full"]["decode_tokens_per_s"]
                                  for n in ("rule", "rule_pipelined")}
        if row["full"]["joules_per_token"]:
            row["energy_ratio_vs_full"] = {n: row[n]["joules_per_token"] / row["full"]["joules_per_token"]
                                           for n in ("rule", "rule_pipelined") if row[n]["joules_per_token"]}
        row["wasted_segments_pipelined"] = ahead.wasted_segments - wasted  # its warm-up run included
        out[str(batch)] = row
        print(f"realistic exits batch {batch}: " + json.dumps({k: v for k, v in row.items()}), flush=True)
    return out


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


def random_model(cfg, exits: list[int], dev, shortlist: int = 0):
    """A random-weight model of shape ``cfg`` in bf16 on ``dev`` (std 0.02, norms 1), exits after ``exits``
    (norm + shared head; a ``shortlist`` of candidate ids 0..K-1 where asked: all timing needs)."""
    import torch

    from edge.model.decoder import Decoder
    from edge.model.exits import ExitConfig, MultiExitModel

    torch.manual_seed(0)
    with torch.device(dev):
        dec = Decoder(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for p in dec.parameters():
            p.normal_(0.0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    model = MultiExitModel(dec.eval(), ExitConfig(layers=[*exits, cfg.num_layers], adapter_rank=0, shortlist=shortlist))
    return model.to(device=dev, dtype=torch.bfloat16).eval()  # the exit norms too (their weights are float32 when made)


def llama8b_shape(dev):
    """A random-weight model of Llama-3.1-8B's shape in bf16 with exits after 8, 16, 24 (norm + shared head)."""
    from edge.model.config import ModelConfig

    cfg = ModelConfig(vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                      intermediate_size=14336, max_position_embeddings=8192)
    return random_model(cfg, [8, 16, 24], dev)


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
            r = _rotate(systems, [prompts], steps, window_s, rounds, meter, sync, cfg.num_layers)
            ms = {n: 1e3 * batch / v["decode_tokens_per_s"] for n, v in r.items()}  # ms per step
            res: dict[str, Any] = {"ms_per_step": ms,
                                   "mean_exit_layer": {n: v["mean_exit_layer"] for n, v in r.items()}}
            for n in ("never", "never_pipelined"):
                res[f"extra_ms_per_check{n[5:]}"] = (ms[n] - ms["full"]) / len(exits)
            if cuda:
                seg = plain._plans.get(("segment", len(exits), plain._bucket(batch)))  # the last segment: whole layers
                if seg is not None:
                    layer_ms = _replay_ms(seg, sync) / len(plain.segments[-1])
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


def _open_nvml():
    """(the NVML meter, None), or (None, why it cannot open). edge.energy is imported here: its NVML meter
    needs the 'gpu' extra (nvidia-ml-py)."""
    from edge.core.errors import SmartExitError

    try:
        from edge.energy.detect import open_meter

        return open_meter("nvml", interval_s=0.05), None
    except (ImportError, SmartExitError) as exc:
        return None, f"{type(exc).__name__}: {exc}"


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
    ap.add_argument("--window", type=float, default=1.5, help="seconds of one rule's energy window (section 6)")
    ap.add_argument("--only-exit-costs", action="store_true", help="sections 6-8 alone")
    ap.add_argument("--projection", default="qwen2_0_5b,llama3_1b",
                    help="section 8's shapes (edge/pipeline/bench/projection_shapes.py's SHAPES; '' skips it)")
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
    batches = [int(b) for b in args.batches.split(",")]

    def save() -> None:  # after every section: what ran is kept if a later one fails or the run is cut
        (out / "gpu_check.json").write_text(json.dumps(result, indent=2, default=str) + "\n")

    def decode_by_exit() -> dict[str, Any]:
        timings = {}
        for batch in batches:
            ids = torch.randint(0, bb.cfg.vocab_size, (batch, args.prompt), generator=g).to(dev)
            run_decode(bb, ids, 4, depth, sync)  # warm-up: kernels, allocator
            row = {}
            for exit_at in sorted({*(int(e) for e in args.exits.split(",")), depth}):
                seconds, _ = run_decode(bb, ids, args.steps, exit_at, sync)
                row[str(exit_at)] = {"ms_per_step": 1e3 * seconds / args.steps,
                                     "tokens_per_s": batch * args.steps / seconds}
            for v in row.values():
                v["speedup_vs_full"] = row[str(depth)]["ms_per_step"] / v["ms_per_step"]
            timings[str(batch)] = row
            print(f"batch {batch}: " + ", ".join(f"exit {k}: {v['ms_per_step']:.2f} ms/step" for k, v in row.items()),
                  flush=True)
        return timings

    def greedy_cuda_vs_cpu() -> dict[str, int]:
        ids = torch.randint(0, bb.cfg.vocab_size, (1, args.prompt), generator=g)
        _, on_cpu = run_decode(cpu_model, ids, 32, depth, lambda: None)
        _, on_gpu = run_decode(bb, ids.to(dev), 32, depth, sync)
        return {"compared": len(on_cpu[0]), "equal": sum(a == b for a, b in zip(on_cpu[0], on_gpu[0]))}

    every = not args.only_exit_costs
    if every:
        result["decode_ms_by_batch_and_exit"] = _guarded(decode_by_exit)
        result["greedy_tokens_cuda_vs_cpu"] = _guarded(greedy_cuda_vs_cpu)
        big = torch.randint(0, bb.cfg.vocab_size, (16, args.prompt), generator=g).to(dev)
        result["nvml_energy_full_depth_b16"] = _guarded(nvml_window, bb, big, args.steps, depth, sync)
        save()
    from edge.model.exits import ExitConfig, MultiExitModel

    exits = sorted({*(int(e) for e in args.exits.split(",") if int(e) < depth), depth})
    tiny = MultiExitModel(bb, ExitConfig(layers=exits, adapter_rank=0)).to(dev).eval()
    if every:
        result["static_cache_graphs_bundled"] = _guarded(static_graphs, tiny, batches, args.prompt, args.steps, sync)
        save()
        result["engine_torch_static_bundled"] = _guarded(engine_runs, tiny, batches, args.prompt, args.steps,
                                                         "float32")
        save()
    meter, reason = _open_nvml()
    if meter is None:
        print(f"no NVML meter for the energy windows: {reason}", flush=True)
    result["exit_costs_bundled"] = _guarded(engine_exit_costs, tiny, batches, args.prompt, args.steps, "float32",
                                            args.window, 3, "cuda", meter)
    save()
    result["realistic_exits_bundled"] = _guarded(realistic_exits, bb, batches, args.steps, "float32", args.window,
                                                 3, "cuda", meter)
    save()
    if args.projection:
        result["projection"] = _guarded(projection_on_gpu, args.projection.split(","), 32, min(args.window, 0.5), 2,
                                        args.prompt, "cuda", meter)
        save()
    if not args.skip_8b:
        del tiny
        big8 = llama8b_shape(dev)
        if every:
            result["static_cache_graphs_llama8b_shape"] = _guarded(static_graphs, big8, batches, args.prompt, 32, sync)
            save()
            result["engine_torch_static_llama8b_shape"] = _guarded(engine_runs, big8, batches, args.prompt, 32,
                                                                   "bfloat16")
            save()
        result["exit_costs_llama8b_shape"] = _guarded(engine_exit_costs, big8, batches, args.prompt, 32, "bfloat16",
                                                      args.window, 3, "cuda", meter)
        save()
    print(f"wrote {out / 'gpu_check.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
