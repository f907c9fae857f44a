"""How exits cut the decoder into segments (torch-free: the runtime and the exporter both use it)."""
from __future__ import annotations


def segment_layers(exit_layers: list[int] | tuple[int, ...]) -> list[list[int]]:
    """0-based decoder layers of each segment; segment i ends at exit ``exit_layers[i]`` (1-based, the
    last = the number of layers): [2, 4] -> [[0, 1], [2, 3]]."""
    bounds = [0, *exit_layers]
    return [list(range(bounds[i], bounds[i + 1])) for i in range(len(exit_layers))]
