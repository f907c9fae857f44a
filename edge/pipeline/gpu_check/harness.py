"""What every section of deploy/gpu_check.py shares: the NVML meter opened (or why it cannot be), and a
section's call guarded, so that one section's error is recorded and the other sections' numbers are kept."""
from __future__ import annotations

from typing import Any


def open_nvml():
    """(the NVML meter, None), or (None, why it cannot open). edge.energy is imported here: its NVML meter
    needs the 'gpu' extra (nvidia-ml-py)."""
    from edge.core.errors import SmartExitError

    try:
        from edge.energy.detect import open_meter

        return open_meter("nvml", interval_s=0.05), None
    except (ImportError, SmartExitError) as exc:
        return None, f"{type(exc).__name__}: {exc}"


def guarded(fn, *args) -> Any:
    """One section's result, or its error (the other sections' numbers are kept)."""
    import traceback

    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - a check script records what failed and goes on
        traceback.print_exc()
        return {"error": f"{type(exc).__name__}: {exc}"}
