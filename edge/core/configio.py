"""Typed configs from YAML presets and ``key=value`` overrides.

``apply(cfg, {"steps": "10", "exits.layers": "[3, 6]"})`` sets fields of a
(nested) dataclass, converting each value to the field's declared type; an
unknown key or a value of the wrong type is a :class:`ConfigError` naming it.
"""
from __future__ import annotations

import dataclasses
import enum
import re
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

from edge.core.errors import ConfigError

T = TypeVar("T")


_UNIONS = (typing.Union, types.UnionType)  # Optional[X] / Union[X, Y] and PEP 604's ``X | None``
_NONE_WORDS = ("none", "null")


class _FileLoader(yaml.SafeLoader):
    """YAML for config files, resolving fewer plain words than YAML 1.1 does: integers only in decimal, booleans
    only ``true`` / ``false`` (any case YAML 1.2 allows), no dates. Other words (``0x1F``, ``0o17``, ``yes``,
    ``on``, ``2026-12-06``) stay text, so a text field (an API key, a name) holds what was written; a field
    typed int or bool still reads them as YAML 1.1 would (:func:`_convert` parses text for non-text fields)."""


_FileLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag.rsplit(":", 1)[-1] not in ("int", "bool", "timestamp")]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_FileLoader.add_implicit_resolver("tag:yaml.org,2002:int", re.compile(r"^[-+]?(?:0|[1-9][0-9]*)$"),
                                  list("-+0123456789"))
_FileLoader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                                  list("tTfF"))


def _literal(tp: Any) -> bool:
    """Whether a string for a field of type ``tp`` is taken as it is (``str`` and ``str`` Enums), not as YAML."""
    return isinstance(tp, type) and issubclass(tp, str)


def _parse(value: str, key: str) -> Any:
    """A ``key=value`` string as YAML (numbers, booleans, lists, mappings)."""
    try:
        return yaml.safe_load(value)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{key}: cannot parse {value!r}: {exc}") from exc
    except RecursionError:
        raise ConfigError(f"{key}: {value[:40]!r}... is nested too deeply to parse") from None


def _convert(value: Any, tp: Any, key: str) -> Any:
    """``value`` (a ``key=value`` string, or what a YAML file held) as type ``tp``.

    A string for a field of any type but ``str`` is parsed as YAML first (``16``, ``true``, ``[3, 6]``).
    A field typed ``str``, ``str | None`` or a ``str`` Enum takes the string literally: ``yes``, ``0x1F``, ``# x`` and
    ``def f(x): return x`` stay exactly those strings, and ``""`` stays the empty string. A YAML file is read the
    same way (:class:`_FileLoader`: ``0x1F`` and ``yes`` there are text until a field's type asks for a number or a
    boolean); a number with a fraction or a ``true`` / ``false`` for a text field is an error (quote it). An optional
    field (``X | None``, ``Optional[X]``) is set to None by the exact word ``none`` or ``null`` (any case;
    the one spelling for every optional field), or, for a non-string ``X``, by anything YAML reads as null.

    Raises:
        ConfigError: a value that does not parse or is not of the field's type, naming ``key``.
    """
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in _UNIONS:
        optional = type(None) in args
        inner = [a for a in args if a is not type(None)][0]
        if isinstance(value, str) and value.lower() in _NONE_WORDS and optional:
            return None
        if isinstance(value, str) and not _literal(inner):
            value = _parse(value, key)
        if value is None and optional:
            return None
        return _convert(value, inner, key)
    if isinstance(value, str) and not _literal(tp):
        value = _parse(value, key)
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
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is str:
        if isinstance(value, (bool, float)):  # str() would not give back what was written: 3.10 -> "3.1"
            raise ConfigError(f"{key}: expected text, got {type(value).__name__} {value!r} (YAML reads an unquoted "
                              f"number or true/false as such: quote the value to mean the text)")
        return str(value)
    return value


def apply(cfg: T, values: dict[str, Any], prefix: str = "") -> T:
    """Set (dotted) keys of dataclass ``cfg`` from ``values``; re-run ``__post_init__``."""
    hints = typing.get_type_hints(type(cfg))
    names = {f.name for f in dataclasses.fields(cfg)}
    for key, value in values.items():
        if not isinstance(key, str):
            raise ConfigError(f"config key {prefix}{key!r} is not a name")
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
    """The mapping a YAML config file holds.

    Raises:
        ConfigError: naming the file: it is missing or not a file, unreadable, not UTF-8, not YAML,
            nested too deeply to parse, or not a mapping at top level.
    """
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist")
    if not path.is_file():
        raise ConfigError(f"config file {path} is not a file" + (" (it is a folder)" if path.is_dir() else ""))
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_FileLoader) or {}  # noqa: S506 - a SafeLoader
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path} is not UTF-8 text: {exc}") from exc
    except OSError as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from exc
    except RecursionError:
        raise ConfigError(f"config file {path} is nested too deeply to parse") from None
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
