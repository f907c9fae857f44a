"""``smartexit repo``: the stage. The work is :mod:`exporters.triton`'s; this module reads the run, calls it and
records what it made."""
from __future__ import annotations

import time
from dataclasses import asdict

from edge.core.artifacts import Manifest
from exporters.triton import RepoConfig, STAGE, write_repository


def main(cfg: RepoConfig) -> int:
    t0 = time.time()
    out = write_repository(cfg)
    manifest = Manifest(cfg.run_dir)
    manifest.record(STAGE, inputs={"graphs": manifest.verified_output("export", "graphs"),
                                   "thresholds": manifest.verified_output("calibrate", "thresholds")},
                    config=asdict(cfg), outputs={"repository": out}, metrics={}, seconds=time.time() - t0)
    print(f"Triton model repository: {out} (serve it with `smartexit serve run_dir={cfg.run_dir}`)")
    return 0
