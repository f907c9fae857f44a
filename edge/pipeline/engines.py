"""``smartexit engines``: the stage. The work is :mod:`exporters.tensorrt`'s; this module reads the run, calls it and
records what it made."""
from __future__ import annotations

import time
from pathlib import Path

from edge.core.artifacts import Manifest, sha256_path
from exporters.tensorrt import EnginesConfig, STAGE, build_engines


def main(cfg: EnginesConfig) -> int:
    """Build the engines of a run folder and record the ``engines`` stage.

    Raises:
        SmartExitError: any of :func:`build_engines`'s errors, or a missing / changed export or checkpoint.
    """
    t0 = time.time()
    manifest = Manifest(cfg.run_dir)
    graphs = manifest.verified_output("export", "graphs")
    ckpt = manifest.served_checkpoint()
    out = Path(cfg.run_dir) / "engines"
    result = build_engines(graphs, out, cfg.build, sha256_path(ckpt))
    manifest.record(STAGE, inputs={"graphs": graphs, "checkpoint": ckpt},
                    config={"run_dir": cfg.run_dir, "build": result["build"]},
                    outputs={"engines": out},
                    metrics={"tensorrt_version": result["tensorrt_version"], "device": result["device"],
                             "build_seconds": {k: v["build_seconds"] for k, v in result["engines"].items()}},
                    seconds=time.time() - t0)
    print(f"engines: {len(result['engines'])} plans in {out} (TensorRT {result['tensorrt_version']}, "
          f"{result['device']})")
    return 0
