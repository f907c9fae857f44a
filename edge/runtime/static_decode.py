"""The decode step of a multi-exit model on a static KV cache: fixed shapes, so it can be captured
as CUDA graphs (one per segment and batch bucket), as static-cache engines do.

The engine's torch backend (:mod:`edge.runtime.torch_backend`) works on host arrays and variable
past lengths: right for a reference, not for a GPU, where each decode step would launch every
kernel from Python. Here the cache lives on the device as [B, KV, L, hd] per layer, a decode step
attends over all L past slots with a mask built from a device tensor of positions (slots at or
after a row's position are masked) and writes its new K/V at that position with ``index_put_``:
no shape depends on the step, so :meth:`StaticDecode.capture` can record each segment once and
replay it. After an exit, the skipped layers' K/V come from their K/V projections of the exit's
residual (state propagation, CALM), also a fixed-shape graph.

This is the path a Jetson without TensorRT engines runs (JetPack ships CUDA torch wheels) and what
``deploy/gpu_check.py`` times. On the CPU the same code runs eagerly and is tested against the
reference generator; graph capture needs CUDA (``capture`` refuses otherwise).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from edge.core.errors import ConfigError
from edge.model.decoder import attention_mask
from edge.model.exits import MultiExitModel
from edge.model.segments import segment_layers


def past_mask(positions: torch.Tensor, start: torch.Tensor, past: int, window: int | None) -> torch.Tensor:
    """Additive mask [B, 1, T, past + T] over ``past`` cached positions then the T new rows at ``positions``
    [B, T]: a row sees its sequence's first ``start[b]`` cached positions and the new rows up to its own
    (within ``window``); the torch twin of :func:`edge.runtime.backend_host.build_mask`. A decode step over a
    static cache is ``past_mask(pos[:, None], pos, L, window)``: no shape depends on the step."""
    b = positions.shape[0]
    cached = torch.arange(past, device=positions.device)[None, :].expand(b, past)
    k_pos = torch.cat((cached, positions), dim=1)
    k_valid = torch.cat((cached < start[:, None], torch.ones_like(positions, dtype=torch.bool)), dim=1)
    return attention_mask(positions, k_pos, k_valid, window)


@dataclass
class SegmentResult:
    """One segment's outputs for the B rows of a decode step (device tensors, valid until the next call)."""

    hidden: torch.Tensor  # [B, 1, D] residual after the segment
    token: torch.Tensor  # [B] argmax of the segment's exit


class StaticDecode:
    """Greedy decoding of B sequences on a static cache of ``max_len`` positions.

    Args:
        model: the multi-exit model, already on ``device`` in the dtype to run.
        batch: B, the rows of every call (a batch bucket: pad with any token ids).
        max_len: L, prompt + generated tokens per row.
    """

    def __init__(self, model: MultiExitModel, batch: int, max_len: int) -> None:
        cfg = model.backbone.cfg
        if batch < 1 or not 2 <= max_len <= cfg.max_position_embeddings:
            raise ConfigError(f"static decode: batch >= 1 and 2 <= max_len <= {cfg.max_position_embeddings} "
                              f"are required, got {batch}, {max_len}")
        p = next(model.parameters())
        self.model, self.device, self.dtype = model.eval(), p.device, p.dtype
        self.batch, self.max_len = batch, max_len
        self.segments = segment_layers(model.exit_layers)
        shape = (batch, cfg.num_kv_heads, max_len, cfg.head_dim)
        self.keys = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in range(cfg.num_layers)]
        self.values = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in range(cfg.num_layers)]
        self.window = cfg.sliding_window
        self._rows = torch.arange(batch, device=self.device)
        # static inputs of the captured graphs, and their outputs
        self.pos = torch.zeros(batch, dtype=torch.long, device=self.device)  # [B] position of this step's token
        self.ids = torch.zeros(batch, 1, dtype=torch.long, device=self.device)  # [B, 1]
        self.hidden_in = [torch.zeros(batch, 1, cfg.hidden_size, device=self.device, dtype=self.dtype)
                          for _ in self.segments]
        self._graphs: dict[str, torch.cuda.CUDAGraph] = {}
        self._out: dict[str, object] = {}

    # ---------------------------------------------------------------- eager computation
    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary tables in the model's dtype: K/V then have the cache's dtype (index_put_ needs it)."""
        cos, sin = self.model.backbone.rope(positions)
        return cos.to(self.dtype), sin.to(self.dtype)

    @torch.no_grad()
    def _segment(self, i: int) -> SegmentResult:
        bb = self.model.backbone
        h = bb.embed(self.ids) if i == 0 else self.hidden_in[i]
        cos, sin = self._rope(self.pos[:, None])
        mask = past_mask(self.pos[:, None], self.pos, self.max_len, self.window)
        for j in self.segments[i]:
            h, k, v = bb.layers[j](h, cos, sin, self.keys[j], self.values[j], mask)
            self.keys[j][self._rows, :, self.pos] = k[:, :, 0]  # index_put_: graph-safe, no host sync
            self.values[j][self._rows, :, self.pos] = v[:, :, 0]
        layer = self.model.exit_layers[i]
        token = bb.logits(self.model.exit_hidden(layer, h[:, 0])).argmax(-1)
        return SegmentResult(h, token)

    @torch.no_grad()
    def _fill(self, i: int) -> None:
        """K/V of every layer of segments i.. from ``hidden_in[i]`` (rows that exited before segment i)."""
        bb = self.model.backbone
        cos, sin = self._rope(self.pos[:, None])
        for j in [j for seg in self.segments[i:] for j in seg]:
            k, v = bb.layers[j].kv_only(self.hidden_in[i], cos, sin)
            self.keys[j][self._rows, :, self.pos] = k[:, :, 0]
            self.values[j][self._rows, :, self.pos] = v[:, :, 0]

    # ---------------------------------------------------------------- public
    @torch.no_grad()
    def prefill(self, prompts: torch.Tensor) -> torch.Tensor:
        """Write the K/V of ``prompts`` [B, P] (full depth, eager) and return the next token [B]."""
        if prompts.shape[0] != self.batch or not 1 <= prompts.shape[1] < self.max_len:
            raise ConfigError(f"static decode: prompts must be [{self.batch}, 1..{self.max_len - 1}], got "
                              f"{tuple(prompts.shape)}")
        bb = self.model.backbone
        p = prompts.shape[1]
        positions = torch.arange(p, device=self.device)[None, :].expand(self.batch, p)
        cos, sin = self._rope(positions)
        h = bb.embed(prompts.to(self.device))
        for j, layer in enumerate(bb.layers):
            h, k, v = layer(h, cos, sin, None, None, None)  # causal, no past
            self.keys[j][:, :, :p] = k
            self.values[j][:, :, :p] = v
        self.pos.fill_(p)
        return bb.logits(self.model.exit_hidden(self.model.num_layers, h[:, -1])).argmax(-1)

    def segment(self, i: int) -> SegmentResult:
        """Segment i for this step: reads ``ids`` (i == 0) or ``hidden_in[i]`` and ``pos``; replays its
        graph when captured."""
        key = f"segment_{i}"
        if key in self._graphs:
            self._graphs[key].replay()
            return self._out[key]
        return self._segment(i)

    def fill(self, i: int) -> None:
        """K/V of the layers of segments i.. for rows that exited before segment i (state propagation)."""
        key = f"fill_{i}"
        if key in self._graphs:
            self._graphs[key].replay()
        else:
            self._fill(i)

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, exit_after: int | None = None) -> torch.Tensor:
        """One decode step for every row: feed ``tokens`` [B] at ``pos``, run the segments (all, or up to
        segment ``exit_after`` with the rest's K/V propagated), advance ``pos``; returns the next token [B]."""
        last = len(self.segments) - 1 if exit_after is None else exit_after
        self.ids.copy_(tokens.view(-1, 1))
        out = None
        for i in range(last + 1):
            if i > 0:
                self.hidden_in[i].copy_(out.hidden)
            out = self.segment(i)
        if last < len(self.segments) - 1:
            self.hidden_in[last + 1].copy_(out.hidden)
            self.fill(last + 1)
        token = out.token.clone()
        self.pos.add_(1)
        return token

    def capture(self) -> None:
        """Record every segment and every K/V fill as a CUDA graph on the current static buffers.

        Raises:
            ConfigError: the model is not on a CUDA device.
        """
        if self.device.type != "cuda":
            raise ConfigError(f"CUDA graphs need the model on a CUDA device, it is on {self.device}")
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up on a side stream, as torch.cuda.graphs asks
            for i in range(len(self.segments)):
                self._segment(i)
                if i > 0:
                    self._fill(i)
        torch.cuda.current_stream().wait_stream(stream)
        for i in range(len(self.segments)):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                self._out[f"segment_{i}"] = self._segment(i)
            self._graphs[f"segment_{i}"] = g
            if i > 0:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    self._fill(i)
                self._graphs[f"fill_{i}"] = g
