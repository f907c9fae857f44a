"""Quantized linear layers: INT8 weights per output channel with static INT8 activations (W8A8), or
block-wise INT4 weights with float activations (W4, weight-only).

Fake quantization runs in float32 (quantize, round, clamp, dequantize) with straight-through
gradients, so one module serves post-training quantization, quantization-aware training and the
export: :class:`QuantLinear` is an ``nn.Linear`` (code that reads ``.weight`` keeps working) whose
forward is the quantized computation. The W8A8 forward uses torch's own
``fake_quantize_per_channel_affine`` / ``fake_quantize_per_tensor_affine`` (straight-through
gradients built in), which the ONNX exporter (``dynamo=False``) writes as QuantizeLinear /
DequantizeLinear pairs: the explicit Q/DQ placement TensorRT builds INT8 from. The fused ONNX
Runtime graphs (:mod:`exporters.ort_fused`) write the same numbers as Q/DQ around each MatMul (W8A8,
which ONNX Runtime runs as integer matrix products) or as ``MatMulNBits`` (W4).

Not ``torch.ao.quantization`` (being retired for torchao) and not torchao (its tensor subclasses do
not export through the ONNX exporter that writes Q/DQ, and the new exporter fails on FakeQuantize,
pytorch#167063): the arithmetic here is a few lines, and owning it keeps the torch model, the
ONNX Runtime graphs and the TensorRT graphs bit-for-bit the same scheme (DESIGN.md, compression).

Conventions (ONNX's, so the export is a copy): symmetric, zero point 0, round half to even;
weights in [-127, 127] (INT8) or [-8, 7] (INT4, stored as ``code + 8``), activations in [-128, 127].
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from edge.core.errors import ConfigError

W8_MAX = 127
A8_MIN, A8_MAX = -128, 127
W4_MIN, W4_MAX = -8, 7
ROW_SAMPLES = 1024  # input rows an observer keeps (for choosing the activation range by measured error)
CLIP_GRID = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)  # INT4 block clipping ratios searched (by block MSE)


class Precision(str, enum.Enum):
    W8A8 = "w8a8"  # INT8 weights per output channel, INT8 activations per tensor (static range)
    W4 = "w4"  # INT4 weights per block of inputs (weight-only: activations quantized per block on the fly, as
    # ONNX Runtime's MatMulNBits kernel does at accuracy_level 4; no calibrated range)


class Observer(str, enum.Enum):
    MINMAX = "minmax"  # the largest |x| seen
    PERCENTILE = "percentile"  # the 99.99th percentile of |x|
    MSE = "mse"  # the clipping range minimising the quantization error of x


@dataclass(frozen=True)
class QuantSpec:
    precision: Precision = Precision.W8A8
    block_size: int = 32  # W4: inputs per scale (a power of two >= 16, as MatMulNBits wants)

    def __post_init__(self) -> None:
        if self.block_size < 16 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"quantization block_size must be a power of two >= 16, got {self.block_size}")


def w4_codes(w: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    """INT4 codes [N, K / block, block] (float, in [-8, 7]) of w [N, K] with scales [N, K / block]."""
    n, k = w.shape
    return torch.clamp(torch.round(w.reshape(n, k // block, block) / scale.unsqueeze(-1)), W4_MIN, W4_MAX)


def fake_quant_w4(w: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    """Block-wise INT4 fake quantization of w [N, K] with scales [N, K / block]; straight-through."""
    q = (w4_codes(w, scale, block) * scale.unsqueeze(-1)).reshape(w.shape)
    return w + (q - w).detach()


def fake_quant_act_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """Dynamic INT8 fake quantization of x [..., K] per block of ``block`` inputs (scale = block absmax
    / 127): what ONNX Runtime's MatMulNBits does to its input at ``accuracy_level`` 4 before the integer
    product, so that the torch model computes what the served graph computes; straight-through."""
    shape = x.shape
    xb = x.reshape(*shape[:-1], shape[-1] // block, block)
    s = (xb.detach().abs().amax(-1, keepdim=True) / W8_MAX).clamp_min(1e-12)
    q = torch.clamp(torch.round(xb / s), -W8_MAX, W8_MAX) * s
    return x + (q.reshape(shape) - x).detach()


def w4_scales(w: torch.Tensor, block: int) -> torch.Tensor:
    """Per-block scales [N, K / block] of w [N, K]: absmax / 7 times the clipping ratio of
    :data:`CLIP_GRID` with the smallest squared error in each block (round-to-nearest with a
    clipping search)."""
    n, k = w.shape
    wb = w.detach().reshape(n, k // block, block)
    amax = wb.abs().amax(-1).clamp_min(1e-12)  # [N, nb]
    best_err, best = None, None
    for r in CLIP_GRID:
        s = amax * r / W4_MAX
        err = (w4_codes(w.detach(), s, block) * s.unsqueeze(-1) - wb).pow(2).sum(-1)
        if best is None:
            best_err, best = err, s
        else:
            better = err < best_err
            best_err, best = torch.where(better, err, best_err), torch.where(better, s, best)
    return best


def w8_scales(w: torch.Tensor) -> torch.Tensor:
    """Per-output-channel scales [N] of w [N, K]: absmax / 127."""
    return (w.detach().abs().amax(1) / W8_MAX).clamp_min(1e-12)


def fake_quant_act(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Per-tensor symmetric INT8 fake quantization of x with a fixed scale; straight-through. Without
    gradients (calibration's decode steps) the same arithmetic as three plain kernels, a third faster on
    decode-sized tensors (x / scale, round half to even, clamp: QuantizeLinear's definition)."""
    if not torch.is_grad_enabled() and not torch.jit.is_tracing():
        return torch.round(x / scale).clamp_(A8_MIN, A8_MAX).mul_(scale)
    return torch.fake_quantize_per_tensor_affine(x, scale, torch.zeros((), dtype=torch.int32), A8_MIN, A8_MAX)


class QuantLinear(nn.Linear):
    """``nn.Linear`` with quantized weights (and, W8A8, activations).

    ``act_scale`` is 0 until calibrated (:func:`calibrate_activations`): until then W8A8 runs with float
    activations. While ``observing`` is set, the forward keeps the input's largest |x| and a sample of
    input rows for the observers."""

    def __init__(self, in_features: int, out_features: int, bias: bool, spec: QuantSpec) -> None:
        super().__init__(in_features, out_features, bias=bias)
        if spec.precision is Precision.W4 and in_features % spec.block_size:
            raise ConfigError(f"W4 needs in_features ({in_features}) divisible by block_size {spec.block_size}")
        self.spec = spec
        self.register_buffer("act_scale", torch.zeros(()))
        w4 = spec.precision is Precision.W4
        self.register_buffer("w4_scale", torch.zeros(out_features, in_features // spec.block_size) if w4 else None)
        self.enabled = True  # False: the float computation (sensitivity analysis turns layers on one at a time)
        self._wq: tuple[int, torch.Tensor] | None = None  # (weight version, quantized weight) for inference
        self.observing = False
        self.obs_amax = 0.0
        self.obs_rows: list[torch.Tensor] = []

    @classmethod
    def from_linear(cls, lin: nn.Linear, spec: QuantSpec) -> "QuantLinear":
        q = cls(lin.in_features, lin.out_features, lin.bias is not None, spec)
        with torch.no_grad():
            q.weight.copy_(lin.weight)
            if lin.bias is not None:
                q.bias.copy_(lin.bias)
            if spec.precision is Precision.W4:
                q.w4_scale.copy_(w4_scales(lin.weight, spec.block_size))
        return q.to(lin.weight.device)

    @property
    def has_act_quant(self) -> bool:
        return self.spec.precision is Precision.W8A8 and float(self.act_scale) > 0

    def weight_scale(self) -> torch.Tensor:
        """[N] (W8A8) or [N, K / block] (W4)."""
        return w8_scales(self.weight) if self.spec.precision is Precision.W8A8 else self.w4_scale

    def quantized_weight(self) -> torch.Tensor:
        """The fake-quantized weight [N, K] (float, straight-through to ``weight``). Without gradients it is
        computed once per version of the weight (a decode step would otherwise re-quantize every weight)."""
        if not torch.is_grad_enabled() and not torch.jit.is_tracing():
            v = (self.weight._version, id(self.weight), self.w4_scale._version if self.w4_scale is not None else 0)
            if self._wq is None or self._wq[0] != v:
                self._wq = (v, self._quantize_weight().detach())
            return self._wq[1]
        return self._quantize_weight()

    def _quantize_weight(self) -> torch.Tensor:
        if self.spec.precision is Precision.W4:
            return fake_quant_w4(self.weight, self.w4_scale, self.spec.block_size)
        zp = torch.zeros(self.out_features, dtype=torch.int32)
        # range (-128, 127), the one ONNX's exporter accepts: with scale = absmax / 127 no weight reaches -128
        return torch.fake_quantize_per_channel_affine(self.weight, self.weight_scale(), zp, 0, A8_MIN, A8_MAX)

    def int_weight(self, weight: torch.Tensor | None = None) -> torch.Tensor:
        """Integer codes [N, K] (int8: [-127, 127] or [-8, 7]) of the weight as exported, or of ``weight``
        quantized the same way (W8A8: with its own per-channel scales; W4: with this layer's block scales)."""
        w = (self.weight if weight is None else weight).detach()
        if self.spec.precision is Precision.W4:
            return w4_codes(w, self.w4_scale, self.spec.block_size).reshape(w.shape).to(torch.int8)
        return torch.clamp(torch.round(w / w8_scales(w).unsqueeze(1)), -W8_MAX, W8_MAX).to(torch.int8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.observing:
            self._observe(x)
        if not self.enabled:
            return F.linear(x, self.weight, self.bias)
        if self.has_act_quant:
            x = fake_quant_act(x, self.act_scale)
        elif self.spec.precision is Precision.W4:
            x = fake_quant_act_blocks(x, self.spec.block_size)
        return F.linear(x, self.quantized_weight(), self.bias)

    def _observe(self, x: torch.Tensor) -> None:
        rows = x.detach().reshape(-1, x.shape[-1])
        self.obs_amax = max(self.obs_amax, float(rows.abs().max()) if rows.numel() else 0.0)
        have = sum(r.shape[0] for r in self.obs_rows)
        if have < ROW_SAMPLES and rows.shape[0]:
            step = max(1, rows.shape[0] // max(1, (ROW_SAMPLES - have)))
            self.obs_rows.append(rows[::step][: ROW_SAMPLES - have].clone())

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {self.spec.precision.value}, act_scale={float(self.act_scale):.4g}"


def observer_scale(rows: torch.Tensor, amax: float, observer: Observer) -> float:
    """An activation scale (range / 127) for sampled input rows [R, K] whose largest |x| was ``amax``."""
    if amax <= 0:
        return 1.0 / A8_MAX
    if observer is Observer.MINMAX:
        return amax / A8_MAX
    flat = rows.abs().flatten().float()
    if observer is Observer.PERCENTILE:
        k = max(1, int(round(0.9999 * flat.numel())))
        return max(float(flat.kthvalue(k).values), 1e-8) / A8_MAX
    best, best_err = amax, None
    for r in torch.linspace(0.3, 1.0, 15).tolist():
        s = torch.tensor(amax * r / A8_MAX)
        err = float((fake_quant_act(rows, s) - rows).pow(2).mean())
        if best_err is None or err < best_err:
            best, best_err = amax * r, err
    return best / A8_MAX
