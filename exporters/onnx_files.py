"""From a traced module to a checked graph file: the legacy exporter's trace (:func:`export_one`),
onnxslim's simplification in a process of its own (:func:`slim_graphs`), the fixed output sizes and a
zero point per Q/DQ pair written in (:func:`own_zero_points`), large weights moved to one external data
file, ``onnx.checker`` and the hashes that ``graphs.json`` records (:func:`finish_graph`)."""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

import onnx
import torch
from onnx import external_data_helper as edh
from torch import nn

from edge.core.artifacts import sha256_file
from edge.core.errors import ArtifactError
from exporters.onnx_config import ExportConfig
from exporters.onnx_graphs import dynamic_axes
from exporters.onnx_manifest import GraphInfo


def export_one(module: nn.Module, args: tuple, path: Path, inputs: list[str], outputs: list[str],
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
                          dynamic_axes=dynamic_axes(inputs, outputs), do_constant_folding=True)


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

    out = run_command([sys.executable, "-m", "exporters.onnx_files", "--slim", *map(str, paths)], timeout=3600)
    if out.returncode != 0:
        raise ArtifactError(f"onnxslim failed on {[p.name for p in paths]}: {out.stderr.strip()[-600:]}")


def _slim_in_process(paths: list[str]) -> None:
    import onnxslim

    for path in paths:
        onnx.save_model(onnxslim.slim(onnx.load(path)), path)


def finish_graph(path: Path, cfg: ExportConfig, weight_bytes: int, inputs: list[str],
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


if __name__ == "__main__" and len(sys.argv) > 2 and sys.argv[1] == "--slim":
    _slim_in_process(sys.argv[2:])
