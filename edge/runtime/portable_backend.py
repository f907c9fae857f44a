"""Backend over the portable graphs (``onnx/``: embed, segment_i, kvfill_i, head), run by ONNX Runtime
or by TensorRT.

The portable graphs are the ones TensorRT's parser accepts (exporters/onnx_export.py documents their
tensors): plain ONNX attention over an explicit past and an additive mask, the new rows' K/V as
outputs, one exit row per sequence. So, like the torch reference, this backend gathers each
sequence's past from the engine's host :class:`KVCache` (a copy), builds the mask on the host
(:func:`build_mask`), writes the new rows back, and computes the exit rule's features on the host
(:func:`host_decision`). The graphs themselves run behind :class:`GraphRunner`: ONNX Runtime sessions
(:class:`OrtGraphRunner`, any CPU) or the TensorRT plans ``make jetson-engines`` builds on the device
(:class:`TrtGraphRunner`, one per graph). Registered as ``onnxruntime_portable`` and ``tensorrt``.

Not supported by these graphs: exit gates (no gate output) and self-speculative verification (one
exit row per sequence); the fused graphs of the ``onnxruntime`` backend have both.

A TensorRT engine takes shapes within its optimisation profile only: the TensorRT backend states the
profile's largest T (new rows per call) as its ``max_chunk`` (:func:`profile_max_chunk`, from the
engines.json its builds recorded), and the engine keeps every prefill chunk within it.
"""
from __future__ import annotations

import abc
import json
from pathlib import Path
from typing import Any

import numpy as np

from edge.core.artifacts import sha256_file, sha256_path
from edge.core.errors import ArtifactError, ConfigError, require
from edge.runtime.backend import Backend, HeadOut, ModelSpec, SegmentOut
from edge.runtime.backend_host import build_mask, host_candidates, host_decision
from edge.runtime.graphs import (GRAPHS_JSON, load_graphs_json, load_ngram_table, shortlist_act_scale, shortlist_rows,
                                 verify_graphs)
from edge.runtime.ortsession import open_session

ENGINES_JSON = "engines.json"  # what `make jetson-engines` (edge/jetson/engines.py) writes beside the plans
REBUILD = "rebuild with `make jetson-engines`"


class GraphRunner(abc.ABC):
    """Runs the portable graphs by name ("embed", "segment_0", "kvfill_1", "head", ...)."""

    @abc.abstractmethod
    def run(self, name: str, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run graph ``name`` on ``feeds`` (each of its inputs by name); returns all its outputs by name."""

    @abc.abstractmethod
    def inputs(self, name: str) -> list[str]:
        """Input names of graph ``name`` (opens it if it is not open yet)."""


class OrtGraphRunner(GraphRunner):
    """ONNX Runtime sessions over the portable graphs listed in graphs.json, opened on first use, on the
    process-wide thread pool (edge/runtime/ortsession.py)."""

    def __init__(self, graphs_dir: str | Path, threads: int = 0, meta: dict[str, Any] | None = None) -> None:
        """``meta``: graphs.json already read (and verified) by the caller; read here if None."""
        self.ort = require("onnxruntime", "onnxruntime")
        self.graphs_dir = Path(graphs_dir)
        self.meta = meta if meta is not None else load_graphs_json(self.graphs_dir)
        self.threads = threads
        self._sessions: dict[str, Any] = {}
        self._outputs: dict[str, list[str]] = {}

    def _session(self, name: str):
        if name not in self._sessions:
            g = self.meta["graphs"].get(name)
            if g is None:
                raise ArtifactError(f"{self.graphs_dir / GRAPHS_JSON} lists no graph {name!r} (has "
                                    f"{sorted(self.meta['graphs'])}); re-run `smartexit export`")
            sess = open_session(self.ort, self.graphs_dir / g["file"], self.threads, source_sha256=g["sha256"])
            self._outputs[name] = [o.name for o in sess.get_outputs()]
            self._sessions[name] = sess
        return self._sessions[name]

    def run(self, name, feeds):
        sess = self._session(name)
        return dict(zip(self._outputs[name], sess.run(None, feeds)))

    def inputs(self, name):
        return [x.name for x in self._session(name).get_inputs()]


class TrtGraphRunner(GraphRunner):
    """One TensorRT plan per graph (edge/runtime/trt_runner.py), opened on first use.

    Args:
        engines_dir: the folder of the plans (``<run>/jetson/engines``).
        engines: engines.json's table by graph (what :func:`check_engines` returns): each entry's
            ``file`` is the graph's plan.

    Raises:
        MissingExtraError: TensorRT is not installed here.
        NoCudaDeviceError: no CUDA GPU is visible.
    """

    def __init__(self, engines_dir: str | Path, engines: dict[str, dict[str, Any]]) -> None:
        from edge.runtime.trt_runner import require_tensorrt

        require_tensorrt()  # fail at construction, not at the first request
        self.engines_dir = Path(engines_dir)
        self.engines = engines
        self._runners: dict[str, Any] = {}

    def _runner(self, name: str):
        if name not in self._runners:
            from edge.runtime.trt_runner import TrtRunner

            if name not in self.engines:
                raise ArtifactError(f"{self.engines_dir / ENGINES_JSON} has no engine for graph {name!r}; {REBUILD}")
            self._runners[name] = TrtRunner(self.engines_dir / self.engines[name]["file"])
        return self._runners[name]

    def run(self, name, feeds):
        return self._runner(name).run(feeds)

    def inputs(self, name):
        return list(self._runner(name).inputs)


def load_meta(graphs_dir: str | Path | None, checkpoint: str | Path | None, backend: str) -> dict[str, Any]:
    """graphs.json of ``graphs_dir``, its graphs verified against ``checkpoint`` when one is given.

    Raises:
        ConfigError: no ``graphs_dir``.
        ArtifactError: see :func:`edge.runtime.graphs.verify_graphs`.
    """
    if graphs_dir is None:
        raise ConfigError(f"the {backend} backend needs graphs_dir (the export folder: run `smartexit export`)")
    if checkpoint is None:
        return load_graphs_json(graphs_dir)
    return verify_graphs(graphs_dir, sha256_path(checkpoint))


def portable_spec(meta: dict[str, Any], graphs_dir: str | Path) -> ModelSpec:
    """The model's shape from graphs.json (as :class:`~edge.runtime.ort_backend.OrtBackend` reads it).

    Raises:
        ConfigError: a model with exit gates (the portable graphs have no gate output).
    """
    m = meta["model"]
    spec = ModelSpec(m["num_layers"], tuple(meta["exit_layers"]), m["hidden_size"], m["num_kv_heads"], m["head_dim"],
                     m["vocab_size"], m["max_positions"], m.get("sliding_window"), m["gated"],
                     tuple(m.get("shortlist", ())))
    if spec.gated:
        raise ConfigError(f"{Path(graphs_dir) / GRAPHS_JSON}: a model with exit gates; the portable graphs have no "
                          f"gate output, so neither TensorRT nor 'onnxruntime_portable' can run it (the fused graphs "
                          f"of the 'onnxruntime' backend can)")
    return spec


def check_engines(graphs_dir: str | Path, engines_dir: str | Path, meta: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Check that the TensorRT engines in ``engines_dir`` were built from this export's graphs: for every
    graph of graphs.json (``meta``), engines.json records an engine built from an ONNX file of the same
    sha256, and its plan is there (with the recorded sha256, when one is recorded).

    Returns:
        engines.json's table by graph.

    Raises:
        ArtifactError: engines.json missing or unreadable, a graph without an engine, an engine of
            another ONNX graph, a missing or changed plan. The message names the graph.
    """
    engines_dir = Path(engines_dir)
    path = engines_dir / ENGINES_JSON
    if not path.is_file():
        raise ArtifactError(f"{path} is missing: no TensorRT engines for the export {graphs_dir}; build them on the "
                            f"device with `make jetson-engines`")
    try:
        table = json.loads(path.read_text()).get("engines")
    except (json.JSONDecodeError, AttributeError) as exc:
        raise ArtifactError(f"{path} is not an engines.json `make jetson-engines` wrote ({exc}); {REBUILD}") from exc
    if not isinstance(table, dict):
        raise ArtifactError(f"{path} has no 'engines' table; {REBUILD}")
    for name, g in meta["graphs"].items():
        e = table.get(name)
        if not isinstance(e, dict) or "file" not in e:
            raise ArtifactError(f"{path} has no engine for graph {name!r}; {REBUILD}")
        if e.get("onnx_sha256") != g["sha256"]:
            raise ArtifactError(f"{path}: the engine of graph {name!r} was built from ONNX sha256 "
                                f"{e.get('onnx_sha256')}, but {Path(graphs_dir) / g['file']} of this export has "
                                f"sha256 {g['sha256']} (engines of another export); {REBUILD}")
        plan = engines_dir / e["file"]
        if not plan.is_file():
            raise ArtifactError(f"{plan} (the engine of graph {name!r}) is missing; {REBUILD}")
        want = e.get("plan_sha256") or e.get("sha256")  # edge/jetson/engines.py or exporters/tensorrt.py
        if want is not None and sha256_file(plan) != want:
            raise ArtifactError(f"{plan} (the engine of graph {name!r}) sha256 differs from {path}'s record: the "
                                f"plan changed after its build; {REBUILD}")
    return table


def _max_shapes(entry: dict[str, Any]) -> dict[str, list[int]] | None:
    """{input: max shape} of one engines.json entry: its ``shapes`` (exporters/tensorrt.py build_engines), else
    the ``--maxShapes=`` of the trtexec command line that built it (edge/jetson/engines.py); None: neither."""
    shapes = entry.get("shapes")
    if isinstance(shapes, dict):
        return {name: [int(d) for d in s["max"]] for name, s in shapes.items()}
    for arg in entry.get("argv") or []:
        if isinstance(arg, str) and arg.startswith("--maxShapes="):
            pairs = (p.rsplit(":", 1) for p in arg[len("--maxShapes="):].split(",") if p)
            return {name: [int(d) for d in dims.split("x")] for name, dims in pairs}
    return None


def profile_max_chunk(engines: dict[str, dict[str, Any]], source: str | Path = ENGINES_JSON) -> int:
    """The most new rows (T) one call may take on these engines: the smallest profile maximum of T over
    the embedding and segment graphs (``input_ids`` [B, T] and ``hidden`` [B, T, D]; exporters/tensorrt.py
    ``profile_shapes``), i.e. the largest prefill chunk every graph of a call accepts.

    Args:
        engines: engines.json's table by graph (:func:`check_engines`).
        source: the file it came from, for the error message.

    Raises:
        ArtifactError: an embed or segment engine whose profile is recorded nowhere.
    """
    return _profile_max(engines, 1, source)


def profile_max_batch(engines: dict[str, dict[str, Any]], source: str | Path = ENGINES_JSON) -> int:
    """The most sequences (B) one call may take on these engines: :func:`profile_max_chunk` of the batch axis.

    Raises:
        ArtifactError: an embed or segment engine whose profile is recorded nowhere.
    """
    return _profile_max(engines, 0, source)


def _profile_max(engines: dict[str, dict[str, Any]], axis: int, source: str | Path) -> int:
    """The smallest profile maximum of axis ``axis`` (0: B, 1: T) of the embed and segment graphs' inputs."""
    sizes = []
    for name, entry in engines.items():
        if name != "embed" and not name.startswith("segment_"):
            continue
        shapes = _max_shapes(entry)
        key = "input_ids" if name == "embed" else "hidden"
        if shapes is None or key not in shapes or len(shapes[key]) < 2:
            raise ArtifactError(f"{source}: the engine of graph {name!r} records no optimisation profile for "
                                f"{key!r} (neither 'shapes' nor a --maxShapes command line); {REBUILD}")
        sizes.append(shapes[key][axis])
    if not sizes:
        raise ArtifactError(f"{source}: no embed or segment engine to read the profile's largest chunk from; {REBUILD}")
    return min(sizes)


class PortableBackend(Backend):
    """Segments and K/V fills over the portable graphs, whatever runs them (:class:`GraphRunner`)."""

    name = "portable"

    def __init__(self, spec: ModelSpec, runner: GraphRunner) -> None:
        super().__init__(spec)
        self.runner = runner
        # open the graphs every call needs now (a bad file fails here, not at the first request); the K/V
        # fill graphs on first use, as the onnxruntime backend does: deferral never loads their weights
        self._inputs = {n: runner.inputs(n) for n in ["embed", *(f"segment_{i}" for i in range(len(self.segments))),
                                                       "head"]}
        self.shortlist_rows = None  # the LM head's rows of the shortlist [K, D] (shortlist_rows.npy of the export)

    def _run(self, name: str, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Graph ``name`` on the feeds it takes."""
        if name not in self._inputs:
            self._inputs[name] = self.runner.inputs(name)
        missing = [k for k in self._inputs[name] if k not in feeds]
        if missing:
            raise ArtifactError(f"graph {name!r} takes inputs {missing} the portable graphs do not have "
                                f"(exporters/onnx_export.py): an export from another SmartExit? re-export")
        return self.runner.run(name, {k: feeds[k] for k in self._inputs[name]})

    def _segment(self, i, x, slots, start, prev, decide, rows, draft, lookup):  # drafts use the exact head
        if rows > 1:
            raise ConfigError(f"rows={rows}: the portable graphs output one exit row per sequence, and "
                              f"self-speculative decoding verifies several; it needs the fused graphs of the "
                              f"'onnxruntime' backend")
        b, t = x.shape[:2]
        positions = (start[:, None] + np.arange(t)[None, :]).astype(np.int64)  # [B, T]
        p = int(start.max())  # past rows gathered: the longest sequence's; build_mask hides the others' padding
        hidden = self._run("embed", {"input_ids": x})["hidden"] if i == 0 else x
        c = self.cache
        feeds = {"hidden": np.ascontiguousarray(hidden, np.float32), "positions": positions,
                 "attn_mask": build_mask(positions, start, p, self.sliding_window),  # [B, 1, T, P + T]
                 "exit_index": np.full(b, t - 1, np.int64)}  # the exit reads each sequence's last row
        for j in self.segments[i]:
            feeds[f"past_key_{j}"] = c.keys[j][slots, :, :p]  # [B, KV, P, hd] (fancy index: a copy)
            feeds[f"past_value_{j}"] = c.values[j][slots, :, :p]
        out = self._run(f"segment_{i}", feeds)
        for j in self.segments[i]:  # present [B, KV, T, hd]: the new rows
            k, v = out[f"present_key_{j}"], out[f"present_value_{j}"]
            for r in range(b):
                c.keys[j][slots[r], :, start[r]:start[r] + t] = k[r]
                c.values[j][slots[r], :, start[r]:start[r] + t] = v[r]
        eh3 = out["exit_hidden"]  # [B, 1, D]
        eh = eh3.reshape(b, -1).astype(np.float32, copy=False)
        if i == len(self.segments) - 1:
            head = self._head_rows(eh3)
            return SegmentOut(None, eh, head.logits, head.stats, head.token)
        h = out["hidden_out"].astype(np.float32, copy=False)
        if not decide:  # nobody reads this exit's decision
            return SegmentOut(h, eh, None, None, None)
        if self.spec.candidates:  # the candidate check on the host: no LM head
            return host_candidates(self, i, SegmentOut(h, eh, None, None, None), prev, lookup, self.shortlist_rows)
        head = self._head_rows(eh3)
        return host_decision(self, i, SegmentOut(h, eh, head.logits, head.stats, head.token), prev)

    def _head(self, i, exit_hidden):
        return self._head_rows(exit_hidden[:, None, :])

    def _head_rows(self, exit_hidden: np.ndarray) -> HeadOut:
        """The shared LM head on exit hidden rows [B, 1, D]."""
        b = exit_hidden.shape[0]
        out = self._run("head", {"exit_hidden": np.ascontiguousarray(exit_hidden, np.float32)})
        return HeadOut(out["logits"].reshape(b, -1).astype(np.float32, copy=False),  # [B, V]
                       out["exit_stats"].reshape(b, 3).astype(np.float32, copy=False),  # [B, 3]
                       out["exit_token"].reshape(b).astype(np.int64, copy=False))  # [B]

    def _kvfill(self, i, hidden, slots, positions):
        out = self._run(f"kvfill_{i}", {"hidden": np.ascontiguousarray(hidden, np.float32)[:, None],  # [B, 1, D]
                                        "positions": np.asarray(positions, np.int64)[:, None]})  # [B, 1]
        for j in self.suffix_layers(i):  # present [B, KV, 1, hd]
            self.cache.keys[j][slots, :, positions] = out[f"present_key_{j}"][:, :, 0]
            self.cache.values[j][slots, :, positions] = out[f"present_value_{j}"][:, :, 0]


class OrtPortableBackend(PortableBackend):
    """``onnxruntime_portable``: the portable graphs on ONNX Runtime (the CPU reference of what TensorRT runs)."""

    name = "onnxruntime_portable"

    def __init__(self, graphs_dir: str | Path | None = None, checkpoint: str | Path | None = None,
                 threads: int = 0) -> None:
        """
        Args:
            graphs_dir: the export folder (graphs.json and the portable graphs).
            checkpoint: the checkpoint the export must come from (its graphs are then verified).
            threads: size of ONNX Runtime's process-wide pool, if this backend creates it (0: one per core).

        Raises:
            ConfigError: no graphs_dir, or a gated model.
            ArtifactError: graphs of another checkpoint, or changed files.
        """
        meta = load_meta(graphs_dir, checkpoint, self.name)
        super().__init__(portable_spec(meta, graphs_dir), OrtGraphRunner(graphs_dir, threads, meta))
        self.shortlist_rows = shortlist_rows(graphs_dir, meta)
        self.shortlist_act_scale = shortlist_act_scale(meta)
        self.ngram_table = load_ngram_table(graphs_dir)  # the exit rule's lookup may fall back to it


class TensorRTBackend(PortableBackend):
    """``tensorrt``: the TensorRT engines ``make jetson-engines`` built from the portable graphs."""

    name = "tensorrt"

    def __init__(self, graphs_dir: str | Path | None = None, engines_dir: str | Path | None = None,
                 checkpoint: str | Path | None = None) -> None:
        """
        Args:
            graphs_dir: the export folder the engines were built from (its graphs.json).
            engines_dir: the engines' folder (``<run>/jetson/engines``, with engines.json).
            checkpoint: the checkpoint the export must come from (its graphs are then verified).

        Raises:
            ConfigError: a missing argument, or a gated model.
            MissingExtraError: TensorRT is not installed here; NoCudaDeviceError: no CUDA GPU.
            ArtifactError: engines missing or built from another export (:func:`check_engines`).
        """
        from edge.runtime.trt_runner import require_tensorrt

        if engines_dir is None:
            raise ConfigError("the tensorrt backend needs engines_dir (<run>/jetson/engines: `make jetson-engines`)")
        require_tensorrt()  # before reading anything: this machine cannot run engines at all
        meta = load_meta(graphs_dir, checkpoint, self.name)
        spec = portable_spec(meta, graphs_dir)
        engines = check_engines(graphs_dir, engines_dir, meta)
        super().__init__(spec, TrtGraphRunner(engines_dir, engines))
        self.shortlist_rows = shortlist_rows(graphs_dir, meta)
        self.shortlist_act_scale = shortlist_act_scale(meta)
        self.ngram_table = load_ngram_table(graphs_dir)  # the exit rule's lookup may fall back to it
        # the profile's largest T: a longer call is outside every engine's profile (trt_runner refuses it)
        self.max_chunk = profile_max_chunk(engines, Path(engines_dir) / ENGINES_JSON)
        self.max_batch = profile_max_batch(engines, Path(engines_dir) / ENGINES_JSON)  # the same profile's largest B
