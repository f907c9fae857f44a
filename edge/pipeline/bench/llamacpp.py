"""llama.cpp as a peer system of ``smartexit bench decode`` (system f): where it is installed and whether
it can run (:func:`available`).

``llama-cpp-python`` is built from its source distribution by ``make llamacpp`` (never by
``make test`` / ``make demo``), which also unpacks that sdist into ``.venv/llamacpp-src/``: the
converter (``vendor/llama.cpp/convert_hf_to_gguf.py`` with its ``conversion`` and ``gguf-py``
packages) ships in the sdist, not in the wheel. :func:`available` says why the peer cannot run.

The peer itself is ``llamacpp_peer.LlamaCppPeer`` (with prompt-lookup drafting:
``llamacpp_lookup.LlamaCppLookupPeer``), run with its weights repacked where that runs
(``llamacpp_repack``). The same weights reach llama.cpp through that converter (``llamacpp_gguf``, which
also quantizes them and reads back what a GGUF stores); ``llamacpp_tokenizer`` checks that the converted
tokenizer reproduces ours id for id, and ``llamacpp_match.check_greedy_match`` that llama.cpp's greedy
tokens are ours before its speed is reported. Its quality on held-out text is scored in
``llamacpp_quality``. ``LlamaCppPeer.generate_timed`` times the prefill and the decode steps apart
(``llamacpp_timing``); ``llamacpp_bench`` sets that row beside llama.cpp's own ``llama-bench``.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from edge.core.errors import MissingExtraError

INSTALL_HINT = "run `make llamacpp`"
SRC_ENV = "SMARTEXIT_LLAMACPP_SRC"  # overrides where the unpacked sdist is looked for


# ------------------------------------------------------------------ where things are
def source_dir() -> Path:
    """The unpacked llama-cpp-python sdist (``$SMARTEXIT_LLAMACPP_SRC`` or ``<venv>/llamacpp-src``)."""
    return Path(os.environ.get(SRC_ENV) or Path(sys.prefix) / "llamacpp-src")


def converter_dir() -> Path:
    """``vendor/llama.cpp`` of the sdist: ``convert_hf_to_gguf.py``, ``conversion/``, ``gguf-py/``."""
    return source_dir() / "vendor" / "llama.cpp"


def sdist_version(src: Path | None = None) -> str | None:
    """The llama-cpp-python version of the unpacked sdist (its ``PKG-INFO``; default :func:`source_dir`),
    or None when it is not there."""
    pkg_info = (src or source_dir()) / "PKG-INFO"
    if not pkg_info.is_file():
        return None
    for line in pkg_info.read_text(errors="replace").splitlines():
        if line.startswith("Version:"):
            return line.split(":", 1)[1].strip()
    return None


def available() -> str | None:
    """None when llama_cpp loads and the converter of the same version is unpacked; else why not."""
    try:
        import llama_cpp
    except ImportError:
        return f"llama-cpp-python not installed: {INSTALL_HINT}"
    except OSError as exc:  # the package is there but its shared library does not load
        return f"llama-cpp-python is installed but its library does not load ({exc}): {INSTALL_HINT}"
    conv = converter_dir()
    missing = [p for p in (conv / "convert_hf_to_gguf.py", conv / "conversion", conv / "gguf-py" / "gguf")
               if not p.exists()]
    if missing:
        return f"llama.cpp converter not found ({missing[0]} is missing): {INSTALL_HINT}"
    src_version = sdist_version()
    if src_version != llama_cpp.__version__:
        return (f"the converter in {source_dir()} is from llama-cpp-python {src_version}, the installed "
                f"package is {llama_cpp.__version__}: {INSTALL_HINT}")
    return None


def require_available() -> None:
    """Raise :class:`MissingExtraError` with :func:`available`'s reason when the peer cannot run."""
    reason = available()
    if reason is not None:
        raise MissingExtraError(reason)


def llamacpp_version() -> str:
    import llama_cpp

    return llama_cpp.__version__
