"""The reference backend: the PyTorch modules themselves, on copies of the cached past.

Not on the serving path (it needs torch and the checkpoint); the engine tests and the parity gate
compare the ONNX Runtime backend against it.
"""
from __future__ import annotations

import numpy as np
import torch

from edge.core.errors import ConfigError
from edge.model.exits import exit_decision_stats
from edge.runtime.backend import Backend, HeadOut, ModelSpec, SegmentOut, build_mask


class TorchBackend(Backend):
    """The reference: the PyTorch modules themselves, on copies of the cached past."""

    name = "torch"

    def __init__(self, model=None) -> None:
        if model is None:
            raise ConfigError("the torch backend needs the model (make_backend('torch', model=...))")
        super().__init__(ModelSpec.of(model))
        self.model = model.eval()

    def _segment(self, i, x, slots, start, prev, decide, rows, draft):  # the reference drafts with the exact head
        with torch.no_grad():
            bb = self.model.backbone
            b, t = x.shape[:2]
            positions = start[:, None] + np.arange(t)[None, :]  # [B, T]
            cos, sin = bb.rope(torch.from_numpy(positions))
            h = bb.embed(torch.from_numpy(x)) if i == 0 else torch.from_numpy(np.ascontiguousarray(x, np.float32))
            p = int(start.max())
            mask = torch.from_numpy(build_mask(positions, start, p, self.sliding_window))
            c = self.cache
            for j in self.segments[i]:
                pk = torch.from_numpy(c.keys[j][slots, :, :p])  # [B, KV, P, hd] (a copy: the reference)
                pv = torch.from_numpy(c.values[j][slots, :, :p])
                h, k, v = bb.layers[j](h, cos, sin, pk, pv, mask)
                for r in range(b):
                    c.keys[j][slots[r], :, start[r]:start[r] + t] = k[r].numpy()
                    c.values[j][slots[r], :, start[r]:start[r] + t] = v[r].numpy()
            layer = self.exit_layers[i]
            eh = self.model.exit_hidden(layer, h[:, t - rows:]).reshape(b * rows, -1)  # [B * R, D]
            if i == len(self.segments) - 1:
                head = self._head(i, eh.numpy())
                return SegmentOut(None, eh.numpy(), head.logits, head.stats, head.token)
            if not decide:  # nobody reads this exit's decision
                return SegmentOut(h.numpy(), eh.numpy(), None, None, None)
            if self.spec.gated:
                out = SegmentOut(h.numpy(), eh.numpy(), None, None, None, self.model.exit_gate(layer, eh).numpy())
            else:
                head = self._head(i, eh.numpy())
                out = SegmentOut(h.numpy(), eh.numpy(), head.logits, head.stats, head.token)
            return self._decision(i, out, prev)

    def _decision(self, i: int, out: SegmentOut, prev: SegmentOut | None) -> SegmentOut:
        """The exit rule's features and score, as the fused graphs compute them (float32)."""
        b = out.exit_hidden.shape[0]
        zeros = np.zeros(b, np.float32)
        first = i == 0
        if prev is None:
            prev = SegmentOut(None, np.zeros_like(out.exit_hidden), None, None, np.full(b, -1), zeros, run=zeros)
        cos = zeros if first else _cosine32(out.exit_hidden, prev.exit_hidden)
        if self.spec.gated:
            g = 1.0 / (1.0 + np.exp(-out.gate))
            pg = zeros if first else 1.0 / (1.0 + np.exp(-prev.gate))
            feats = np.stack([g, pg, cos], axis=1).astype(np.float32)
            run = None
        else:
            agree = zeros if first else (out.token == prev.token).astype(np.float32)
            run = zeros if first else agree * (prev.run + 1)
            m = np.float32(len(self.exit_layers))
            feats = np.concatenate([out.stats, np.stack([agree, run / m, cos], axis=1)], axis=1).astype(np.float32)
        out.features, out.run = feats, run
        out.score = feats @ self.rule_w[i] + self.rule_b[i]
        return out

    def _head(self, i, exit_hidden):
        with torch.no_grad():
            logits = self.model.backbone.logits(torch.from_numpy(exit_hidden))
            stats, token = exit_decision_stats(logits)
            return HeadOut(logits.numpy(), stats.numpy(), token.numpy())

    def _kvfill(self, i, hidden, slots, positions):
        with torch.no_grad():
            bb = self.model.backbone
            cos, sin = bb.rope(torch.from_numpy(positions[:, None]))
            h = torch.from_numpy(np.ascontiguousarray(hidden, np.float32))[:, None]  # [B, 1, D]
            for j in self.suffix_layers(i):
                k, v = bb.layers[j].kv_only(h, cos, sin)  # [B, KV, 1, hd]
                self.cache.keys[j][slots, :, positions] = k[:, :, 0].numpy()
                self.cache.values[j][slots, :, positions] = v[:, :, 0].numpy()


def _cosine32(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row cosine [B] in float32, 0 where either row is zero (the graphs' formula)."""
    dot, norms = (a * b).sum(1), np.sqrt((a * a).sum(1) * (b * b).sum(1))
    ok = norms > 0
    return np.where(ok, np.clip(dot / np.where(ok, norms, 1), -1, 1), 0).astype(np.float32)
