"""How the report writes a number: ``fmt``, with ``n/a`` for one the run did not measure."""
from __future__ import annotations

from typing import Any


def fmt(v: Any, spec: str = ".4f") -> str:
    return "n/a" if v is None else format(v, spec)
