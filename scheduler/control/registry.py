"""The control policies by name: ``make_policy("aimd", ...)`` for the serving worker, training and the
benchmarks. The learned policy (``ppo``) is imported on demand, so choosing a heuristic imports no torch.
It sits above both :mod:`scheduler.control.policies` and :mod:`scheduler.control.learned` (which builds on
the policies' observation), so neither imports the other's module back.
"""
from __future__ import annotations

from typing import Any

from edge.core.errors import ConfigError
from scheduler.control.policies import AIMD, FixedBudget, MaxDelay, Policy


def _learned(path: str | None = None, deterministic: bool = True) -> Policy:
    """The learned policy in ``path`` (default: the shipped scheduler/assets/ppo), imported on demand so
    this module stays free of torch."""
    from scheduler.control.learned import load_policy

    return load_policy(path, deterministic)


POLICIES = {"fixed": FixedBudget, "aimd": AIMD, "maxdelay": MaxDelay, "ppo": _learned}


def make_policy(name: str, **kwargs: Any) -> Policy:
    """The policy registered as ``name`` with its settings.

    Raises:
        ConfigError: unknown name or setting.
    """
    if name not in POLICIES:
        raise ConfigError(f"unknown policy {name!r}; expected one of {', '.join(POLICIES)}")
    try:
        return POLICIES[name](**kwargs)
    except TypeError as exc:
        raise ConfigError(f"policy {name!r}: {exc}") from None
