"""What cutting the decoder into segments costs by itself: k chained layer-span calls against one
call over all layers, the same total work (no exit heads), nothing between the calls but the calls.

Each span is a fused ONNX Runtime graph (exporters/ort_fused.py) bound once to its buffers: the
output buffer of span k is the input buffer of span k+1, the KV cache is bound in place, so a
repeat is ``run_with_iobinding`` called k times. Configurations run interleaved and the ratio is
the median over repeats of (time of k calls) / (time of one call).
"""
from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edge.core.errors import ConfigError
from edge.model.exits import MultiExitModel
from edge.runtime.ortsession import open_session


@dataclass
class SegmentOverhead:
    spans: int
    batch: int
    past: int
    ms_one_call: float  # median time of one call over all layers
    ms_split: float  # median time of the chained span calls
    ratio: float  # median over repeats of split / one

    def to_dict(self) -> dict:
        return self.__dict__.copy()


def split_layers(num_layers: int, spans: int) -> list[list[int]]:
    """``spans`` runs of consecutive layers covering 0..num_layers-1, as equal as possible."""
    if not 1 <= spans <= num_layers:
        raise ConfigError(f"spans must be in [1, {num_layers}], got {spans}")
    bounds = np.linspace(0, num_layers, spans + 1).round().astype(int)
    return [list(range(a, b)) for a, b in zip(bounds[:-1], bounds[1:])]


class _Chain:
    """Sessions of consecutive spans bound to shared buffers; ``run()`` calls each once."""

    def __init__(self, ort, files: list[Path], spans: list[list[int]], batch: int, past: int, model) -> None:
        cfg = model.backbone.cfg
        ov = ort.OrtValue.ortvalue_from_numpy
        rng = np.random.default_rng(0)
        cap = past + 8
        bufs = [rng.standard_normal((batch, 1, cfg.hidden_size)).astype(np.float32)]
        bufs += [np.zeros((batch, 1, cfg.hidden_size), np.float32) for _ in spans]
        self.keep = [bufs, np.full(batch, past, np.int32), np.array(past + 1, np.int32)]
        self.calls = []
        for k, (path, layers) in enumerate(zip(files, spans)):
            sess = open_session(ort, path, cache=False)
            io = sess.io_binding()
            io.bind_ortvalue_input("hidden", ov(bufs[k]))
            io.bind_ortvalue_output("hidden_out", ov(bufs[k + 1]))
            io.bind_ortvalue_input("seqlens_k", ov(self.keep[1]))
            io.bind_ortvalue_input("total_len", ov(self.keep[2]))
            for j in layers:
                for kind in ("key", "value"):
                    c = (0.1 * rng.standard_normal((batch, cfg.num_kv_heads, cap, cfg.head_dim))).astype(np.float32)
                    self.keep.append(c)
                    io.bind_ortvalue_input(f"past_{kind}_{j}", ov(c))
                    io.bind_ortvalue_output(f"present_{kind}_{j}", ov(c))
            self.calls.append((sess, io))

    def run(self) -> None:
        for sess, io in self.calls:
            sess.run_with_iobinding(io)


def segment_call_overhead(model: MultiExitModel, spans: int = 4, batch: int = 1, past: int = 96,
                          calls: int = 50, repeats: int = 7) -> SegmentOverhead:
    """Median time of ``spans`` chained span calls vs one all-layer call (see module docstring)."""
    import onnxruntime as ort

    from exporters.ort_fused import build_layer_spans, save_fused

    n = model.num_layers
    parts = split_layers(n, spans)
    with tempfile.TemporaryDirectory(prefix="smartexit-spans-") as tmp:
        tmp = Path(tmp)
        files = save_fused(build_layer_spans(model, [list(range(n))]), tmp / "one")
        one = _Chain(ort, [tmp / "one" / files["span_0"][0]], [list(range(n))], batch, past, model)
        files = save_fused(build_layer_spans(model, parts), tmp / "split")
        split = _Chain(ort, [tmp / "split" / files[f"span_{k}"][0] for k in range(spans)], parts, batch, past, model)
        for chain in (one, split):  # warm-up
            for _ in range(5):
                chain.run()
        t_one, t_split = [], []
        for _ in range(repeats):
            for chain, acc in ((one, t_one), (split, t_split)):
                t0 = time.perf_counter()
                for _ in range(calls):
                    chain.run()
                acc.append((time.perf_counter() - t0) / calls)
    ratio = float(np.median(np.array(t_split) / np.array(t_one)))
    return SegmentOverhead(spans, batch, past, 1e3 * float(np.median(t_one)), 1e3 * float(np.median(t_split)), ratio)
