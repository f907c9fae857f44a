"""The replay of the shipped model's exits at another depth: what the projection forces at each shape.

:func:`read_replay` reads a run's calibrated exits and where its tokens left (the ``calibrate``
stage's certify walk; :data:`DEFAULT_RUN` where the run has none); :func:`replay_at` moves that
distribution to a shape's depth, each exit to the same relative depth (:func:`scale_layer`,
:func:`scale_distribution`); :func:`projected_speedup` is the batch-1 speed-up such a distribution
buys, ``t_full / sum_k f_k t_exit(k)``.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edge.core.artifacts import Manifest
from edge.core.errors import ArtifactError, ConfigError
from edge.pipeline.bench.projection_shapes import shape_config

# The replayed run when none is given: a calibrated bundled-ee run (exits 1, 2, 3, 4, 6, 8 of 12, a
# 256-token shortlist, eps 0.009, delta 0.05, K/V mode defer); its certify walk's exit counts out of
# 47616 tokens (1536 prompts x 31 judged tokens).
DEFAULT_RUN = {"num_layers": 12, "shortlist": 256, "kv_mode": "defer",
               "counts": {1: 4337, 2: 2726, 3: 2596, 4: 2842, 6: 1991, 8: 478, 12: 32646}}
# calibrate writes each fraction as count / tokens in float64: their sum is 1 to ~1e-15, so a sum
# further than this from 1 is not an exit distribution
SUM_TOL = 1e-6


@dataclass
class Replay:
    """The shipped model's exits and where its tokens left: what is replayed at another depth.

    Raises:
        ConfigError: ``fraction`` is not a distribution over layers 1..``num_layers``
            (:func:`check_distribution`).
    """

    source: str  # where the numbers come from
    num_layers: int
    fraction: dict[int, float]  # exit layer (1-based, the last included) -> fraction of tokens leaving there
    shortlist: int  # K, the candidate tokens of a check
    kv_mode: str  # the K/V mode the run ships (calibrate's choice)
    checkpoint: str | None = None  # the run's checkpoint whose exits these are (None: the default)
    free_run: dict[str, Any] | None = None  # the run's held-out free run (its summary), for comparison

    def __post_init__(self) -> None:
        check_distribution(self.fraction, self.num_layers)


def check_distribution(fraction: dict[int, float], n: int) -> None:
    """Raises ConfigError unless ``fraction`` maps layers within 1..``n`` to non-negative fractions that
    sum to 1 (within :data:`SUM_TOL`)."""
    bad = [k for k in fraction if not 1 <= k <= n]
    if bad:
        raise ConfigError(f"exit distribution: layers {bad} are outside the shipped model's 1..{n}")
    if any(f < 0 for f in fraction.values()):
        raise ConfigError(f"exit distribution: negative fractions in {fraction}")
    total = sum(fraction.values())
    if abs(total - 1.0) > SUM_TOL:
        raise ConfigError(f"exit distribution: fractions sum to {total:.9g}, not 1 ({fraction})")


def scale_layer(k: int, n: int, layers: int) -> int:
    """Layer ``k`` of ``n`` moved to the same relative depth in a model of ``layers`` layers:
    round(k * layers / n), halves up, kept within 1..layers (an exit cannot come before the first
    layer; the last layer maps to the last)."""
    return min(max((2 * k * layers + n) // (2 * n), 1), layers)


def scale_distribution(fraction: dict[int, float], n: int, layers: int) -> dict[int, float]:
    """Exit fractions over layers 1..``n`` replayed in a model of ``layers`` layers: each layer moved by
    :func:`scale_layer`, the fractions of layers that land together added. The keys of the result are
    the target's exit layers (the last one, ``layers``, always among them).

    Raises:
        ConfigError: as :func:`check_distribution`.
    """
    check_distribution(fraction, n)
    out = {layers: 0.0}
    for k, f in fraction.items():
        t = scale_layer(k, n, layers)
        out[t] = out.get(t, 0.0) + f
    return dict(sorted(out.items()))


def projected_speedup(full_ms: float, exit_ms: dict[int, float], fraction: dict[int, float]) -> float:
    """``full_ms / sum_k fraction[k] * exit_ms[k]``: the step time at full depth over the expected step
    time when a fraction ``fraction[k]`` of steps leaves at exit ``k`` (``exit_ms[k]``: such a step)."""
    return full_ms / sum(f * exit_ms[k] for k, f in fraction.items())


def read_replay(run_dir: Path) -> Replay:
    """The replay of ``run_dir``'s calibrated rule: its checkpoint's exits and shortlist, the calibrate
    stage's certify-walk exit fractions, K/V mode and held-out free run; :data:`DEFAULT_RUN` where the
    run has not been calibrated.

    Raises:
        ArtifactError: the checkpoint changed since the manifest recorded it, or calibrate's metrics lack
            the certify walk's exit fractions or the K/V mode.
        ConfigError: the recorded exit fractions are not a distribution over the checkpoint's exits.
    """
    from edge.model.exits import read_exits_json

    manifest = Manifest(run_dir)
    if "calibrate" not in manifest.data["stages"]:
        c = DEFAULT_RUN
        tokens = sum(c["counts"].values())
        return Replay(f"default (no calibrated run in {run_dir}): a calibrated bundled-ee run's certify walk, "
                      f"{tokens} tokens", c["num_layers"], {k: v / tokens for k, v in c["counts"].items()},
                      c["shortlist"], c["kv_mode"])
    ckpt = manifest.served_checkpoint()
    exits = read_exits_json(ckpt)
    metrics = manifest.stage("calibrate")["metrics"]
    try:
        walk, kv_mode = metrics["certify_walk"], str(metrics["kv_mode"])
        fraction = {int(k): float(v) for k, v in walk["exit_fraction"].items()}
    except KeyError as exc:
        raise ArtifactError(f"{manifest.path}: calibrate's metrics have no {exc.args[0]!r}; re-run calibrate") from None
    extra = sorted(set(fraction) - set(exits["exit_layers"]))
    if extra:
        raise ConfigError(f"{manifest.path}: calibrate's exit fractions name layers {extra} that are not exits of "
                          f"{ckpt} ({exits['exit_layers']})")
    return Replay(f"{run_dir}: calibrate's certify walk ({walk.get('n_tokens')} tokens, lambda {walk.get('lambda')})",
                  int(exits["num_layers"]), fraction, int(exits["exits"]["shortlist"]), kv_mode, str(ckpt),
                  metrics.get("free_run"))


def replay_at(shape: str, replay: Replay) -> dict[int, float]:
    """``replay``'s exit fractions moved to shape ``shape``'s depth (:func:`scale_distribution`); its keys
    are the shape's exit layers.

    Raises:
        ConfigError: an unknown shape, one so shallow that no decision exit is left, or a shortlist
            larger than its vocabulary.
    """
    mcfg = shape_config(shape)
    fraction = scale_distribution(replay.fraction, replay.num_layers, mcfg.num_layers)
    if len(fraction) < 2:
        raise ConfigError(f"bench projection: shape {shape} ({mcfg.num_layers} layers) keeps no decision exit of "
                          f"the replayed {sorted(replay.fraction)} of {replay.num_layers} layers")
    if replay.shortlist > mcfg.vocab_size:
        raise ConfigError(f"bench projection: the shortlist ({replay.shortlist}) exceeds shape {shape}'s vocabulary "
                          f"({mcfg.vocab_size})")
    return fraction
