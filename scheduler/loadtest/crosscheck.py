"""``smartexit bench crosscheck``: our load client against one nobody on this project wrote.

NVIDIA's ``aiperf`` and ``smartexit bench serve``'s client run the same closed-loop load (concurrency,
request count, prompt and output lengths, greedy) against the same running stack, one after the
other, and their TTFT, inter-token latency, request latency and throughput are put side by side. A
client that timed the wrong event (first byte instead of first token, say) would disagree. The
prompts differ (aiperf synthesises its own from the tokenizer; ours are held-out code of the same
length), which moves the decode cost little at these lengths.

aiperf lives in its own environment (``make aiperf-check`` creates ``.venv-aiperf`` from
``requirements/aiperf.txt``): it pins other versions of packages this project pins, so it never
enters ``.venv``. It runs offline with the bundle's tokenizer, written as a Hugging Face tokenizer
folder (tokenizer.json + tokenizer_config.json).
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edge.core.errors import ConfigError

STAGE = "bench_crosscheck"
METRICS = (("ttft_mean_ms", "time_to_first_token", "avg"), ("e2e_mean_ms", "request_latency", "avg"),
           ("ttft_p50_ms", "time_to_first_token", "p50"), ("ttft_p99_ms", "time_to_first_token", "p99"),
           ("itl_p50_ms", "inter_token_latency", "p50"), ("e2e_p50_ms", "request_latency", "p50"),
           ("output_tokens_per_s", "output_token_throughput", "avg"),
           ("requests_per_s", "request_throughput", "avg"), ("output_tokens_mean", "output_sequence_length", "avg"))


@dataclass
class CrossCheckConfig:
    run_dir: str = "artifacts/demo"
    url: str | None = None            # a running server; None: start the stack on serve.port
    aiperf: str = ".venv-aiperf/bin/aiperf"
    concurrency: int = 4
    requests: int = 32
    prompt_tokens: int = 64
    max_tokens: int = 32
    warmup_requests: int = 2
    seed: int = 0
    serve: dict[str, Any] = field(default_factory=lambda: {"port": 8011})

    def __post_init__(self) -> None:
        if min(self.concurrency, self.requests, self.prompt_tokens, self.max_tokens) < 1:
            raise ConfigError("bench crosscheck: concurrency, requests, prompt_tokens and max_tokens must be >= 1")


def aiperf_command(cfg: CrossCheckConfig, url: str, model: str, tokenizer_dir: Path, out_dir: Path) -> list[str]:
    """aiperf's command line for the closed-loop load of ``cfg`` (completions, streaming, greedy)."""
    return [cfg.aiperf, "profile", "-m", model, "--url", url, "--endpoint-type", "completions", "--streaming",
            "--tokenizer", str(tokenizer_dir), "--concurrency", str(cfg.concurrency),
            "--request-count", str(cfg.requests), "--warmup-request-count", str(cfg.warmup_requests),
            "--synthetic-input-tokens-mean", str(cfg.prompt_tokens), "--synthetic-input-tokens-stddev", "0",
            "--output-tokens-mean", str(cfg.max_tokens), "--output-tokens-stddev", "0",
            "--extra-inputs", "temperature:0", "--random-seed", str(cfg.seed),
            "--output-artifact-dir", str(out_dir), "--no-auto-plot"]


def aiperf_numbers(export: dict[str, Any]) -> dict[str, float | None]:
    """Our names for the numbers in aiperf's ``profile_export_aiperf.json``."""
    out = {}
    for ours, theirs, stat in METRICS:
        v = export.get(theirs)
        out[ours] = float(v[stat]) if isinstance(v, dict) and v.get(stat) is not None else None
    return out


def our_numbers(summary: dict[str, Any]) -> dict[str, float | None]:
    """The same numbers from ``scheduler.loadtest.bench_report.summarize``."""
    return {"ttft_mean_ms": summary["ttft_mean_ms"], "e2e_mean_ms": summary["e2e_mean_ms"],
            "ttft_p50_ms": summary["ttft_p50_ms"], "ttft_p99_ms": summary["ttft_p99_ms"],
            "itl_p50_ms": summary["tpot_p50_ms"], "e2e_p50_ms": summary["e2e_p50_ms"],
            "output_tokens_per_s": summary["tokens_per_s"],
            "requests_per_s": summary["completed"] / summary["duration_s"] if summary["duration_s"] else None,
            "output_tokens_mean": summary["tokens"] / summary["completed"] if summary["completed"] else None}


SERVER_SERIES = {"ttft": "smartexit_ttft_seconds", "e2e": "smartexit_e2e_latency_seconds"}


def server_counts(metrics_text: str) -> dict[str, float]:
    """Sums and counts of the server's TTFT and end-to-end histograms, and its generated tokens, from
    a ``/metrics`` scrape: two scrapes bracket a client's run, and their difference is what the
    server measured for that run's requests."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(metrics_text):
        for smp in fam.samples:
            for key, name in SERVER_SERIES.items():
                if smp.name == f"{name}_sum":
                    out[f"{key}_sum"] = smp.value
                elif smp.name == f"{name}_count":
                    out[f"{key}_count"] = smp.value
            if smp.name == "smartexit_generated_tokens_total":
                out["tokens"] = smp.value
    return out


def server_means(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """Mean TTFT and end-to-end latency (ms) and tokens the server saw between two scrapes."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    mean = lambda k: 1e3 * d[f"{k}_sum"] / d[f"{k}_count"] if d.get(f"{k}_count") else None  # noqa: E731
    return {"ttft_mean_ms": mean("ttft"), "e2e_mean_ms": mean("e2e"), "requests": d.get("ttft_count"),
            "tokens": d.get("tokens")}


def _scrape(url: str) -> dict[str, float]:
    import urllib.request

    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        return server_counts(r.read().decode())


def agreement(res: dict[str, Any]) -> dict[str, float | None]:
    """Per client, its mean TTFT and E2E minus the server's for the same requests (ms): equal gaps mean
    both clients time the same events, whatever the load did to the server between the runs."""
    out = {}
    for client, server in (("ours", "server_during_ours"), ("aiperf", "server_during_aiperf")):
        for k in ("ttft_mean_ms", "e2e_mean_ms"):
            c, s = res[client].get(k), res[server].get(k)
            out[f"{client}_{k.removesuffix('_mean_ms')}_minus_server_ms"] = c - s if c is not None and s is not None else None
    return out


def tokenizer_folder(bundle: Path, out: Path) -> Path:
    """A Hugging Face tokenizer folder (what aiperf loads) from the bundle's tokenizer.json."""
    from edge.model.tokenizer import EOS

    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_bytes((bundle / "tokenizer.json").read_bytes())
    (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                           "eos_token": EOS}))
    return out


def _ours(cfg: CrossCheckConfig, url: str) -> tuple[dict[str, Any], str]:
    from scheduler.control.outcomes import summarize
    from scheduler.loadtest.bench_serve_capacity import capacity_requests
    from scheduler.loadtest.bench_serve_config import BenchServeConfig
    from scheduler.loadtest.bench_serve_inputs import make_schedule
    from scheduler.loadtest.loadgen import ScheduledRequest, run_closed_loop
    from scheduler.loadtest.senders import HttpSender

    bcfg = BenchServeConfig(run_dir=cfg.run_dir, url=url, max_requests=cfg.requests, duration_s=None,
                            capacity_concurrency=[cfg.concurrency], capacity_requests=cfg.requests,
                            capacity_prompt_tokens=cfg.prompt_tokens, capacity_max_tokens=cfg.max_tokens,
                            seed=cfg.seed)
    schedule, _ = make_schedule(bcfg)
    reqs = capacity_requests(bcfg, schedule)

    async def run():
        async with HttpSender(url, "", "bounded", bcfg.sla_ttft_ms, bcfg.sla_tpot_ms, None, 300.0) as send:
            send.model = (await send.models())[0]
            for i, r in enumerate(reqs[:cfg.warmup_requests]):
                await send(ScheduledRequest(0.0, r.prompt_ids, r.max_tokens, f"warmup-{i}"))
            return await run_closed_loop(reqs, send, cfg.concurrency), send.model

    results, model = asyncio.run(run())
    return summarize(results, bcfg.sla_ttft_ms, bcfg.sla_tpot_ms), model
