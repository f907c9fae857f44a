"""The live SLA dashboard's data (``GET /dashboard``, ``GET /dashboard/data``; docs/serving.md).

:class:`Dashboard` samples the front end's :class:`~scheduler.serving.metrics.ServeMetrics` (the
finished requests' raw latencies, tokens/s, exit-layer counts) and the workers' latest stats (queue,
prefill budget, admission limit, policy, power) every ``serve.dashboard_tick_s`` into a ring buffer
of rows; :meth:`Dashboard.data` hands the page columns (uPlot's data layout), only the rows newer
than the page's last one when it says ``since``.

Power is measured where the device is: each worker opens its meter (:func:`open_power`,
``serve.power_meter``) and adds :meth:`LivePower.reading` to the stats it pushes, so a fleet's
dashboard and ``/metrics`` show every device's own power, not the head node's.

The page and its assets (``static/``) are package data, read with :func:`static_file`.
"""
from __future__ import annotations

import hashlib
import hmac
import time
from collections import deque
from collections.abc import Callable, Mapping
from importlib import resources
from typing import Any

from edge.core.errors import ConfigError
from edge.energy.meter import Measurement, PowerMeter
from edge.core.stats import percentiles
from scheduler.serving.metrics import ServeMetrics

PAGE = "dashboard.html"  # under static/; served at /dashboard (behind the key)
# the page's assets under static/ -> content type, served at /dashboard/static/<name> (public code, no key);
# nothing else is served: no path from a request reaches the disk
ASSETS = {
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
    "vendor/uplot/uPlot.iife.min.js": "text/javascript; charset=utf-8",
    "vendor/uplot/uPlot.min.css": "text/css; charset=utf-8",
}
# the page's own headers: only this origin's scripts, styles and fetches; no Referer carries a key away
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; "
                               "base-uri 'none'; form-action 'none'",
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-store",
}
COOKIE = "smartexit_dashboard"  # holds session_token(key), never the key itself
NO_METER_REASON = "no power meter configured (serve.power_meter is 'none')"
# the time series, in the order of the page's columns (``t``: unix seconds, the x axis)
SERIES = ("t", "ttft_p50_ms", "ttft_p95_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p95_ms", "tpot_p99_ms",
          "requests", "sla_attainment", "goodput_rps", "tokens_per_s", "queue", "running", "prefill_budget",
          "admission_limit", "fallback", "fallback_events", "watts", "temperature_c", "joules_per_token",
          "false_exit_rate", "false_exit_upper")


def static_file(name: str) -> bytes:
    """The bytes of :data:`PAGE` or one of :data:`ASSETS` (package data: works installed as a wheel too).

    Raises:
        KeyError: ``name`` is neither.
    """
    if name != PAGE and name not in ASSETS:
        raise KeyError(name)
    return resources.files("scheduler.serving").joinpath("static", *name.split("/")).read_bytes()


def session_token(api_key: str) -> str:
    """The dashboard cookie's value for ``api_key``: an HMAC of it, so a leaked cookie is not the key
    (it opens the dashboard only, not ``/v1``)."""
    return hmac.new(api_key.encode(), b"smartexit-dashboard", hashlib.sha256).hexdigest()


class LivePower:
    """A started power meter read for a live view: :meth:`reading` each control tick.

    A sampled meter keeps every reading of its window until ``stop()``; :meth:`roll` (due every
    ``roll_s``) ends the window and starts the next, so a server running for weeks keeps minutes of
    samples, not weeks. ``roll`` joins the meter's thread: call it off the event loop.
    """

    def __init__(self, meter: PowerMeter, roll_s: float = 300.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.meter, self.roll_s, self._clock = meter, roll_s, clock
        meter.start()
        self._rolled = clock()

    def reading(self) -> dict[str, Any]:
        """``{"meter", "available", "reason", "watts", "temperature_c", "rails"}`` from the latest sample
        (watts and temperature None before the first one, or where the meter has none)."""
        s = self.meter.latest()
        return {"meter": self.meter.name, "available": bool(self.meter.available), "reason": self.meter.reason,
                "watts": None if s is None else float(s.watts),
                "temperature_c": None if s is None or s.temperature_c is None else float(s.temperature_c),
                "rails": {} if s is None else {k: float(v) for k, v in s.rails.items()}}

    def roll_due(self) -> bool:
        return self._clock() - self._rolled >= self.roll_s

    def roll(self) -> Measurement:
        """End the meter's window and start the next; the window's measurement."""
        m = self.meter.stop()
        self.meter.start()
        self._rolled = self._clock()
        return m

    def close(self) -> None:
        self.meter.close()


def open_power(kind: str, interval_s: float) -> LivePower | None:
    """The worker's started meter for ``serve.power_meter`` (None for ``"none"``).

    ``edge.energy.detect`` is imported only here, only when a meter is asked for.
    Raises:
        ConfigError: a meter is asked for but ``edge.energy.detect`` is not installed.
    """
    if kind == "none":
        return None
    try:
        from edge.energy.detect import open_meter
    except ImportError as exc:
        raise ConfigError(f"serve.power_meter={kind!r} needs edge.energy.detect, which this installation "
                          f"lacks ({exc}); set serve.power_meter=none") from exc
    return LivePower(open_meter(kind, interval_s=interval_s))


class Dashboard:
    """The dashboard's time series: one row per :meth:`sample`, the last ``points`` kept.

    Args:
        metrics: the front end's metrics (its clock and ``window_s`` set the windows below).
        exit_layers, num_layers: the model's exits and depth (the exit-layer histogram's bars).
        sla_ttft_ms, sla_tpot_ms: the server's default targets (the SLA lines).
        power_meter: ``serve.power_meter`` (what the page says when no replica reports power).
        points: rows kept; tick_s: the caller's sampling period (the page says it).
        wall: unix seconds (the x axis; injected by tests).

    Per row, over the requests finished in the last ``metrics.window_s``: TTFT and TPOT p50 / p95 /
    p99 (edge.core.stats.percentiles: the benchmark's definition), SLA attainment (requests meeting
    their targets / requests the server served, refused or failed; client errors and disconnects
    left out) and goodput (requests meeting their targets per second, DistServe's, as in
    bench_report); tokens/s is ``metrics.tokens_per_second()``. Summed over replicas: queue,
    running, prefill budget, admission limit, power; temperature is the hottest device's.
    ``fallback`` is 1 while any replica's learned policy has handed control to its heuristic;
    ``fallback_events`` counts the hand-overs since the previous row. ``joules_per_token``:
    power / tokens per second. ``false_exit_rate`` / ``false_exit_upper``: the replicas' online audits
    pooled (every token of a greedy bounded request, judged by the engine with deferral), since their start
    or last reset, against the certificate's epsilon (``data()["audit"]``).
    """

    def __init__(self, metrics: ServeMetrics, exit_layers: tuple[int, ...], num_layers: int, sla_ttft_ms: float,
                 sla_tpot_ms: float, power_meter: str = "none", points: int = 600, tick_s: float = 1.0,
                 wall: Callable[[], float] = time.time) -> None:
        self._metrics, self._wall = metrics, wall
        self.layers = sorted(set(exit_layers) | {num_layers})
        self.sla = {"ttft_ms": sla_ttft_ms, "tpot_ms": sla_tpot_ms}
        self.power_meter, self.points, self.tick_s = power_meter, points, tick_s
        self._rows: deque[dict[str, Any]] = deque(maxlen=points)
        self._exits: deque[tuple[float, tuple[int, ...]]] = deque(maxlen=points)  # (clock, cumulative counts)
        self._t0 = metrics.clock()
        self._fallbacks_seen: float | None = None
        self._latest: dict[str, Any] = {"scheduler": {}, "power": self._power_status({}), "audit": _audit_status({})}

    def sample(self) -> dict[str, Any]:
        """Append one row sampled now (and refresh the policy and power status); the row."""
        m = self._metrics
        now = m.clock()
        span = min(m.window_s, max(now - self._t0, 1e-9))  # a young server has not had a whole window yet
        recent = [f for f in m.finished if f.t >= now - m.window_s]
        row: dict[str, Any] = {"t": self._wall()}
        for name, values in (("ttft", [f.ttft_s for f in recent]), ("tpot", [f.tpot_s for f in recent])):
            for q, v in percentiles([1e3 * x for x in values if x is not None]).items():
                row[f"{name}_{q}_ms"] = _round(v)
        counted = [f for f in recent if f.counted]
        met = sum(f.met for f in counted)
        row["requests"] = len(counted)
        row["sla_attainment"] = _round(met / len(counted)) if counted else None
        row["goodput_rps"] = _round(met / span)
        tps = m.tokens_per_second()
        row["tokens_per_s"] = _round(tps)

        replicas = m.replicas
        for key, name in (("waiting", "queue"), ("running", "running"), ("prefill_budget", "prefill_budget"),
                          ("max_running", "admission_limit")):
            row[name] = _total(s.get(key) for s in replicas.values())
        sched = {rid: s["scheduler"] for rid, s in sorted(replicas.items()) if isinstance(s.get("scheduler"), Mapping)}
        row["fallback"] = (int(any(s.get("active") != s.get("policy") for s in sched.values())) if sched else None)
        total = _total(s.get("fallbacks") for s in sched.values())
        row["fallback_events"] = (None if total is None or self._fallbacks_seen is None
                                  else max(0, int(total - self._fallbacks_seen)))
        self._fallbacks_seen = total if total is not None else self._fallbacks_seen

        power = {rid: s["power"] for rid, s in sorted(replicas.items()) if isinstance(s.get("power"), Mapping)}
        watts = _total(p.get("watts") for p in power.values())
        temps = [float(p["temperature_c"]) for p in power.values() if _number(p.get("temperature_c"))]
        row["watts"] = _round(watts)
        row["temperature_c"] = _round(max(temps)) if temps else None
        row["joules_per_token"] = _round(watts / tps, 6) if watts is not None and tps > 0 else None

        audits = {rid: s["audit"] for rid, s in sorted(replicas.items()) if isinstance(s.get("audit"), Mapping)}
        audit = _audit_status(audits)
        row["false_exit_rate"], row["false_exit_upper"] = _round(audit["rate"], 6), _round(audit["upper"], 6)

        self._rows.append(row)
        self._exits.append((now, tuple(m.exit_counts.get(layer, 0) for layer in self.layers)))
        self._latest = {"scheduler": {rid: {k: s.get(k) for k in ("policy", "active", "fallbacks", "updates")}
                                      for rid, s in sched.items()},
                        "power": self._power_status(power), "audit": audit}
        return row

    def data(self, since: float | None = None) -> dict[str, Any]:
        """What ``/dashboard/data`` answers: the columns of the rows after ``since`` (unix seconds; all
        rows when None), the SLA targets, the exit-layer histogram (tokens per layer since the start
        and over the last window), the policy per replica and the power status."""
        rows = [r for r in self._rows if since is None or r["t"] > since]
        m = self._metrics
        totals = tuple(m.exit_counts.get(layer, 0) for layer in self.layers)
        horizon = m.clock() - m.window_s
        before = next((c for t, c in self._exits if t >= horizon), totals)
        return {
            "points": self.points,
            "tick_s": self.tick_s,
            "window_s": m.window_s,
            "sla": self.sla,
            "series": {k: [r[k] for r in rows] for k in SERIES},
            "exit_layers": {"layers": self.layers, "total": list(totals),
                            "recent": [a - b for a, b in zip(totals, before)]},
            "replicas": len(m.replicas),
            **self._latest,
        }

    def _power_status(self, power: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
        """Whether any replica reports power, and why not where none does."""
        if not power:
            reason = NO_METER_REASON if self.power_meter == "none" else \
                f"no replica has reported power yet (serve.power_meter is {self.power_meter!r})"
            return {"available": False, "reason": reason, "meters": {}}
        available = any(p.get("available") and _number(p.get("watts")) for p in power.values())
        reasons = sorted({str(p.get("reason", "")) for p in power.values() if not p.get("available")} - {""})
        return {"available": available, "reason": "; ".join(reasons) or ("" if available else "no reading yet"),
                "meters": {rid: p.get("meter") for rid, p in power.items()}}


def _audit_status(audits: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The replicas' online false-exit audits (edge/runtime/audit.py, the host's ``audit`` stats) pooled: audited
    tokens, false exits, their rate and one-sided Clopper-Pearson upper bound at the audits' delta, the
    certificate's epsilon; and per replica the per-request test (requests audited whole, their mean rate, the
    betting p-value, whether it certifies) and whether the audit has fallen back to full depth."""
    from edge.runtime.audit import clopper_pearson

    n = int(_total(a.get("audited") for a in audits.values()) or 0)
    k = int(_total(a.get("false") for a in audits.values()) or 0)
    deltas = [float(a["delta"]) for a in audits.values() if _number(a.get("delta"))]
    epsilons = [float(a["epsilon"]) for a in audits.values() if _number(a.get("epsilon"))]
    upper = clopper_pearson(k, n, min(deltas))[1] if n and deltas else None
    return {"audited": n, "false": k, "rate": k / n if n else None, "upper": upper,
            "epsilon": min(epsilons) if epsilons else None,
            "replicas": {rid: {"requests": a.get("requests"), "fallback": bool(a.get("fallback"))}
                         for rid, a in audits.items()}}


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _total(values) -> float | None:
    """The sum of the numbers among ``values`` (None when there are none)."""
    nums = [float(v) for v in values if _number(v)]
    return sum(nums) if nums else None


def _round(x: float | None, digits: int = 3) -> float | None:
    return None if x is None else round(float(x), digits)
