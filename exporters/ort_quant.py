"""Quantized matrix products in the fused ONNX Runtime graphs (:mod:`exporters.ort_fused`).

One function writes ``x @ [W_1; W_2; ...]^T (+ b)`` for linears that read the same input (packed QKV,
packed K/V of a kvfill graph, or one linear), in the form of the linears' precision
(:mod:`edge.compress.quant`):

- float (``nn.Linear``): MatMul with the packed float weight;
- W8A8: ``QuantizeLinear -> DequantizeLinear`` on the input (per-tensor scale, zero point 0) and
  ``DequantizeLinear`` of the INT8 weight codes (per output channel, axis 1 of [K, N]) into MatMul:
  ONNX Runtime fuses the pattern into an integer matrix product (S8S8, the format its CPU
  quantization guide recommends first), and the numbers are those of the torch fake quantization;
- W4: ``MatMulNBits`` (contrib op: codes + 8 packed two per byte, low nibble first, per-block scales,
  default zero point 8, ``accuracy_level`` 4: the input is quantized to INT8 per block inside the
  kernel, the fastest CPU form; the parity gate measures what that changes).
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from edge.compress.quant import Precision, QuantLinear
from edge.core.errors import ConfigError

MS = "com.microsoft"
NBITS_ACCURACY = 4  # MatMulNBits: INT8 compute on the CPU


def _spec_of(lins: list[nn.Linear]) -> tuple[str, float]:
    """('float' | 'w8a8' | 'w8' | 'w4', activation scale) shared by ``lins``; they must agree."""
    kinds = set()
    scales = set()
    for lin in lins:
        if not isinstance(lin, QuantLinear) or not lin.enabled:
            kinds.add("float")
        elif lin.spec.precision is Precision.W4:
            kinds.add(f"w4/{lin.spec.block_size}")
        else:
            kinds.add("w8a8" if lin.has_act_quant else "w8")
            scales.add(float(lin.act_scale))
    if len(kinds) != 1 or len(scales) > 1:
        raise ConfigError(f"linears packed into one MatMul must share a precision and input scale, got {kinds}, {scales}")
    return kinds.pop(), (scales.pop() if scales else 0.0)


def output_rows(lin: QuantLinear, index: torch.Tensor) -> QuantLinear:
    """A W8A8 linear's outputs ``index`` alone, quantized as ``lin`` quantizes them (per-output-channel
    scales are each row's own; the same activation scale): :func:`matmul` of it computes ``lin``'s product
    for those outputs (a candidate check's logits over the LM head's shortlist rows).

    Raises:
        ConfigError: ``lin`` is not W8A8 with calibrated activations.
    """
    if not (isinstance(lin, QuantLinear) and lin.enabled and lin.has_act_quant):
        raise ConfigError("output rows: only a W8A8 linear with calibrated activations")
    idx = torch.as_tensor(index, dtype=torch.long)
    sub = QuantLinear(lin.in_features, len(idx), lin.bias is not None, lin.spec)
    with torch.no_grad():
        sub.weight.copy_(lin.weight.detach()[idx])
        if lin.bias is not None:
            sub.bias.copy_(lin.bias.detach()[idx])
        sub.act_scale.copy_(lin.act_scale)
    return sub.to(lin.weight.device)


def pack_nbits(codes: np.ndarray, block: int) -> np.ndarray:
    """INT4 codes [N, K] in [-8, 7] -> MatMulNBits' B [N, K / block, block / 2] uint8."""
    n, k = codes.shape
    u = (codes.astype(np.int16) + 8).astype(np.uint8).reshape(n, k // block, block)
    return (u[..., 0::2] | (u[..., 1::2] << 4)).astype(np.uint8)


def matmul(b, x: str, lins: list[nn.Linear], name: str) -> str:
    """Append ``x @ W^T (+ bias)`` for the linears ``lins`` packed along the output to builder ``b``."""
    kind, a_scale = _spec_of(lins)
    with torch.no_grad():
        bias = None
        if lins[0].bias is not None:
            bias = torch.cat([lin.bias for lin in lins]).float().numpy()
        if kind == "float":
            w = torch.cat([lin.weight for lin in lins], 0).T
            y = b.node("MatMul", [x, b.weight(f"{name}_t", w)], [f"{name}.mm"])[0]
        elif kind.startswith("w8"):
            codes = torch.cat([lin.int_weight() for lin in lins], 0).T.numpy().astype(np.int8)  # [K, N]
            scale = torch.cat([lin.weight_scale() for lin in lins]).float().numpy()  # [N]
            wq = b.weight(f"{name}.w_i8", codes)
            ws = b.weight(f"{name}.w_scale", scale.astype(np.float32))
            wz = b.weight(f"{name}.w_zp", np.zeros(scale.shape, np.int8))
            wd = b.node("DequantizeLinear", [wq, ws, wz], [f"{name}.w_dq"], axis=1)[0]
            if kind == "w8a8":  # a Q/DQ pair of its own: ONNX Runtime fuses only a pair that feeds one MatMul
                s = b.weight(f"{name}.a_scale", np.array(a_scale, np.float32))
                z = b.weight(f"{name}.a_zp", np.array(0, np.int8))
                q = b.node("QuantizeLinear", [x, s, z], [f"{name}.a_q"])[0]
                x = b.node("DequantizeLinear", [q, s, z], [f"{name}.a_dq"])[0]
            y = b.node("MatMul", [x, wd], [f"{name}.mm"])[0]
        else:
            block = int(kind.split("/")[1])
            codes = torch.cat([lin.int_weight() for lin in lins], 0).numpy()  # [N, K]
            scale = torch.cat([lin.weight_scale() for lin in lins], 0).float().numpy()  # [N, K / block]
            n, k = codes.shape
            packed = b.weight(f"{name}.w_q4", pack_nbits(codes, block))
            ws = b.weight(f"{name}.w_scale", scale.astype(np.float32))
            y = b.node("MatMulNBits", [x, packed, ws], [f"{name}.mm"], domain=MS, K=k, N=n, bits=4,
                       block_size=block, accuracy_level=NBITS_ACCURACY)[0]
    if bias is not None:
        y = b.node("Add", [y, b.weight(f"{name}.bias", bias)], [f"{name}.out"])[0]
    return y
