"""Reference inputs and outputs of every portable graph, recorded with ONNX Runtime at push time.

One decode case per graph, run the way the engine chains them: a batch of ``batch`` sequences that
already hold ``past`` tokens (their K/V from a prefill through the same graphs) takes ``new`` tokens.
Inputs are saved as raw little-endian C-order files (what trtexec ``--loadInputs`` reads) and outputs
as ``.npy``; ``parity_inputs.json`` says which is which, with shapes and dtypes, and binds them to the
export's sha256. The case stays inside every engine's optimisation profile (batch <= max_batch,
past + new <= max_past) and avoids empty tensors (past > 0), which trtexec cannot load from a file.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from edge.core.artifacts import atomic_dir, atomic_write_json, sha256_path
from edge.core.errors import ArtifactError
from edge.runtime.backend_host import build_mask
from edge.runtime.graphs import load_graphs_json

PARITY_DIR = Path("jetson") / "parity"
PARITY_JSON = "parity_inputs.json"
PARITY_FORMAT = 1


def _session(ort, path: Path):
    """On the process-wide thread pool (edge.runtime.ortsession): a process whose first session
    created that pool refuses sessions with threads of their own."""
    from edge.runtime.ortsession import session_options

    opts = session_options(ort)
    opts.log_severity_level = 3
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def _layers(name: str, meta: dict[str, Any]) -> int:
    """Decoder layers a graph runs (segments: its own; kvfill: K/V of one layer each; embed / head: 0 / 1)."""
    if name.startswith("segment_"):
        return len(meta["segments"][int(name.split("_")[1])]["layers"])
    return 1 if name.startswith(("kvfill_", "head")) else 0


def _feeds(name: str, inputs: list[str], chain: dict[str, np.ndarray], past: dict[str, np.ndarray],
           positions: np.ndarray, mask: np.ndarray, exit_index: np.ndarray,
           model: dict[str, Any]) -> dict[str, np.ndarray]:
    empty = np.zeros((positions.shape[0], model["num_kv_heads"], 0, model["head_dim"]), np.float32)  # no past yet
    feeds = {}
    for inp in inputs:
        if inp in ("input_ids", "hidden", "exit_hidden"):
            feeds[inp] = chain[inp]
        elif inp == "positions":
            feeds[inp] = positions
        elif inp == "attn_mask":
            feeds[inp] = mask
        elif inp == "exit_index":
            feeds[inp] = exit_index
        elif inp.startswith(("past_key_", "past_value_")):
            feeds[inp] = past.get(inp.replace("past_", "present_", 1), empty)
        else:
            raise ArtifactError(f"graph {name!r} has an input {inp!r} the parity recorder does not know")
    return feeds


def run_chain(meta: dict[str, Any], ids: np.ndarray, start: int, exit_index: np.ndarray,
              past: dict[str, np.ndarray], sessions: dict[str, Any]) -> tuple[dict, dict]:
    """Run embed -> segments (and each kvfill and the head on the chain's values) for ``ids`` [B, T] at
    positions start..start+T-1 over ``past`` (present_key_j / present_value_j [B, KV, start, hd]).

    Returns:
        ({graph: feeds}, {graph: outputs}) in graphs.json order.
    """
    b, t = ids.shape
    positions = np.broadcast_to(np.arange(start, start + t), (b, t)).astype(np.int64).copy()  # [B, T]
    mask = build_mask(positions, np.full(b, start), start, meta["model"].get("sliding_window"))  # [B,1,T,P+T]
    chain: dict[str, np.ndarray] = {"input_ids": ids.astype(np.int64)}
    feeds_all, outs_all = {}, {}
    order = list(meta["graphs"])
    run_first = ["embed"] + [n for n in order if n.startswith("segment_")]
    for name in run_first + [n for n in order if n not in run_first]:
        g = meta["graphs"][name]
        if name.startswith("kvfill_"):  # fills the layers after exit i-1 from that exit's hidden state
            i = int(name.split("_")[1])
            chain_in = {**chain, "hidden": outs_all[f"segment_{i - 1}"]["hidden_out"]}
        elif name == "head":
            chain_in = {**chain, "exit_hidden": outs_all["segment_0"]["exit_hidden"]}
        else:
            chain_in = chain
        feeds = _feeds(name, g["inputs"], chain_in, past, positions, mask, exit_index, meta["model"])
        sess = sessions[name]
        values = sess.run(None, feeds)
        outs = {o.name: v for o, v in zip(sess.get_outputs(), values)}
        feeds_all[name], outs_all[name] = feeds, outs
        if name == "embed" or name.startswith("segment_"):
            chain = {**chain, "hidden": outs.get("hidden", outs.get("hidden_out"))}
    return feeds_all, outs_all


def record_parity(graphs_dir: str | Path, out_dir: str | Path, batch: int = 2, past: int = 5, new: int = 3,
                  seed: int = 0) -> dict[str, Any]:
    """Record every portable graph's inputs and ONNX Runtime outputs into ``out_dir`` (replaced whole).

    Returns:
        The ``parity_inputs.json`` written.

    Raises:
        ArtifactError: not an export folder, or a graph with an input this recorder does not know.
    """
    graphs_dir, out_dir = Path(graphs_dir), Path(out_dir)
    meta = load_graphs_json(graphs_dir)
    import onnxruntime as ort  # a core dependency, imported where used (it is heavy)

    sessions = {n: _session(ort, graphs_dir / g["file"]) for n, g in meta["graphs"].items()}
    model = meta["model"]
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, model["vocab_size"], (batch, past + new))  # [B, P + T]
    # prefill (not recorded): the K/V of the first ``past`` tokens, through the same graphs
    _, pre = run_chain(meta, ids[:, :past], 0, np.full(batch, past - 1, np.int64), {}, sessions)
    kv = {k: v for n, o in pre.items() if n.startswith("segment_") for k, v in o.items() if k.startswith("present_")}
    exit_index = (np.arange(batch) % new)[::-1].astype(np.int64).copy()  # varied rows: [new-1, ...]
    feeds, outs = run_chain(meta, ids[:, past:], past, exit_index, kv, sessions)
    info: dict[str, Any] = {"format": PARITY_FORMAT, "graphs_sha256": sha256_path(graphs_dir),
                            "checkpoint_sha256": meta.get("checkpoint_sha256"),
                            "case": {"batch": batch, "past": past, "new": new, "seed": seed},
                            "reduction": model["hidden_size"], "graphs": {}}
    with atomic_dir(out_dir) as tmp:
        for name in meta["graphs"]:
            d = tmp / name
            d.mkdir()
            entry = {"layers": _layers(name, meta), "inputs": {}, "outputs": {}}
            for k, v in feeds[name].items():
                arr = np.ascontiguousarray(v)
                (d / f"{k}.bin").write_bytes(arr.astype(arr.dtype.newbyteorder("<")).tobytes())
                entry["inputs"][k] = {"file": f"{name}/{k}.bin", "shape": list(arr.shape), "dtype": arr.dtype.name}
            for k, v in outs[name].items():
                np.save(d / f"{k}.npy", v)
                entry["outputs"][k] = {"file": f"{name}/{k}.npy", "shape": list(v.shape), "dtype": v.dtype.name}
            info["graphs"][name] = entry
        atomic_write_json(tmp / PARITY_JSON, info)
    return info


def load_recorded(parity_dir: str | Path) -> dict[str, Any]:
    """``parity_inputs.json`` of a recording.

    Raises:
        ArtifactError: missing or malformed (re-run ``make jetson-push``).
    """
    path = Path(parity_dir) / PARITY_JSON
    try:
        info = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ArtifactError(f"{path}: no parity recording ({exc}); re-run `make jetson-push`, which records "
                            f"ONNX Runtime's outputs on the development machine") from exc
    if info.get("format") != PARITY_FORMAT:
        raise ArtifactError(f"{path}: format {info.get('format')!r} is not {PARITY_FORMAT}; re-run `make jetson-push`")
    return info
