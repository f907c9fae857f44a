"""Tolerances between two float32 computation paths (STYLE.md 15).

Two paths that do the same arithmetic in another order (batched vs one by one, ONNX Runtime vs
torch, another CPU's SIMD kernels) differ by rounding. A dot product of length n accumulates
about eps32 * sqrt(n) of its operands' scale (random-walk rounding, Higham, "Accuracy and
Stability of Numerical Algorithms", 2nd ed., sec. 3.1), and each layer a value passes through
adds its own. So a comparison is relative to the compared values' scale:

    max |a - b| <= SAFETY * eps32 * sqrt(n) * layers * max |b|

SAFETY = 16 covers unlucky summation orders; it is still thousands of times tighter than any
real bug (a wrong mask, position or weight changes outputs at the scale of the values).
"""
from __future__ import annotations

import numpy as np

EPS32 = float(np.finfo(np.float32).eps)  # 1.19e-7
SAFETY = 16.0


def f32_rtol(reduction: int, layers: int = 1) -> float:
    """Relative tolerance for values from ``layers`` chained dot products of length ``reduction``."""
    return SAFETY * EPS32 * float(np.sqrt(reduction)) * max(1, layers)


def assert_f32_close(a, b, reduction: int, layers: int = 1, what: str = "") -> None:
    """``a`` and ``b`` agree to :func:`f32_rtol` relative to the scale of ``b``."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, f"{what}: shapes {a.shape} != {b.shape}"
    scale = float(np.abs(b).max()) or 1.0
    tol = f32_rtol(reduction, layers) * scale
    err = float(np.abs(a - b).max())
    assert err <= tol, f"{what}: max |a - b| = {err:.3g} > {tol:.3g} (relative {f32_rtol(reduction, layers):.2g} of {scale:.3g})"
