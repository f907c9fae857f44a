"""The served engine's step log and what the serving path reads off it (scheduler/loadtest/serving_path.py):
its lines read back (:func:`read_step_log`, :func:`count_lines`), each step's time regressed on the profiled
model's decode and prefill parts, the chunks it sent and its draft rounds (:func:`step_terms`, :func:`fit_steps`:
the slowdowns and chunk costs), and how often a decoding sequence took a plain step or verified a round of 1, 2, ...
tokens per decode batch (:func:`decode_rounds`)."""
from __future__ import annotations

import collections
import json
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from edge.core.errors import ConfigError
from scheduler.control.engine_model import STEP_PARAMS
from scheduler.control.latency import LatencyModel
from scheduler.control.sim_config import BUCKET_KEYS, MAX_ROUND_TOKENS, batch_bucket


def read_step_log(path: str | Path, keep: Sequence[tuple[int, int]] | None = None) -> list[dict[str, Any]]:
    """The step log's lines (edge/runtime/host_steplog.py ``step_line``); with ``keep``, only those whose 0-based
    line number lies in one of its ranges [start, end). Raises ConfigError: missing or malformed."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"serving path: no step log at {path} (the served engine did not write one)")
    out = []
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines, 1):
        if not line.strip() or (keep is not None and not any(a < i <= b for a, b in keep)):
            continue
        try:
            rec = json.loads(line)
            d = [(int(a), int(b)) for a, b in rec["d"]]
            out.append({"s": float(rec["s"]) + float(rec.get("e", 0.0)), "c": int(rec["c"]), "d": d,
                        "p": [(int(a), int(b)) for a, b in rec["p"]],
                        "a": int(rec.get("a", 0)), "n": int(rec.get("n", 0)),  # both 0 in logs written before them
                        # per decoding sequence (tokens, 1 for a draft round): in logs written before rounds were
                        # logged, a plain step per row
                        "k": [(int(n), int(r)) for n, r in rec["k"]] if "k" in rec else [(1, 0)] * len(d),
                        # the request ids of ``k``'s sequences, in its order (None in logs written before them)
                        "i": [int(x) if isinstance(x, int) else str(x) for x in rec["i"]] if "i" in rec else None})
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            if i == len(lines):
                break  # the last line of a stack stopped mid-write
            raise ConfigError(f"serving path: step log {path} line {i}: {exc!r}") from None
    return out


def step_terms(latency: LatencyModel, steps: Sequence[dict[str, Any]]) -> np.ndarray:
    """[N, 6 + len(BUCKET_KEYS)]: each logged step's profiled decode part (with the per-step constant; the rows
    of its plain steps), its profiled prefill part, the chunks it sent (in ms: the coefficients are serve_chunk_ms
    and _sq_ms), their square, the two profiled parts times the requests that reached the engine in the last
    FRONT_WINDOW_S seconds (the log's ``a``; 0 in logs written before it), in STEP_PARAMS' order, then its draft
    rounds (in ms: verification calls outside the batched step) in the column of its decode batch's bucket
    (scheduler/control/sim_config.py BUCKET_KEYS: round_ms_by_batch)."""
    from scheduler.control.latency import FEATURES, combine, decode_features, prefill_features

    w = np.array([latency.coef[f] for f in FEATURES])
    pre = np.array([f.startswith("prefill_") for f in FEATURES])
    out = np.zeros((len(steps), 6 + len(BUCKET_KEYS)))
    for i, st in enumerate(steps):
        f = combine(decode_features([e for _, e in st["d"]], [c for c, _ in st["d"]], latency.exit_layers),
                    prefill_features(st["p"], latency.num_layers)).vector()
        d, p, a = w[~pre] @ f[~pre], w[pre] @ f[pre], st.get("a", 0)
        out[i, :6] = (d, p, st["c"] / 1e3, st["c"] ** 2 / 1e3, d * a, p * a)
        rounds = sum(r for _, r in st.get("k", ()))
        if rounds:
            out[i, 6 + BUCKET_KEYS.index(batch_bucket(len(st["k"])))] = rounds / 1e3
    return out


MIN_STEPS = 50


def fit_steps(latency: LatencyModel, steps: Sequence[dict[str, Any]]) -> tuple[dict[str, float], dict[str, Any]]:
    """(STEP_PARAMS' values; the fit's quality) from the served steps: non-negative least squares,
    unweighted, so that the mean step time (what sets the simulator's throughput) comes out right. (Weighted by 1/sqrt(time), as the profile's own fit,
    it followed the typical step and left the mean ~10% short: a simulator optimistic under load.)

    Raises:
        ConfigError: fewer than MIN_STEPS busy steps.
    """
    from scipy.optimize import nnls

    T = step_terms(latency, steps)
    y = np.array([st["s"] for st in steps])
    # a step that only verified rounds has no profiled part but is engine work (before 2026-12-05 such steps,
    # most of a lone sequence's, were left out, and round_ms came from the steps that mixed both)
    busy = (T[:, 0] + T[:, 1] + T[:, 6:].sum(axis=1)) > 0
    T, y = T[busy], y[busy]
    if len(y) < MIN_STEPS:
        raise ConfigError(f"serving path: {len(y)} busy steps in the step log, at least {MIN_STEPS} needed")
    # the served decode step is never faster than the engine alone: fit what it takes beyond the profiled
    # time (decode factor >= 1). Unbounded, the fit traded the base factor for the per-arrival one (x0.17 +
    # x0.088 per arrival on a demo's log: step error median 0.31 against 0.38 bounded), which prices a
    # lightly loaded stack's decode at a fifth of the engine's own time
    scale = np.maximum(T.max(axis=0), 1e-12)
    coef, _ = nnls(T / scale, y - T[:, 0])
    coef = coef / scale
    coef[0] += 1.0
    if coef[1] == 0:  # no prefill in the log: prefill as decode
        coef[1] = coef[0]
    fields: dict[str, Any] = dict(zip(STEP_PARAMS[:6], map(float, coef[:6])))
    counts = T[:, 6:].sum(axis=0)  # rounds per bucket (/1e3)
    fields["round_ms_by_batch"] = {k: float(c) for k, c, n in zip(BUCKET_KEYS, coef[6:], counts) if n > 0} or None
    # one price for files and readers that know no buckets: the rounds' mean
    fields["round_ms"] = float(coef[6:] @ counts / counts.sum()) if counts.sum() > 0 else 0.0
    pred = T @ coef
    rel = np.abs(pred - y) / np.maximum(y, 1e-9)
    kept = [st for st, b in zip(steps, busy) if b]
    only_decode = T[:, 1] == 0

    def buckets(values: np.ndarray, edges: Sequence[int]) -> dict[str, dict[str, float]]:
        """Decode-only steps by ``values`` in [edges[k], edges[k + 1]) (the last open): served, fitted, profiled."""
        out = {}
        for lo, hi in zip(edges, [*edges[1:], None]):
            m = only_decode & (values >= lo) & (values < (hi if hi is not None else np.inf))
            if m.sum():
                out[f"{lo}-{hi - 1}" if hi is not None else f"{lo}+"] = {
                    "steps": int(m.sum()), "measured_ms": float(y[m].mean() * 1e3),
                    "fitted_ms": float(pred[m].mean() * 1e3), "profiled_ms": float(T[m, 0].mean() * 1e3)}
        return out

    # by decoding sequences, those that verified rounds too (steps without ``k``: their plain rows)
    batches = buckets(np.array([len(st.get("k", st["d"])) for st in kept]), (1, 2, 4, 8))
    # by the requests that reached the engine in the last FRONT_WINDOW_S seconds
    by_arrivals = buckets(np.array([st.get("a", 0) for st in kept]), (0, 3, 6, 10))
    return fields, {"steps": int(len(y)), "rel_err_median": float(np.median(rel)),
                    "rel_err_p90": float(np.quantile(rel, 0.9)), "total_ratio": float(pred.sum() / y.sum()),
                    "profiled_total_ratio": float((T[:, 0] + T[:, 1]).sum() / y.sum()),
                    "mean_step_ms": float(y.mean() * 1e3), "decode_batches": batches,
                    "decode_by_recent_arrivals": by_arrivals}


def decode_rounds(steps: Sequence[dict[str, Any]]) -> dict[str, list[float]] | None:
    """SimConfig.decode_rounds from the served steps: per decode batch bucket, the share of decoding sequences
    that took a plain step, and that verified a draft round emitting 1, 2, ... MAX_ROUND_TOKENS tokens; None
    without decode steps. Where the log names the requests (``i``), only the steps of a sequence with more than
    MAX_ROUND_TOKENS tokens still to go are counted: there max_tokens cannot have cut a round, and the simulator
    cuts its own draws at a request's end (counted, the cut rounds were cut twice). On two profiles' runs
    (2026-12-05) the simulator's heaviest run then put TTFT p50 at 115 and 137 ms instead of 124 and 148 (served
    105 and 73), its lighter runs within 0.4 ms of before."""
    total: dict[Any, int] = collections.Counter()
    for st in steps:
        for (n, _), rid in zip(st.get("k", ()), st.get("i") or ()):
            total[rid] += n
    done: dict[Any, int] = collections.Counter()
    counts: dict[str, np.ndarray] = {}
    for st in steps:
        ks, ids = st.get("k", [(1, 0)] * len(st["d"])), st.get("i")
        if ks:
            c = counts.setdefault(batch_bucket(len(ks)), np.zeros(MAX_ROUND_TOKENS + 1))
            for q, (n, r) in enumerate(ks):
                if ids is not None:
                    rid = ids[q]
                    left, done[rid] = total[rid] - done[rid], done[rid] + n
                    if left <= MAX_ROUND_TOKENS:
                        continue
                c[min(max(n, 1), MAX_ROUND_TOKENS) if r else 0] += 1
    counts = {key: c for key, c in counts.items() if c.sum() > 0}
    if not counts:
        return None
    return {key: [float(x) for x in c[:int(np.flatnonzero(c).max()) + 1] / c.sum()] for key, c in counts.items()}


def count_lines(path: Path) -> int:
    """The complete lines of a step log written so far (0 before it exists)."""
    return path.read_text().count("\n") if path.is_file() else 0
