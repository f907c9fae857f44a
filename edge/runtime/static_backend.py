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
- the exit rule's decision is read on the host (:func:`edge.runtime.backend_host.host_decision`,
  :func:`edge.runtime.backend_host.host_candidates`): a decision exit copies its exit hidden (B x D) and
  its statistics and token, or its candidate logits over the shortlist (B x K, computed on the device
  in the segment's graph), to the host. The residual and the logits stay on the device
  (:class:`OnDevice`): the residual goes into the next segment call as it is, and B x V logits are
  copied only when the engine reads them (a sampled row, a verification). Measured on an H200 before
  this (deploy/gpu_check.py, Llama-3.1-8B shape, batch 16): a full-head check cost 21 layers, most of
  it the B x V logits' copy, and the candidate check 3.2 layers, most of it its B x D x K product on
  the host.

On a CPU the same code runs eagerly (``graphs`` False), which is how the tests check it against the
reference. Capture needs CUDA (``graphs`` True refuses otherwise).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from edge.compress.quant import fake_quant_act
from edge.core.errors import ConfigError
from edge.model.exits import MultiExitModel, exit_decision_stats
from edge.runtime.backend import Backend, HeadOut, ModelSpec, SegmentOut
from edge.runtime.backend_host import host_candidates, host_decision
from edge.runtime.static_capture import Captured, Launched, OnDevice
from edge.runtime.static_decode import past_mask

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class StaticTorchBackend(Backend):
    """The multi-exit model on ``device`` with a static device cache; decode calls as CUDA graphs.

    Args:
        model: the model, or ``checkpoint``: its folder (compressed or not; loaded and hash-checked).
        device: where to run ("cuda", "cuda:1", "cpu"; default cuda when available).
        dtype: "float32", "float16" or "bfloat16" (default float32).
        graphs: capture decode calls as CUDA graphs (default: on CUDA).
        buckets: the batch sizes graphs are captured for (default 1, 2, 4, ... up to the cache's slots).
        pipeline: launch each decode segment before the previous exit's decision is read
            (:meth:`decode_until_exit`; off by default: see docs/runtime.md for what it measured).
    """

    name = "torch_static"
    host_cache = False

    def __init__(self, model: MultiExitModel | None = None, checkpoint: str | Path | None = None,
                 device: str | None = None, dtype: str = "float32", graphs: bool | None = None,
                 buckets: list[int] | None = None, pipeline: bool = False) -> None:
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
        self.shortlist_act_scale = model.shortlist_act_scale() if model.has_shortlist else None
        self.dtype = DTYPES[dtype]
        self.model = model.eval().to(device=self.device, dtype=self.dtype)
        # the candidate check's product runs on the device, in float32 as on the host and in the fused graphs
        self._rows_t = (None if self.shortlist_rows is None
                        else torch.from_numpy(self.shortlist_rows.T.copy()).to(self.device))  # [D, K]
        self._act_scale = (None if self.shortlist_act_scale is None  # float32 whatever the model's dtype
                           else torch.tensor(self.shortlist_act_scale, dtype=torch.float32, device=self.device))
        self.bb = self.model.backbone
        self._buckets_asked = buckets
        self._plans: dict[tuple, Captured] = {}
        self._held_index: tuple | None = None  # the last (slots, start) and their device copies
        self._pinned: dict[tuple, torch.Tensor] = {}  # decision copies' host buffers, per (array, segment, bucket)
        self.pipeline = pipeline
        self.wasted_segments = 0  # segments launched ahead that a leaving row made useless (pipeline)
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
        # statistics and token in one array (one copy to the host; ids < 2^24 are exact in float32)
        return {"logits": logits, "stats_token": torch.cat((stats, token[:, None].float()), dim=1)}

    def _ehz(self, eh: torch.Tensor) -> torch.Tensor:
        """A shortlist check's exit hidden and candidate logits [B, D + K] in float32: one array, one copy to
        the host."""
        e = eh.float()
        x = e if self._act_scale is None else fake_quant_act(e, self._act_scale)  # a W8A8 head's input quantization
        return torch.cat((e, x @ self._rows_t), dim=1)

    def _decode_plan(self, kind: str, i: int, bucket: int) -> Captured:
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
                if self._rows_t is not None and i < len(self.segments) - 1:
                    out["ehz"] = self._ehz(out["exit_hidden"])
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
        plan = Captured(torch.no_grad()(fn), ins, self.graphs, {"slots": self.spare})
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

    def _index(self, slots: np.ndarray, start: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots and start positions on the device; a decode step's segments all take the same, so the last
        pair is reused while the values are equal (two host-to-device copies fewer per segment call)."""
        held = self._held_index
        if held is not None and np.array_equal(held[0], slots) and np.array_equal(held[1], start):
            return held[2], held[3]
        slots, start = slots.astype(np.int64), start.astype(np.int64)  # copies: the engine may reuse its arrays
        self._held_index = (slots, start, self._to(slots), self._to(start))
        return self._held_index[2], self._held_index[3]

    def _input(self, x) -> torch.Tensor:
        """A segment's input on the device: a residual this backend returned stays where it is."""
        if isinstance(x, OnDevice):
            return x.t
        return self._to(x) if x.dtype == np.int64 else self._to(x, self.dtype)

    def _decision_copy(self, t: torch.Tensor, key: tuple) -> torch.Tensor:
        """Enqueue the copy of a decision's small array (float32) to the host: into a pinned buffer, without
        waiting, on CUDA (read after the launch's event); the array itself on the CPU."""
        t = t.float()
        if self.device.type != "cuda":
            return t
        buf = self._pinned.get(key)
        if buf is None or buf.shape != t.shape:
            buf = self._pinned[key] = torch.empty(t.shape, dtype=torch.float32, pin_memory=True)
        buf.copy_(t, non_blocking=True)
        return buf

    def _launch(self, i: int, x, slots_t: torch.Tensor, start_t: torch.Tensor, b: int, decide: bool) -> Launched:
        """Segment i's decode call (one row per sequence) launched: its graph, its exit's head where a
        decision is read with the full head, and the copies of what the host decides from; nothing waited for."""
        k, last = self._bucket(b), i == len(self.segments) - 1
        out = self._decode_plan("segment", i, k)(slots=slots_t, pos=start_t, x=self._input(x))
        h, eh = out["hidden"], out["exit_hidden"]
        run = Launched(i, None if last else h[:b], eh[:b])
        if not decide and not last:
            return run
        if self.spec.candidates and not last:
            run.copies["ehz"] = self._decision_copy(out["ehz"][:b], ("ehz", i, k))
        elif out.get("gate") is not None and not last:
            run.copies["eh"] = self._decision_copy(eh[:b], ("eh", i, k))
            run.copies["gate"] = self._decision_copy(out["gate"][:b], ("gate", i, k))
        else:
            ho = self._decode_plan("head", i, k)(x=eh)
            run.logits = ho["logits"][:b]
            run.copies["st"] = self._decision_copy(ho["stats_token"][:b], ("st", i, k))
            if not last:
                run.copies["eh"] = self._decision_copy(eh[:b], ("eh", i, k))
        if self.device.type == "cuda":
            run.event = torch.cuda.Event()
            run.event.record()
        return run

    def _collect(self, run: Launched, prev: SegmentOut | None, lookup) -> SegmentOut:
        """A launched segment's output once its copies have arrived, with its decision (on the host)."""
        if run.event is not None:
            run.event.synchronize()
        i, last = run.i, run.i == len(self.segments) - 1
        hidden = None if last else OnDevice(run.hidden)  # stays on the device for the next segment
        c = {name: t.numpy().copy() for name, t in run.copies.items()}  # pinned buffers are reused next step
        if not c:  # nobody reads this exit's decision: its exit hidden is copied only if read
            return SegmentOut(hidden, OnDevice(run.eh), None, None, None)
        if "ehz" in c:  # the candidate check: its product done on the device, the rest on the host
            d = self.spec.hidden_size
            return host_candidates(self, i, SegmentOut(hidden, c["ehz"][:, :d], None, None, None), prev, lookup,
                                   z=c["ehz"][:, d:])
        if "gate" in c:
            return host_decision(self, i, SegmentOut(hidden, c["eh"], None, None, None, c["gate"]), prev)
        st = c["st"]
        out = SegmentOut(hidden, c["eh"] if "eh" in c else OnDevice(run.eh), OnDevice(run.logits), st[:, :3],
                         st[:, 3].astype(np.int64))
        return out if last else host_decision(self, i, out, prev)

    @torch.no_grad()
    def _segment(self, i, x, slots, start, prev, decide, rows, draft, lookup):
        b, t = x.shape[:2]
        last = i == len(self.segments) - 1
        slots_t, start_t = self._index(slots, start)
        if t == 1:  # a decode call (B <= slots, the largest bucket): the bucket's graph
            return self._collect(self._launch(i, x, slots_t, start_t, b, decide), prev, lookup)
        # a prompt chunk or deferred rows (B == 1): eagerly, over the past that exists
        positions = start_t[:, None] + torch.arange(t, device=self.device)[None, :]
        p = int(start.max())
        mask = past_mask(positions, start_t, p, self.sliding_window)
        h = self.bb.embed(self._input(x)) if i == 0 else self._input(x)
        h = self._layers(i, h, slots_t, positions, p, mask)
        eh = self._exit(i, h[:, t - rows:])
        run = Launched(i, None if last else h[:b], eh)
        if decide and not last and self._rows_t is not None:
            run.copies["ehz"] = self._ehz(eh).cpu()
        elif decide and not last and self.spec.gated:
            run.copies["eh"] = eh.float().cpu()
            run.copies["gate"] = self.model.exit_gate(self.exit_layers[i], eh).float().cpu()
        elif decide:
            ho = self._head_fn(eh)
            run.logits, run.copies["st"] = ho["logits"], ho["stats_token"].cpu()
            if not last:
                run.copies["eh"] = eh.float().cpu()
        return self._collect(run, prev, lookup)

    @torch.no_grad()
    def decode_until_exit(self, x, slots, start, lookup, allowed):
        """The segments of a decode step with each next segment launched before the previous decision is read
        (``pipeline`` on): the device runs segment i + 1 while the host decides at exit i, so a check costs
        no idle device time; where rows leave at exit i, segment i + 1 was computed for nothing (its K/V
        rows are exact and are written again, or propagated over, by whatever comes next)."""
        if not self.pipeline or x.shape[1] != 1:
            return super().decode_until_exit(x, slots, start, lookup, allowed)
        if self.cache is None or int(start.max()) + 1 > self.cache.capacity:
            raise ConfigError("no KV cache attached, or positions past its capacity")
        b, last = x.shape[0], len(self.segments) - 1
        if self.spec.candidates and lookup is None:
            lookup = (np.full(b, -1, np.int64), np.zeros(b, np.float32))
        slots_t, start_t = self._index(slots, start)
        run, prev = self._launch(0, x, slots_t, start_t, b, True), None
        for i in range(len(self.segments)):
            ahead = self._launch(i + 1, OnDevice(run.hidden), slots_t, start_t, b, True) if i < last else None
            out = self._collect(run, prev, lookup)
            if i == last or bool(((out.score >= 0.0) & allowed).any()):
                self.wasted_segments += ahead is not None
                return i, out
            run, prev = ahead, out
        raise AssertionError("unreachable")

    @torch.no_grad()
    def _head(self, i, exit_hidden):
        ho = self._head_fn(self._input(exit_hidden))
        b = exit_hidden.shape[0]
        st = self._host(ho["stats_token"], b)
        return HeadOut(OnDevice(ho["logits"][:b]), st[:, :3], st[:, 3].astype(np.int64))

    @torch.no_grad()
    def _kvfill(self, i, hidden, slots, positions):
        b = len(slots)
        slots_t, pos_t = self._to(slots.astype(np.int64)), self._to(positions.astype(np.int64))
        hid = self._input(hidden)[:, None]
        self._decode_plan("fill", i, self._bucket(b))(slots=slots_t, pos=pos_t, x=hid)
