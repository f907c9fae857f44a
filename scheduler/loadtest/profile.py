"""``smartexit profile``: the engine's step time against what the step does, and the latency model fitted to it.

The served engine (the bundle opened as the server opens it, :func:`scheduler.serving.bundle.open_bundle`) is
stepped on this thread through a list of scenarios, each a prefill budget, an admission limit (the decode
batch), a prompt-length range and a share of requests in mode ``full`` (no exits; the rest ``bounded``,
exiting where the calibrated rule says), so the prefill tokens, the batch and the exit-depth mix vary.
Requests are topped up so the batch stays full. Every step's :class:`scheduler.control.latency.StepFeatures`
are read from the engine's state before and after it, and its wall time from ``time.perf_counter``;
:func:`scheduler.control.latency.fit_latency` fits the model, holding whole scenarios out to score it.

Writes under ``<run_dir>/scheduler/``: ``latency.json`` (the model), ``profile.json`` (every step, the
fit, the config, the exit-layer fractions), ``profile.md`` and ``exit_traces.json`` (per bounded request:
prompt length, its first ids, its decode exit layers in order), and records stage ``profile``.

With deferred K/V (``kv_mode: defer``) the engine lets rows exit only while the decode batch holds at
most ``defer_exit_max_batch`` sequences; above that every row runs to full depth. Each traced token says
whether exits were allowed in its step (``exits_allowed``), the exit fractions are given both over all
bounded decode tokens and over those alone, and a last phase (``trace_steps``, not fitted) decodes bounded
requests at the largest batch that may exit, so the traces hold natural exits too.

Its settings and scenarios are in :mod:`scheduler.loadtest.profile_config`, the engine stepped through them
and each step observed in :mod:`scheduler.loadtest.profile_driver`, the fit's design matrix and held-out
scenarios in :mod:`scheduler.loadtest.profile_fit`; this module holds the stage's name and what the stage
reads about the bundle (its path, its prompts) and the machine. The stage itself is edge/pipeline/profile.py.
"""
from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

from edge.core.errors import ConfigError
from edge.runtime.engine import Engine
from scheduler.loadtest.profile_config import ProfileConfig

STAGE = "profile"


# --------------------------------------------------------------------------- outputs

def machine_info(engine: Engine, asked: int | None) -> dict[str, Any]:
    """Where the profile ran. The ONNX Runtime pool belongs to the process, sized by its first session
    (edge/runtime/ortsession.py): its real size is reported, and a mismatch with ``asked`` said."""
    threads = getattr(engine.backend, "pool_threads", asked)
    if asked is not None and threads != asked:
        print(f"profile: ONNX Runtime's shared pool has {threads} threads (0: one per core), not the {asked} "
              f"asked: an earlier session in this process made it; the profile measures that", flush=True)
    cpu = platform.processor() or platform.machine()
    info = Path("/proc/cpuinfo")
    if info.is_file():  # Linux: platform.processor() gives only the architecture
        cpu = next((line.split(":", 1)[1].strip() for line in info.read_text().splitlines()
                    if line.startswith("model name")), cpu)
    return {"processor": cpu, "cpus": os.cpu_count(), "threads": threads, "platform": platform.platform(),
            "kv_mode": engine.cfg.kv_mode.value, "defer_exit_max_batch": engine.cfg.defer_exit_max_batch}


def bundle_path(cfg: ProfileConfig) -> Path:
    from scheduler.serving.config import REPO_BUNDLE

    path = Path(cfg.bundle) if cfg.bundle is not None else Path(cfg.run_dir) / "triton" / REPO_BUNDLE
    if not (path / "bundle.json").is_file():
        raise ConfigError(f"profile: no serving bundle at {path} (bundle.json missing); run `smartexit repo` "
                          f"or name one (bundle=DIR)")
    return path


def prompt_pool(bundle: Path) -> tuple[list[list[int]], tuple[int, ...]]:
    """The held-out test split, one token stream per document, and the stop ids the server adds (end of
    text), both through the bundle's tokenizer (as scheduler/loadtest/bench_serve_inputs.py reads them)."""
    from edge.core.data import Split, load_split
    from edge.model.tokenizer import EOS, load_tokenizer

    path = bundle / "tokenizer.json"
    if not path.is_file():
        raise ConfigError(f"profile: tokenizer {path} is missing; run `smartexit repo`")
    tok = load_tokenizer(path)
    eos = tok.token_to_id(EOS)
    return [e.ids for e in tok.encode_batch([d.text for d in load_split(Split.TEST)])], (() if eos is None else (eos,))
