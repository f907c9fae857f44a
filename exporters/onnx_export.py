"""Export a :class:`MultiExitModel` to per-segment ONNX graphs for an early-exit engine.

The decoder is cut at its exits: segment ``i`` holds the decoder layers after
exit ``i-1`` up to and including exit ``i`` (exits [3, 6, 9, 12] give segments
of layers 1-3, 4-6, 7-9, 10-12, 1-based). The engine runs ``embed``, then one
segment at a time, reads the segment's exit logits and stops when it is
confident; the layers it skipped get their keys / values from ``kvfill``
(CALM's state propagation, Schuster et al. 2022: skipped layers store the K/V
of the exit hidden state).

Graphs and their tensors (``j`` = 0-based decoder layer index; B batch, T new
tokens, P past length, S = P + T, D hidden size, KV key/value heads, hd head
dim, V vocabulary; B, T, P and S are dynamic axes):

``embed.onnx``
    in:  ``input_ids`` int64 [B, T]
    out: ``hidden`` float32 [B, T, D]
``segment_{i}.onnx`` (one per exit)
    in:  ``hidden`` float32 [B, T, D] (residual stream before the segment's first layer),
         ``positions`` int64 [B, T],
         ``attn_mask`` float32 [B, 1, T, S] (additive, 0 or a large negative; build it with
         :func:`edge.model.decoder.attention_mask` over the past slots then the new tokens),
         ``past_key_{j}``, ``past_value_{j}`` float32 [B, KV, P, hd] per layer j (P may be 0),
         ``exit_index`` int64 [B] (the row of each sequence whose exit hidden is computed: its
         newest token; a prefill chunk or deferred rows need no head for the other rows)
    out: ``hidden_out`` [B, T, D] (residual stream after the segment's last layer),
         ``exit_hidden`` [B, 1, D] (the exit's normalised hidden at ``exit_index``, after its
         adapter and norm: the input of ``head``),
         ``present_key_{j}``, ``present_value_{j}`` [B, KV, T, hd] per layer j (new tokens only;
         the caller writes them into its cache)
``head.onnx`` (one for every exit: the shared LM head)
    in:  ``exit_hidden`` float32 [B, 1, D] (a segment's output)
    out: ``logits`` [B, 1, V] (exit logits),
         ``exit_stats`` [B, 1, 3] (softmax top-1 probability, top-1 minus top-2, entropy) and
         ``exit_token`` int64 [B, 1] (argmax): what the exit rule reads, so the engine never
         runs a softmax over V on the host (:func:`edge.model.exits.exit_decision_stats`)
``kvfill_{i}.onnx`` (every segment but the first; it covers the layers of segments i..last)
    in:  ``hidden`` [B, T, D] (raw residual stream at exit i-1, *before* its head),
         ``positions`` int64 [B, T]
    out: ``present_key_{j}``, ``present_value_{j}`` [B, KV, T, hd] per layer j of segment i
         (:meth:`edge.model.decoder.DecoderLayer.kv_only`)

RoPE cos / sin are computed inside each graph from ``positions``; attention,
RoPE and RMSNorm stay decomposed (no ``com.microsoft`` ops) so TensorRT's
parser accepts the graphs. ``graphs.json`` in the output folder records the
exits, the segments, every graph's file, I/O names and sha256, the checkpoint
sha256, the opset and, per graph, what ``onnx.checker`` answered (a rejection stops the export).
"""
from __future__ import annotations

import shutil
import time
from pathlib import Path

import numpy as np
import torch

from edge.core.artifacts import atomic_dir, atomic_write_json, sha256_file
from edge.model.exits import MultiExitModel
from edge.model.segments import segment_layers
from edge.runtime.graphs import FUSED_DIR, GRAPHS_JSON, SHORTLIST_ROWS
from exporters.onnx_config import ExportConfig
from exporters.onnx_files import export_one, finish_graph, slim_graphs
from exporters.onnx_graphs import (EmbedGraph, HeadGraph, KVFillGraph, SegmentGraph, head_io, kvfill_io, segment_io,
                                   static_dims)
from exporters.onnx_manifest import ExportManifest, GraphInfo
from exporters.ort_fused import (DRAFT_HEAD, build_fused, fused_supported, head_has_stats, save_draft_head, save_fused,
                                 stats_head)


def _weight_bytes(model: MultiExitModel, layers: list[int]) -> int:
    return sum(p.numel() * p.element_size() for j in layers for p in model.backbone.layers[j].parameters())


def export_onnx(model: MultiExitModel, out_dir: str | Path, cfg: ExportConfig,
                checkpoint_sha256: str) -> ExportManifest:
    """Export ``embed``, one ``segment_{i}`` per exit, ``kvfill_{i}`` per later segment and ``head``.

    Args:
        model: the multi-exit model (fp32; put in eval mode here).
        out_dir: folder to (re)create atomically with the graphs and ``graphs.json``.
        cfg: opset and trace shapes.
        checkpoint_sha256: hash of the checkpoint the model was loaded from, recorded so that
            :func:`edge.runtime.graphs.verify_graphs` can refuse graphs of another checkpoint.

    Returns:
        The :class:`ExportManifest` written to ``graphs.json``.

    Raises:
        ArtifactError: a graph fails ``onnx.checker`` (nothing is left in ``out_dir``).
    """
    t0 = time.perf_counter()
    out_dir = Path(out_dir)
    model = model.eval()
    mcfg = model.backbone.cfg
    b, t, p = cfg.trace_batch, cfg.trace_seq, cfg.trace_past
    d, kvh, hd = mcfg.hidden_size, mcfg.num_kv_heads, mcfg.head_dim
    g = torch.Generator().manual_seed(0)  # trace inputs; leaves the caller's RNG alone
    ids = torch.randint(0, mcfg.vocab_size, (b, t), generator=g)
    hidden = torch.randn(b, t, d, generator=g)
    positions = (torch.arange(t) + p).unsqueeze(0).expand(b, t).contiguous()
    mask = torch.zeros(b, 1, t, p + t)  # values do not matter for tracing, only that it is a tensor
    seg_layers = segment_layers(model.exit_layers)
    emb = model.backbone.embed_tokens.weight
    # (name, module, trace args, inputs, outputs, weight bytes)
    jobs = [("embed", EmbedGraph(model), (ids,), ["input_ids"], ["hidden"], emb.numel() * emb.element_size())]
    for i, (layers, exit_layer) in enumerate(zip(seg_layers, model.exit_layers)):
        past = tuple(torch.randn(b, kvh, p, hd, generator=g) for _ in range(2 * len(layers)))
        exit_index = torch.randint(0, t, (b,), generator=g)
        jobs.append((f"segment_{i}", SegmentGraph(model, layers, exit_layer),
                     (hidden, positions, mask, *past, exit_index),
                     *segment_io(layers), _weight_bytes(model, layers)))
        if i > 0:  # K/V of every layer from segment i to the end: one call fills all skipped layers
            suffix = [j for seg in seg_layers[i:] for j in seg]
            jobs.append((f"kvfill_{i}", KVFillGraph(model, suffix), (hidden, positions), *kvfill_io(suffix),
                         _weight_bytes(model, suffix)))
    head_w = model.backbone.head_weight
    jobs.append(("head", HeadGraph(model), (torch.randn(b, 1, d, generator=g),), *head_io(),
                 head_w.numel() * head_w.element_size()))
    graphs: dict[str, GraphInfo] = {}
    with atomic_dir(out_dir) as tmp, torch.no_grad():
        for name, module, args, ins, outs, nbytes in jobs:
            export_one(module, args, tmp / f"{name}.onnx", ins, outs, cfg)
        if cfg.slim:  # a > 2 GiB graph (external data) is not loaded whole to be slimmed
            slim_graphs([tmp / f"{name}.onnx" for name, *_, nbytes in jobs if nbytes <= cfg.external_data_threshold])
        for name, module, args, ins, outs, nbytes in jobs:
            path = tmp / f"{name}.onnx"
            static = {o: static_dims(o, d, kvh, hd, mcfg.vocab_size) for o in outs}
            graphs[name] = finish_graph(path, cfg, nbytes, ins, outs, static)
        manifest = ExportManifest(
            out_dir=out_dir, exit_layers=list(model.exit_layers),
            segments=[{"index": i, "exit_layer": e, "layers": ls}
                      for i, (ls, e) in enumerate(zip(seg_layers, model.exit_layers))],
            graphs=graphs, checkpoint_sha256=checkpoint_sha256, opset=cfg.opset,
            model={"num_layers": mcfg.num_layers, "hidden_size": d, "num_kv_heads": kvh, "head_dim": hd,
                   "vocab_size": mcfg.vocab_size, "sliding_window": mcfg.sliding_window,
                   "max_positions": mcfg.max_position_embeddings, "gated": model.gated,
                   "shortlist": model.shortlist.tolist() if model.has_shortlist else []},
        )
        if model.has_shortlist:  # the shortlist's LM-head rows, for backends that check candidates on the host
            np.save(tmp / SHORTLIST_ROWS, model.shortlist_rows().numpy().astype(np.float32))
            manifest.model["shortlist_rows"] = {"file": SHORTLIST_ROWS, "sha256": sha256_file(tmp / SHORTLIST_ROWS),
                                                "act_scale": model.shortlist_act_scale()}
        manifest.fused_skipped = fused_supported(model)
        if manifest.fused_skipped is None:
            fused = save_fused(build_fused(model, seg_layers, cfg.full_graph, tuple(cfg.verify_batches)), tmp / FUSED_DIR,
                               cfg.external_data_threshold)
            if len(model.exit_layers) > 1:  # a draft exit exists: self-speculative decoding drafts with it
                src = tmp / FUSED_DIR
                if not head_has_stats(model):  # the draft head keeps the statistics its stop rules read
                    src = tmp / "draft_src"
                    save_fused([stats_head(model)], src, cfg.external_data_threshold)
                fused[DRAFT_HEAD] = save_draft_head(src / fused["head"][0], tmp / FUSED_DIR,
                                                    external_data=fused["head"][3] is not None)
                if src != tmp / FUSED_DIR:
                    shutil.rmtree(src)
            for name, (file, ins, outs, data) in fused.items():
                info = GraphInfo(f"{FUSED_DIR}/{file}", ins, outs, sha256_file(tmp / FUSED_DIR / file))
                if data:
                    info.external_data = f"{FUSED_DIR}/{data}"
                    info.external_data_sha256 = sha256_file(tmp / FUSED_DIR / data)
                manifest.fused[name] = info
        manifest.seconds = time.perf_counter() - t0
        atomic_write_json(tmp / GRAPHS_JSON, manifest.to_dict())
    return manifest
