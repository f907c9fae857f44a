"""llama.cpp's quality on held-out text: :func:`peer_perplexity` scores held-out windows teacher-forced
from logits at every position (:meth:`LlamaCppPeer.logits`), with the same arithmetic as ours
(:func:`next_token_scores`).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edge.core.errors import SmartExitError
from edge.pipeline.bench.llamacpp_peer import LlamaCppPeer

if TYPE_CHECKING:
    import numpy as np


# ------------------------------------------------------------------ quality on held-out text
def next_token_scores(logits: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Negative log-likelihood and top-1 hit of each next token of one window, in float64.

    Args:
        logits: [T, V] (row i predicts ids[i + 1]; the last row is unused).
        ids: [T] the window's token ids.
    Returns:
        (nll [T-1] float64, hit [T-1] bool: first argmax == next token).
    """
    import numpy as np

    z = np.asarray(logits, dtype=np.float64)[:-1]  # [T-1, V]
    nxt = np.asarray(ids, dtype=np.int64)[1:]  # [T-1]
    if z.ndim != 2 or z.shape[0] != nxt.shape[0]:
        raise SmartExitError(f"logits {np.shape(logits)} do not fit ids {np.shape(ids)}")
    m = z.max(axis=1, keepdims=True)
    log_z = (m + np.log(np.exp(z - m).sum(axis=1, keepdims=True)))[:, 0]  # [T-1] log-sum-exp
    nll = log_z - z[np.arange(nxt.size), nxt]
    return nll, z.argmax(axis=1) == nxt


@dataclass(frozen=True)
class PeerQuality:
    """Teacher-forced next-token quality over held-out windows (tokens 1..T-1 of each window)."""

    windows: int
    window_tokens: int  # T
    mean_nll: float  # nats per predicted token, over all N * (T - 1)
    perplexity: float  # exp(mean_nll)
    top1: float  # fraction of predicted tokens that are the argmax
    window_nll: tuple[float, ...]  # [N] mean NLL of each window

    @classmethod
    def from_scores(cls, nll: np.ndarray, hit: np.ndarray) -> PeerQuality:
        """From per-token ``nll`` / ``hit`` arrays [N, T-1] (:func:`next_token_scores` per window)."""
        import numpy as np

        nll, hit = np.asarray(nll, dtype=np.float64), np.asarray(hit, dtype=bool)
        if nll.ndim != 2 or nll.shape != hit.shape or nll.size == 0:
            raise SmartExitError(f"nll {nll.shape} and hit {hit.shape} must be the same non-empty [N, T-1]")
        mean = float(nll.mean())
        return cls(nll.shape[0], nll.shape[1] + 1, mean, float(np.exp(mean)), float(hit.mean()),
                   tuple(float(x) for x in nll.mean(axis=1)))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["window_nll"] = list(self.window_nll)
        return d


def peer_perplexity(peer_or_gguf: LlamaCppPeer | str | Path, windows_ids: np.ndarray,
                    threads: int = 2) -> PeerQuality:
    """llama.cpp's perplexity and top-1 accuracy on ``windows_ids``, each window scored from an
    empty cache (the tokenizer must be ours, :func:`verify_tokenizer`, for the ids to mean the same).

    Args:
        peer_or_gguf: a loaded peer, or a GGUF file (opened with ``threads`` and closed again).
        windows_ids: [N, T] int token ids (``TokenCorpus.draw(...).ids``), T >= 2.
        threads: llama.cpp threads when a file is given.
    Raises:
        SmartExitError: not a non-empty [N, T >= 2] array, or T beyond the peer's ``n_ctx``.
    """
    import numpy as np

    ids = np.asarray(windows_ids)
    if ids.ndim != 2 or ids.shape[0] < 1 or ids.shape[1] < 2 or not np.issubdtype(ids.dtype, np.integer):
        raise SmartExitError(f"windows_ids must be integer [N >= 1, T >= 2], got {ids.dtype} {ids.shape}")
    opened = isinstance(peer_or_gguf, (str, Path))
    peer = LlamaCppPeer(peer_or_gguf, threads, n_ctx=max(ids.shape[1], 2)) if opened else peer_or_gguf
    try:
        scores = [next_token_scores(peer.logits(w.tolist()), w) for w in ids]
    finally:
        if opened:
            peer.close()
    return PeerQuality.from_scores(np.stack([s[0] for s in scores]), np.stack([s[1] for s in scores]))
