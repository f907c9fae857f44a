"""What an exit check costs, in layers, and where the time goes: measured on the run's own graphs.

Three ways to compute the same decode step (same weights, same cache contents, same batch), each a
chain of ONNX Runtime calls bound once to their buffers, run interleaved call by call; the check and
the boundary are medians over repeats of differences within a repeat:

  full     the graph of every layer, then the LM head: what a step costs with no exit;
  split    the same layers cut at the exits into segment graphs without checks, then the head;
  checks   the export's own segment graphs, each with its candidate check, then the head.

From them, per check point at batch 1 and 16, in layer-equivalents (one layer = (full - head) / L):
``check`` = (checks - split) / (segments - 1), the nodes a check adds inside a call (the decision
itself), and ``boundary`` = (split - full) / (segments - 1), cutting a call in two. The engine's own
work around each call (host) is measured by the decode benchmark on whole steps
(edge/pipeline/bench/decode_measure.py).

The pieces are public for benchmarks that time more chains on the same sessions in the same
interleaved loop (edge/pipeline/bench/projection.py): :func:`split_graphs`, :func:`decision_chains`,
:func:`chain_times`, :func:`cost_from_times`.
"""
from __future__ import annotations

import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from edge.core.errors import ConfigError
from edge.model.config import ModelConfig
from edge.model.exits import ExitConfig, MultiExitModel
from edge.model.segments import segment_layers
from edge.runtime.ortsession import open_session

SYMBOLS = ("batch", "seq", "rows", "capacity", "hidden")


@dataclass
class DecisionCost:
    batch: int
    past: int
    layer_ms: float  # one decoder layer (from the full graph)
    full_ms: float
    split_ms: float
    checks_ms: float
    head_ms: float
    check_layers: float  # the check's nodes, per check point, in layers
    boundary_layers: float  # cutting a call, per boundary

    def to_dict(self) -> dict:
        return asdict(self)


class _Chain:
    """Sessions of graphs called one after another on shared buffers: every input bound by name (ids,
    the residual handed on from the previous graph, the cache in place, zeros for the rest), every output
    to a buffer of its own (outputs named like a later graph's input are handed on). ``sessions`` (path ->
    session) is shared by the chains of one measurement: a graph that several chains call is loaded once,
    as the engine loads it once, and each chain binds its own buffers to it."""

    def __init__(self, ort, paths: list[Path], batch: int, past: int, cache: dict[str, np.ndarray], threads: int,
                 sessions: dict[Path, object], seed: int = 0) -> None:
        ov = ort.OrtValue.ortvalue_from_numpy
        rng = np.random.default_rng(seed)
        self.keep: list[np.ndarray] = []
        self.calls = []
        env = {"batch": batch, "seq": 1, "rows": batch, "capacity": next(iter(cache.values())).shape[2], "hidden": 32}
        handed: dict[str, np.ndarray] = {}  # an output a later graph reads under this name
        for path in paths:
            if path not in sessions:
                sessions[path] = open_session(ort, path, threads, cache=False)
            sess = sessions[path]
            io = sess.io_binding()
            for inp in sess.get_inputs():
                name = inp.name
                if name.startswith(("past_key_", "past_value_")):
                    arr = cache[name.replace("past_", "")]
                elif name == "input_ids":
                    arr = rng.integers(0, 100, (batch, 1)).astype(np.int64)
                elif name in ("hidden", "exit_hidden") and name in handed:
                    arr = handed[name]
                elif name == "seqlens_k":
                    arr = np.full(batch, past, np.int32)
                elif name == "total_len":
                    arr = np.array(past + 1, np.int32)
                else:  # the rule's weights, the lookup, the previous check: zeros of the declared shape
                    arr = np.zeros(_shape(inp.shape, env), _dtype(inp.type))
                self.keep.append(arr)
                io.bind_ortvalue_input(name, ov(arr))
            for out in sess.get_outputs():
                name = out.name
                if name.startswith(("present_key_", "present_value_")):
                    arr = cache[name.replace("present_", "")]
                else:
                    arr = np.zeros(_shape(out.shape, env), _dtype(out.type))
                    handed[{"hidden_out": "hidden"}.get(name, name)] = arr
                self.keep.append(arr)
                io.bind_ortvalue_output(name, ov(arr))
            self.calls.append((sess, io))

    def run(self) -> None:
        for sess, io in self.calls:
            sess.run_with_iobinding(io)


def _shape(dims, env: dict[str, int]) -> tuple[int, ...]:
    return tuple(env[d] if isinstance(d, str) else int(d) for d in dims)


def _dtype(t: str):
    return {"tensor(float)": np.float32, "tensor(int64)": np.int64, "tensor(int32)": np.int32,
            "tensor(bool)": np.bool_}[t]


def _times_ms(fns: dict, calls: int, repeats: int, by_call: bool = False) -> dict[str, list[float]]:
    """Milliseconds per call of each function, one mean over ``calls`` per repeat. The functions are
    interleaved within a repeat so that a slow stretch of the machine hits each of them: ``calls`` of one,
    then the next (a small model's weights stay in cache between its calls, as they do in a decode loop),
    or with ``by_call`` one call of each in turn, the first rotating (for calls long enough that the
    machine's load changes between one function's batch of calls and the next's)."""
    for fn in fns.values():  # warm-up
        for _ in range(max(5, calls // 10)):
            fn()
    names = list(fns)
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        if by_call:
            spent = dict.fromkeys(names, 0.0)
            for i in range(calls):
                for name in names[i % len(names):] + names[:i % len(names)]:
                    t0 = time.perf_counter()
                    fns[name]()
                    spent[name] += time.perf_counter() - t0
            for name in names:
                times[name].append(spent[name] / calls * 1e3)
            continue
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - t0) / calls * 1e3)
    return times


def split_graphs(model: MultiExitModel, out_dir: Path, external_data_threshold: int | None = None) -> None:
    """Write ``model``'s segment graphs without checks (the same cuts, exit norms and adapters, no
    shortlist) to ``out_dir`` as ``segment_{i}.onnx``; weights past ``external_data_threshold`` bytes go
    to external data (:func:`exporters.ort_fused.save_fused`)."""
    from exporters.ort_fused import build_fused, save_fused

    nocheck = MultiExitModel(model.backbone, ExitConfig(layers=model.exit_layers, adapter_rank=0))
    for layer, head in model.heads.items():  # the same exit norms and adapters, no shortlist
        nocheck.heads[layer].load_state_dict(head.state_dict())
    save_fused([g for g in build_fused(nocheck.eval(), segment_layers(model.exit_layers), full=False)
                if g.name.startswith("segment_")], out_dir, external_data_threshold)


def decision_chains(fused_dir: Path, split_dir: Path, segments: int) -> dict[str, list[Path]]:
    """The graphs each chain of the module docstring calls, in order (``fused_dir``: the export's fused
    graphs with ``full``; ``split_dir``: :func:`split_graphs`'s)."""
    from exporters.ort_fused import FULL

    head = fused_dir / "head.onnx"
    return {"full": [fused_dir / f"{FULL}.onnx", head],
            "split": [split_dir / f"segment_{i}.onnx" for i in range(segments)] + [head],
            "checks": [fused_dir / f"segment_{i}.onnx" for i in range(segments)] + [head],
            "head": [head]}


def chain_times(chains: dict[str, list[Path]], cfg: ModelConfig, batch: int, past: int, threads: int, calls: int,
                repeats: int, by_call: bool = False, builds: int = 1) -> dict[str, list[float]]:
    """Milliseconds per call of each chain at ``batch`` rows of ``past`` cached tokens of a model shaped
    ``cfg``, one value per repeat, the chains interleaved (``by_call``: call by call, else ``calls`` at a
    time); chains calling the same graph share its session.

    ``builds`` > 1: the sessions are opened afresh that many times, the chains' order reversed every other
    time, and the repeats split between them. Where a session sits in memory moves its speed: on a 2-core
    VM the same chains measured a check at 0.12-0.17 layers (batch 16) with the no-check graphs opened
    before the checking ones and 0.19-0.46 the other way round, so one order is one draw of that bias.

    Raises:
        ConfigError: ``batch``, ``past``, ``calls``, ``repeats`` or ``builds`` below 1.
    """
    import onnxruntime as ort

    if min(batch, past, calls, repeats, builds) < 1:
        raise ConfigError(f"chain times: batch ({batch}), past ({past}), calls ({calls}), repeats ({repeats}) and "
                          f"builds ({builds}) must be >= 1")
    cap = past + 8
    rng = np.random.default_rng(1)
    cache = {f"{kind}_{j}": (0.1 * rng.standard_normal((batch, cfg.num_kv_heads, cap, cfg.head_dim))).astype(np.float32)
             for j in range(cfg.num_layers) for kind in ("key", "value")}
    times: dict[str, list[float]] = {name: [] for name in chains}
    for k in range(min(builds, repeats)):
        share = repeats // builds + (k < repeats % builds)  # the repeats, spread over the builds
        names = list(chains) if k % 2 == 0 else list(chains)[::-1]
        sessions: dict[Path, object] = {}
        built = {name: _Chain(ort, chains[name], batch, past, cache, threads, sessions) for name in names}
        got = _times_ms({name: built[name].run for name in chains}, calls, share, by_call)
        for name in chains:
            times[name] += got[name]
        del built, sessions
    return times


def cost_from_times(ms: dict[str, float], num_layers: int, segments: int, batch: int, past: int) -> DecisionCost:
    """The :class:`DecisionCost` of the chains' times ``ms`` (``full``, ``split``, ``checks``, ``head``: one
    value each, a median or one repeat's) of a model of ``num_layers`` layers cut into ``segments`` (>= 2)."""
    layer = max(ms["full"] - ms["head"], 1e-9) / num_layers
    return DecisionCost(batch, past, layer, ms["full"], ms["split"], ms["checks"], ms["head"],
                        (ms["checks"] - ms["split"]) / (segments - 1) / layer,
                        (ms["split"] - ms["full"]) / (segments - 1) / layer)


def decision_cost(model: MultiExitModel, fused_dir: Path, batch: int, past: int = 96, threads: int = 2,
                  calls: int = 50, repeats: int = 15, builds: int = 2) -> DecisionCost:
    """The check's price on ``model``'s export (``fused_dir``: its fused graphs, a candidate shortlist
    model's) at ``batch`` rows of ``past`` cached tokens; the repeats spread over ``builds`` openings of the
    sessions in alternating orders (:func:`chain_times`).

    Raises:
        ConfigError: a model without a candidate shortlist (its checks are LM heads: docs/runtime.md).
    """
    if not model.has_shortlist:
        raise ConfigError("decision cost: the model has no candidate shortlist (exits.shortlist)")
    n = len(model.exit_layers)
    with tempfile.TemporaryDirectory(prefix="smartexit-decision-") as tmp:
        split_graphs(model, Path(tmp))
        # call by call: the chains differ by a few percent, less than this VM's drift between batches of calls
        # and over sessions opened in both orders (chain_times: where a session sits moves its speed)
        times = chain_times(decision_chains(fused_dir, Path(tmp), n), model.backbone.cfg, batch, past, threads,
                            calls, repeats, by_call=True, builds=builds)
    # the check and the boundary are differences of chains measured in the same repeat: the median of the
    # paired differences, not the difference of medians (which pairs one repeat's split with another's checks)
    per = [cost_from_times({k: v[r] for k, v in times.items()}, model.num_layers, n, batch, past)
           for r in range(repeats)]
    mid = cost_from_times({k: float(np.median(v)) for k, v in times.items()}, model.num_layers, n, batch, past)
    mid.check_layers = float(np.median([c.check_layers for c in per]))
    mid.boundary_layers = float(np.median([c.boundary_layers for c in per]))
    return mid
