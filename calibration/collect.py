"""Run a multi-exit model over text and collect exit signals (teacher-forced).

:func:`collect_units` reads a batch of equal-length sequences (one per unit:
a prompt and its continuation, generated or natural) at full depth and keeps,
for every continuation position and exit, the exit signals, the exit's argmax
and the next token of the sequence, tagged with the unit it belongs to (a token
stream is read the same way, cut into rows by
:func:`edge.model.windows.stream_windows`, with ``first=0``). Logits are reduced
to signals batch by batch, so memory stays at one batch's [B, T, V] per exit.

Only :func:`collect_units` runs a model: it imports torch (through
:mod:`edge.model.windows`) when called, so the rest of calibration, which reads
:class:`Collected`, stays torch-free. :func:`collect_engine` reads the same data
from an engine backend (numpy only): the served kernels, in decode, at full depth.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from calibration.signals import (GATED_SIGNAL_NAMES, candidate_signals_all_exits, gated_signals_all_exits,
                                 signals_all_exits)
from edge.core.errors import ConfigError

if TYPE_CHECKING:
    from edge.model.exits import MultiExitModel
    from edge.runtime.backend import Backend


@dataclass
class Collected:
    """Per-token data of one split; every array has N rows."""

    exit_layers: list[int]
    signals: dict[int, np.ndarray]  # exit -> [N, F]
    argmax: dict[int, np.ndarray]  # exit -> [N]
    next_token: np.ndarray  # [N]
    unit: np.ndarray | None = None  # [N] the unit (prompt) of each token, 0..n_units-1
    n_units: int = 0

    @property
    def n(self) -> int:
        return int(self.next_token.shape[0])

    @property
    def final(self) -> int:
        return self.exit_layers[-1]

    @classmethod
    def concat(cls, parts: list["Collected"]) -> "Collected":
        """Unit-tagged collections one after the other; units renumbered consecutively."""
        offsets = np.cumsum([0] + [p.n_units for p in parts[:-1]])
        return cls(parts[0].exit_layers, {k: np.concatenate([p.signals[k] for p in parts]) for k in parts[0].signals},
                   {k: np.concatenate([p.argmax[k] for p in parts]) for k in parts[0].argmax},
                   np.concatenate([p.next_token for p in parts]),
                   np.concatenate([p.unit + o for p, o in zip(parts, offsets)]), int(sum(p.n_units for p in parts)))

    def select_units(self, units: np.ndarray) -> "Collected":
        """The tokens of ``units`` (ids into this collection), renumbered 0..len(units)-1 in that order."""
        units = np.asarray(units, dtype=np.int64)
        remap = np.full(self.n_units, -1, np.int64)
        remap[units] = np.arange(units.size)
        keep = remap[self.unit] >= 0
        order = np.argsort(remap[self.unit][keep], kind="stable")
        idx = np.flatnonzero(keep)[order]
        return Collected(self.exit_layers, {k: v[idx] for k, v in self.signals.items()},
                         {k: v[idx] for k, v in self.argmax.items()}, self.next_token[idx],
                         remap[self.unit][idx], int(units.size))


def collect_units(model: MultiExitModel, seqs: np.ndarray, first: int, batch: int = 32, table=None) -> Collected:
    """Teacher-forced signals of the continuation of every sequence: unit u is row u of ``seqs``.

    The signals are computed as the engine computes them: softmax statistics in float32 by
    :func:`edge.model.exits.exit_decision_stats` (what the segment graphs output), then
    :func:`calibration.signals.signals_all_exits`, so a calibrator is fitted on exactly the
    features :class:`calibration.table.TableRule` sees at run time. A model with exit gates gets
    :data:`calibration.signals.GATED_SIGNAL_NAMES` instead (what the engine decides from there).

    Args:
        model: the multi-exit model.
        seqs: int token ids [U, L], one unit per row (prompt + continuation).
        first: the first position judged; positions first..L-2 are kept, each predicting the next
            token of its row (L - 1 - first tokens per unit).
        batch: rows per forward pass.
        table: the corpus n-gram table the context lookup falls back to (the rule's; None: none).

    Returns:
        :class:`Collected` with ``unit`` set; tokens are in row order, positions ascending.

    Raises:
        ConfigError: no rows, or nothing to judge (first >= L - 1).
    """
    from edge.model.windows import read_exits  # torch, only where a model runs

    seqs = _units(seqs, first, 0, "collect_units")
    u, length = seqs.shape
    layers = model.exit_layers
    sig: dict[int, list[np.ndarray]] = {k: [] for k in layers}
    arg: dict[int, list[np.ndarray]] = {k: [] for k in layers}
    lookups = lookups_along(seqs, first, table) if model.has_shortlist else None
    rows = model.shortlist_rows().numpy() if model.has_shortlist else None
    for n, r in enumerate(read_exits(model, seqs, first, batch)):
        if lookups is not None:  # the checks over the shortlist, as the engine runs them
            lt, ll = (a[n * batch:(n + 1) * batch].reshape(-1) for a in lookups)
            s, tokens = candidate_signals_all_exits(r.hidden, r.tokens[layers[-1]], rows, model.shortlist.numpy(), lt, ll,
                                                    model.shortlist_act_scale())
        else:
            s, tokens = _signals(layers, model.gated, r.stats, r.tokens, r.hidden, r.gates), r.tokens
        for k in layers:
            sig[k].append(s[k])
            arg[k].append(tokens[k])
    per = length - 1 - first
    return Collected(layers, {k: np.concatenate(v) for k, v in sig.items()},
                     {k: np.concatenate(v) for k, v in arg.items()}, seqs[:, first + 1:].reshape(-1),
                     np.repeat(np.arange(u), per), u)


def lookups_along(seqs: np.ndarray, first: int, table=None) -> tuple[np.ndarray, np.ndarray]:
    """The context lookup's token and ``lookup_len`` feature (match length / MAX_N) [U, L - 1 - first] at
    every judged position of every row (:func:`edge.model.lookup.lookup_along`: what the engine's lookup
    gives after feeding those tokens; ``table``: the corpus table it falls back to, or None)."""
    from edge.model.candidates import lookup_feature
    from edge.model.lookup import lookup_along

    parts = [lookup_along(row, first, seqs.shape[1] - 1, table) for row in seqs]
    return np.stack([p[0] for p in parts]), lookup_feature(np.stack([p[1] for p in parts]))


def _units(seqs: np.ndarray, first: int, lowest: int, who: str) -> np.ndarray:
    """``seqs`` as int64 [U >= 1, L], with ``lowest <= first < L - 1``; a clear error otherwise."""
    seqs = np.asarray(seqs, dtype=np.int64)
    if seqs.ndim != 2 or seqs.shape[0] == 0:
        raise ConfigError(f"{who}: expected token ids [U >= 1, L], got shape {seqs.shape}")
    if not lowest <= first < seqs.shape[1] - 1:
        raise ConfigError(f"{who}: first judged position {first} must be in [{lowest}, {seqs.shape[1] - 1})")
    return seqs


def _signals(layers: list[int], gated: bool, stats: dict[int, np.ndarray], tokens: dict[int, np.ndarray],
             hidden: dict[int, np.ndarray], gates: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
    """Signals [N, F] at every exit, as the engine decides from them."""
    if gated:  # what the engine decides from: gates (the last layer is never a decision point)
        s = gated_signals_all_exits(gates, hidden)
        s[layers[-1]] = np.zeros((len(tokens[layers[-1]]), len(GATED_SIGNAL_NAMES)))
        return s
    return signals_all_exits(stats, tokens, hidden)


def collect_engine(backend: Backend, seqs: np.ndarray, first: int, batch: int = 128,
                   slots: np.ndarray | None = None, table=None) -> Collected:
    """:func:`collect_units` read from an engine backend instead of the torch model: each row's first
    ``first`` tokens are prefilled (full-depth calls of many rows, as calibration's engine prefills prompts together:
    :attr:`edge.runtime.engine_config.EngineConfig.prefill_together`), then
    the rest of the row is fed one token per decode step, every segment run, every exit read. This is the
    served engine itself at full depth on the same prefixes, in the kernels a decode step uses: the
    reference a quantized engine's tokens are judged against, where the torch model's fake
    quantization and the runtime's integer kernels may round an activation to adjacent codes.

    Args:
        backend: the engine's backend (its cache is replaced: attach yours again afterwards).
        seqs: int token ids [U, L], one unit per row.
        first: positions first..L-2 are judged (first >= 1: the prompt is prefilled).
        batch: rows per decode batch.
        slots: the backend's attached cache already holds row u's first ``first`` tokens, at full depth,
            in slot ``slots[u]``: the engine that generated the rows prefilled them there (a prefill is
            always full depth), so they are not run again and row u decodes in that slot. Positions from
            ``first`` on are written by this reading before any later position attends to them, so what
            the engine left there (its continuation's K/V, approximate in propagate mode) is never read.
            None: a cache of its own, every prompt prefilled.
        table: the corpus n-gram table the context lookup falls back to (the rule's; None: none).

    Returns:
        :class:`Collected` with ``unit`` set; tokens are in row order, positions ascending.

    Raises:
        ConfigError: no rows, nothing to judge, or no prompt (first < 1); with ``slots``, not one distinct
            slot of the attached cache per row, or a cache too short for the rows.
    """
    seqs = _units(seqs, first, 1, "collect_engine")
    u, length = seqs.shape
    if slots is not None:
        slots, cache = np.asarray(slots, dtype=np.int64), backend.cache
        shape = None if cache is None else (cache.slots, cache.capacity)
        if (cache is None or slots.shape != (u,) or np.unique(slots).size != u or slots.min() < 0
                or slots.max() >= cache.slots or cache.capacity < length):
            raise ConfigError(f"collect_engine: prefilled rows need one distinct slot each of the backend's cache "
                              f"and {length} positions; got slots of shape {slots.shape} for {u} rows, cache "
                              f"(slots, positions) {shape}")
    return _read_engine(backend, seqs, first, batch, slots, generate=False, table=table)


def generate_engine(backend: Backend, prompts: np.ndarray, new_tokens: int, batch: int = 128, table=None
                    ) -> tuple[np.ndarray, Collected]:
    """Greedy full-depth continuations that read themselves: each prompt prefilled in one full-depth call
    (as the engine prefills), its first token from that call, then every later token from the decode step
    that reads every exit, exactly as :func:`collect_engine` reads a given continuation. The same data as a
    full-depth engine run followed by :func:`collect_engine` on its tokens, in one pass (calibration's fit
    units: half the work), with the segment graphs' own full depth as the generator.

    Args:
        backend: the engine's backend (its cache is replaced).
        prompts: int token ids [U, P], P >= 1.
        new_tokens: T >= 2 tokens per prompt (the first, from the prefill, is not judged).
        batch: rows per decode batch.
        table: the corpus n-gram table the context lookup falls back to (the rule's; None: none).

    Returns:
        (prompt + continuation [U, P + T], :class:`Collected` over the judged tokens as :func:`collect_engine`).

    Raises:
        ConfigError: no prompts, an empty prompt, or fewer than 2 new tokens.
    """
    prompts = np.asarray(prompts, dtype=np.int64)
    if prompts.ndim != 2 or prompts.shape[0] == 0 or prompts.shape[1] == 0:
        raise ConfigError(f"generate_engine: expected prompts [U >= 1, P >= 1], got shape {prompts.shape}")
    if new_tokens < 2:
        raise ConfigError(f"generate_engine: at least 2 new tokens are needed (the first is not judged), "
                          f"got {new_tokens}")
    seqs = np.concatenate([prompts, np.zeros((prompts.shape[0], new_tokens), np.int64)], axis=1)
    return seqs, _read_engine(backend, seqs, prompts.shape[1], batch, None, generate=True, table=table)


def _read_engine(backend: Backend, seqs: np.ndarray, first: int, batch: int, prefilled: np.ndarray | None,
                 generate: bool, table=None) -> Collected:
    """:func:`collect_engine`'s reading; with ``generate``, ``seqs`` from ``first`` on is written as it is
    read (the first token from the prompt's full-depth call, each later one the last exit's argmax)."""
    from edge.runtime.cache import KVCache
    from edge.model.candidates import lookup_feature
    from edge.model.lookup import Lookup

    u, length = seqs.shape
    layers, nseg, gated = backend.exit_layers, len(backend.segments), backend.spec.gated
    cand = backend.spec.candidates
    sig: dict[int, list[np.ndarray]] = {k: [] for k in layers}
    arg: dict[int, list[np.ndarray]] = {k: [] for k in layers}
    lookups = lookups_along(seqs, first, table) if cand and not generate else None
    for a in range(0, u, batch):
        rows = seqs[a:a + batch]  # a view: generation writes into seqs
        b = rows.shape[0]
        if prefilled is not None:
            slots = prefilled[a:a + b]
        else:
            backend.attach(KVCache(backend.num_layers, backend.num_kv_heads, backend.head_dim, b, length,
                                   allocate=backend.host_cache))
            most = (backend.max_batch or b) if backend.prefills_together else 1
            for r0 in range(0, b, most):  # the prompts as the engine prefills them together: full-depth calls
                r1 = min(b, r0 + most)
                out = backend.full(rows[r0:r1, :first], np.arange(r0, r1), np.zeros(r1 - r0, np.int64))
                if generate:  # the first tokens, from that call's logits
                    rows[r0:r1, first] = np.argmax(out.logits.reshape(r1 - r0, -1), axis=-1)
            slots = np.arange(b)
        index = [Lookup(row[:first + 1].tolist(), table) for row in rows] if cand and generate else None
        steps: list[dict[int, np.ndarray]] = []  # per position: exit -> signals [b, F]
        tokens: list[dict[int, np.ndarray]] = []
        for pos in range(first, length - 1):
            x, prev = rows[:, pos:pos + 1], None
            st, tk, hd, gt, ft = {}, {}, {}, {}, {}
            lk = None
            if index is not None:  # what the engine's lookup predicts after the tokens up to pos
                pred = [ix.predict() for ix in index]
                lk = (np.array([p[0] for p in pred], np.int64), lookup_feature(np.array([p[1] for p in pred])))
            elif lookups is not None:
                lk = (lookups[0][a:a + b, pos - first], lookups[1][a:a + b, pos - first])
            for i, k in enumerate(layers):
                out = backend.segment(i, x, slots, np.full(b, pos, np.int64), prev, decide=True, lookup=lk)
                hd[k] = out.exit_hidden.copy()  # [b, D]; the backend's buffers are reused by the next call
                if out.gate is not None:  # a gated decision exit: the head runs apart
                    gt[k] = out.gate.copy()
                    tk[k] = backend.head(i, hd[k]).token.copy()
                elif cand and i < nseg - 1:  # a candidate check: its features as the engine computed them
                    ft[k], tk[k] = out.features.astype(np.float64), out.token.copy()
                else:  # softmax exits; and a candidate model's last exit, whose head may compute no statistics
                    st[k] = None if out.stats is None else out.stats.copy()
                    tk[k] = out.token.copy()
                x, prev = out.hidden, out
            if generate:  # the full model's greedy token is the next one fed
                rows[:, pos + 1] = tk[layers[-1]]
                if index is not None:
                    for ix, t in zip(index, rows[:, pos + 1]):
                        ix.push(int(t))
            if cand:
                ft[layers[-1]] = np.zeros((b, backend.spec.num_features))
                steps.append(ft)
            else:
                steps.append(_signals(layers, gated, st, tk, hd, gt))
            tokens.append(tk)
        for k in layers:  # [T, b, ...] -> unit-major rows
            sig[k].append(np.stack([s[k] for s in steps], axis=1).reshape(b * len(steps), -1))
            arg[k].append(np.stack([t[k] for t in tokens], axis=1).reshape(-1))
    per = length - 1 - first
    return Collected(layers, {k: np.concatenate(v) for k, v in sig.items()},
                     {k: np.concatenate(v) for k, v in arg.items()}, seqs[:, first + 1:].reshape(-1),
                     np.repeat(np.arange(u), per), u)
