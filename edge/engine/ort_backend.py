"""ONNX Runtime backend over the graphs written by ``smartexit export``.

Providers: TensorRT and CUDA execution providers when this onnxruntime build
has them, else the CPU provider. Graph hashes and the checkpoint hash are
checked at load, so graphs from another checkpoint are refused.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from edge.artifacts import sha256_path
from edge.engine.backend import BACKENDS, Backend, SegmentOut
from edge.errors import ConfigError, require
from edge.ortsession import pool_threads, session_options
from edge.exits import MultiExitModel

PREFERRED_PROVIDERS = ("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider")


def pick_providers(available: list[str], requested: list[str] | None = None) -> list[str]:
    """Providers to use, in preference order, among those this build offers."""
    if requested:
        missing = [p for p in requested if p not in available]
        if missing:
            raise ConfigError(f"onnxruntime providers {missing} are not available; this build has {available}")
        return list(requested)
    return [p for p in PREFERRED_PROVIDERS if p in available]


class OrtBackend(Backend):
    name = "onnxruntime"

    def __init__(self, model: MultiExitModel, graphs_dir: str | Path | None, checkpoint: str | Path | None = None,
                 threads: int = 0, providers: list[str] | None = None) -> None:
        super().__init__(model)
        ort = require("onnxruntime", "onnxruntime")
        from exporters.onnx_export import verify_graphs

        if graphs_dir is None:
            raise ConfigError("the onnxruntime backend needs graphs_dir (run `smartexit export`)")
        graphs_dir = Path(graphs_dir)
        expected = sha256_path(checkpoint) if checkpoint is not None else None
        meta = verify_graphs(graphs_dir, expected) if expected else _load_meta(graphs_dir)
        if meta["exit_layers"] != self.exit_layers:
            raise ConfigError(f"graphs in {graphs_dir} have exits {meta['exit_layers']}, model has {self.exit_layers}")
        opts = session_options(ort, threads)  # one thread pool for every session (edge/ortsession.py)
        self.pool_threads = pool_threads()
        self.providers = pick_providers(ort.get_available_providers(), providers)

        def session(name: str):
            return ort.InferenceSession(str(graphs_dir / meta["graphs"][name]["file"]), opts,
                                        providers=self.providers)

        self._embed_s = session("embed")
        self._seg = [session(f"segment_{i}") for i in range(len(self.segments))]
        self._fill = [None] + [session(f"kvfill_{i}") for i in range(1, len(self.segments))]

    def _embed(self, ids):
        return self._embed_s.run(["hidden"], {"input_ids": ids})[0]

    def _segment(self, i, hidden, positions, mask, past_k, past_v, exit_index):
        feeds = {"hidden": np.ascontiguousarray(hidden, np.float32), "positions": positions.astype(np.int64),
                 "attn_mask": mask, "exit_index": exit_index}
        for j, pk, pv in zip(self.segments[i], past_k, past_v):
            feeds[f"past_key_{j}"] = np.ascontiguousarray(pk)
            feeds[f"past_value_{j}"] = np.ascontiguousarray(pv)
        outs = self._seg[i].run(None, feeds)
        n = len(self.segments[i])
        return SegmentOut(outs[0], outs[1][:, 0], outs[2][:, 0], outs[3][:, 0], outs[4][:, 0],
                          list(outs[5:5 + 2 * n:2]), list(outs[6:6 + 2 * n:2]))

    def _kvfill(self, i, hidden, positions):
        outs = self._fill[i].run(None, {"hidden": np.ascontiguousarray(hidden, np.float32),
                                        "positions": positions.astype(np.int64)})
        return list(outs[0::2]), list(outs[1::2])


def _load_meta(graphs_dir: Path) -> dict:
    from exporters.onnx_export import load_graphs_json

    return load_graphs_json(graphs_dir)


BACKENDS["onnxruntime"] = OrtBackend
