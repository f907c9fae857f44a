"""The torch backend on a device: a static K/V cache there, decode steps captured as CUDA graphs.

The serving path of a GPU without built TensorRT engines (a Jetson whose ``make jetson-engines`` has
not run yet: JetPack ships CUDA torch wheels; a discrete GPU). Unlike the reference
(:mod:`edge.runtime.torch_backend`), which works on the engine's host arrays, this backend keeps its
own cache on the device, [slots + 1, KV, capacity, hd] per layer (``host_cache`` False: the engine
allocates slots only), and computes where the weights are:

- a *decode call* (one row per sequence, any slots) has no shape that depends on the step: each
  sequence's past is gathered from its slot over the whole capacity, a mask built on the device from
  the rows' positions hides the slots at or after each row's position, and the new K/V is written
  with ``index_put_``. So one CUDA graph per (segment, batch bucket) replays it, and one more per
  (exit head, bucket) and (K/V fill, bucket), as static-cache engines do. A call of B rows runs in
  the smallest bucket >= B; its padding rows compute in the spare slot (index ``slots``) at
  position 0, which no sequence reads. Graphs are captured on first use (after one eager warm-up
  run, which computes the same values);
- a *prompt chunk* (one sequence, T rows) or a verification call runs eagerly, over the past it has;
- the exit rule's decision is read on the host (:func:`edge.runtime.backend.host_decision`): each
  segment call copies its exit's hidden, logits, statistics and token to the host (B x V floats for
  the logits) and the residual to the next segment (B x D).

On a CPU the same code runs eagerly (``graphs`` False), which is how the tests check it against the
reference. Capture needs CUDA (``graphs`` True refuses otherwise).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import torch

from edge.core.errors import ConfigError
from edge.model.exits import MultiExitModel, exit_decision_stats
from edge.runtime.backend import Backend, HeadOut, ModelSpec, SegmentOut, host_candidates, host_decision
from edge.runtime.static_decode import past_mask

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class _Captured:
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


class StaticTorchBackend(Backend):
    """The multi-exit model on ``device`` with a static device cache; decode calls as CUDA graphs.

    Args:
        model: the model, or ``checkpoint``: its folder (compressed or not; loaded and hash-checked).
        device: where to run ("cuda", "cuda:1", "cpu"; default cuda when available).
        dtype: "float32", "float16" or "bfloat16" (default float32).
        graphs: capture decode calls as CUDA graphs (default: on CUDA).
        buckets: the batch sizes graphs are captured for (default 1, 2, 4, ... up to the cache's slots).
    """

    name = "torch_static"
    host_cache = False

    def __init__(self, model: MultiExitModel | None = None, checkpoint: str | Path | None = None,
                 device: str | None = None, dtype: str = "float32", graphs: bool | None = None,
                 buckets: list[int] | None = None) -> None:
        if (model is None) == (checkpoint is None):
            raise ConfigError("the torch_static backend needs the model or its checkpoint folder (one of them)")
        if dtype not in DTYPES:
            raise ConfigError(f"torch_static dtype {dtype!r}: one of {sorted(DTYPES)}")
        if model is None:
            from edge.compress.checkpoint import load_served

            model = load_served(checkpoint)
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"device {device!r}: this torch ({torch.__version__}) sees no CUDA GPU")
        self.graphs = self.device.type == "cuda" if graphs is None else graphs
        if self.graphs and self.device.type != "cuda":
            raise ConfigError(f"CUDA graphs need a CUDA device, not {self.device}")
        super().__init__(ModelSpec.of(model))
        self.shortlist_rows = model.shortlist_rows().numpy() if model.has_shortlist else None  # [K, D], float32
        self.dtype = DTYPES[dtype]
        self.model = model.eval().to(device=self.device, dtype=self.dtype)
        self.bb = self.model.backbone
        self._buckets_asked = buckets
        self._plans: dict[tuple, _Captured] = {}
        self.captured = 0  # graphs captured so far

    # ---------------------------------------------------------------- cache
    def _attached(self) -> None:
        c = self.cache
        shape = (c.slots + 1, self.num_kv_heads, c.capacity, self.head_dim)  # + the spare slot of padding rows
        if getattr(self, "keys", None) and tuple(self.keys[0].shape) == shape:
            return  # a new engine of the same shape (a benchmark's next run): keep the cache and its graphs;
            # stale K/V is never read (a slot's positions are written before they are attended to)
        self.keys = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in range(self.num_layers)]
        self.values = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in range(self.num_layers)]
        self.spare = c.slots
        asked = self._buckets_asked or [1 << k for k in range(c.slots.bit_length() + 1) if 1 << k <= c.slots]
        self.buckets = sorted({b for b in asked if 1 <= b <= c.slots} | {c.slots})
        self._plans.clear()

    def _bucket(self, b: int) -> int:
        return next(k for k in self.buckets if k >= b)

    # ---------------------------------------------------------------- device computations
    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.bb.rope(positions)
        return cos.to(self.dtype), sin.to(self.dtype)

    def _layers(self, i: int, h: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, past: int,
                mask: torch.Tensor) -> torch.Tensor:
        """Segment i's layers on h [B, T, D] at ``positions`` [B, T] over the first ``past`` cached positions
        of each slot (a decode call: the whole capacity). Writes the new rows' K/V into the slots."""
        cos, sin = self._rope(positions)
        idx = slots[:, None].expand_as(positions)
        for j in self.segments[i]:
            k_all, v_all = self.keys[j], self.values[j]
            pk, pv = k_all[slots, :, :past], v_all[slots, :, :past]  # [B, KV, past, hd] (a gather)
            h, k, v = self.bb.layers[j](h, cos, sin, pk, pv, mask)
            k_all[idx, :, positions] = k.transpose(1, 2)  # [B, T, KV, hd] at (slot, position)
            v_all[idx, :, positions] = v.transpose(1, 2)
        return h

    def _exit(self, i: int, h: torch.Tensor) -> torch.Tensor:
        """Normalised exit hidden [B*R, D] of rows h [B, R, D]."""
        return self.model.exit_hidden(self.exit_layers[i], h).reshape(-1, h.shape[-1])

    def _head_fn(self, eh: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.bb.logits(eh).float()  # the rule's statistics in float32, as calibrated
        stats, token = exit_decision_stats(logits)
        return {"logits": logits, "stats": stats, "token": token}

    def _decode_plan(self, kind: str, i: int, bucket: int) -> _Captured:
        key = (kind, i, bucket)
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        dev, d = self.device, self.spec.hidden_size
        slots = torch.full((bucket,), self.spare, dtype=torch.long, device=dev)
        pos = torch.zeros(bucket, dtype=torch.long, device=dev)
        ins = {"slots": slots, "pos": pos}
        if kind == "segment":
            x = (torch.zeros(bucket, 1, dtype=torch.long, device=dev) if i == 0
                 else torch.zeros(bucket, 1, d, device=dev, dtype=self.dtype))
            ins["x"] = x

            def fn():
                h = self.bb.embed(x) if i == 0 else x
                cap = self.cache.capacity  # the whole slot: no shape depends on the step
                h = self._layers(i, h, slots, pos[:, None], cap, past_mask(pos[:, None], pos, cap, self.sliding_window))
                out = {"hidden": h, "exit_hidden": self._exit(i, h)}
                if self.spec.gated and i < len(self.segments) - 1:
                    out["gate"] = self.model.exit_gate(self.exit_layers[i], out["exit_hidden"])
                return out
        elif kind == "head":
            eh = ins["x"] = torch.zeros(bucket, d, device=dev, dtype=self.dtype)
            del ins["slots"], ins["pos"]

            def fn():
                return self._head_fn(eh)
        else:  # K/V fill of segments i.. from the residual at exit i-1
            hid = ins["x"] = torch.zeros(bucket, 1, d, device=dev, dtype=self.dtype)

            def fn():
                cos, sin = self._rope(pos[:, None])
                for j in self.suffix_layers(i):
                    k, v = self.bb.layers[j].kv_only(hid, cos, sin)  # [B, KV, 1, hd]
                    self.keys[j][slots, :, pos] = k[:, :, 0]
                    self.values[j][slots, :, pos] = v[:, :, 0]
                return {}
        plan = _Captured(torch.no_grad()(fn), ins, self.graphs, {"slots": self.spare})
        self.captured += plan.graph is not None
        self._plans[key] = plan
        return plan

    # ---------------------------------------------------------------- host boundary
    def _to(self, a: np.ndarray, dtype=None) -> torch.Tensor:
        t = torch.from_numpy(np.ascontiguousarray(a)).to(self.device, non_blocking=False)
        return t.to(dtype) if dtype is not None and t.is_floating_point() else t

    @staticmethod
    def _host(t: torch.Tensor, b: int) -> np.ndarray:
        t = t[:b]
        return (t.float() if t.is_floating_point() else t).cpu().numpy()

    @torch.no_grad()
    def _segment(self, i, x, slots, start, prev, decide, rows, draft, lookup):
        b, t = x.shape[:2]
        last = i == len(self.segments) - 1
        slots_t, start_t = self._to(slots.astype(np.int64)), self._to(start.astype(np.int64))
        if t == 1:  # a decode call (B <= slots, the largest bucket): the bucket's graph
            k = self._bucket(b)
            out = self._decode_plan("segment", i, k)(slots=slots_t, pos=start_t, x=self._to(x, self.dtype))
            h, eh = out["hidden"], out["exit_hidden"]
            gate = out.get("gate")
            head = (lambda e: self._decode_plan("head", i, k)(x=e)) if decide else None
        else:  # a prompt chunk or deferred rows (B == 1 or T == 1): eagerly, over the past that exists
            positions = start_t[:, None] + torch.arange(t, device=self.device)[None, :]
            p = int(start.max())
            mask = past_mask(positions, start_t, p, self.sliding_window)
            h = self.bb.embed(self._to(x)) if i == 0 else self._to(x, self.dtype)
            h = self._layers(i, h, slots_t, positions, p, mask)
            eh = self._exit(i, h[:, t - rows:])
            gate = (self.model.exit_gate(self.exit_layers[i], eh)
                    if self.spec.gated and not last and decide else None)
            head = self._head_fn if decide else None
        r = b * rows
        hidden = None if last else self._host(h, b)
        eh_host = self._host(eh, r)
        if not decide and not last:  # nobody reads this exit's decision
            return SegmentOut(hidden, eh_host, None, None, None)
        if self.spec.candidates and not last:  # the candidate check on the host (no LM head)
            return host_candidates(self, i, SegmentOut(hidden, eh_host, None, None, None), prev, lookup,
                                   self.shortlist_rows)
        if gate is not None:
            out = SegmentOut(hidden, eh_host, None, None, None, self._host(gate, r))
        else:
            ho = head(eh)
            out = SegmentOut(hidden, eh_host, self._host(ho["logits"], r), self._host(ho["stats"], r),
                             self._host(ho["token"], r))
        return out if last else host_decision(self, i, out, prev)

    @torch.no_grad()
    def _head(self, i, exit_hidden):
        ho = self._head_fn(self._to(exit_hidden, self.dtype))
        b = exit_hidden.shape[0]
        return HeadOut(self._host(ho["logits"], b), self._host(ho["stats"], b), self._host(ho["token"], b))

    @torch.no_grad()
    def _kvfill(self, i, hidden, slots, positions):
        b = len(slots)
        slots_t, pos_t = self._to(slots.astype(np.int64)), self._to(positions.astype(np.int64))
        hid = self._to(hidden, self.dtype)[:, None]
        self._decode_plan("fill", i, self._bucket(b))(slots=slots_t, pos=pos_t, x=hid)
