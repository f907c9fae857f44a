"""Calibration figures: reliability diagrams and exit-depth histograms (PNG).

matplotlib is imported inside the functions and drawn on an Agg canvas (no
display, no global pyplot state); files are written atomically.
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from edge.core.artifacts import atomic_path
from edge.core.errors import ConfigError


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    return path


def reliability_diagram(curves: Mapping[str, Sequence[np.ndarray]], path: str | Path,
                        title: str = "Reliability diagram") -> Path:
    """Plot accuracy against confidence per bin for one or more calibrators.

    Args:
        curves: label -> (conf [B], acc [B], count [B]), e.g.
            :func:`calibration.metrics.reliability_curve` output; empty bins
            (count 0) are skipped.
        path: PNG file to write.
        title: figure title.

    Returns:
        The written path.

    Raises:
        ConfigError: no curves, or a curve whose three arrays differ in length.
    """
    if not curves:
        raise ConfigError("reliability_diagram: no curves to plot")
    fig = _figure(5.0, 6.0)
    ax, ax_n = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    ax.plot([0, 1], [0, 1], color="grey", linestyle="--", linewidth=1, label="perfect")
    for label, curve in curves.items():
        conf, acc, count = (np.asarray(a, dtype=np.float64) for a in curve)
        if not conf.shape == acc.shape == count.shape or conf.ndim != 1:
            raise ConfigError(f"reliability_diagram: curve {label!r} has arrays of shapes "
                              f"{conf.shape}, {acc.shape}, {count.shape}; expected three equal 1-D arrays")
        full = count > 0
        ax.plot(conf[full], acc[full], marker="o", markersize=3, label=label)
        ax_n.plot(conf[full], count[full], marker=".", label=label)
    ax.set_ylabel("accuracy (exit token == full model)")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_title(title)
    ax.legend(loc="upper left", fontsize="small")
    ax_n.set_yscale("log")
    ax_n.set_xlabel("predicted probability")
    ax_n.set_ylabel("tokens")
    fig.tight_layout()
    return _save(fig, path)


def exit_depth_histogram(exit_fraction: Mapping[int, float] | Mapping[str, Mapping[int, float]],
                         path: str | Path, title: str = "Exit depth") -> Path:
    """Bar chart of the fraction of tokens exiting at each layer.

    Args:
        exit_fraction: layer -> fraction, or label -> (layer -> fraction) for
            grouped bars (e.g. one group per calibrator or threshold).
        path: PNG file to write.
        title: figure title.

    Returns:
        The written path.

    Raises:
        ConfigError: nothing to plot.
    """
    if not exit_fraction:
        raise ConfigError("exit_depth_histogram: no exit fractions to plot")
    first = next(iter(exit_fraction.values()))
    groups = dict(exit_fraction) if isinstance(first, Mapping) else {"": exit_fraction}
    layers = sorted({int(k) for g in groups.values() for k in g})
    fig = _figure(6.0, 4.0)
    ax = fig.subplots()
    x = np.arange(len(layers))
    width = 0.8 / len(groups)
    for i, (label, frac) in enumerate(groups.items()):
        vals = [float(frac.get(k, frac.get(str(k), 0.0))) for k in layers]
        ax.bar(x + (i - (len(groups) - 1) / 2) * width, vals, width, label=label or None)
    ax.set_xticks(x, [str(k) for k in layers])
    ax.set_xlabel("exit layer")
    ax.set_ylabel("fraction of tokens")
    ax.set_ylim(0, 1)
    ax.set_title(title)
    if len(groups) > 1:
        ax.legend(fontsize="small")
    fig.tight_layout()
    return _save(fig, path)
