"""Where a served request's first token spends its time: the stamps of :mod:`scheduler.serving.stamps` (written by
the load generator, the ingress replica, Triton's core in it and the model's stub, on one shared clock) cut into the
hops between them, for the closed-loop runs of ``bench serve`` at concurrency 1 (one request at a time, so each
request's stamps are the ones between its ``client_send`` and the next).

The engine's own share (``model_execute`` -> ``engine_first``: waiting for the engine thread, then the prefill) is what
the in-process run measures as its TTFT; the rest is what serving adds on the way in and out.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from scheduler.serving.stamps import POINTS

ENGINE = ("model_execute", "engine_first")
LABELS = {
    ("client_send", "ingress_in"): "client -> ingress handler (HTTP, Ray Serve's direct ingress)",
    ("ingress_in", "core_submit"): "ingress handler -> Triton's core (body, checks, tokens)",
    ("core_submit", "model_execute"): "Triton's core -> the model's stub (python backend IPC)",
    ENGINE: "the engine: its thread, then the prefill (what in process measures)",
    ("engine_first", "model_send"): "first chunk -> its response sent (stub's responder thread)",
    ("model_send", "core_response"): "stub -> Triton's core (python backend IPC)",
    ("core_response", "ingress_first"): "core's callback -> first SSE event (ingress loop)",
    ("ingress_first", "client_first"): "first SSE event -> client (HTTP, parsing)",
}


def read_stamps(folder: Path) -> list[tuple[float, str]]:
    """Every ``(time ms, point)`` in the folder's ``*.tsv`` files, in time order (a torn last line is skipped)."""
    out: list[tuple[float, str]] = []
    for f in sorted(Path(folder).glob("*.tsv")):
        for line in f.read_text(encoding="utf-8").splitlines():
            parts = line.split("\t")
            if len(parts) == 3 and parts[0] in POINTS:
                try:
                    out.append((float(parts[2]), parts[0]))
                except ValueError:
                    continue
    out.sort()
    return out


def requests_in(stamps: Sequence[tuple[float, str]], spans: Iterable[tuple[float, float]]) -> list[dict[str, float]]:
    """Per request (a ``client_send`` inside one of ``spans``, in ms of the same clock), the first time of each
    point from its ``client_send`` to the next one or the span's end; only requests that carry every point."""
    out = []
    for t0, t1 in spans:
        current: dict[str, float] | None = None
        for t, point in stamps:
            if t < t0 or t > t1:
                continue
            if point == "client_send":
                if current is not None and len(current) == len(POINTS):
                    out.append(current)
                current = {}
            if current is not None and point not in current:
                current[point] = t
        if current is not None and len(current) == len(POINTS):
            out.append(current)
    return out


def breakdown(stamps: Sequence[tuple[float, str]], spans: Iterable[tuple[float, float]]) -> dict[str, Any] | None:
    """The hops' medians and 90th percentiles (ms) over the requests in ``spans`` (:func:`requests_in`), with the
    whole TTFT and the serving hops' sum; None where no request carries every point (a server this process did
    not start stamps nothing)."""
    reqs = requests_in(stamps, spans)
    if not reqs:
        return None
    stat = lambda xs: {"median_ms": float(np.median(xs)), "p90_ms": float(np.percentile(xs, 90))}  # noqa: E731
    hops = [{"from": a, "to": b, "label": LABELS[(a, b)], **stat([r[b] - r[a] for r in reqs])}
            for a, b in zip(POINTS, POINTS[1:])]
    serving = [sum(r[b] - r[a] for a, b in zip(POINTS, POINTS[1:]) if (a, b) != ENGINE) for r in reqs]
    return {"requests": len(reqs), "hops": hops,
            "ttft": stat([r["client_first"] - r["client_send"] for r in reqs]),
            "serving_hops": stat(serving)}


def breakdown_markdown(b: dict[str, Any] | None, inprocess_ttft_ms: float | None) -> list[str]:
    """The breakdown as a table (empty without one), the in-process TTFT beside the engine's share."""
    if not b:
        return []
    ref = "" if inprocess_ttft_ms is None else f" (in process, same runs' repeats: {inprocess_ttft_ms:.2f} ms)"
    lines = ["", f"Where a served request's first token goes (concurrency 1, {b['requests']} requests, stamps on one "
             "clock in every process: scheduler/serving/stamps.py):", "",
             "| hop | median ms | p90 ms |", "| --- | ---: | ---: |"]
    for h in b["hops"]:
        label = h["label"] + (ref if (h["from"], h["to"]) == ENGINE else "")
        lines.append(f"| {label} | {h['median_ms']:.2f} | {h['p90_ms']:.2f} |")
    lines += [f"| every hop but the engine's, summed per request | {b['serving_hops']['median_ms']:.2f} | "
              f"{b['serving_hops']['p90_ms']:.2f} |",
              f"| TTFT at the client | {b['ttft']['median_ms']:.2f} | {b['ttft']['p90_ms']:.2f} |"]
    return lines
