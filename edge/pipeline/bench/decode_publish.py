"""What ``smartexit bench decode`` (:mod:`edge.pipeline.bench.decode`) leaves behind: bench/decode.{json,md,png},
the manifest's record of the stage and the summary lines it prints (the numbers in them: :mod:`.summary`)."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from edge.core.artifacts import Manifest, atomic_write_json, publish_files
from edge.pipeline.bench.decode_config import DecodeBenchConfig
from edge.pipeline.bench.summary import goals, headline, plot, render_markdown, summary_lines
from edge.pipeline.run import Run

STAGE = "bench_decode"


def publish_results(cfg: DecodeBenchConfig, run: Run, graphs: Path, results: dict[str, Any], epsilon: float,
                    t0: float) -> None:
    """bench/decode.{json,md,png}, the manifest's record, the summary lines; ``epsilon``: the tolerance the
    threshold table was certified for."""
    cal = Manifest(cfg.run_dir).stage("calibrate")["metrics"]  # quality is measured there, on more tokens
    results["calibration"] = {k: cal.get(k) for k in ("layers_skipped_frac", "accuracy_loss_rel",
                                                       "free_run_false_exit_rate_test", "kv_mode")}
    # the false-exit goal is the tolerance the table was certified for
    results["calibration"]["epsilon"] = epsilon
    summary = headline(results)
    summary["goals"] = goals(summary, results["calibration"]["epsilon"], cfg.batch_sizes)
    out = Path(cfg.run_dir) / "bench"
    # bench/ holds the other benches' outputs (compress, energy, serve, projection): a re-run of this one
    # replaces its own files only
    publish_files(out, {"decode.json": lambda p: atomic_write_json(p, {**results, "summary": summary}),
                        "decode.md": lambda p: p.write_text(render_markdown(results, summary)),
                        "decode.png": lambda p: plot(results, p)})
    run.manifest.record(STAGE, inputs={"checkpoint": run.path, "graphs": graphs, "graphs_full": run.graphs(full=True),
                                       "thresholds": run.thresholds},
                        config=results["config"], outputs={"json": out / "decode.json",
                                                           "png": out / "decode.png"},
                        metrics={**summary, "batches": results["batches"],
                                 "profile_b1": results["profile_b1"],
                                 "speculative_config": results["speculative_config"],
                                 "speculative_stop_rules": results["speculative_stop_rules"],
                                 "speculative_by_draft_exit": results["speculative_by_draft_exit"],
                                 "peak_rss_mib": results.get("peak_rss_mib")},
                        seconds=time.time() - t0)
    for line in summary_lines(results, summary, out / "decode.md", time.time() - t0):
        print(line)
