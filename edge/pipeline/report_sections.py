"""What each section of ``report.json`` holds, read off the run's manifest: one reader per section, and
``SECTIONS``, which names the stage a section needs and its reader (``report.build`` keeps the sections whose
stage has run). A later stage adds its section here.
"""
from __future__ import annotations

from typing import Any, Callable

from edge.core.artifacts import STAGE_TIME_FORMAT, Manifest
from edge.core.errors import ArtifactError


def _model(m: Manifest) -> dict[str, Any]:
    d = m.stage("distill")["metrics"]
    return {"params": d["params"], "layers": d["layers"], "exits": d["exits"],
            "heldout_top1": d["heldout_top1"], "heldout_ppl": d["heldout_ppl"], "heldout_tokens": d["tokens"],
            "heldout_window": m.stage("distill")["config"]["seq_len"]}


def _distill(m: Manifest) -> dict[str, Any]:
    st = m.stage("distill")
    d = st["metrics"]
    return {"exit_agreement": d["exit_agreement"], "exit_accuracy": d["exit_accuracy"],
            "steps": st["config"]["steps"], "freeze_backbone": st["config"]["freeze_backbone"],
            "adapter_rank": st["config"]["exits"]["adapter_rank"], "seconds": st["seconds"],
            **{k: d[k] for k in ("base_heldout_ppl", "base_heldout_top1", "heldout_ppl", "heldout_top1") if k in d}}


def _generate(m: Manifest) -> dict[str, Any]:
    return dict(m.stage("generate")["metrics"])


def _calibration(m: Manifest) -> dict[str, Any]:
    return dict(m.stage("calibrate")["metrics"])


def _export(m: Manifest) -> dict[str, Any]:
    d = m.stage("export")["metrics"]
    p = d["parity"]
    fused = d.get("parity_fused")
    return {"graphs": d["graphs"], "graphs_full_depth": d["graphs_full"], "opset": d["opset"],
            "parity_passed": p["passed"] and d["parity_full"]["passed"] and (fused is None or fused["passed"]),
            "argmax_agreement": p["argmax_agreement"], "atol": p["atol"],
            "max_abs_diff": max(v for outs in p["max_abs_diff"].values() for v in outs.values()),
            "fused": None if fused is None else {
                "argmax_agreement": fused["argmax_agreement"], "rtol": fused["rtol"],
                "max_abs_diff": max(v for outs in fused["max_abs_diff"].values() for v in outs.values())},
            "fused_skipped": d.get("fused_skipped")}


def _bench(m: Manifest) -> dict[str, Any]:
    return dict(m.stage("bench_decode")["metrics"])


def _serve(m: Manifest) -> dict[str, Any]:
    return dict(m.stage("bench_serve")["metrics"])


def _crosscheck(m: Manifest) -> dict[str, Any]:
    return dict(m.stage("bench_crosscheck")["metrics"])


def _scheduler(m: Manifest) -> dict[str, Any]:
    return dict(m.stage("bench_scheduler")["metrics"])


def _audit(m: Manifest) -> dict[str, Any]:
    out = dict(m.stage("bench_audit")["metrics"])
    if "epsilon" not in out:
        raise ArtifactError(f"{m.path}: the bench_audit stage's metrics lack 'epsilon' (recorded before it was the "
                            f"audit's key); re-run `smartexit bench audit run_dir=...`")
    return out


def _compression(m: Manifest) -> dict[str, Any]:
    """The shipped recipe (stage compress) and the recipes side by side (stage bench_compress)."""
    out = dict(m.stage("bench_compress")["metrics"])
    if "compress" in m.data["stages"]:
        c = m.stage("compress")["metrics"]
        out["recipe"] = c["recipe"]
        out["pruned"] = c.get("pruned", False)
        out["perplexity_ratio_heldout"] = c.get("perplexity_ratio")
    return out


def _energy(m: Manifest) -> dict[str, Any]:
    return dict(m.stage("bench_energy")["metrics"])


def _projection(m: Manifest) -> dict[str, Any]:
    """`make bench-projection`: the run's exits replayed at real model shapes (edge/pipeline/bench/projection.py)."""
    return dict(m.stage("bench_projection")["metrics"])


def _jetson(m: Manifest) -> dict[str, Any]:
    """The device's own bench metrics, pulled into <run>/jetson/ by `make jetson-bench` (edge/jetson/bench.py)."""
    return dict(m.stage("jetson_bench")["metrics"])


# `make demo` on a fresh clone, 2 cores, the venv excluded: the time the project holds its main job to (README)
DEMO_BUDGET_S = 900.0


def stage_times(m: Manifest) -> dict[str, Any]:
    """Each recorded stage's seconds, in the order the stages were first recorded, their sum, and the span from the
    first stage's start to the last one's end (each stage records when it ended, to the second, and how long it
    took): the pipeline's wall time, process start-ups between stages included, when the stages ran one after
    another (`make demo`); a stage re-run later stretches the span, so both are given."""
    import calendar
    import time

    stages = m.data["stages"]
    seconds = {k: float(v.get("seconds", 0.0)) for k, v in stages.items()}
    ends = {k: calendar.timegm(time.strptime(v["time"], STAGE_TIME_FORMAT)) for k, v in stages.items()
            if isinstance(v.get("time"), str)}
    span = max(ends.values()) - min(e - seconds[k] for k, e in ends.items()) if ends else None
    return {"seconds": seconds, "sum_s": sum(seconds.values()), "span_s": span, "demo_budget_s": DEMO_BUDGET_S}


SECTIONS: dict[str, tuple[str, Callable[[Manifest], dict[str, Any]]]] = {
    "model": ("distill", _model),
    "distill": ("distill", _distill),
    "calibration": ("calibrate", _calibration),
    "generate": ("generate", _generate),
    "export": ("export", _export),
    "compression": ("bench_compress", _compression),
    "energy": ("bench_energy", _energy),
    "decode_bench": ("bench_decode", _bench),
    "serve_bench": ("bench_serve", _serve),
    "audit_bench": ("bench_audit", _audit),
    "crosscheck": ("bench_crosscheck", _crosscheck),
    "scheduler": ("bench_scheduler", _scheduler),
    "projection": ("bench_projection", _projection),
    "jetson": ("jetson_bench", _jetson),
}
