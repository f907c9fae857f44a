"""The reference backend: the PyTorch modules themselves, on copies of the cached past.

Not on the serving path (it needs torch and the checkpoint); the engine tests and the parity gate
compare the ONNX Runtime backend against it.
"""
from __future__ import annotations

import numpy as np
import torch

from edge.core.errors import ConfigError
from edge.model.exits import exit_decision_stats
from edge.runtime.backend import Backend, HeadOut, ModelSpec, SegmentOut
from edge.runtime.backend_host import build_mask, host_candidates, host_decision


class TorchBackend(Backend):
    """The reference: the PyTorch modules themselves, on copies of the cached past."""

    name = "torch"

    def __init__(self, model=None) -> None:
        if model is None:
            raise ConfigError("the torch backend needs the model (make_backend('torch', model=...))")
        super().__init__(ModelSpec.of(model))
        self.model = model.eval()
        self.shortlist_rows = model.shortlist_rows().numpy() if model.has_shortlist else None  # [K, D]
        self.shortlist_act_scale = model.shortlist_act_scale() if model.has_shortlist else None

    def _segment(self, i, x, slots, start, prev, decide, rows, draft, lookup):  # the reference drafts with the exact head
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
            if self.spec.candidates:  # the candidate check (no LM head)
                out = SegmentOut(h.numpy(), eh.numpy(), None, None, None)
                return host_candidates(self, i, out, prev, lookup, self.shortlist_rows)
            if self.spec.gated:
                out = SegmentOut(h.numpy(), eh.numpy(), None, None, None, self.model.exit_gate(layer, eh).numpy())
            else:
                head = self._head(i, eh.numpy())
                out = SegmentOut(h.numpy(), eh.numpy(), head.logits, head.stats, head.token)
            return host_decision(self, i, out, prev)

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

