"""The mlp kind's learned score: a one-hidden-layer ReLU network on the standardised signals (SpecEE's
per-layer predictor, Xu et al., ISCA 2025, smaller), its size and weight decay, its fit, its score, and the
same score on the raw signals as the graphs compute it (:class:`calibration.calibrators.Calibrator`)."""
from __future__ import annotations

import contextlib
import multiprocessing
import os
from concurrent.futures import Executor, ProcessPoolExecutor
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

from edge.runtime.rules import ScoreForm

MLP_HIDDEN = 16  # hidden units of the mlp kind (edge.runtime.backend.MAX_HIDDEN bounds what a graph takes)
# L2 weight decay of the mlp kind. A few named signals fit with almost none; a candidate check's features carry
# the exit hidden state (9 + D columns, edge.model.candidates), which on ~25k fit tokens overfits without it:
# layers skipped at 0.6% held-out false exits, shipped model, exits 1/2/4: 0.209 / 0.214 / 0.192 / 0.142 with
# alpha 0.3 / 1 / 3 / 10 (docs/runtime.md)
MLP_ALPHA, MLP_ALPHA_WIDE, MLP_WIDE = 1e-4, 1.0, 32


MlpParams = tuple[np.ndarray, np.ndarray, np.ndarray, float]  # (w1 [F, H], b1 [H], w2 [H], b2)
MlpJob = tuple[np.ndarray, np.ndarray, int]  # (standardised signals z [N, F], 0/1 targets y [N], seed)


def fit_mlp(z: np.ndarray, y: np.ndarray, seed: int) -> MlpParams:
    """(w1 [F, H], b1 [H], w2 [H], b2) of the network fitted with the log-loss on standardised signals
    z [N, F] and 0/1 targets y [N]; the wide weight decay above :data:`MLP_WIDE` columns.

    BLAS runs on one thread: the network's matrices are small ([200, F] by [F, 16] per minibatch), so a second
    thread costs more than it gives (a 30,000 x 137 fit: 2.6 s on one thread, 3.2 s on two, 2-core Intel VM), and
    a fit computes the same in :func:`fit_pool`'s processes as here."""
    from sklearn.neural_network import MLPClassifier
    from threadpoolctl import threadpool_limits

    alpha = MLP_ALPHA_WIDE if z.shape[1] > MLP_WIDE else MLP_ALPHA
    net = MLPClassifier((MLP_HIDDEN,), activation="relu", alpha=alpha, max_iter=300, early_stopping=True,
                        random_state=seed)
    with threadpool_limits(1):
        net.fit(z, y)
    return (net.coefs_[0].astype(np.float64), net.intercepts_[0].astype(np.float64),
            net.coefs_[1][:, 0].astype(np.float64), float(net.intercepts_[1][0]))


def _import_fit() -> None:
    """A worker's first task: what a fit imports, imported before the first job arrives."""
    import sklearn.neural_network  # noqa: F401
    import threadpoolctl  # noqa: F401


@dataclass
class FitPool:
    """Processes for the networks' fits (:func:`fit_pool`): each job is a task of its own, the largest first, so
    a worker that is free takes the next (the exits' fits differ in size: the routed tokens of each)."""

    executor: Executor
    workers: int

    def fit(self, jobs: Sequence[MlpJob]) -> list[MlpParams]:
        order = sorted(range(len(jobs)), key=lambda i: -jobs[i][0].size)
        futures = {i: self.executor.submit(fit_mlp, *jobs[i]) for i in order}
        return [futures[i].result() for i in range(len(jobs))]


@contextlib.contextmanager
def fit_pool(workers: int | None = None) -> Iterator[FitPool | None]:
    """Processes for :func:`fit_mlps`: ``workers`` (None: the machine's cores), started by spawn (the caller holds
    ONNX Runtime's threads: nothing of them is forked) and started now, while the caller computes the signals they
    will fit; None on one core. A fit is seeded and runs on one BLAS thread wherever it runs, so the networks are
    the same with a pool as without, only sooner: calibrate's nine fits (three exits, the final fit and two
    cross-fitting folds) took 22-23 s in process and 14-15 s in two processes on the 2-core Intel VM (stop 68)."""
    n = workers if workers is not None else (os.cpu_count() or 1)
    if n < 2:
        yield None
        return
    with ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn")) as executor:
        for _ in range(n):  # spawned, and scikit-learn imported, while the caller goes on
            executor.submit(_import_fit)
        yield FitPool(executor, n)


def fit_mlps(jobs: Sequence[MlpJob], pool: FitPool | None = None) -> list[MlpParams]:
    """:func:`fit_mlp` of every job, in ``pool``'s processes (:func:`fit_pool`) when given and there are two or
    more jobs, else here; the same networks either way."""
    if pool is None or len(jobs) < 2:
        return [fit_mlp(*job) for job in jobs]
    return pool.fit(jobs)


def mlp_score(z: np.ndarray, w1: np.ndarray, b1: np.ndarray, w2: np.ndarray, b2: float) -> np.ndarray:
    """The network's logit [N] of standardised signals z [N, F]."""
    return np.maximum(z @ w1 + b1, 0.0) @ w2 + b2  # [N]


def mlp_score_form(mean: np.ndarray, std: np.ndarray, w1: np.ndarray, b1: np.ndarray, w2: np.ndarray,
                   b2: float) -> ScoreForm:
    """:func:`mlp_score` on the raw signals, standardisation (mean [F], std [F]) folded into the first layer."""
    w1_raw = w1 / std[:, None]  # [F, H]
    return ScoreForm(w1_raw.astype(np.float32), (b1 - (mean / std) @ w1).astype(np.float32),
                     w2.astype(np.float32), float(b2))
