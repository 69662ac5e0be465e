"""Typed configuration from TOML and ``--section.key=value`` overrides.

A job config is a dataclass whose fields are sections, each itself a small dataclass of scalars.
Values are checked against the field types as they are read, so a typo or a wrong type is reported with
the exact key before any process starts.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import sys
import typing
from pathlib import Path

from tessera.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _suggest(name: str, choices, prefix: str = "") -> str:
    close = difflib.get_close_matches(name, list(choices), n=1)
    return f" (did you mean '{prefix}{close[0]}'?)" if close else ""


def field_types(cls) -> dict[str, type]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _coerce_list(value, typ, key: str) -> list:
    """A TOML array, or a command-line string in TOML/JSON array syntax (``[[0, 1], [2, 3]]``)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise ConfigError(f"config key '{key}' expects a list such as [1, 2], got '{value}'") from None
    if not isinstance(value, list):
        raise ConfigError(f"config key '{key}' expects a list, got {value!r}")
    (item,) = typing.get_args(typ) or (str,)
    return [coerce(v, item, key) for v in value]


def coerce(value, typ: type, key: str):
    """Convert a TOML value or a command-line string to ``typ`` (bool, int, float, str or list of them)."""
    if typing.get_origin(typ) is list:
        return _coerce_list(value, typ, key)
    if isinstance(value, str) and typ is not str:
        text = value.strip()
        if typ is bool:
            if text.lower() in _TRUE:
                return True
            if text.lower() in _FALSE:
                return False
        else:
            try:
                return typ(text)
            except ValueError:
                pass
        raise ConfigError(f"config key '{key}' expects {typ.__name__}, got '{value}'")
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise ConfigError(f"config key '{key}' expects {typ.__name__}, got {value!r}")
    return value


def parse_overrides(args: list[str]) -> dict[str, dict[str, str]]:
    """``["--model.dim=64", "--train.steps", "5"]`` → ``{"model": {"dim": "64"}, "train": {"steps": "5"}}``."""
    out: dict[str, dict[str, str]] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            raise ConfigError(f"unexpected argument '{arg}': overrides look like --section.key=value")
        if "=" in arg:
            key, value = arg[2:].split("=", 1)
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            key, value = arg[2:], args[i + 1]
            i += 1
        else:
            raise ConfigError(f"override '{arg}' has no value: write --section.key=value")
        section, _, name = key.partition(".")
        out.setdefault(section, {})[name] = value
        i += 1
    return out


def read_toml(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file '{path}' does not exist")
    try:
        return tomllib.loads(p.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"config file '{path}' is not valid TOML: {err}") from None


def check_keys(section: str, raw: dict, cls) -> dict:
    """Typed values for ``cls`` from ``raw``; unknown keys are errors with a suggestion."""
    types = field_types(cls)
    out = {}
    for key, value in raw.items():
        if key not in types:
            raise ConfigError(f"unknown config key '{section}.{key}'{_suggest(key, types, section + '.')}")
        out[key] = coerce(value, types[key], f"{section}.{key}")
    return out


def merge(*layers: dict) -> dict[str, dict]:
    """Later layers win, key by key within a section."""
    out: dict[str, dict] = {}
    for layer in layers:
        for section, values in layer.items():
            if not isinstance(values, dict):
                raise ConfigError(f"config entry '{section}' must be a [section] table, got {values!r}")
            out.setdefault(section, {}).update(values)
    return out


def check_sections(raw: dict, sections: dict[str, type]) -> None:
    for section in raw:
        if section not in sections:
            raise ConfigError(f"unknown config section '{section}'{_suggest(section, sections)}")


def to_plain(cfg) -> dict:
    """A dataclass tree as nested dicts of TOML-writable scalars."""
    return dataclasses.asdict(cfg)
