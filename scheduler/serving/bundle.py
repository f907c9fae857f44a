"""Open a serving bundle (``smartexit repo``'s ``smartexit/1/bundle``) as an engine host.

What Triton's model.py calls at load, and what the in-process side of ``smartexit bench serve`` uses,
so both run the same files with the same settings. It lives here, above ``calibration`` and
``exporters``, because it needs both: the bundle's hashes (exporters.triton) and the calibrated rule
(calibration.table).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

from calibration.table import TableRule, ThresholdTable
from edge.core.errors import ArtifactError
from edge.runtime.served import BACKEND_ENV, open_backend, read_backend_choice
from edge.runtime.graphs import verify_graphs
from edge.runtime.host import EngineHost
from exporters.triton import RepoConfig, read_bundle


def open_bundle(bundle_dir: str | Path, threads: int | None = None, backend: dict[str, Any] | None = None,
                rule_edit: Callable[[ThresholdTable], ThresholdTable] | None = None,
                **host_overrides: Any) -> EngineHost:
    """The engine host over a bundle (hash-checked) with the calibrated rule, on ONNX Runtime unless
    ``backend`` (:func:`read_backend_choice`'s dict; default: the file ``$SMARTEXIT_BACKEND_CONFIG``
    names) says otherwise.

    ``host_overrides``: RepoConfig fields that replace the bundle's (``max_seqs``, ``audit``, ...).
    ``rule_edit``: a bench's change to the calibrated table (its certificate and epsilon kept: what the audit
    tests), e.g. thresholds dropped to show the audit catching a rule that breaks it; never used by serving.
    """
    bundle_dir = Path(bundle_dir)
    info = read_bundle(bundle_dir)
    verify_graphs(bundle_dir, info["checkpoint_sha256"])
    choice = backend if backend is not None else read_backend_choice(os.environ.get(BACKEND_ENV) or None)
    table = ThresholdTable.from_dict(json.loads((bundle_dir / "thresholds.json").read_text()),
                                     source=str(bundle_dir / "thresholds.json"))
    if table.checkpoint_sha256 != info["checkpoint_sha256"]:
        raise ArtifactError(f"{bundle_dir}: thresholds.json was calibrated for checkpoint "
                            f"{table.checkpoint_sha256[:16]}..., the graphs for {info['checkpoint_sha256'][:16]}...")
    if rule_edit is not None:
        table = rule_edit(table)
    known = {k: v for k, v in info.get("host", {}).items() if k in RepoConfig.__dataclass_fields__}
    cfg = RepoConfig(**{**known, **host_overrides})
    backend = open_backend(choice, bundle_dir, info["checkpoint_sha256"], threads if threads is not None else cfg.threads,
                           cfg.prefill_threads)
    host_cfg = cfg.host_config(backend.spec.max_positions, table.kv_mode)
    fractions = table.certificate.get("expected_exit_fraction") or {}
    expected = sum(int(k) * v for k, v in fractions.items()) if fractions else None
    return EngineHost(backend, host_cfg, TableRule(table), epsilon=table.epsilon, expected_exit_layer=expected)
