"""Free-running units: the engine continues prompts, and every generated token is checked.

For each prompt the engine (torch backend, a K/V mode, an exit rule) greedily
generates ``new_tokens`` tokens; then the multi-exit model reads prompt +
continuation teacher-forced at full depth, which gives, for every generated
token, the full model's greedy token on exactly the prefix the engine had, and
the exit signals of that prefix at every exit.

In ``defer`` mode the engine's K/V of skipped layers are recomputed exactly, so
these teacher-forced signals *are* the signals the engine saw (up to float
rounding between the two computation paths): the collection serves both as the
check and as calibration data along the engine's own trajectories. In
``propagate`` mode the engine's later hidden states differ (approximate K/V):
the check is still exact, the signals only approximate what the engine saw.

A generated token is *wrong* when it differs from the full model's token on the
same prefix: a *false exit* if it exited early, a *full-depth mismatch* if it
ran every layer (possible only with approximate K/V). The first generated
token comes from the full-depth prefill and is not judged.

:func:`check_continuations` is that check alone, for continuations any engine
produced (the decode benchmark's); :func:`free_run` generates and checks.

What "the full model" is depends on the engine under test (:class:`Served`): for
the torch backend, the torch model read teacher-forced (fast, batched); for any
other backend (the ONNX Runtime graphs that are served), that same backend run
at full depth on the same prefixes, one decode step per token
(:func:`calibration.collect.collect_engine`). A quantized model needs the
latter: the torch model's fake quantization and the runtime's integer kernels
can round an activation to adjacent codes, and on a near tie the full-depth
token flips; judged against torch, those flips would count as false exits of
the served engine that no exit rule caused, and a certificate computed on
torch would not cover the engine that serves.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
from tqdm import tqdm

from calibration.collect import Collected, collect_engine, collect_units, generate_engine
from edge.runtime.backend import Backend
from edge.runtime.torch_backend import TorchBackend
from edge.runtime.batch import run_batch
from edge.runtime.engine_config import KVMode
from edge.core.errors import ConfigError
from edge.model.exits import MultiExitModel
from edge.runtime.rules import NeverExit


@dataclass
class Served:
    """The engine under test: the backend it generates with, and the model its tokens are judged
    against (``model`` set: the torch model teacher-forced; None: the backend itself at full depth)."""

    backend: Backend
    model: MultiExitModel | None = None
    # the corpus n-gram table the exit rule's context lookup falls back to (the export's; None: the context
    # alone): the features read here must be the ones the engine computes under the rule calibrated
    lookup_table: Any = None

    @classmethod
    def torch(cls, model: MultiExitModel) -> "Served":
        """The torch backend over ``model``, judged by ``model`` teacher-forced."""
        return cls(TorchBackend(model), model)

    @property
    def num_layers(self) -> int:
        return self.backend.num_layers

    @property
    def reference_name(self) -> str:
        return "torch, teacher-forced" if self.model is not None else f"{self.backend.name}, full-depth decode"

    def reference(self, seqs: np.ndarray, first: int, slots: np.ndarray | None = None) -> Collected:
        """Full-depth exit signals and tokens on every prefix of ``seqs`` from position ``first``.
        ``slots``: the backend's cache holds row u's prompt in slot ``slots[u]``, as the engine that generated
        the rows left it (:func:`calibration.collect.collect_engine`; the torch reference reads every row)."""
        if self.model is not None:
            return collect_units(self.model, seqs, first, table=self.lookup_table)
        return collect_engine(self.backend, seqs, first, slots=slots, table=self.lookup_table)


@dataclass
class FreeRunResult:
    """Summary of a free run (token counts are over judged tokens)."""

    prompts: int
    tokens: int  # decoded tokens judged
    false_exits: int  # exited early and differs from the full model on the same prefix
    full_depth_mismatches: int  # ran full depth yet differs (approximate K/V left by earlier exits)
    false_exit_rate: float  # (false_exits + full_depth_mismatches) / tokens = mean per-prompt rate
    exited_frac: float
    mean_exit_layer: float
    layers_skipped_frac: float  # mean (L - exit layer) / L
    kv_mode: str = ""


@dataclass
class FreeRun:
    """Engine continuations of U prompts and their check against the full model."""

    kv_mode: KVMode
    num_layers: int
    seqs: np.ndarray  # [U, P + T] prompt + generated tokens
    exit_layers: np.ndarray  # [U, T] layer each generated token was decided at
    data: Collected  # teacher-forced over the judged tokens: U * (T - 1) rows, unit-tagged

    @property
    def judged(self) -> np.ndarray:
        """[U, T-1]: (emitted token, full model's token, exit layer) are aligned on this grid."""
        return self.exit_layers[:, 1:]

    def wrong(self) -> tuple[np.ndarray, np.ndarray]:
        """(false exit [U, T-1], full-depth mismatch [U, T-1]) as bool."""
        u, t = self.judged.shape
        emitted = self.seqs[:, -t:]  # the judged generated tokens
        ref = self.data.argmax[self.data.final].reshape(u, t)
        differs = emitted != ref
        early = self.judged < self.num_layers
        return differs & early, differs & ~early

    def unit_losses(self) -> np.ndarray:
        """Per-prompt rate of wrong tokens [U] in [0, 1]: the loss a certificate bounds the mean of."""
        fe, mm = self.wrong()
        return (fe | mm).mean(axis=1)

    def summary(self) -> FreeRunResult:
        fe, mm = self.wrong()
        layers = self.judged
        n = int(layers.size)
        return FreeRunResult(
            prompts=int(self.seqs.shape[0]), tokens=n, false_exits=int(fe.sum()), full_depth_mismatches=int(mm.sum()),
            false_exit_rate=float((fe | mm).mean()), exited_frac=float((layers < self.num_layers).mean()),
            mean_exit_layer=float(layers.mean()),
            layers_skipped_frac=float(((self.num_layers - layers) / self.num_layers).mean()),
            kv_mode=self.kv_mode.value)

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        return asdict(self.summary())

    @classmethod
    def concat(cls, runs: list["FreeRun"]) -> "FreeRun":
        """Runs of the same mode one after the other (units in order)."""
        return cls(runs[0].kv_mode, runs[0].num_layers, np.concatenate([r.seqs for r in runs]),
                   np.concatenate([r.exit_layers for r in runs]), Collected.concat([r.data for r in runs]))


def check_continuations(served: Served, prompts: np.ndarray, generated: np.ndarray, exit_layers: np.ndarray,
                        kv_mode: KVMode, slots: np.ndarray | None = None) -> FreeRun:
    """Check every generated token against the full model on the same prefix (module docstring).

    Args:
        served: the engine that generated, and its reference.
        prompts: int token ids [U, P].
        generated: the engine's tokens [U, T], T >= 2 (the first, from the prefill, is not judged).
        exit_layers: the layer each generated token was decided at [U, T].
        kv_mode: the K/V mode the engine ran in.
        slots: the engine that generated has just run these prompts, and its cache, still attached to the
            backend, holds prompt u in slot ``slots[u]`` (:meth:`Served.reference`): the reference does not
            prefill them again. None: it does.

    Raises:
        ConfigError: shapes that disagree, or fewer than 2 generated tokens.
    """
    prompts, generated = np.asarray(prompts, dtype=np.int64), np.asarray(generated, dtype=np.int64)
    exit_layers = np.asarray(exit_layers, dtype=np.int64)
    if (prompts.ndim != 2 or generated.ndim != 2 or generated.shape != exit_layers.shape
            or generated.shape[0] != prompts.shape[0] or prompts.shape[0] == 0):
        raise ConfigError(f"check_continuations: expected prompts [U, P], tokens and exit layers [U, T], got shapes "
                          f"{prompts.shape}, {generated.shape}, {exit_layers.shape}")
    if generated.shape[1] < 2:
        raise ConfigError(f"check_continuations: at least 2 new tokens are needed (the first is not judged), "
                          f"got {generated.shape[1]}")
    seqs = np.concatenate([prompts, generated], axis=1)
    return FreeRun(KVMode(kv_mode), served.num_layers, seqs, exit_layers,
                   served.reference(seqs, prompts.shape[1], slots))


def _progress(total: int, desc: str | None) -> tqdm:
    """A bar over prompts on a terminal (``disable=None``: quiet when stderr is not a TTY); none without desc."""
    return tqdm(total=total, desc=desc, unit="prompt", disable=None if desc else True, leave=False)


@torch.no_grad()
def free_run(served: Served, prompts: np.ndarray, new_tokens: int, rule, kv_mode: KVMode,
             batch: int = 128, desc: str | None = None) -> FreeRun:
    """Generate ``new_tokens`` tokens for every prompt with the engine and check each one.

    Args:
        served: the engine to run (``Served.torch(model)``: the torch backend) and its reference.
        prompts: int token ids [U, P].
        new_tokens: T >= 2 tokens generated per prompt (T - 1 are judged).
        rule: the engine's exit rule (``decide(layer, stats, tokens, hidden)``), e.g. a
            :class:`calibration.table.TableRule` or :class:`edge.runtime.rules.NeverExit`.
        kv_mode: how skipped layers get their K/V.
        batch: prompts per engine run.
        desc: label of a progress bar over the prompts (shown on a terminal only); None: no bar.

    Raises:
        ConfigError: fewer than 2 new tokens, no prompts, or an engine that returned the wrong count.
    """
    prompts = np.asarray(prompts, dtype=np.int64)
    if prompts.ndim != 2 or prompts.shape[0] == 0:
        raise ConfigError(f"free_run: expected prompts [U >= 1, P], got shape {prompts.shape}")
    if new_tokens < 2:
        raise ConfigError(f"free_run: at least 2 new tokens are needed (the first is not judged), got {new_tokens}")
    runs = []
    with _progress(prompts.shape[0], desc) as bar:
        for a in range(0, prompts.shape[0], batch):
            chunk = prompts[a:a + batch]
            # rows exit at any batch size: with deferral each row's tokens are those it would get alone, and a
            # leaving row's skipped layers are computed in the same step (deferral's K/V and tokens, without its
            # extra calls over scattered slots: the demo's certify walk 155 -> ~90 s); the prompts, all of one
            # length, prefilled together (the same K/V and first tokens in fewer calls)
            run = run_batch(served.backend, rule, [p.tolist() for p in chunk], new_tokens, KVMode(kv_mode),
                            defer_exit_max_batch=None, defer_inline=True, prefill_together=True)
            for toks in run.tokens:
                if len(toks) != new_tokens:
                    raise ConfigError(f"engine returned {len(toks)} tokens for a prompt, {new_tokens} were asked for")
            # judged chunk by chunk, while the engine's cache still holds these prompts: no second prefill
            runs.append(check_continuations(served, chunk, np.asarray(run.tokens), np.asarray(run.exit_layers),
                                            kv_mode, np.asarray(run.slots)))
            bar.update(len(chunk))
    return FreeRun.concat(runs)


def full_depth_run(served: Served, prompts: np.ndarray, new_tokens: int, batch: int = 128,
                   desc: str | None = None) -> FreeRun:
    """:func:`free_run` at full depth (no exit rule), for a backend in one pass: the reference generates the
    continuation it reads (:func:`calibration.collect.generate_engine`) instead of reading one an engine
    generated first, so nothing is computed twice. Every token is the backend's own full-depth token, so
    none is wrong; the torch reference runs :func:`free_run` as before.

    Raises:
        ConfigError: fewer than 2 new tokens or no prompts.
    """
    if served.model is not None:
        return free_run(served, prompts, new_tokens, NeverExit(), KVMode.DEFER, batch, desc)
    runs = []
    prompts = np.asarray(prompts, dtype=np.int64)
    if prompts.ndim != 2 or prompts.shape[0] == 0:
        raise ConfigError(f"full_depth_run: expected prompts [U >= 1, P], got shape {prompts.shape}")
    with _progress(prompts.shape[0], desc) as bar:
        for a in range(0, prompts.shape[0], batch):
            seqs, data = generate_engine(served.backend, prompts[a:a + batch], new_tokens, batch, served.lookup_table)
            layers = np.full((seqs.shape[0], new_tokens), served.num_layers, np.int64)
            runs.append(FreeRun(KVMode.DEFER, served.num_layers, seqs, layers, data))
            bar.update(seqs.shape[0])
    return FreeRun.concat(runs)


def free_run_until(served: Served, prompts: np.ndarray, new_tokens: int, rule, kv_mode: KVMode,
                   batch: int, stop: Callable[[FreeRun], bool], desc: str | None = None) -> tuple[FreeRun, bool]:
    """:func:`free_run` batch by batch in the order of ``prompts``, stopping after the first batch for
    which ``stop(all units so far)`` is true. Returns (the units run, whether ``stop`` fired).

    With i.i.d. prompts in draw order and an anytime-valid test (the betting p-value: Ville's
    inequality bounds the capital's supremum over all times), stopping as soon as the test
    succeeds, or fails for good, keeps it valid.
    """
    runs: list[FreeRun] = []
    with _progress(prompts.shape[0], desc) as bar:
        for a in range(0, prompts.shape[0], batch):
            runs.append(free_run(served, prompts[a:a + batch], new_tokens, rule, kv_mode, batch))
            bar.update(runs[-1].seqs.shape[0])
            done = FreeRun.concat(runs)
            if stop(done):
                return done, True
    return FreeRun.concat(runs), False
