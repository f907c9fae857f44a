"""Typed configs from YAML presets and ``key=value`` overrides.

``apply(cfg, {"steps": "10", "exits.layers": "[3, 6]"})`` sets fields of a
(nested) dataclass, converting each value to the field's declared type; an
unknown key or a value of the wrong type is a :class:`ConfigError` naming it.
"""
from __future__ import annotations

import dataclasses
import enum
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

from edge.core.errors import ConfigError

T = TypeVar("T")


def _convert(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if isinstance(value, str) and tp is not str and origin is not typing.Union:
        try:
            value = yaml.safe_load(value)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{key}: cannot parse {value!r}: {exc}") from exc
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        if value is None and type(None) in args:
            return None
        if isinstance(value, str) and value.lower() in ("none", "null") and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(value, inner[0], key)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return apply(tp(), value, prefix=f"{key}.")
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            raise ConfigError(f"{key}: {value!r} is not one of {[e.value for e in tp]}") from None
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        item = args[0] if args else Any
        return [_convert(v, item, f"{key}[]") for v in value]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true/false, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is str:
        return str(value)
    return value


def apply(cfg: T, values: dict[str, Any], prefix: str = "") -> T:
    """Set (dotted) keys of dataclass ``cfg`` from ``values``; re-run ``__post_init__``."""
    hints = typing.get_type_hints(type(cfg))
    names = {f.name for f in dataclasses.fields(cfg)}
    for key, value in values.items():
        head, _, rest = key.partition(".")
        if head not in names:
            raise ConfigError(f"unknown config key {prefix}{head!r}; known: {', '.join(sorted(names))}")
        if rest:
            sub = getattr(cfg, head)
            if isinstance(sub, dict):  # a free-form section (its owner validates it): serve.port=8123
                node = sub
                *path, last = rest.split(".")
                for part in path:
                    node = node.setdefault(part, {})
                    if not isinstance(node, dict):
                        raise ConfigError(f"{prefix}{head}.{rest}: {part} is not a section")
                node[last] = value
                continue
            if not dataclasses.is_dataclass(sub):
                raise ConfigError(f"{prefix}{head} has no sub-keys")
            apply(sub, {rest: value}, prefix=f"{prefix}{head}.")
        else:
            setattr(cfg, head, _convert(value, hints[head], prefix + head))
    post = getattr(cfg, "__post_init__", None)
    if post is not None:
        try:
            post()
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"{prefix or type(cfg).__name__}: {exc}") from exc
    return cfg


def load_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping at top level")
    return data


def parse_overrides(cfg: T, argv: list[str], config_file: str | Path | None = None) -> T:
    """Apply a YAML file (if given) and then ``key=value`` arguments to ``cfg``."""
    if config_file is not None:
        apply(cfg, load_yaml(config_file))
    pairs = {}
    for arg in argv:
        key, eq, value = arg.partition("=")
        if not eq or not key:
            raise ConfigError(f"expected key=value, got {arg!r}")
        pairs[key] = value
    return apply(cfg, pairs)
