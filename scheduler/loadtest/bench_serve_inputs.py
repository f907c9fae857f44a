"""What ``smartexit bench serve`` replays: the arrivals (a trace, or synthetic), the bundle it reads, the
context window, the held-out prompts and the end-of-text stop id, and the schedule made of them
(:func:`make_schedule`, :mod:`scheduler.loadtest.loadgen`)."""
from __future__ import annotations

import math
from pathlib import Path

from edge.core.errors import ConfigError, SmartExitError
from scheduler.loadtest.bench_serve_config import BenchServeConfig
from scheduler.loadtest.loadgen import ScheduledRequest, build_schedule
from scheduler.control.workload import SHARED_TRACE, Arrivals, Workload, load_workload, synthetic

MAX_TRACE_ROWS = 10_000_000  # read a whole trace; the window is cut afterwards


def load_arrivals(cfg: BenchServeConfig) -> Workload:
    """The workload the window is cut from; its ``source`` says which it is."""
    window_s = cfg.start_s + (cfg.duration_s / cfg.time_scale if cfg.duration_s is not None else 0.0)
    # enough synthetic requests to cover the window (1.5x the expected count, plus a margin)
    n = math.ceil(1.5 * cfg.rate_rps * window_s) + 10 + (cfg.max_requests or 0)
    if cfg.arrivals != "trace":
        return synthetic(n, cfg.rate_rps, Arrivals(cfg.arrivals), cfg.seed)
    has_trace = cfg.trace is not None or SHARED_TRACE.is_file()
    return load_workload(cfg.trace, n=MAX_TRACE_ROWS if has_trace else n, rate=cfg.rate_rps,
                         kind=Arrivals.POISSON, seed=cfg.seed)


def bundle_dir(cfg: BenchServeConfig) -> Path:
    # the layout exporters/triton.py writes: <out>/<model name>/<version>/bundle
    from scheduler.serving.config import REPO_BUNDLE

    return Path(cfg.bundle) if cfg.bundle is not None else Path(cfg.run_dir) / "triton" / REPO_BUNDLE


def context_window(cfg: BenchServeConfig) -> int:
    """``cfg.context_window``, else the bundle's model positions (what the server accepts by default)."""
    if cfg.context_window is not None:
        return cfg.context_window
    from scheduler.serving.config import BundleInfo

    try:
        return BundleInfo.load(bundle_dir(cfg)).max_positions
    except ConfigError as exc:
        raise ConfigError(f"bench serve: {exc}; run `smartexit repo`, name the bundle (bundle=DIR) or set "
                          f"context_window") from exc


def _tokenizer_path(cfg: BenchServeConfig) -> Path:
    path = Path(cfg.tokenizer) if cfg.tokenizer is not None else bundle_dir(cfg) / "tokenizer.json"
    if not path.is_file():
        raise SmartExitError(f"bench serve: tokenizer {path} is missing; run `smartexit repo`, name the bundle "
                             f"(bundle=DIR) or the tokenizer (tokenizer=PATH)")
    return path


def prompt_pool(cfg: BenchServeConfig) -> list[list[int]]:
    """The held-out test split, one token stream per document."""
    from edge.core.data import Split, load_split
    from edge.model.tokenizer import load_tokenizer

    tok = load_tokenizer(_tokenizer_path(cfg))
    return [e.ids for e in tok.encode_batch([d.text for d in load_split(Split.TEST)])]


def stop_ids(cfg: BenchServeConfig) -> tuple[int, ...]:
    """The end-of-text token, which the server adds to every request's stop ids (scheduler/serving/app.py)."""
    from edge.model.tokenizer import EOS, load_tokenizer

    eos = load_tokenizer(_tokenizer_path(cfg)).token_to_id(EOS)
    return () if eos is None else (eos,)


def make_schedule(cfg: BenchServeConfig) -> tuple[list[ScheduledRequest], Workload]:
    w = load_arrivals(cfg)
    sched = build_schedule(w, prompt_pool(cfg), context_window(cfg), cfg.max_output, cfg.time_scale, cfg.seed,
                           start_s=cfg.start_s, duration_s=cfg.duration_s, max_requests=cfg.max_requests,
                           prompt_percentile=cfg.prompt_percentile)
    return sched, w
