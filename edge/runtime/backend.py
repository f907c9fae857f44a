"""Backends: how one segment of the model is computed. One small interface, a registry by name.

The engine speaks numpy at this boundary. A *segment* is the decoder layers between two exits
plus that exit's head; segment i ends at exit ``exit_layers[i]``. Segment 0 starts from token
ids (the embedding is part of it). A backend computes on the engine's :class:`KVCache` where it
lies: it reads each sequence's past from its slot and writes only the new rows. Public methods
validate, private ones compute.

A call holds B sequences with T new rows each, with T == 1 (a decode step; every row has its own
cache length) or B == 1 (a prompt chunk, one sequence's deferred rows, or the rows a
self-speculative verification checks): the shapes ONNX Runtime's fused attention takes, and all the
engine needs. The exit head runs on each sequence's last ``rows`` rows (1 but for verification).
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

import numpy as np

from edge.model.segments import segment_layers
from edge.runtime.cache import KVCache
from edge.model.candidates import num_features
from edge.runtime.rules import ScoreForm
from edge.core.errors import ConfigError

MAX_HIDDEN = 32  # hidden units of a shortlist model's rule MLP (ScoreForm), the graphs' input width


@dataclass(frozen=True)
class ModelSpec:
    """What the engine needs to know about a multi-exit model (from the model or from graphs.json)."""

    num_layers: int
    exit_layers: tuple[int, ...]  # 1-based, the last is num_layers
    hidden_size: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_positions: int
    sliding_window: int | None = None
    gated: bool = False  # decision exits output a gate; their LM head runs apart (Backend.head)
    # the candidate token ids of decision exits (edge/model/candidates.py); () = none: they decide from
    # their LM head's softmax (or gates)
    shortlist: tuple[int, ...] = ()

    @classmethod
    def of(cls, model) -> "ModelSpec":
        cfg = model.backbone.cfg
        return cls(cfg.num_layers, tuple(model.exit_layers), cfg.hidden_size, cfg.num_kv_heads, cfg.head_dim,
                   cfg.vocab_size, cfg.max_position_embeddings, cfg.sliding_window, model.gated,
                   tuple(int(t) for t in model.shortlist.tolist()) if model.has_shortlist else ())

    @property
    def candidates(self) -> bool:
        """Decision exits decide over the candidate shortlist, in the segment (no LM head)."""
        return bool(self.shortlist) and len(self.exit_layers) > 1

    @property
    def num_features(self) -> int:
        """Columns of a decision exit's features: calibration.signals' SIGNAL_NAMES (6), with gates
        GATED_SIGNAL_NAMES (3), with a shortlist edge.model.candidates.signal_names(hidden_size) (9 + D)."""
        return num_features(self.hidden_size) if self.candidates else (3 if self.gated else 6)

    @property
    def segments(self) -> list[list[int]]:
        """0-based decoder layers of each segment."""
        return segment_layers(self.exit_layers)


@dataclass
class HeadOut:
    """An exit's LM head on some rows."""

    logits: np.ndarray  # [B, V] exit logits
    stats: np.ndarray  # [B, 3] float32: top-1 probability, top-1 minus top-2, entropy
    token: np.ndarray  # [B] int64 argmax of the logits


@dataclass
class SegmentOut:
    """One segment's results; arrays may be the backend's own buffers, valid until its next call.
    A gated decision exit gives ``gate`` and no head (None): :meth:`Backend.head` computes it."""

    hidden: np.ndarray | None  # [B, T, D] residual after the segment (None after the last one)
    # [B, D] normalised exit hidden (LM-head input) of each sequence's last row; [B * R, D], sequence
    # major, for a call with rows=R (and likewise for logits, stats, token)
    exit_hidden: np.ndarray
    logits: np.ndarray | None  # [B, V] exit logits there
    # [B, 3] float32: top-1 probability, top-1 minus top-2, entropy (None where nobody reads them: the last exit of
    # a model with a candidate shortlist or one exit on ONNX Runtime, whose head graph has none)
    stats: np.ndarray | None
    token: np.ndarray | None  # [B] int64 argmax of the logits
    gate: np.ndarray | None = None  # [B] float32 gate logit (gated decision exits)
    # decision exits: the exit rule's features [B, F], its linear score [B] (exit where >= 0) and the
    # run of consecutive exit agreements [B] (softmax features) that the next decision exit reads
    features: np.ndarray | None = None
    score: np.ndarray | None = None
    run: np.ndarray | None = None
    # a candidate check's two best tokens [B, 2] and their logits [B, 2] (the next check reads them;
    # ``token`` is the first column)
    cand_tokens: np.ndarray | None = None
    cand_logits: np.ndarray | None = None


class Backend(abc.ABC):
    """Computes segments and K/V fills of a multi-exit model on an attached :class:`KVCache`."""

    name = "abstract"
    host_cache = True  # computes on the engine's host KV arrays (False: keeps its own cache on a device)
    # the most new rows (T) one call may take: a TensorRT engine's optimisation profile bounds it (its
    # largest prefill chunk); None: no limit (ONNX Runtime, torch). The engine clamps its prefill budget
    # to it, the host reports it in its stats, and every control policy stays within it
    max_chunk: int | None = None
    # the most sequences one call may take (a TensorRT profile's largest batch); None: no limit. An engine
    # that prefills several sequences in one call (EngineConfig.prefill_together) takes at most this many
    max_batch: int | None = None
    # batch sizes whose sequences' drafts :meth:`verify` takes in one call (mode exact above batch 1)
    verify_batches: tuple[int, ...] = ()

    @property
    def prefills_together(self) -> bool:
        """Whether :meth:`full` takes the first prompt chunks of several sequences in one call (x [B, T], B > 1
        and T > 1, every row from position 0 of a block of cache slots); the engine's
        ``EngineConfig.prefill_together`` groups chunks only then. This default chains segment calls, which
        take one row per sequence or one sequence: no."""
        return False

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        self.exit_layers = list(spec.exit_layers)
        self.num_layers = spec.num_layers
        self.vocab_size = spec.vocab_size
        self.num_kv_heads, self.head_dim = spec.num_kv_heads, spec.head_dim
        self.sliding_window = spec.sliding_window
        self.segments = spec.segments
        self.cache: KVCache | None = None
        # one-time work done inside calls so far (a graph opened on first use, a binding built for a new call
        # shape): what a measurement of steady-state cost leaves out (edge.runtime.spec_gates.SpeculationGate)
        self.setup_events = 0
        # self-speculative decoding's measured costs per draft exit (edge.runtime.spec_costs.DraftCosts):
        # a property of this backend on this machine, so every engine over it shares and refines them
        self.draft_costs: dict[int, Any] = {}
        # the exit rule's linear score per decision segment (features @ w + b); never exit by default
        f = spec.num_features
        self.rule_w = [np.zeros(f, np.float32) for _ in self.segments[:-1]]
        self.rule_b = [np.full((), -1.0, np.float32) for _ in self.segments[:-1]]
        # a shortlist model's rule: the ScoreForm MLP per decision segment, padded to MAX_HIDDEN units (the
        # padding units have zero weights: relu(0) * 0 adds nothing); never exit by default
        self.rule_mlp = [(np.zeros((f, MAX_HIDDEN), np.float32), np.zeros(MAX_HIDDEN, np.float32),
                          np.zeros((MAX_HIDDEN, 1), np.float32), np.full(1, -1.0, np.float32)) for _ in self.segments[:-1]]
        self.shortlist_ids = np.asarray(spec.shortlist, np.int64)
        # a W8A8 head's activation scale: host-side checks quantize the exit hidden with it before the product
        # (MultiExitModel.shortlist_act_scale; the export records it beside the rows)
        self.shortlist_act_scale: float | None = None

    def set_rule(self, forms: dict[int, tuple[np.ndarray, float] | ScoreForm]) -> None:
        """The exit rule per decision exit layer: a linear score (w, b), exit where features @ w + b >= 0,
        or (shortlist models) a :class:`ScoreForm`, exit where it is >= 0."""
        for i, layer in enumerate(self.exit_layers[:-1]):
            form = forms[layer]
            if self.spec.candidates:
                self._set_mlp(i, layer, form if isinstance(form, ScoreForm) else ScoreForm.linear(*form))
                continue
            if isinstance(form, ScoreForm):
                raise ConfigError(f"exit rule for layer {layer} is an MLP score; this model's decision exits take a "
                                  f"linear score (only candidate-shortlist models compute an MLP in the graph)")
            w, b = form
            w = np.asarray(w, np.float32)
            if w.shape != self.rule_w[i].shape:
                raise ConfigError(f"exit rule for layer {layer} has {w.shape[0]} weights; this model's decision "
                                  f"exits have {self.rule_w[i].shape[0]} features")
            self.rule_w[i][...] = w  # in place: bound buffers see the new values
            self.rule_b[i][()] = b

    def _set_mlp(self, i: int, layer: int, form: ScoreForm) -> None:
        w1, b1, w2, b2 = self.rule_mlp[i]
        f, h = np.asarray(form.w1).shape
        if f != w1.shape[0] or h > MAX_HIDDEN or np.asarray(form.b1).shape != (h,) or np.asarray(form.w2).shape != (h,):
            raise ConfigError(f"exit rule for layer {layer}: an MLP of {f} features and {h} hidden units; this model's "
                              f"checks have {w1.shape[0]} features and take at most {MAX_HIDDEN} hidden units")
        w1[...] = 0  # in place: bound buffers see the new values
        b1[...] = 0
        w2[...] = 0
        w1[:, :h], b1[:h], w2[:h, 0], b2[0] = form.w1, form.b1, form.w2, form.b2

    def rule_score(self, i: int) -> ScoreForm:
        """The MLP rule of shortlist decision segment i as set (padded)."""
        w1, b1, w2, b2 = self.rule_mlp[i]
        return ScoreForm(w1, b1, w2[:, 0], float(b2[0]))

    def suffix_layers(self, i: int) -> list[int]:
        """0-based layers of segments i..last (what ``kvfill(i)`` writes K/V for)."""
        return [j for seg in self.segments[i:] for j in seg]

    def attach(self, cache: KVCache) -> None:
        """Compute on ``cache`` from now on (the engine's, allocated once)."""
        if cache.num_layers != self.num_layers or cache.shape[1:] != (self.num_kv_heads, cache.capacity, self.head_dim):
            raise ConfigError(f"KV cache of shape {cache.shape} x {cache.num_layers} layers does not fit "
                              f"this model ({self.num_layers} layers, {self.num_kv_heads} KV heads, head dim "
                              f"{self.head_dim})")
        if cache.capacity > self.spec.max_positions:
            raise ConfigError(f"KV cache capacity {cache.capacity} exceeds the model's {self.spec.max_positions} "
                              f"positions")
        self.cache = cache
        self._attached()

    def segment(self, i: int, x: np.ndarray, slots: np.ndarray, start: np.ndarray,
                prev: SegmentOut | None = None, decide: bool = True, rows: int = 1, draft: bool = False,
                lookup: tuple[np.ndarray, np.ndarray] | None = None) -> SegmentOut:
        """Run segment i on new rows: token ids int64 [B, T] when i == 0, else the residual float32
        [B, T, D]; sequence b lives in cache slot ``slots[b]`` and has ``start[b]`` tokens cached, so its
        rows sit at positions start[b] .. start[b] + T - 1. Writes the rows' K/V into the cache; the
        exit head runs on each sequence's last row. ``prev``: the previous decision exit's outputs for
        these sequences (its token, run, gate and exit hidden feed this exit's features; None: zeros,
        for calls whose decision does not matter). ``decide`` False (a decision exit only): nobody reads
        this exit's decision, so its LM head need not run; the output's logits, stats, token, features
        and score are then undefined. ``rows``: the exit runs on each sequence's last ``rows`` rows
        (1 <= rows <= T), and its outputs have B * rows rows (a verification call of self-speculative
        decoding reads the last exit's prediction at every row); with rows > 1 no decision is read
        (the last segment, or ``decide`` False). ``draft``: the exit's token only proposes a draft that the
        full model verifies, so a backend may compute the head approximately (the ONNX Runtime backend
        runs the export's int8 ``draft_head``); never for the last segment. ``lookup``: the context
        lookup's (token [B] int64, match length / MAX_N [B] float32: edge.model.candidates.lookup_feature)
        of each sequence (:mod:`edge.model.lookup`), a feature of a shortlist model's checks; None: no
        match for any row."""
        b, t = x.shape[:2]
        if t != 1 and b != 1:
            raise ConfigError(f"a segment call takes one row per sequence or one sequence, got B={b}, T={t}")
        if self.max_chunk is not None and t > self.max_chunk:
            raise ConfigError(f"a call of {t} new rows exceeds the {self.name} backend's largest chunk "
                              f"{self.max_chunk} (the engine clamps its prefill budget to it)")
        if draft and i == len(self.segments) - 1:
            raise ConfigError("the last segment's head is the full model's: it never drafts")
        if not 1 <= rows <= t or (rows > 1 and decide and i < len(self.segments) - 1):
            raise ConfigError(f"rows={rows}: the exit runs on 1..T={t} rows, and on more than one only where no "
                              f"exit decision is read")
        if self.cache is None:
            raise ConfigError("no KV cache attached (Backend.attach)")
        if (i == 0) != (x.dtype == np.int64):
            raise ConfigError("segment 0 takes token ids (int64), later segments the residual (float32)")
        if i == 0 and (x.min(initial=0) < 0 or x.max(initial=0) >= self.vocab_size):
            raise ConfigError(f"token ids outside the vocabulary [0, {self.vocab_size})")
        if int(start.max()) + t > self.cache.capacity:
            raise ConfigError(f"positions up to {int(start.max()) + t} exceed the cache capacity {self.cache.capacity}")
        last = i == len(self.segments) - 1
        if self.spec.candidates and not last and lookup is None:
            lookup = (np.full(b * rows, -1, np.int64), np.zeros(b * rows, np.float32))
        return self._segment(i, x, slots, start, prev, decide or last, rows, draft, lookup)

    def decode_until_exit(self, x: np.ndarray, slots: np.ndarray, start: np.ndarray,
                          lookup: tuple[np.ndarray, np.ndarray] | None, allowed: np.ndarray) -> tuple[int, SegmentOut]:
        """A decode step's segments, one after another, until the first where some row that ``allowed``
        [B] bool lets leave has exit score >= 0, or the last segment: returns (that segment's index, its
        output). For an exit rule in the graphs (its score is ``SegmentOut.score``); the engine then goes on
        from there. Backends may run it faster than segment by segment (the ONNX Runtime backend does)."""
        prev, last = None, len(self.segments) - 1
        for i in range(len(self.segments)):
            out = self.segment(i, x, slots, start, prev, lookup=lookup)
            if i == last or bool(((out.score >= 0.0) & allowed).any()):
                return i, out
            x, prev = out.hidden, out
        raise AssertionError("unreachable")

    def full(self, x: np.ndarray, slots: np.ndarray, start: np.ndarray, rows: int = 1) -> SegmentOut:
        """Every layer, no decision exit: what the last segment outputs (logits, token of each sequence's
        last ``rows`` rows), for calls in which no row may leave early (prompt chunks, batches above the
        exit limit, requests in mode full). A backend with a graph of every layer runs it in one call;
        this default chains the segments without their decisions."""
        out = None
        for i in range(len(self.segments)):
            out = self.segment(i, x, slots, start, decide=False, rows=rows if i == len(self.segments) - 1 else 1)
            x = out.hidden
        return out

    def verify(self, x: np.ndarray, slots: np.ndarray, start: np.ndarray) -> SegmentOut:
        """Every layer for B sequences of T new rows each (x [B, T], B one of :attr:`verify_batches`, row
        t of sequence b at position ``start[b] + t`` of slot ``slots[b]``), no decision exit: the full
        model's logits and token at every row, sequence-major ([B * T]). What mode exact verifies
        several sequences' drafts with, in one call."""
        b, t = x.shape[:2]
        if b not in self.verify_batches:
            raise ConfigError(f"the {self.name} backend verifies batches of {list(self.verify_batches)} sequences, "
                              f"not {b}")
        if self.cache is None or int(start.max()) + t > self.cache.capacity:
            raise ConfigError(f"positions up to {int(start.max()) + t} exceed the cache capacity "
                              f"{None if self.cache is None else self.cache.capacity}")
        return self._verify(x, slots, start)

    def _verify(self, x, slots, start) -> SegmentOut:
        """This default calls :meth:`full` sequence by sequence (the same tokens, none of the savings): a backend
        lists a batch size in :attr:`verify_batches` only where it verifies it in one call."""
        t = x.shape[1]
        outs = [self.full(x[q:q + 1], slots[q:q + 1], start[q:q + 1], rows=t) for q in range(x.shape[0])]
        cat = lambda name: None if getattr(outs[0], name) is None else np.concatenate([getattr(o, name) for o in outs])  # noqa: E731
        return SegmentOut(None, cat("exit_hidden"), cat("logits"), cat("stats"), cat("token"))

    def head(self, i: int, exit_hidden: np.ndarray) -> HeadOut:
        """The LM head of decision exit i on normalised exit hidden rows [B, D], for decision exits that
        decide without it (gates, candidate checks)."""
        if not (self.spec.gated or self.spec.candidates) or not 0 <= i < len(self.segments) - 1:
            raise ConfigError(f"segment {i} has no separate head (decision exits with gates or candidate checks only)")
        return self._head(i, np.ascontiguousarray(exit_hidden, np.float32))

    def kvfill(self, i: int, hidden: np.ndarray, slots: np.ndarray, positions: np.ndarray) -> None:
        """Write the K/V of every layer of segments i..last for rows that exited after segment i-1:
        hidden [B, D] is the raw residual at the exit, row b goes to ``positions[b]`` of ``slots[b]``."""
        if i == 0:
            raise ConfigError("segment 0 is never skipped")
        self._kvfill(i, hidden, slots, positions)

    def _attached(self) -> None:
        """Hook: the cache was (re)attached."""

    @abc.abstractmethod
    def _segment(self, i, x, slots, start, prev, decide, rows, draft, lookup) -> SegmentOut: ...

    @abc.abstractmethod
    def _kvfill(self, i, hidden, slots, positions) -> None: ...

    def _head(self, i, exit_hidden) -> HeadOut:
        raise NotImplementedError


ENTRY_POINTS = "smartexit.backends"  # group of the package's entry points (pyproject.toml)
BUILTIN_BACKENDS = {  # the package's own, as pyproject.toml declares them: found also where its metadata is not
    # installed (a Triton bundle's copy of the package); tests/unit/test_layers.py holds the two equal
    "torch": "edge.runtime.torch_backend:TorchBackend",
    "onnxruntime": "edge.runtime.ort_backend:OrtBackend",
    "onnxruntime_portable": "edge.runtime.portable_backend:OrtPortableBackend",
    "tensorrt": "edge.runtime.portable_backend:TensorRTBackend",
    "torch_static": "edge.runtime.static_backend:StaticTorchBackend",
}


def backend_names() -> list[str]:
    """The backends installed: the package's own and those other packages declare under the
    ``smartexit.backends`` entry-point group."""
    from importlib.metadata import entry_points

    return sorted(set(BUILTIN_BACKENDS) | {ep.name for ep in entry_points(group=ENTRY_POINTS)})


def make_backend(name: str, **kwargs: Any) -> Backend:
    """The one backend factory: the backend registered as ``name``, called with ``kwargs`` (``model=`` for
    torch, ``graphs_dir=`` for an export). Its module is imported only now, so the serving path never imports
    the backends it does not use (torch for torch_static, TensorRT for tensorrt).

    Raises:
        ConfigError: no backend of that name is installed.
    """
    import importlib
    from importlib.metadata import entry_points

    if name in BUILTIN_BACKENDS:
        module, attr = BUILTIN_BACKENDS[name].split(":")
        return getattr(importlib.import_module(module), attr)(**kwargs)
    found = [ep for ep in entry_points(group=ENTRY_POINTS) if ep.name == name]
    if not found:
        raise ConfigError(f"unknown backend {name!r}; installed: {', '.join(backend_names()) or 'none'} "
                          f"(backends are the {ENTRY_POINTS!r} entry points; reinstall the package if one is missing)")
    return found[0].load()(**kwargs)
