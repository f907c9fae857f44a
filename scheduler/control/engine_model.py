"""The engine as the simulator sees it, read from a run: the latency model (``smartexit profile``) and
the exit model (the threshold table's exit fractions, the profile's per-request exit traces).

It also holds :class:`ServingPath`, the serving path's own cost that ``smartexit profile serving=true``
fits (scheduler/loadtest/serving_path.py) and the simulator reads (``SimConfig`` fields).

One place for both, so training (scheduler/control/train.py) and evaluation (scheduler/loadtest/bench_scheduler.py)
simulate the same engine.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from edge.core.errors import ConfigError
from scheduler.control.exit_model import ExitModel
from scheduler.control.latency import LatencyModel

SERVING_JSON = "serving.json"


@dataclass
class ServingPath:
    ttft_overhead_ms: float = 0.0
    token_overhead_ms: float = 0.0
    ingress_ms: float = 0.0                # the front end's time per request (SimConfig.ingress_ms); 0 in older files
    serve_chunk_ms: float = 0.0
    serve_chunk_sq_ms: float = 0.0
    engine_slowdown: float = 1.0
    prefill_slowdown: float | None = None  # None: engine_slowdown (a serving.json of the one-factor fit)
    front_decode_per_arrival: float = 0.0  # SimConfig's; 0 in older files
    front_prefill_per_arrival: float = 0.0
    round_ms: float = 0.0                  # engine time per draft round (SimConfig's); 0 in older files
    round_ms_by_batch: dict[str, float] | None = None  # the same per decode batch bucket (SimConfig's); None: older
    # plain steps and draft rounds per decoding sequence and step by decode batch, as the served engine did them
    # (SimConfig.decode_rounds); None in older files: plain steps only
    decode_rounds: dict[str, list[float]] | None = None
    rates: list[float] | None = None       # req/s of the calibration runs
    requests: int = 0
    fit: dict[str, Any] | None = None      # per run: measured and simulated percentiles, relative errors

    def sim_fields(self) -> dict[str, Any]:
        """The SimConfig fields."""
        return {k: getattr(self, k) for k in PARAMS}

    def save(self, path: str | Path) -> None:
        from edge.core.artifacts import atomic_write_json

        atomic_write_json(Path(path), asdict(self))

    @classmethod
    def load(cls, path: str | Path) -> ServingPath | None:
        """None without the file. Raises ConfigError: malformed."""
        path = Path(path)
        if not path.is_file():
            return None
        try:
            d = json.loads(path.read_text())
            return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})
        except (json.JSONDecodeError, TypeError) as exc:
            raise ConfigError(f"serving path {path}: {exc}") from None


STEP_PARAMS = ("engine_slowdown", "prefill_slowdown", "serve_chunk_ms", "serve_chunk_sq_ms",  # from the step log
               "front_decode_per_arrival", "front_prefill_per_arrival", "round_ms")
OVERHEADS = ("ttft_overhead_ms", "token_overhead_ms", "ingress_ms")  # from the requests' latencies
# the last two: counted in the step log, and the round price per batch bucket (fitted with STEP_PARAMS)
PARAMS = STEP_PARAMS + OVERHEADS + ("decode_rounds", "round_ms_by_batch")


def exit_traces(path: str | Path) -> list[dict[str, Any]] | None:
    """The profile's per-request exit traces cut to the tokens decoded where the engine let rows exit
    (``exits_allowed``; with deferred K/V on CPU only at batch 1: at larger batches every row runs to
    full depth, which says nothing about the text); None without the file.

    Raises:
        ConfigError: the file is not JSON or not a list of ``{"exit_layers": [...], ...}``.
    """
    path = Path(path)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        out = []
        for t in data:
            allowed = t.get("exits_allowed") or [True] * len(t["exit_layers"])
            layers = [int(e) for e, a in zip(t["exit_layers"], allowed) if a]
            if layers:
                out.append({**t, "exit_layers": layers})
    except (json.JSONDecodeError, TypeError, KeyError, AttributeError) as exc:
        raise ConfigError(f"exit traces {path}: expected a JSON list of {{'exit_layers': [...]}} "
                          f"({type(exc).__name__}: {exc})") from None
    return out


def exit_model(latency: LatencyModel, thresholds: str | Path | None, traces: str | Path | None) -> tuple[ExitModel, str]:
    """(exit model, where it came from): the threshold table's expected exit fractions (calibrated on
    free-running batch-1 generations, the regime where rows may exit) with the between-request
    concentration fitted on the exit-allowed tokens of the profile's traces where there are enough;
    full depth when there is no table.

    Raises:
        ConfigError: malformed files; exit layers that disagree with the latency model's.
    """
    fractions, source = None, "no threshold table: full depth"
    if thresholds is not None and Path(thresholds).is_file():
        try:
            fractions = json.loads(Path(thresholds).read_text()).get("expected_exit_fraction")
        except json.JSONDecodeError as exc:
            raise ConfigError(f"threshold table {thresholds}: not JSON ({exc})") from None
        source = f"exit fractions of {thresholds}"
    model = ExitModel.from_certificate(latency.exit_layers, fractions)
    data = exit_traces(traces) if traces is not None else None
    if data:
        try:
            model.concentration = ExitModel.fit(latency.exit_layers, [t["exit_layers"] for t in data]).concentration
            source += f"; concentration {model.concentration:.2f} from {traces} (exit-allowed tokens)"
        except ConfigError as exc:
            source += f"; default concentration ({exc})"
    if list(model.layers) != list(latency.exit_layers):
        raise ConfigError(f"exit model layers {model.layers} differ from the latency model's {latency.exit_layers}")
    return model, source


def serving_fields(run_dir: str | Path) -> dict[str, Any]:
    """The SimConfig fields of the served engine: the host's limits and audit rate from the bundle
    ``smartexit repo`` wrote (the audit's full-depth re-decodes are engine work too), and the serving
    path ``smartexit profile`` measured (serving.json); what is absent keeps the simulator's default."""
    from edge.runtime.audit import AuditConfig

    run = Path(run_dir)
    out: dict[str, Any] = {}
    bundle = run / "triton" / "smartexit" / "1" / "bundle" / "bundle.json"
    if bundle.is_file():
        host = json.loads(bundle.read_text()).get("host", {})
        audit = host.get("audit") or {}
        out["audit_fraction"] = float(audit.get("fraction", AuditConfig().fraction))
        out["audit_max_pending"] = int(audit.get("max_pending", AuditConfig().max_pending))
        for k in ("max_seqs", "max_waiting", "prefill_budget", "max_running"):  # the initial knob values too
            if k in host:
                out[k] = int(host[k])
    sp = ServingPath.load(run / "scheduler" / SERVING_JSON)
    return out if sp is None else {**out, **sp.sim_fields()}


def from_run(run_dir: str | Path, latency: str | Path | None = None, thresholds: str | Path | None = None,
             traces: str | Path | None = None) -> tuple[LatencyModel, ExitModel, dict[str, str]]:
    """The run's latency model and exit model (each file the run's unless named), with their sources:
    the files that exist (``latency``, ``thresholds``, ``exit_traces``) and ``exits``, how the exit
    model was made.

    Raises:
        ConfigError: a named file that does not exist; as LatencyModel.load and exit_model.
    """
    run = Path(run_dir)
    for name, path in (("exit_traces", traces), ("thresholds", thresholds)):
        if path and not Path(path).is_file():
            raise ConfigError(f"{name} {path} does not exist")
    lat_path = Path(latency) if latency else run / "scheduler" / "latency.json"
    table = Path(thresholds) if thresholds else run / "calibration" / "thresholds.json"
    trace_path = Path(traces) if traces else run / "scheduler" / "exit_traces.json"
    lm = LatencyModel.load(lat_path)
    exits, source = exit_model(lm, table, trace_path)
    files = {"latency": str(lat_path)} | {k: str(p) for k, p in (("thresholds", table), ("exit_traces", trace_path))
                                          if p.is_file()}
    return lm, exits, {**files, "exits": source}
