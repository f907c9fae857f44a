"""Whether llama.cpp runs a GGUF with its weights repacked (:func:`repack_runs`, probed in a child
process), and the switch that turns repacking off for llama-cpp-python (:func:`model_params`).

The probe's child is ``python -m edge.pipeline.bench.llamacpp_peer probe ...`` (:func:`probe_argv`): it
loads the GGUF into a ``LlamaCppPeer`` and decodes a few greedy tokens, so a crash is the answer.
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

from edge.core.errors import SmartExitError

# llama.cpp repacks some weight types at load into layouts for its CPU kernels ("extra buffer types"; on
# by default, llama-bench's --repack). Its repacked q8_0 kernels of llama-cpp-python 0.3.36 crash
# (SIGSEGV in the first llama_decode) on a 2-core Intel Xeon with AVX-512 VNNI (2026-12-05), where the
# plain kernels run: a crash takes the whole bench process with it, so whether repacking runs is
# probed in a child process first, per GGUF file, and the peer runs without it where it crashes.
PROBE_TOKENS = 4  # greedy tokens the probe decodes after an 8-token prompt
_REPACK: dict[tuple, bool] = {}  # (path, size, mtime, threads) -> whether repacking runs there


@contextlib.contextmanager
def model_params(repack: bool) -> Iterator[None]:
    """llama-cpp-python's ``Llama`` takes no repacking switch: within this block the model parameters it
    starts from have ``use_extra_bufts`` = ``repack`` (llama.cpp's ``llama_model_params``)."""
    import llama_cpp.llama_cpp as lib

    default = lib.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = repack
        return p

    lib.llama_model_default_params = params
    try:
        yield
    finally:
        lib.llama_model_default_params = default


def probe_argv(gguf: str | Path, threads: int, repack: bool) -> list[str]:
    return [sys.executable, "-m", "edge.pipeline.bench.llamacpp_peer", "probe", str(gguf), str(threads),
            "repack" if repack else "no-repack"]


def repack_runs(gguf: str | Path, threads: int, timeout: float = 120.0) -> bool:
    """Whether llama.cpp runs ``gguf`` with its weights repacked (its default), else False where the
    plain kernels run and the repacked ones fail (a crash, in a child process: :func:`probe_argv`).
    Cached per file (path, size, modification time) and thread count.

    Raises:
        SmartExitError: the file is missing, or llama.cpp fails on it either way (both children's last
            lines in the message).
    """
    path = Path(gguf).resolve()
    if not path.is_file():
        raise SmartExitError(f"GGUF file {gguf} does not exist")
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns, threads)
    if key not in _REPACK:
        tails = []
        for repack in (True, False):
            how = "with" if repack else "without"
            try:
                res = subprocess.run(probe_argv(path, threads, repack), capture_output=True, text=True,
                                     timeout=timeout, env={**os.environ, "PYTHONFAULTHANDLER": "1"})
            except subprocess.TimeoutExpired:  # a hang counts as a failure of that way
                tails.append(f"{how} repacking: no answer in {timeout:g} s")
                continue
            if res.returncode == 0:
                _REPACK[key] = repack
                break
            what = f"signal {-res.returncode}" if res.returncode < 0 else f"exit {res.returncode}"
            lines = (res.stderr or res.stdout).strip().splitlines()[-3:]
            tails.append(f"{how} repacking: {what}: " + " | ".join(lines))
        else:
            raise SmartExitError(f"llama.cpp fails to decode {gguf} on this machine ({'; '.join(tails)})")
    return _REPACK[key]
