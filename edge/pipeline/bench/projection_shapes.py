"""The projection's real model shapes and their random-weight graphs.

:data:`SHAPES` holds Qwen2.5-0.5B's and Llama-3.2-1B's shapes (and the unit tests' micro one);
:func:`export_graphs` makes random float32 weights of a shape and exports them to the fused ONNX
Runtime graphs the projection times (edge/pipeline/bench/projection.py): nothing is downloaded, the
cost of a step depends on the shapes, not on the values. :func:`layer_params` is one decoder layer's
parameter count, the scale of a check's weight bytes.
"""
from __future__ import annotations

import copy
import gc
from pathlib import Path

from edge.core.errors import ConfigError
from edge.model.config import Arch, ModelConfig, RopeConfig, preset

# Shapes from the models' Hugging Face config.json (Qwen/Qwen2.5-0.5B, meta-llama/Llama-3.2-1B);
# max_position_embeddings is cut to 1024: it only sizes the RoPE tables (the benchmark's cache holds
# ``past`` + 8 tokens), and Llama-3's RoPE scaling changes the tables' values, not a step's cost.
SHAPES: dict[str, ModelConfig] = {
    "qwen2_0_5b": ModelConfig(arch=Arch.QWEN2, vocab_size=151936, hidden_size=896, num_layers=24, num_heads=14,
                              num_kv_heads=2, head_dim=64, intermediate_size=4864, rms_norm_eps=1e-6,
                              max_position_embeddings=1024, tie_word_embeddings=True, qkv_bias=True,
                              rope=RopeConfig(theta=1e6)),
    "llama3_1b": ModelConfig(arch=Arch.LLAMA, vocab_size=128256, hidden_size=2048, num_layers=16, num_heads=32,
                             num_kv_heads=8, head_dim=64, intermediate_size=8192, rms_norm_eps=1e-5,
                             max_position_embeddings=1024, tie_word_embeddings=True, rope=RopeConfig(theta=5e5)),
    # the unit tests' shape (seconds), also a smoke run of the whole path
    "micro": preset("micro"),
}


def shape_config(name: str) -> ModelConfig:
    """A fresh copy of the :data:`SHAPES` entry ``name``.

    Raises:
        ConfigError: an unknown name.
    """
    if name not in SHAPES:
        raise ConfigError(f"bench projection: unknown shape {name!r}; known: {', '.join(SHAPES)}")
    return copy.deepcopy(SHAPES[name])


def export_graphs(cfg: ModelConfig, exit_layers: list[int], shortlist: int, seed: int, out: Path,
                  verify_batches: tuple[int, ...] = ()) -> None:
    """Random float32 weights of shape ``cfg`` (std 0.02) with exits at ``exit_layers`` and a candidate
    shortlist of ``shortlist`` tokens, exported to ``out``: ``checks/`` (the fused segment graphs with
    their checks, ``head``, ``full`` and a ``verify_{B}`` graph per B of ``verify_batches``) and
    ``split/`` (the segments without checks). One set of graphs is in memory at a time, and the torch
    weights are gone when this returns."""
    import torch

    from edge.model.decoder import Decoder
    from edge.model.exits import ExitConfig, MultiExitModel
    from edge.model.segments import segment_layers
    from edge.pipeline.bench.decision import split_graphs
    from exporters.ort_fused import FULL, FusedGraph, build_fused, build_verify, save_fused

    # Every graph's weights go to external data, not only past protobuf's 2 GiB: saving a graph whole
    # serialises it in memory (measured: a 1.98 GB full graph took the export's peak from 6.2 to 10 GiB).
    # ONNX Runtime runs the same graph either way (the weights are loaded into the session).
    limit = 0
    with torch.no_grad():
        decoder = Decoder(cfg)
        decoder.init_weights(seed, std=0.02)
        # the candidate ids are the first K (the shortlist buffer's initial value): which rows are scored
        # does not change what a check costs
        model = MultiExitModel(decoder, ExitConfig(layers=exit_layers, adapter_rank=0, shortlist=shortlist)).eval()
        graphs = [g for g in build_fused(model, segment_layers(model.exit_layers), full=False)
                  if g.name.startswith("segment_") or g.name == "head"]  # kvfill_*: not timed here
        save_fused(graphs, out / "checks", limit)
        del graphs
        # the graph of every layer is a one-exit model's only segment (what build_fused's ``full`` is), built
        # after the segments' protos are gone: building one graph holds its weights about three times over
        # (_Builder.model_proto copies them twice), this export's peak (measured: 18.9 GiB at llama3_1b)
        whole = MultiExitModel(decoder, ExitConfig(layers=[cfg.num_layers], adapter_rank=0)).eval()
        graph = next(g for g in build_fused(whole, [list(range(cfg.num_layers))], full=False)
                     if g.name == "segment_0")
        save_fused([FusedGraph(FULL, graph.proto)], out / "checks", limit)
        del graph
        for b in verify_batches:  # mode exact's several-sequence verification, one graph in memory at a time
            save_fused([build_verify(whole, b)], out / "checks", limit)
        del whole
        split_graphs(model, out / "split", limit)
    del model, decoder
    gc.collect()


def layer_params(cfg: ModelConfig) -> float:
    """Parameters of one decoder layer of shape ``cfg`` (all but the embedding, LM head and final norm)."""
    table = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    return (cfg.num_params() - table - cfg.hidden_size) / cfg.num_layers
