"""``smartexit bench crosscheck``: the stage. The work is :mod:`scheduler.loadtest.crosscheck`'s; this module reads the run, calls it and
records what it made."""
from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from edge.core.artifacts import Manifest, atomic_write_json, atomic_write_text
from edge.core.device import run_command
from edge.core.errors import SmartExitError
from scheduler.loadtest.crosscheck import CrossCheckConfig, METRICS, STAGE, _ours, _scrape, agreement, aiperf_command, aiperf_numbers, our_numbers, server_means, tokenizer_folder


def main(cfg: CrossCheckConfig) -> int:
    t0 = time.perf_counter()
    if not Path(cfg.aiperf).is_file():
        raise SmartExitError(f"bench crosscheck: {cfg.aiperf} not found; `make aiperf-check` creates .venv-aiperf")
    out = Path(cfg.run_dir) / "bench" / "crosscheck"
    from scheduler.serving.stack import bundle as run_bundle

    bundle = run_bundle(cfg.run_dir)
    tok = tokenizer_folder(bundle, out / "tokenizer")

    def both(url: str) -> dict[str, Any]:
        s0 = _scrape(url)
        ours, model = _ours(cfg, url)
        s1 = _scrape(url)
        proc = run_command(aiperf_command(cfg, url, model, tok, out / "aiperf"), timeout=1800)
        if proc.returncode != 0:
            raise SmartExitError(f"aiperf failed ({proc.returncode}): {proc.stderr[-2000:] or proc.stdout[-2000:]}")
        s2 = _scrape(url)
        theirs = json.loads((out / "aiperf" / "profile_export_aiperf.json").read_text())
        # the warm-up requests of each client are inside its bracket: the server's means include them
        return {"ours": our_numbers(ours), "aiperf": aiperf_numbers(theirs),
                "server_during_ours": server_means(s0, s1), "server_during_aiperf": server_means(s1, s2),
                "aiperf_version": theirs.get("aiperf_version")}

    if cfg.url is not None:
        res = both(cfg.url)
    else:
        from edge.core.configio import apply
        from scheduler.serving.config import ServeConfig
        from scheduler.serving.stack import free_port, serving_stack

        scfg = apply(ServeConfig(), {"port": free_port(), **cfg.serve})  # a port of its own unless named
        with serving_stack(cfg.run_dir, scfg, graceful=False) as url:
            res = both(url)
    ratio = {k: (res["ours"][k] / res["aiperf"][k] if res["ours"][k] and res["aiperf"][k] else None)
             for k, _, _ in METRICS}
    report = {"stage": STAGE, "config": asdict(cfg), **res, "ours_over_aiperf": ratio}
    md = ["# Load-client cross-check: smartexit bench serve's client vs NVIDIA aiperf", "",
          f"Same stack, one after the other: closed loop at concurrency {cfg.concurrency}, {cfg.requests} "
          f"requests, {cfg.prompt_tokens} prompt tokens, max {cfg.max_tokens} new tokens, greedy "
          f"(aiperf {res.get('aiperf_version')}; its prompts are synthetic, ours held-out code).", "",
          "| metric | ours | aiperf | ours / aiperf |", "| --- | ---: | ---: | ---: |"]
    f = lambda v, s=".2f": "n/a" if v is None else format(v, s)  # noqa: E731
    for k, _, _ in METRICS:
        md.append(f"| {k} | {f(res['ours'][k])} | {f(res['aiperf'][k])} | {f(ratio[k], '.3f')} |")
    so, sa = res["server_during_ours"], res["server_during_aiperf"]
    md += ["", "Each client against what the server measured for the same requests (the ingress's TTFT and "
           "end-to-end histograms, scraped from /metrics before and after each client's run; the client "
           "adds HTTP and the proxy; warm-up requests included on the server side):", "",
           "| client | client TTFT mean ms | server TTFT mean ms | client E2E mean ms | server E2E mean ms | "
           "server-seen requests |", "| --- | ---: | ---: | ---: | ---: | ---: |",
           f"| ours | {f(res['ours']['ttft_mean_ms'])} | {f(so['ttft_mean_ms'])} | {f(res['ours']['e2e_mean_ms'])} | "
           f"{f(so['e2e_mean_ms'])} | {f(so['requests'], '.0f')} |",
           f"| aiperf | {f(res['aiperf']['ttft_mean_ms'])} | {f(sa['ttft_mean_ms'])} | "
           f"{f(res['aiperf']['e2e_mean_ms'])} | {f(sa['e2e_mean_ms'])} | {f(sa['requests'], '.0f')} |"]
    atomic_write_json(out / "crosscheck.json", report)
    atomic_write_text(out / "crosscheck.md", "\n".join(md) + "\n")
    Manifest(cfg.run_dir).record(STAGE, inputs={}, config=asdict(cfg),
                                 outputs={"json": out / "crosscheck.json", "md": out / "crosscheck.md"},
                                 metrics={"ours_over_aiperf": ratio, "server_agreement": agreement(res)},
                                 seconds=time.perf_counter() - t0)
    print("\n".join(md))
    return 0
