"""Exit signals: per-token features an exit rule can threshold on.

A model has exits at layers e_1 < ... < e_m (e_m is the full model). At each
exit the segment graph reduces the logits [N, V] to softmax statistics [N, 3]
and the argmax [N] (:func:`edge.model.exits.exit_decision_stats`); with the
normalised hidden state [N, D] that fed the LM head, :func:`signals_from_stats`
turns what the exits reached so far give into the float64 feature matrix
[N, F] of the deepest one, columns :data:`SIGNAL_NAMES`:

- ``top1_prob``: softmax top-1 probability (the CALM "softmax confidence",
  Schuster et al. 2022, "Confident Adaptive Language Modeling");
- ``margin``: top-1 minus top-2 probability;
- ``entropy``: softmax entropy in nats (DeeBERT, Xin et al. 2020);
- ``agree_prev``: 1.0 if this exit's argmax equals the previous exit's;
- ``agree_run``: length of the run of consecutive agreeing exits ending here,
  divided by m (patience, PABEE, Zhou et al. 2020);
- ``cos_prev``: cosine similarity of this exit's hidden state with the
  previous exit's (CALM's "hidden-state saturation").

This is the one computation of the signals: calibration collects them with
:func:`signals_all_exits` (the same function at every exit) and the exit rule
(:class:`calibration.table.TableRule`) decides on them.

A model with exit gates (:class:`edge.model.exits.ExitGate`, a small MLP per
decision exit that predicts agreement with the last layer) is decided from the
gates alone: the engine runs the LM head only for the rows that exit, so no
softmax statistic or argmax exists at decision time. Its signals are
:data:`GATED_SIGNAL_NAMES` (:func:`gated_signals`):

- ``gate_prob``: sigmoid of this exit's gate logit (CALM's learned classifier,
  Schuster et al. 2022, sec. 3.5);
- ``gate_prob_prev``: the same at the previous exit (0 at the first);
- ``cos_prev``: as above.

A model with a candidate shortlist decides each check over K rows of the LM
head (:mod:`edge.model.candidates`): its signals are
:func:`edge.model.candidates.signal_names` (nine named features and the exit hidden), computed by that module's
:func:`~edge.model.candidates.check` (:func:`candidate_signals_all_exits`), and
a decision exit's token is the best candidate, not the vocabulary's argmax.

All functions are pure: arrays in, arrays out.
"""
from __future__ import annotations

import numpy as np

from calibration.platt import sigmoid
from edge.core.errors import ConfigError
from edge.model.candidates import check, num_features, shortlist_logits

SIGNAL_NAMES: tuple[str, ...] = ("top1_prob", "margin", "entropy", "agree_prev", "agree_run", "cos_prev")
GATED_SIGNAL_NAMES: tuple[str, ...] = ("gate_prob", "gate_prob_prev", "cos_prev")


def exit_targets(argmax: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
    """Calibration target of every decision exit: 1 where its argmax equals the last exit's, else 0.

    Args:
        argmax: exit layer -> argmax [N], every exit (the last is the full model).

    Returns:
        decision exit (every exit but the last) -> int64 0/1 [N].

    Raises:
        ConfigError: empty dict or arrays of different lengths.
    """
    if not argmax:
        raise ConfigError("exit targets: no exits given (argmax dict is empty)")
    layers = sorted(argmax)
    final = np.asarray(argmax[layers[-1]])  # [N]
    out = {}
    for k in layers[:-1]:
        a = np.asarray(argmax[k])  # [N]
        if a.shape != final.shape or a.ndim != 1:
            raise ConfigError(f"exit {k}: argmax shape {a.shape} disagrees with the last exit's {final.shape}")
        out[k] = (a == final).astype(np.int64)
    return out


def _cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cosine similarity of a [N, D] and b [N, D] -> [N]; 0 where either row is zero."""
    # einsum: no [N, D] temporaries (this runs at every exit of every decode step)
    dot = np.einsum("ij,ij->i", a, b)  # [N]
    norms = np.sqrt(np.einsum("ij,ij->i", a, a) * np.einsum("ij,ij->i", b, b))  # [N]
    ok = norms > 0
    return np.where(ok, np.clip(dot / np.where(ok, norms, 1.0), -1.0, 1.0), 0.0)


def signals_from_stats(stats: dict[int, np.ndarray], tokens: dict[int, np.ndarray], hidden: dict[int, np.ndarray],
                       num_exits: int | None = None) -> np.ndarray:
    """Signals [N, F] of the deepest exit in ``tokens``, from what the segment graphs output.

    Args:
        stats: exit layer -> [N, 3] (top-1 probability, margin, entropy), as computed in the graph by
            :func:`edge.model.exits.exit_decision_stats`; only the deepest exit's row is read.
        tokens: exit layer -> argmax [N] of every exit reached so far.
        hidden: exit layer -> normalised hidden [N, D]; the deepest two are read.
        num_exits: the model's number of exits m.

    Returns:
        float64 [N, F], columns :data:`SIGNAL_NAMES`; at the first exit ``agree_prev``, ``agree_run``
        and ``cos_prev`` are 0. No validation (this runs at every exit of every decode step).
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


def gated_signals(gates: dict[int, np.ndarray], hidden: dict[int, np.ndarray]) -> np.ndarray:
    """Signals [N, 3] (:data:`GATED_SIGNAL_NAMES`) of the deepest exit in ``gates``, from the gate logits
    [N] of every exit reached so far and the normalised hidden [N, D] of the deepest two: what
    ``decide_gated`` sees in the engine. The engine's hot path: no validation."""
    layers = sorted(gates)
    k = layers[-1]
    g = sigmoid(np.asarray(gates[k], dtype=np.float64))  # [N]
    if len(layers) == 1:
        zeros = np.zeros_like(g)
        return np.stack([g, zeros, zeros], axis=1)
    j = layers[-2]
    prev = sigmoid(np.asarray(gates[j], dtype=np.float64))
    cos = _cosine(np.asarray(hidden[k], dtype=np.float64), np.asarray(hidden[j], dtype=np.float64))
    return np.stack([g, prev, cos], axis=1)


def gated_signals_all_exits(gates: dict[int, np.ndarray], hidden: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
    """:func:`gated_signals` at every decision exit in ``gates``."""
    layers = sorted(gates)
    return {k: gated_signals({j: gates[j] for j in layers[:i + 1]}, hidden) for i, k in enumerate(layers)}


def candidate_signals_all_exits(hidden: dict[int, np.ndarray], final_tokens: np.ndarray, rows: np.ndarray,
                                shortlist: np.ndarray, lookup_token: np.ndarray, lookup_len: np.ndarray,
                                act_scale: float | None = None) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray]]:
    """Signals [N, F] (:func:`edge.model.candidates.signal_names`) and token [N] at every exit of a shortlist model, as
    its checks compute them in the engine, one check after another (each reads the previous one).

    Args:
        hidden: exit layer -> normalised exit hidden [N, D], every exit (the last is the full model).
        final_tokens: the full model's argmax [N] (the last exit's token).
        rows: the LM head's rows of the shortlist [K, D].
        shortlist: their token ids [K].
        lookup_token, lookup_len: the context lookup's token and match length / MAX_N at each position [N].
        act_scale: a W8A8 head's activation scale (:func:`edge.model.candidates.shortlist_logits`).

    Returns:
        (signals, tokens): exit layer -> [N, F] and -> [N]; the last exit's signals are zeros and its token
        ``final_tokens``.
    """
    layers = sorted(hidden)
    sig, tok = {}, {}
    prev = None
    for k in layers[:-1]:
        c = check(shortlist_logits(hidden[k], rows, act_scale), shortlist, lookup_token, lookup_len,
                  None if prev is None else prev.tokens, None if prev is None else prev.logits, hidden[k])
        sig[k], tok[k], prev = c.features.astype(np.float64), c.token, c
    n = len(final_tokens)
    sig[layers[-1]], tok[layers[-1]] = np.zeros((n, num_features(rows.shape[1]))), np.asarray(final_tokens)
    return sig, tok
