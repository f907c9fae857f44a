"""``smartexit repo``: a Triton model repository that serves the run's export with the engine.

Layout (``<run>/triton/`` by default)::

    smartexit/config.pbtxt       python backend, decoupled (one response per engine step), inputs and
                                 outputs of docs/serving.md
    smartexit/1/model.py         the environment set-up, then scheduler.serving.triton_model's TritonPythonModel
                                 (a thin adapter over edge.runtime.host.EngineHost)
    smartexit/1/bundle/          what the engine needs and nothing else: the ONNX export (graphs.json,
                                 the fused graphs), tokenizer.json, thresholds.json, and bundle.json
                                 with every file's sha256 and the host's settings

Files are hard-linked from the run where the file system allows (the export is ~150 MB), else
copied. ``scheduler.serving.bundle.open_bundle`` (what model.py calls at load) re-hashes every file against bundle.json,
checks the export and the threshold table belong to the same checkpoint, and builds the host: a
bundle that was edited or mixed from two runs refuses to load.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from edge.core.artifacts import Manifest, atomic_dir, atomic_write_json, sha256_file
from edge.core.errors import ArtifactError, ConfigError
from edge.runtime.audit import AuditConfig
from edge.runtime.engine_config import EngineConfig
from edge.runtime.host_types import HostConfig
from edge.runtime.settings import MAX_RUNNING, MAX_SEQS, PREFILL_BUDGET, SLA_TPOT_MS, SLA_TTFT_MS

STAGE = "repo"
MODEL_NAME = "smartexit"
STREAM_INTERVAL_MS = 20.0  # RepoConfig.stream_interval_ms's default (docs/serving.md, "The price of serving")
BUNDLE_FORMAT = 1
# The repository's model.py. Triton's python stub runs it in its own interpreter, which ignores PYTHONPATH:
# the launcher (scheduler/serving/tritonserver.py; edge/jetson/units.py on a Jetson) names the environment
# that holds this package in SMARTEXIT_PYTHONPATH. The model itself is scheduler.serving.triton_model.
MODEL_PY = '''"""Triton python-backend model ``smartexit``, written by ``smartexit repo``: the model is
scheduler.serving.triton_model; this file only makes the environment that holds it importable."""
import os
import site
import sys

# SMARTEXIT_PYTHONPATH first, with its .pth files read (an editable install of SmartExit is one)
for _p in reversed([p for p in os.environ.get("SMARTEXIT_PYTHONPATH", "").split(os.pathsep) if p]):
    if _p in sys.path:
        sys.path.remove(_p)
    sys.path.insert(0, _p)
    site.addsitedir(_p)

from scheduler.serving.triton_model import TritonPythonModel  # noqa: E402,F401 - after the set-up above
'''

_INPUTS = [("input_ids", "TYPE_INT64", -1), ("max_tokens", "TYPE_INT32", 1), ("temperature", "TYPE_FP32", 1),
           ("top_p", "TYPE_FP32", 1), ("seed", "TYPE_INT64", 1), ("stop_ids", "TYPE_INT64", -1),
           ("mode", "TYPE_STRING", 1), ("sla_ttft_ms", "TYPE_FP32", 1), ("sla_tpot_ms", "TYPE_FP32", 1),
           ("control", "TYPE_STRING", 1)]
_OUTPUTS = [("token_ids", "TYPE_INT64", -1), ("exit_layers", "TYPE_INT32", -1), ("finish_reason", "TYPE_STRING", 1),
            ("control_out", "TYPE_STRING", 1)]


@dataclass
class RepoConfig:
    run_dir: str = "artifacts/demo"
    out: str | None = None  # default: <run_dir>/triton
    threads: int = 1  # ONNX Runtime intra-op threads of the model instance
    # > 0: prompt chunks on a session of their own with this many threads, sleeping between calls (ONNX Runtime;
    # edge/runtime/ort_backend.py; another copy of the layers' weights); 0: on the engine's threads. For spare
    # cores: on 2, prompts ran faster in process and the stack served worse at its SLA edge (docs/serving.md)
    prefill_threads: int = 0
    max_seqs: int = MAX_SEQS.default  # cache slots
    max_running: int = MAX_RUNNING.default  # initial admission limit (the control loop moves it)
    # initial prefill tokens per step (the control loop moves it, within the backend's largest chunk)
    prefill_budget: int = PREFILL_BUDGET.default
    max_waiting: int = 64  # queued requests before "overloaded"
    # refuse (429) a request still waiting when its TTFT deadline passes (edge/runtime/host.py); the
    # serving front end may turn it on or off (serve.shed_late)
    shed_late: bool = HostConfig.shed_late
    # the Triton model's shortest gap between two responses of one request (its first token and its end go
    # at once): later tokens wait up to this long and go together (scheduler/serving/triton_model.py
    # Responder); 0: a response per engine step. serve.stream_interval_ms overrides it.
    stream_interval_ms: float = STREAM_INTERVAL_MS
    default_sla_ttft_ms: float = SLA_TTFT_MS.default
    default_sla_tpot_ms: float = SLA_TPOT_MS.default
    # the online audit's settings; the bound it tests is the threshold table's epsilon (thresholds.json)
    audit: dict[str, Any] = field(default_factory=lambda: {"fraction": 0.05})
    speculative: dict[str, Any] = field(default_factory=dict)  # SpecConfig fields for mode exact
    # the served engine runs exit checks only at batch sizes where it measured them cheaper than full depth
    # (edge/runtime/gate.py); false: every step of a bounded request checks
    exit_gate: bool = True
    # requests in mode bounded also take lossless context-lookup and corpus drafts where a round is expected to
    # pay (EngineConfig.bounded_drafts): never slower than mode exact for want of drafts; false: they only check
    bounded_drafts: bool = True

    def __post_init__(self) -> None:
        if self.threads < 1:
            raise ConfigError(f"repo.threads must be >= 1, got {self.threads}")
        if self.prefill_threads < 0:
            raise ConfigError(f"repo.prefill_threads must be >= 0, got {self.prefill_threads}")
        if not 0 <= self.stream_interval_ms <= 1000:
            raise ConfigError(f"repo.stream_interval_ms must be in [0, 1000], got {self.stream_interval_ms}")
        AuditConfig.from_dict(self.audit, "repo.audit")  # validates
        self.host_config(512)  # validates the engine and host fields

    def host_config(self, max_len: int, kv_mode: str = "propagate") -> HostConfig:
        engine = EngineConfig(max_seqs=self.max_seqs, max_len=max_len, prefill_budget=self.prefill_budget, kv_mode=kv_mode,
                              max_running=min(self.max_running, self.max_seqs), speculative=dict(self.speculative),
                              exit_gate=self.exit_gate, bounded_drafts=self.bounded_drafts)
        return HostConfig(engine=engine, max_waiting=self.max_waiting, default_sla_ttft_ms=self.default_sla_ttft_ms,
                          default_sla_tpot_ms=self.default_sla_tpot_ms, shed_late=self.shed_late,
                          audit=AuditConfig.from_dict(self.audit, "repo.audit"))


def config_pbtxt(name: str = MODEL_NAME) -> str:
    """The model configuration: python backend, decoupled, every input optional (docs/serving.md)."""
    def block(items, optional):
        rows = []
        for n, t, d in items:
            rows.append(f'  {{ name: "{n}" data_type: {t} dims: [ {d} ]' + (" optional: true" if optional else "")
                        + " }")
        return ",\n".join(rows)
    return (f'name: "{name}"\nbackend: "python"\nmax_batch_size: 0\n'
            "model_transaction_policy { decoupled: true }\n"
            f"input [\n{block(_INPUTS, True)}\n]\noutput [\n{block(_OUTPUTS, False)}\n]\n"
            "instance_group [ { count: 1 kind: KIND_CPU } ]\n")


def _place(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def write_repository(cfg: RepoConfig) -> Path:
    """Write the repository for ``cfg.run_dir``'s export and threshold table; returns its folder.

    Raises:
        ArtifactError: the run's export, table or checkpoint is missing or changed since recorded.
    """
    manifest = Manifest(cfg.run_dir)
    ckpt = manifest.served_checkpoint()
    graphs = manifest.verified_output("export", "graphs")
    table_path = manifest.verified_output("calibrate", "thresholds")
    meta = json.loads((graphs / "graphs.json").read_text())
    table = json.loads(table_path.read_text())
    if table["checkpoint_sha256"] != meta["checkpoint_sha256"]:
        raise ArtifactError(f"{table_path} and {graphs} belong to different checkpoints")
    out = Path(cfg.out or Path(cfg.run_dir) / "triton")
    with atomic_dir(out) as tmp:
        model = tmp / MODEL_NAME
        bundle = model / "1" / "bundle"
        files: dict[str, str] = {}
        for f in sorted(graphs.rglob("*")):
            rel = f.relative_to(graphs)
            if f.is_file() and not any(p.startswith(".") for p in rel.parts):
                _place(f, bundle / rel)
        _place(ckpt / "tokenizer.json", bundle / "tokenizer.json")
        _place(table_path, bundle / "thresholds.json")
        for f in sorted(bundle.rglob("*")):
            if f.is_file():
                files[f.relative_to(bundle).as_posix()] = sha256_file(f)
        m = meta["model"]
        atomic_write_json(bundle / "bundle.json", {
            "format": BUNDLE_FORMAT, "checkpoint_sha256": meta["checkpoint_sha256"], "files": files,
            "model": {"num_layers": m["num_layers"], "exit_layers": meta["exit_layers"],
                      "max_positions": m["max_positions"], "vocab_size": m["vocab_size"]},
            "host": asdict(cfg), "written": time.strftime("%Y-%m-%dT%H:%M:%SZ"),
        })
        (model / "config.pbtxt").write_text(config_pbtxt())
        (model / "1" / "model.py").write_text(MODEL_PY)
    return out


def read_bundle(bundle_dir: str | Path) -> dict[str, Any]:
    """``bundle.json`` after re-hashing every file it lists.

    Raises:
        ArtifactError: bundle.json missing or malformed, a file missing or changed.
    """
    bundle_dir = Path(bundle_dir)
    path = bundle_dir / "bundle.json"
    try:
        info = json.loads(path.read_text())
        files = info["files"]
    except (OSError, json.JSONDecodeError, KeyError) as exc:
        raise ArtifactError(f"{path}: not a SmartExit bundle ({exc!r}); run `smartexit repo`") from exc
    if info.get("format") != BUNDLE_FORMAT:
        raise ArtifactError(f"{path}: bundle format {info.get('format')!r} is not {BUNDLE_FORMAT}; run `smartexit repo`")
    for rel, sha in files.items():
        f = bundle_dir / rel
        if not f.is_file():
            raise ArtifactError(f"{f} is missing from the bundle (listed in {path})")
        if sha256_file(f) != sha:
            raise ArtifactError(f"{f} changed since `smartexit repo` wrote it (sha256 differs from {path})")
    return info
