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
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from onnx import external_data_helper as edh
from torch import nn

from edge.core.artifacts import atomic_dir, atomic_write_json, sha256_file
from edge.core.errors import ArtifactError, ConfigError
from edge.model.exits import MultiExitModel, exit_decision_stats
from edge.model.decoder import rope_cos_sin
from edge.model.segments import segment_layers
from edge.runtime.graphs import FUSED_DIR, GRAPHS_FORMAT, GRAPHS_JSON, SHORTLIST_ROWS
from exporters.ort_fused import (DRAFT_HEAD, build_fused, fused_supported, head_has_stats, save_draft_head, save_fused,
                                 stats_head)

SUPPORTED_OPSETS = (17, 18)
# Protobuf's hard limit: one ModelProto cannot exceed 2 GiB, larger weights go to external data.
PROTOBUF_LIMIT = 2**31
MAX_VERIFY_BATCH = 64  # largest batch a verify graph is written for (each sequence is an attention node per layer)


@dataclass
class ExportConfig:
    """How to export (opset, trace shapes, when to use external data)."""

    opset: int = 17
    # Dummy shapes for tracing: distinct and > 1 so the exporter cannot fold B, T or P into constants.
    trace_batch: int = 2
    trace_seq: int = 3
    trace_past: int = 5
    # Graphs whose weights exceed this many bytes are saved with one external data file.
    external_data_threshold: int = PROTOBUF_LIMIT - (64 << 20)
    slim: bool = True  # simplify the portable graphs with onnxslim (see _slim)
    # the fused graph of every layer ("full"): what a call in which no row may leave runs (prompt chunks,
    # batches above the exit limit), one call instead of one per segment and no check. It holds a second
    # copy of the layers and the embedding table: off for a model whose weights the device cannot hold twice
    full_graph: bool = True
    # batch sizes that get a graph of every layer verifying several sequences' drafts in one call
    # (exporters/ort_fused.py ``verify_{B}``: mode exact speculates at those batch sizes, where the cost model
    # and the measured iterations say it pays). Each holds another copy of the layers, loaded only when used;
    # [] for none. 2 by default: on a 2-core CPU batch 4 and 8 measured no gain (docs/runtime.md); where a
    # decode step is bound by reading the weights (a GPU), larger batches are worth a graph
    verify_batches: list[int] = field(default_factory=lambda: [2])

    def __post_init__(self) -> None:
        if self.opset not in SUPPORTED_OPSETS:
            raise ConfigError(f"export.opset must be one of {SUPPORTED_OPSETS} (TensorRT-friendly), got {self.opset}")
        for name in ("trace_batch", "trace_seq", "trace_past"):
            if getattr(self, name) < 2:
                raise ConfigError(f"export.{name} must be >= 2 so the axis stays dynamic, got {getattr(self, name)}")
        if len({self.trace_batch, self.trace_seq, self.trace_past}) != 3:
            raise ConfigError("export.trace_batch, trace_seq and trace_past must differ (else the tracer may tie them)")
        if (not isinstance(self.verify_batches, (list, tuple))
                or not all(isinstance(b, int) and not isinstance(b, bool) and 2 <= b <= MAX_VERIFY_BATCH
                           for b in self.verify_batches) or len(set(self.verify_batches)) != len(self.verify_batches)):
            raise ConfigError(f"export.verify_batches must be a list of distinct batch sizes in 2..{MAX_VERIFY_BATCH}, "
                              f"got {self.verify_batches!r}")
        self.verify_batches = sorted(self.verify_batches)


@dataclass
class GraphInfo:
    """One exported graph: file, I/O names, content hash (and its external data file, if any)."""

    file: str
    inputs: list[str]
    outputs: list[str]
    sha256: str
    external_data: str | None = None
    external_data_sha256: str | None = None
    checker: str | None = None  # what onnx.checker.check_model answered for this file (None: not run)


@dataclass
class ExportManifest:
    """What :func:`export_onnx` wrote; ``to_dict`` is the content of ``graphs.json``."""

    out_dir: Path
    exit_layers: list[int]  # 1-based, last = num_layers
    segments: list[dict[str, Any]]  # {"index", "exit_layer" (1-based), "layers" (0-based indices)}
    graphs: dict[str, GraphInfo]  # "embed", "segment_{i}", "kvfill_{i}", "head"
    checkpoint_sha256: str
    opset: int
    model: dict[str, Any] = field(default_factory=dict)  # hidden_size, num_kv_heads, head_dim, vocab_size, gated...
    fused: dict[str, GraphInfo] = field(default_factory=dict)  # the ONNX Runtime graphs, in FUSED_DIR
    fused_skipped: str | None = None  # why there are none
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": GRAPHS_FORMAT,
            "exit_layers": self.exit_layers,
            "segments": self.segments,
            "graphs": {k: asdict(v) for k, v in self.graphs.items()},
            "checkpoint_sha256": self.checkpoint_sha256,
            "opset": self.opset,
            "checker": {"onnx": onnx.__version__},  # and each graph's answer under graphs.<name>.checker
            "model": self.model,
            "fused": {"dir": FUSED_DIR, "graphs": {k: asdict(v) for k, v in self.fused.items()}} if self.fused else None,
            "fused_skipped": self.fused_skipped,
            "seconds": round(self.seconds, 3),
        }


def segment_io(layers: list[int]) -> tuple[list[str], list[str]]:
    """Input and output names of the segment graph over 0-based ``layers``."""
    past = [n for j in layers for n in (f"past_key_{j}", f"past_value_{j}")]
    present = [n for j in layers for n in (f"present_key_{j}", f"present_value_{j}")]
    return (["hidden", "positions", "attn_mask", *past, "exit_index"],
            ["hidden_out", "exit_hidden", *present])


def head_io() -> tuple[list[str], list[str]]:
    """Input and output names of the head graph."""
    return ["exit_hidden"], ["logits", "exit_stats", "exit_token"]


def kvfill_io(layers: list[int]) -> tuple[list[str], list[str]]:
    """Input and output names of the kvfill graph over 0-based ``layers``."""
    present = [n for j in layers for n in (f"present_key_{j}", f"present_value_{j}")]
    return ["hidden", "positions"], present


# --- graph modules: thin wrappers that call the model's own layers ---------------------------------

class _EmbedGraph(nn.Module):
    def __init__(self, model: MultiExitModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.backbone.embed(input_ids)  # [B, T, D]


class _SegmentGraph(nn.Module):
    def __init__(self, model: MultiExitModel, layers: list[int], exit_layer: int) -> None:
        super().__init__()
        self.model, self.layers, self.exit_layer = model, layers, exit_layer

    def forward(self, hidden, positions, attn_mask, *rest):
        *past, exit_index = rest
        backbone = self.model.backbone
        cos, sin = rope_cos_sin(positions, backbone.inv_freq)  # [B, 1, T, hd]
        h, presents = hidden, []
        for n, j in enumerate(self.layers):
            # always a mask tensor: Attention's mask=None fast path is SDPA, not for export
            h, k, v = backbone.layers[j](h, cos, sin, past[2 * n], past[2 * n + 1], attn_mask)
            presents += [k, v]  # [B, KV, T, hd]
        rows = torch.gather(h, 1, exit_index.view(-1, 1, 1).expand(-1, 1, h.shape[-1]))  # [B, 1, D]
        e = self.model.exit_hidden(self.exit_layer, rows)  # [B, 1, D]
        return (h, e, *presents)


class _HeadGraph(nn.Module):
    def __init__(self, model: MultiExitModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, exit_hidden):
        logits = self.model.backbone.logits(exit_hidden)  # [B, 1, V]
        stats, token = exit_decision_stats(logits)  # [B, 1, 3], [B, 1]
        return logits, stats, token


class _KVFillGraph(nn.Module):
    def __init__(self, model: MultiExitModel, layers: list[int]) -> None:
        super().__init__()
        self.model, self.layers = model, layers

    def forward(self, hidden, positions):
        backbone = self.model.backbone
        cos, sin = rope_cos_sin(positions, backbone.inv_freq)
        out = []
        for j in self.layers:
            out += list(backbone.layers[j].kv_only(hidden, cos, sin))
        return tuple(out)


def _dynamic_axes(inputs: list[str], outputs: list[str]) -> dict[str, dict[int, str]]:
    axes: dict[str, dict[int, str]] = {}
    for name in inputs + outputs:
        if name == "attn_mask":
            axes[name] = {0: "batch", 2: "seq", 3: "total"}
        elif name.startswith("past_"):
            axes[name] = {0: "batch", 2: "past"}
        elif name.startswith("present_"):
            axes[name] = {0: "batch", 2: "seq"}
        elif name in ("exit_index", "exit_hidden", "logits", "exit_stats", "exit_token"):
            axes[name] = {0: "batch"}  # one row per sequence
        else:  # input_ids, positions, hidden, hidden_out
            axes[name] = {0: "batch", 1: "seq"}
    return axes


def _export_one(module: nn.Module, args: tuple, path: Path, inputs: list[str], outputs: list[str],
                cfg: ExportConfig) -> None:
    with warnings.catch_warnings():
        # The legacy TorchScript exporter is deliberate (the dynamo exporter fails on FakeQuantize,
        # pytorch/pytorch issues on torch.export of fake-quantized modules); its deprecation notice is noise here.
        warnings.filterwarnings("ignore", category=DeprecationWarning, message=".*legacy TorchScript-based ONNX export")
        # ... and torch's exporter calls its own deprecated exporter_context (torch 2.13).
        warnings.filterwarnings("ignore", category=DeprecationWarning, message="The feature will be removed")
        # a quantized linear reads whether its activation range is set (a constant of the export) as a float
        warnings.filterwarnings("ignore", category=torch.jit.TracerWarning, module="edge.compress.quant")
        torch.onnx.export(module, args, str(path), dynamo=False, opset_version=cfg.opset,
                          input_names=inputs, output_names=outputs,
                          dynamic_axes=_dynamic_axes(inputs, outputs), do_constant_folding=True)


def _static_dims(name: str, d: int, kv_heads: int, head_dim: int, vocab: int) -> dict[int, int]:
    """Fixed axes of a graph output (the rest are the dynamic axes of :func:`_dynamic_axes`)."""
    if name.startswith("present_"):
        return {1: kv_heads, 3: head_dim}
    one = {1: 1}  # exit outputs: one row per sequence
    return {"exit_token": one, "logits": {**one, 2: vocab}, "exit_stats": {**one, 2: 3},
            "exit_hidden": {**one, 2: d}}.get(name, {2: d})


def own_zero_points(graph: onnx.GraphProto) -> int:
    """Give each Q/DQ pair (a QuantizeLinear and the DequantizeLinears of its output; or a lone
    DequantizeLinear) a zero-point initializer of its own; returns the copies made.

    The tracer writes one zero-point constant per linear and onnxslim merges the equal ones, so one
    INT8 zero point ends up shared by several pairs. ONNX Runtime's conversion of INT8 Q/DQ to UINT8
    (``session.x64quantprecision``, which edge/runtime/ortsession.py sets so that x86 CPUs without
    VNNI do not saturate: see there) converts a zero point once per pair and fails on a shared one
    ("Attempt to replace the existing tensor"). Values are unchanged; TensorRT reads the graph as before.
    """
    inits = {t.name: t for t in graph.initializer}
    q_out = {n.output[0]: n for n in graph.node if n.op_type == "QuantizeLinear"}
    groups: dict[str, list[onnx.NodeProto]] = {}  # a pair's key -> its nodes
    for n in graph.node:
        if n.op_type == "QuantizeLinear":
            groups.setdefault(n.output[0], []).append(n)
        elif n.op_type == "DequantizeLinear":
            key = n.input[0] if n.input[0] in q_out else n.output[0]
            groups.setdefault(key, []).append(n)
    users: dict[str, list[str]] = {}  # zero point -> the pairs that read it
    for key, nodes in groups.items():
        for zp in {n.input[2] for n in nodes if len(n.input) > 2 and n.input[2] in inits}:
            users.setdefault(zp, []).append(key)
    copies = 0
    for zp, keys in users.items():
        for k, key in enumerate(keys[1:], 1):
            twin = onnx.TensorProto()
            twin.CopyFrom(inits[zp])
            twin.name = f"{zp}.{k}"
            graph.initializer.append(twin)
            for n in groups[key]:
                if len(n.input) > 2 and n.input[2] == zp:
                    n.input[2] = twin.name
            copies += 1
    return copies


def _pin_output_dims(path: Path, static: dict[str, dict[int, int]]) -> None:
    """Write the fixed sizes into the outputs' shapes (and give every Q/DQ pair its own zero point:
    :func:`own_zero_points`).

    The tracer leaves some fixed axes symbolic (RoPE's rotate-half concat makes the head dim of
    ``present_key_*`` read 'Addpresent_key_0_dim_3'); engines size their output buffers from these.
    """
    proto = onnx.load(str(path), load_external_data=False)
    for out in proto.graph.output:
        dims = out.type.tensor_type.shape.dim
        for axis, size in static.get(out.name, {}).items():
            dims[axis].dim_value = size  # clears dim_param (oneof)
    own_zero_points(proto.graph)
    onnx.save_model(proto, str(path))


def slim_graphs(paths: list[Path]) -> None:
    """Fold the tracer's shape plumbing (Shape/Gather/Unsqueeze/Concat chains on fixed sizes) and
    dead nodes with onnxslim, a maintained ONNX simplifier: about half the nodes go (622 -> 312 for a
    3-layer segment of the bundled model), all standard ops, so TensorRT still parses the graph.
    The parity gate runs on the slimmed graphs.

    Runs in a process of its own: onnxslim folds constants with ONNX Runtime sessions of default
    options, which ONNX Runtime refuses once this process made its shared thread pool
    (edge/runtime/ortsession.py), and folding would silently do less."""
    if not paths:
        return
    from edge.core.device import run_command

    out = run_command([sys.executable, "-m", "exporters.onnx_export", "--slim", *map(str, paths)], timeout=3600)
    if out.returncode != 0:
        raise ArtifactError(f"onnxslim failed on {[p.name for p in paths]}: {out.stderr.strip()[-600:]}")


def _slim_in_process(paths: list[str]) -> None:
    import onnxslim

    for path in paths:
        onnx.save_model(onnxslim.slim(onnx.load(path)), path)


def _finish_graph(path: Path, cfg: ExportConfig, weight_bytes: int, inputs: list[str],
                  outputs: list[str], static: dict[str, dict[int, int]]) -> GraphInfo:
    """Pin fixed output dims, move large weights to one external data file, check, hash."""
    _pin_output_dims(path, static)
    data_name = None
    if weight_bytes > cfg.external_data_threshold:
        proto = onnx.load(str(path), load_external_data=False)
        # the legacy exporter writes one file per tensor beside a > 2 GiB graph; gather them into one
        written = {edh.ExternalDataInfo(t).location for t in proto.graph.initializer if edh.uses_external_data(t)}
        edh.load_external_data_for_model(proto, str(path.parent))
        for loc in written:
            (path.parent / loc).unlink()
        data_name = f"{path.name}.data"
        onnx.save_model(proto, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=data_name, size_threshold=1024)
    try:
        onnx.checker.check_model(str(path), full_check=True)  # by path: works with external data and > 2 GiB
    except onnx.checker.ValidationError as exc:
        raise ArtifactError(f"{path.name}: onnx.checker rejected the exported graph: {exc}") from exc
    info = GraphInfo(path.name, inputs, outputs, sha256_file(path), checker="passed (full_check, shape inference)")
    if data_name:
        info.external_data, info.external_data_sha256 = data_name, sha256_file(path.parent / data_name)
    return info


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
    jobs = [("embed", _EmbedGraph(model), (ids,), ["input_ids"], ["hidden"], emb.numel() * emb.element_size())]
    for i, (layers, exit_layer) in enumerate(zip(seg_layers, model.exit_layers)):
        past = tuple(torch.randn(b, kvh, p, hd, generator=g) for _ in range(2 * len(layers)))
        exit_index = torch.randint(0, t, (b,), generator=g)
        jobs.append((f"segment_{i}", _SegmentGraph(model, layers, exit_layer),
                     (hidden, positions, mask, *past, exit_index),
                     *segment_io(layers), _weight_bytes(model, layers)))
        if i > 0:  # K/V of every layer from segment i to the end: one call fills all skipped layers
            suffix = [j for seg in seg_layers[i:] for j in seg]
            jobs.append((f"kvfill_{i}", _KVFillGraph(model, suffix), (hidden, positions), *kvfill_io(suffix),
                         _weight_bytes(model, suffix)))
    head_w = model.backbone.head_weight
    jobs.append(("head", _HeadGraph(model), (torch.randn(b, 1, d, generator=g),), *head_io(),
                 head_w.numel() * head_w.element_size()))
    graphs: dict[str, GraphInfo] = {}
    with atomic_dir(out_dir) as tmp, torch.no_grad():
        for name, module, args, ins, outs, nbytes in jobs:
            _export_one(module, args, tmp / f"{name}.onnx", ins, outs, cfg)
        if cfg.slim:  # a > 2 GiB graph (external data) is not loaded whole to be slimmed
            slim_graphs([tmp / f"{name}.onnx" for name, *_, nbytes in jobs if nbytes <= cfg.external_data_threshold])
        for name, module, args, ins, outs, nbytes in jobs:
            path = tmp / f"{name}.onnx"
            static = {o: _static_dims(o, d, kvh, hd, mcfg.vocab_size) for o in outs}
            graphs[name] = _finish_graph(path, cfg, nbytes, ins, outs, static)
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


if __name__ == "__main__" and len(sys.argv) > 2 and sys.argv[1] == "--slim":
    _slim_in_process(sys.argv[2:])
