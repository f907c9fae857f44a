"""Errors that are part of SmartExit's interface.

Every error a user can cause (a bad path, a bad config, a mismatched artifact)
is a :class:`SmartExitError`; the CLI prints its message and exits with code 2.
"""
from __future__ import annotations


class SmartExitError(Exception):
    """A user-facing error: the message says which file, which field, what was expected."""

    exit_code = 2


class CheckpointError(SmartExitError):
    """A model folder that cannot be loaded (missing, unsupported, corrupt, mismatched)."""


class ConfigError(SmartExitError):
    """A malformed or out-of-range configuration value."""


class ArtifactError(SmartExitError):
    """An artifact whose hash or content disagrees with the manifest that produced it."""


class RequestError(SmartExitError):
    """A request the engine cannot take (empty or oversize prompt, bad sampling values, unknown mode);
    ``field`` names the request field at fault, so a server can answer 400 naming it."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class MissingExtraError(SmartExitError):
    """An optional dependency is absent; the message names the extra to install."""


def require(module: str, extra: str):
    """Import an optional module or raise :class:`MissingExtraError` naming the extra."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingExtraError(
            f"{module} is not installed; install the '{extra}' extra: pip install 'smartexit[{extra}]' "
            f"({type(exc).__name__}: {exc})"
        ) from exc
