"""Exit signals: per-token features an exit rule can threshold on.

A model has exits at layers e_1 < ... < e_m (e_m is the full model). For N
tokens each exit gives logits [N, V] and the normalised hidden state [N, D]
that fed the LM head. :func:`exit_signals` turns these into one float64
feature matrix [N, F] per exit with the columns :data:`SIGNAL_NAMES`:

- ``top1_prob``: softmax top-1 probability (the CALM "softmax confidence",
  Schuster et al. 2022, "Confident Adaptive Language Modeling");
- ``margin``: top-1 minus top-2 probability;
- ``entropy``: softmax entropy in nats (DeeBERT, Xin et al. 2020);
- ``agree_prev``: 1.0 if this exit's argmax equals the previous exit's;
- ``agree_run``: length of the run of consecutive agreeing exits ending here,
  divided by m (patience, PABEE, Zhou et al. 2020);
- ``cos_prev``: cosine similarity of this exit's hidden state with the
  previous exit's (CALM's "hidden-state saturation").

A model with exit gates (:class:`edge.model.exits.ExitGate`, a small MLP per
decision exit that predicts agreement with the last layer) is decided from the
gates alone: the engine runs the LM head only for the rows that exit, so no
softmax statistic or argmax exists at decision time. Its signals are
:data:`GATED_SIGNAL_NAMES`:

- ``gate_prob``: sigmoid of this exit's gate logit (CALM's learned classifier,
  Schuster et al. 2022, sec. 3.5);
- ``gate_prob_prev``: the same at the previous exit (0 at the first);
- ``cos_prev``: as above.

All functions are pure: arrays in, arrays out.
"""
from __future__ import annotations

import numpy as np

from edge.core.errors import ConfigError

SIGNAL_NAMES: tuple[str, ...] = ("top1_prob", "margin", "entropy", "agree_prev", "agree_run", "cos_prev")
GATED_SIGNAL_NAMES: tuple[str, ...] = ("gate_prob", "gate_prob_prev", "cos_prev")


def _checked_logits(logits: dict[int, np.ndarray]) -> tuple[list[int], dict[int, np.ndarray]]:
    """Validate a per-exit logits dict; return the sorted layers and float64 copies."""
    if not logits:
        raise ConfigError("exit signals: no exits given (logits dict is empty)")
    layers = sorted(logits)
    out: dict[int, np.ndarray] = {}
    shape = None
    for k in layers:
        z = np.asarray(logits[k], dtype=np.float64)  # [N, V]
        if z.ndim != 2:
            raise ConfigError(f"exit {k}: logits must be 2-D [N, V], got shape {z.shape}")
        if z.shape[0] == 0:
            raise ConfigError("empty split: no tokens")
        if z.shape[1] < 2:
            raise ConfigError(f"exit {k}: logits need a vocabulary of at least 2, got V={z.shape[1]}")
        if shape is not None and z.shape != shape:
            raise ConfigError(f"exit {k}: logits shape {z.shape} disagrees with exit {layers[0]}'s {shape}")
        if not np.isfinite(z).all():
            raise ConfigError(f"exit {k}: logits contain NaN or infinite values")
        shape = z.shape
        out[k] = z
    return layers, out


def argmaxes(logits: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
    """Per-exit argmax token.

    Args:
        logits: exit layer -> logits [N, V].

    Returns:
        exit layer -> int64 argmax [N] (ties go to the lowest token id, as np.argmax).

    Raises:
        ConfigError: empty dict, N == 0, shapes that disagree, NaN or infinite logits.
    """
    layers, z = _checked_logits(logits)
    return {k: np.argmax(z[k], axis=1).astype(np.int64) for k in layers}  # [N]


def exit_targets(argmax: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
    """Calibration target per exit: 1 where the exit's argmax equals the last exit's, else 0.

    Args:
        argmax: exit layer -> argmax [N] (from :func:`argmaxes`).

    Returns:
        exit layer -> int64 0/1 [N]; the last exit is all ones.

    Raises:
        ConfigError: empty dict or arrays of different lengths.
    """
    if not argmax:
        raise ConfigError("exit targets: no exits given (argmax dict is empty)")
    layers = sorted(argmax)
    final = np.asarray(argmax[layers[-1]])  # [N]
    out = {}
    for k in layers:
        a = np.asarray(argmax[k])  # [N]
        if a.shape != final.shape or a.ndim != 1:
            raise ConfigError(f"exit {k}: argmax shape {a.shape} disagrees with the last exit's {final.shape}")
        out[k] = (a == final).astype(np.int64)
    return out


def _softmax_stats(z: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Logits [N, V] -> (top1 [N], margin [N], entropy [N]) of the softmax, computed stably.

    One exp pass in float32 (this is the engine's per-exit hot path): with m the max logit,
    e = exp(z - m) and S = sum(e): top1 = 1/S, top2 = exp(z2 - m)/S for the second-largest
    logit z2, entropy = log S - sum(e * (z - m)) / S. Results are float64.
    """
    z = np.asarray(z, dtype=np.float32)
    rows = np.arange(z.shape[0])
    first = z.argmax(axis=1)  # [N]
    zmax = z[rows, first][:, None]  # [N, 1]
    d = z - zmax  # [N, V], <= 0: exp cannot overflow
    e = np.exp(d)  # [N, V]
    total = e.sum(axis=1, dtype=np.float64)  # [N], >= 1
    d[rows, first] = -np.inf
    second = np.exp(d.max(axis=1).astype(np.float64))  # [N]: exp(z2 - m)
    d[rows, first] = 0.0
    top1 = 1.0 / total
    margin = (1.0 - second) / total
    entropy = np.log(total) - (e * d).sum(axis=1, dtype=np.float64) / total
    # rounding can put entropy a few ulps outside its mathematical range [0, log V]
    entropy = np.clip(entropy, 0.0, np.log(z.shape[1]))
    return top1, margin, entropy


def _cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cosine similarity of a [N, D] and b [N, D] -> [N]; 0 where either row is zero."""
    # einsum: no [N, D] temporaries (this runs at every exit of every decode step)
    dot = np.einsum("ij,ij->i", a, b)  # [N]
    norms = np.sqrt(np.einsum("ij,ij->i", a, a) * np.einsum("ij,ij->i", b, b))  # [N]
    ok = norms > 0
    return np.where(ok, np.clip(dot / np.where(ok, norms, 1.0), -1.0, 1.0), 0.0)


def exit_signals(logits: dict[int, np.ndarray], hidden: dict[int, np.ndarray],
                 num_exits: int | None = None) -> dict[int, np.ndarray]:
    """Feature matrix per exit, columns in the order of :data:`SIGNAL_NAMES`.

    Args:
        logits: exit layer -> logits [N, V]; same N and V at every exit.
        hidden: exit layer -> normalised hidden state [N, D] that fed the LM head;
            same keys as ``logits``, same N and D at every exit.
        num_exits: the model's number of exits m (normalises ``agree_run``);
            default ``len(logits)``. A runtime that has only seen the first
            exits of a token passes the full m so its features match.

    Returns:
        exit layer -> float64 [N, F] with F = len(SIGNAL_NAMES). At the first
        exit ``agree_prev``, ``agree_run`` and ``cos_prev`` are 0.0.

    Raises:
        ConfigError: empty dicts, N == 0, keys or shapes that disagree, NaN or
            infinite values.
    """
    layers, z = _checked_logits(logits)
    if sorted(hidden) != layers:
        raise ConfigError(f"exit signals: hidden exits {sorted(hidden)} differ from logits exits {layers}")
    n = z[layers[0]].shape[0]
    h: dict[int, np.ndarray] = {}
    for k in layers:
        hk = np.asarray(hidden[k], dtype=np.float64)  # [N, D]
        if hk.ndim != 2 or hk.shape[0] != n:
            raise ConfigError(f"exit {k}: hidden must be [N={n}, D], got shape {hk.shape}")
        if h and hk.shape != h[layers[0]].shape:
            raise ConfigError(f"exit {k}: hidden shape {hk.shape} disagrees with exit {layers[0]}'s "
                              f"{h[layers[0]].shape}")
        if not np.isfinite(hk).all():
            raise ConfigError(f"exit {k}: hidden states contain NaN or infinite values")
        h[k] = hk

    m = num_exits or len(layers)
    out: dict[int, np.ndarray] = {}
    prev_arg = None  # [N]
    run = np.zeros(n)  # [N], agreeing pairs in the run ending at the current exit
    for i, k in enumerate(layers):
        top1, margin, entropy = _softmax_stats(z[k])
        arg = np.argmax(z[k], axis=1)  # [N]
        if prev_arg is None:
            agree = np.zeros(n)
            cos = np.zeros(n)
        else:
            agree = (arg == prev_arg).astype(np.float64)
            cos = _cosine(h[k], h[layers[i - 1]])
        run = np.where(agree > 0, run + 1.0, 0.0)
        out[k] = np.stack([top1, margin, entropy, agree, run / m, cos], axis=1)  # [N, F]
        prev_arg = arg
    return out


def last_exit_signals(logits: dict[int, np.ndarray], hidden: dict[int, np.ndarray],
                      num_exits: int | None = None) -> np.ndarray:
    """Signals [N, F] of the deepest exit in ``logits`` only: what a runtime needs at that exit.

    Same values as ``exit_signals(logits, hidden, num_exits)[max(logits)]``, but the softmax is
    computed for the deepest exit alone (earlier exits contribute only their argmax and hidden).
    Inputs are not re-validated: this is the engine's hot path.
    """
    layers = sorted(logits)
    k = layers[-1]
    stats = {k: np.stack(_softmax_stats(logits[k]), axis=1)}  # [N, 3]
    tokens = {j: np.argmax(logits[j], axis=1) for j in layers}  # [N] per exit
    return signals_from_stats(stats, tokens, hidden, num_exits)


def signals_from_stats(stats: dict[int, np.ndarray], tokens: dict[int, np.ndarray], hidden: dict[int, np.ndarray],
                       num_exits: int | None = None) -> np.ndarray:
    """Signals [N, F] of the deepest exit from what the segment graphs output, not from logits.

    Args:
        stats: exit layer -> [N, 3] (top-1 probability, margin, entropy), as computed in the graph by
            :func:`edge.model.exits.exit_decision_stats`; only the deepest exit's row is read.
        tokens: exit layer -> argmax [N] of every exit reached so far.
        hidden: exit layer -> normalised hidden [N, D]; the deepest two are read.
        num_exits: the model's number of exits m.

    Returns:
        The same columns as :func:`last_exit_signals` (equal up to float32 rounding of the softmax
        statistics, which the graph computes in float32). The engine's hot path: no validation.
    """
    layers = sorted(tokens)
    k = layers[-1]
    s = np.asarray(stats[k], dtype=np.float64)  # [N, 3]
    n = s.shape[0]
    m = num_exits or len(layers)
    if len(layers) == 1:
        zeros = np.zeros((n, 3))
        return np.concatenate([s, zeros], axis=1)
    run = np.zeros(n)
    for a, b in zip(layers[:-1], layers[1:]):
        run = np.where(tokens[a] == tokens[b], run + 1.0, 0.0)
    agree = (tokens[k] == tokens[layers[-2]]).astype(np.float64)
    cos = _cosine(np.asarray(hidden[k], dtype=np.float64), np.asarray(hidden[layers[-2]], dtype=np.float64))
    return np.concatenate([s, np.stack([agree, run / m, cos], axis=1)], axis=1)  # [N, F]


def signals_all_exits(stats: dict[int, np.ndarray], tokens: dict[int, np.ndarray],
                      hidden: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
    """Signals [N, F] at every exit, each as :func:`signals_from_stats` computes it at run time
    with the exits up to it (stats [N, 3], tokens [N], hidden [N, D] per exit)."""
    layers = sorted(tokens)
    out = {}
    for i, k in enumerate(layers):
        upto = layers[:i + 1]
        out[k] = signals_from_stats({k: stats[k]}, {j: tokens[j] for j in upto},
                                    {j: hidden[j] for j in upto[-2:]}, num_exits=len(layers))
    return out


def _sigmoid(z: np.ndarray) -> np.ndarray:
    e = np.exp(-np.abs(z))
    return np.where(z >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def gated_signals(gates: dict[int, np.ndarray], hidden: dict[int, np.ndarray]) -> np.ndarray:
    """Signals [N, 3] (:data:`GATED_SIGNAL_NAMES`) of the deepest exit in ``gates``, from the gate logits
    [N] of every exit reached so far and the normalised hidden [N, D] of the deepest two: what
    ``decide_gated`` sees in the engine. The engine's hot path: no validation."""
    layers = sorted(gates)
    k = layers[-1]
    g = _sigmoid(np.asarray(gates[k], dtype=np.float64))  # [N]
    if len(layers) == 1:
        zeros = np.zeros_like(g)
        return np.stack([g, zeros, zeros], axis=1)
    j = layers[-2]
    prev = _sigmoid(np.asarray(gates[j], dtype=np.float64))
    cos = _cosine(np.asarray(hidden[k], dtype=np.float64), np.asarray(hidden[j], dtype=np.float64))
    return np.stack([g, prev, cos], axis=1)


def gated_signals_all_exits(gates: dict[int, np.ndarray], hidden: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
    """:func:`gated_signals` at every decision exit in ``gates``."""
    layers = sorted(gates)
    return {k: gated_signals({j: gates[j] for j in layers[:i + 1]}, hidden) for i, k in enumerate(layers)}
