"""Time stamps along a request's way to its first token, across the serving stack's processes (``bench serve``'s
breakdown of the TTFT overhead, scheduler/loadtest/hop_stamps.py).

With :data:`ENV` naming a folder when a process starts, :func:`stamp` appends ``point key time`` lines to
``<folder>/<pid>.tsv`` (time: ``time.monotonic()`` in ms, the one clock every process of a Linux machine shares);
without it, a call costs one comparison. The points, in the order a request meets them (docs/serving.md):
``client_send`` / ``client_first`` (the load generator), ``ingress_in`` / ``ingress_first`` (the ingress handler:
request received, first SSE event ready), ``core_submit`` / ``core_response`` (Triton's core in the ingress: request
handed to it, first response back), ``model_execute`` / ``engine_first`` / ``model_send`` (the python backend's stub:
request received, the engine's first chunk, its response sent).
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TextIO

ENV = "SMARTEXIT_STAMPS"
POINTS = ("client_send", "ingress_in", "core_submit", "model_execute", "engine_first", "model_send", "core_response",
          "ingress_first", "client_first")

_folder = os.environ.get(ENV) or None
_file: TextIO | None = None


def on() -> bool:
    """Whether this process stamps (:data:`ENV` was set when it imported this module)."""
    return _folder is not None


def enable(folder: str | Path | None) -> None:
    """Stamp into ``folder`` from now on, in this process and in the processes it starts (:data:`ENV` in its
    environment); None: stop (the processes already started keep stamping)."""
    global _folder, _file
    if _file is not None:
        _file.close()
    _folder, _file = (None if folder is None else str(folder)), None
    if folder is None:
        os.environ.pop(ENV, None)
    else:
        os.environ[ENV] = str(folder)


def stamp(point: str, key: str = "") -> None:
    """Append ``point`` at this moment (``key``: the request's id where the caller has one, else empty)."""
    global _file
    if _folder is None:
        return
    if _file is None:
        Path(_folder).mkdir(parents=True, exist_ok=True)
        _file = open(Path(_folder) / f"{os.getpid()}.tsv", "a", buffering=1, encoding="utf-8")
    _file.write(f"{point}\t{key}\t{time.monotonic() * 1e3:.3f}\n")
