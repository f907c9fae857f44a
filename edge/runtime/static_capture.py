"""What the static-cache torch backend (:mod:`edge.runtime.static_backend`) holds on its device between
calls: a computation on static input tensors replayed as a CUDA graph or run eagerly (:class:`Captured`),
a device tensor the engine may read as a host array (:class:`OnDevice`), and a segment call launched on
the device, its outputs there and its decision's copies on their way to the host (:class:`Launched`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch


class Captured:
    """A computation on static input tensors, replayed as a CUDA graph (or run eagerly)."""

    def __init__(self, fn: Callable[[], dict[str, torch.Tensor]], inputs: dict[str, torch.Tensor],
                 graph: bool, pad: dict[str, int]) -> None:
        """``pad``: the value of an input's padding rows (default 0)."""
        self.fn, self.inputs, self.pad, self.graph, self.out = fn, inputs, pad, None, None
        if graph:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm-up on a side stream, as torch.cuda.graphs asks
                fn()
            torch.cuda.current_stream().wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.out = fn()

    def __call__(self, **values: torch.Tensor) -> dict[str, torch.Tensor]:
        for name, v in values.items():
            dst = self.inputs[name]
            dst[:v.shape[0]].copy_(v, non_blocking=True)
            if v.shape[0] < dst.shape[0]:  # padding rows: slot ``slots`` (spare), position 0, zeros
                dst[v.shape[0]:].fill_(self.pad.get(name, 0))
        if self.graph is None:
            return self.fn()
        self.graph.replay()
        return self.out


class OnDevice:
    """A device tensor that the engine may read as a host array: copied to the host on first read (its
    shape needs no copy); given back to the backend (the next segment's input), it stays on the device.
    Like every array of a :class:`edge.runtime.backend.SegmentOut`, valid until the backend's next call of
    the same kind."""

    __slots__ = ("t", "_host")

    def __init__(self, t: torch.Tensor) -> None:
        self.t, self._host = t, None

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.t.shape)

    @property
    def ndim(self) -> int:
        return self.t.dim()

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.float32) if self.t.is_floating_point() else np.dtype(np.int64)

    def __len__(self) -> int:
        return self.t.shape[0]

    def host(self) -> np.ndarray:
        if self._host is None:
            t = self.t
            self._host = (t.float() if t.is_floating_point() else t).cpu().numpy()
        return self._host

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        a = self.host()
        return a if dtype is None else a.astype(dtype, copy=False)

    def __getitem__(self, key):
        return self.host()[key]

    def copy(self) -> np.ndarray:
        return self.host().copy()


@dataclass
class Launched:
    """A segment call launched on the device: its residual and exit hidden there, the logits of a full-head
    exit, the decision arrays on their way to the host (pinned buffers) and the event that says they are."""

    i: int
    hidden: torch.Tensor | None
    eh: torch.Tensor
    logits: torch.Tensor | None = None
    copies: dict[str, torch.Tensor] = field(default_factory=dict)
    event: torch.cuda.Event | None = None
