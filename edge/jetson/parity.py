"""Does a TensorRT engine compute what ONNX Runtime computes? Pure comparison on arrays.

At push time ONNX Runtime (CPU, float32) runs every portable graph on recorded inputs
(:mod:`edge.jetson.record`); on the device ``trtexec`` runs each engine on the same inputs and writes
its outputs as JSON; :func:`compare_graph` judges each output against the reference.

Tolerance, relative to the reference output's largest magnitude (STYLE.md 15; tests/tolerance.py):

- FP32 engine: ``16 * eps32 * sqrt(n) * layers``, the project's rule for two float32 paths (a dot
  product of length n rounds like a random walk, Higham 2002, sec. 3.1; each layer adds its own).
- FP16 engine: ``16 * eps16 * layers``. TensorRT's FP16 kernels accumulate in FP32 on Ampere tensor
  cores and round what they store to FP16 (unit roundoff eps16 / 2 = 2^-11) at each layer boundary,
  so the error grows with the number of FP16 round trips, not with n.
- INT8 engine (Q/DQ graphs): the FP16 term plus one quantization step (1/127 of a tensor's range, a
  symmetric 8-bit code) per layer: TensorRT and ONNX Runtime may round a value on a code boundary to
  neighbouring codes.

Plus ``6 / 10^6`` of the scale: trtexec prints values with 6 significant digits (std::ostream's default).
Where a graph outputs ``logits``, the argmax must also agree on every row whose top-2 margin is clear
(over 2 * tolerance), and an integer output (``exit_token``) is compared exactly on those rows: a token
is what the engine decides with these numbers.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

import numpy as np

from edge.core.errors import ArtifactError

EPS = {"fp32": float(np.finfo(np.float32).eps), "fp16": float(np.finfo(np.float16).eps)}  # 2^-23, 2^-10
INT8_STEP = 1.0 / 127.0
SAFETY = 16.0
PRINT_RTOL = 6e-6  # trtexec --exportOutput: 6 significant digits
PRECISIONS = ("fp32", "fp16", "int8")


def rtol(precision: str, reduction: int, layers: int) -> float:
    """The relative tolerance of one output (module docstring).

    Args:
        precision: fp32, fp16 or int8 (the engine's build precision).
        reduction: the longest dot product (the hidden size).
        layers: decoder layers between the graph's input and this output (at least 1).
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    k = max(1, layers)
    if precision == "fp32":
        base = SAFETY * EPS["fp32"] * math.sqrt(reduction) * k
    else:
        base = SAFETY * EPS["fp16"] * k + (INT8_STEP * k if precision == "int8" else 0.0)
    return base + PRINT_RTOL


@dataclass
class OutputParity:
    name: str
    shape: list[int]
    max_abs_diff: float | None  # None: integer output compared exactly
    scale: float
    tolerance: float  # absolute: rtol * scale
    passed: bool
    detail: str = ""


@dataclass
class GraphParity:
    graph: str
    precision: str
    outputs: list[OutputParity] = field(default_factory=list)
    argmax_rows: int = 0  # logits rows with a clear top-2 margin
    argmax_agree: int = 0

    @property
    def passed(self) -> bool:
        return bool(self.outputs) and all(o.passed for o in self.outputs) and self.argmax_agree == self.argmax_rows

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "passed": self.passed}


def _clear_rows(logits: np.ndarray, tol: float) -> np.ndarray:
    """bool [rows]: the top-2 margin of the reference is over 2 * tol (a rounding cannot swap them)."""
    flat = logits.reshape(-1, logits.shape[-1])  # [rows, V]
    top2 = np.sort(flat, axis=-1)[:, -2:]
    return (top2[:, 1] - top2[:, 0]) > 2 * tol


def compare_graph(graph: str, reference: Mapping[str, np.ndarray], engine: Mapping[str, np.ndarray],
                  precision: str, reduction: int, layers: int) -> GraphParity:
    """Judge every reference output of one graph against the engine's.

    Args:
        graph: the graph's name (for messages).
        reference: ONNX Runtime's outputs by name.
        engine: the engine's outputs by name (extra names are ignored, a missing one fails).
        precision, reduction, layers: see :func:`rtol`.

    Returns:
        One :class:`OutputParity` per reference output, and the argmax agreement where ``logits`` exists.
    """
    r = rtol(precision, reduction, layers)
    out = GraphParity(graph, precision)
    clear = None
    if "logits" in reference and "logits" in engine and engine["logits"].shape == reference["logits"].shape:
        ref_l = reference["logits"].astype(np.float64)
        clear = _clear_rows(ref_l, r * float(np.abs(ref_l).max() or 1.0))
        agree = (engine["logits"].reshape(ref_l.shape).reshape(-1, ref_l.shape[-1]).argmax(-1)
                 == ref_l.reshape(-1, ref_l.shape[-1]).argmax(-1))
        out.argmax_rows, out.argmax_agree = int(clear.sum()), int((agree & clear).sum())
    for name, ref in reference.items():
        ref = np.asarray(ref)
        got = engine.get(name)
        if got is None:
            out.outputs.append(OutputParity(name, list(ref.shape), None, 0.0, 0.0, False, "missing from the engine"))
            continue
        got = np.asarray(got)
        if got.size != ref.size:
            out.outputs.append(OutputParity(name, list(ref.shape), None, 0.0, 0.0, False,
                                            f"engine shape {list(got.shape)} != {list(ref.shape)}"))
            continue
        got = got.reshape(ref.shape)
        if not np.issubdtype(ref.dtype, np.floating):
            rows_ok = np.ones(ref.size, bool) if clear is None or clear.size != ref.size else clear
            same = (got.reshape(-1) == ref.reshape(-1)) | ~rows_ok
            out.outputs.append(OutputParity(name, list(ref.shape), None, 0.0, 0.0, bool(same.all()),
                                            "" if same.all() else f"{int((~same).sum())} values differ"))
            continue
        scale = float(np.abs(ref).max()) or 1.0
        diff = np.abs(got.astype(np.float64) - ref.astype(np.float64))
        err = float(diff.max()) if diff.size else 0.0
        finite = bool(np.isfinite(got).all() == np.isfinite(ref).all())
        tol = r * scale
        out.outputs.append(OutputParity(name, list(ref.shape), err, scale, tol, finite and err <= tol,
                                        "" if finite else "non-finite values differ"))
    return out


_NONFINITE = re.compile(r"(?<![\w\"])(-?)(inf|nan)(?![\w\"])", re.IGNORECASE)


def parse_trtexec_outputs(text: str) -> dict[str, np.ndarray]:
    """trtexec ``--exportOutput`` JSON -> {name: array}.

    The file is ``[{"name": ..., "dimensions": "2x3x64", "values": [...]}, ...]`` (TensorRT's
    samples/common/sampleReporting.cpp, exportJSONOutput); non-finite values are printed as C++ streams
    print them (``inf``, ``-nan``), which JSON does not have, so they are mapped first.

    Raises:
        ArtifactError: not that format, or a value count that does not match the dimensions.
    """
    def fix(m: re.Match) -> str:
        return "NaN" if m.group(2).lower() == "nan" else f"{m.group(1)}Infinity"

    try:
        items = json.loads(_NONFINITE.sub(fix, text))
        out = {}
        for item in items:
            dims = [int(d) for d in str(item["dimensions"]).split("x") if d != ""]
            arr = np.asarray(item["values"], dtype=np.float64)
            if arr.size != int(np.prod(dims)):
                raise ArtifactError(f"trtexec output {item['name']!r}: {arr.size} values for dimensions "
                                    f"{item['dimensions']!r}")
            out[item["name"]] = arr.reshape(dims)
        return out
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise ArtifactError(f"not trtexec --exportOutput JSON: {exc!r}") from exc
