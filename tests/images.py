"""Checks that a figure the code wrote is a real picture, not just a file.

A test that only asks whether ``x.png`` exists passes for an empty file, a blank canvas or a plot
whose data never got drawn. :func:`assert_png` decodes the image and checks its size and content.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
COLOUR_TOLERANCE = 8  # per channel, of 255: antialiased edges blend a colour with its background


def figure_size(width_in: float, height_in: float, dpi: float) -> tuple[int, int]:
    """Pixels (width, height) of a matplotlib figure of that size in inches saved at ``dpi``
    (without ``bbox_inches="tight"``, which would crop it)."""
    return int(round(width_in * dpi)), int(round(height_in * dpi))


def assert_png(path: str | Path, size: tuple[int, int] | None = None, colours: Sequence[str] = (),
               min_pixels: int = 50, min_ink: float = 0.01) -> np.ndarray:
    """Assert ``path`` is a PNG that decodes, measures ``size`` = (width, height) pixels, is not one
    flat colour (at least ``min_ink`` of its pixels differ from the most common one) and shows each
    hex colour of ``colours`` (the data's bars / lines) on at least ``min_pixels`` pixels.

    Returns:
        The image as uint8 [H, W, 3].
    """
    from matplotlib import image

    path = Path(path)
    assert path.is_file(), f"{path}: no such file"
    assert path.read_bytes()[:8] == PNG_SIGNATURE, f"{path}: not a PNG"
    img = image.imread(path)  # [H, W, 3 or 4] floats in [0, 1] (or uint8 for some PNG modes)
    if img.dtype != np.uint8:
        img = np.round(np.asarray(img, np.float64) * 255).astype(np.uint8)
    rgb = img[..., :3]
    h, w = rgb.shape[:2]
    if size is not None:
        assert (w, h) == tuple(size), f"{path}: {w} x {h} pixels, expected {size[0]} x {size[1]}"
    codes = (rgb[..., 0].astype(np.int64) << 16) | (rgb[..., 1].astype(np.int64) << 8) | rgb[..., 2]
    _, counts = np.unique(codes, return_counts=True)
    ink = 1.0 - counts.max() / codes.size
    assert ink >= min_ink, f"{path}: {ink:.2%} of the pixels differ from the background: blank"
    for colour in colours:
        want = np.array([int(colour.lstrip("#")[i:i + 2], 16) for i in (0, 2, 4)])
        near = (np.abs(rgb.astype(np.int64) - want) <= COLOUR_TOLERANCE).all(-1).sum()
        assert near >= min_pixels, f"{path}: colour {colour} on {near} pixels, expected >= {min_pixels}"
    return rgb


def assert_calibration_plots(run_dir: str | Path) -> None:
    """The calibrate stage's figures (calibration/plots.py, 100 dpi): the reliability diagram 5 x 6 in,
    the exit-depth histogram 6 x 4 in with the first system's bars in matplotlib's first cycle colour."""
    folder = Path(run_dir) / "calibration"
    assert_png(folder / "reliability.png", figure_size(5, 6, 100))
    assert_png(folder / "exit_depth.png", figure_size(6, 4, 100), colours=["#1f77b4"])
