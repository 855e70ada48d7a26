"""Typed configuration: dataclasses, loaded from YAML, overridden by dotted `key=value` arguments.

Each layer defines the dataclass of its own settings next to the code that reads them (one place per default);
the job's top-level config composes them. Unknown keys are errors, never silently ignored.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


class UserError(ValueError):
    """A mistake in what the user gave (a config key or value, a model or data path, a dataset row): the commands
    report it as one line naming the key, path or row, and exit with status 2 (cli.py)."""


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Turn a YAML/command-line value into the annotated type, or raise naming the key."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            if type(None) in args:
                return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, where)
            except (TypeError, ValueError) as err:
                errors.append(err)
        if len(errors) == 1 and isinstance(errors[0], UserError):  # `float | None`: say what the float refused
            raise errors[0]
        raise UserError(f"{where}: cannot read {value!r} as {_type_name(tp)}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise UserError(f"{where}: expected a mapping, got {value!r}")
        return from_dict(tp, value, where)
    if origin in (list, tuple):
        (item,) = typing.get_args(tp)[:1] or (Any,)
        if isinstance(value, str):
            value = yaml.safe_load(value) if value.startswith("[") else [v for v in value.split(",") if v]
        if not isinstance(value, (list, tuple)):
            raise UserError(f"{where}: expected a list, got {value!r}")
        return [_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise UserError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise UserError(f"{where}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise UserError(f"{where}: expected an integer, got {value!r}")
        try:
            return int(value)
        except (TypeError, ValueError):
            raise UserError(f"{where}: expected an integer, got {value!r}") from None
    if tp is float:
        if isinstance(value, bool):
            raise UserError(f"{where}: expected a number, got {value!r}")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise UserError(f"{where}: expected a number, got {value!r}") from None
        # Every section's range checks (`<= 0`, `< 1`) let NaN through, and inf turns a timeout into no timeout:
        # refused here, once for every float key.
        if not math.isfinite(number):
            raise UserError(f"{where}: expected a finite number, got {value!r}")
        return number
    if tp is str:
        if isinstance(value, (dict, list)):
            raise UserError(f"{where}: expected a string, got {value!r}")
        return str(value)
    return value


def _type_name(tp: Any) -> str:
    """`int | None` rather than `typing.Optional[int]` in messages."""
    return " | ".join(getattr(a, "__name__", str(a)) for a in typing.get_args(tp)) or getattr(tp, "__name__", str(tp))


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def from_dict(cls: type[T], data: dict, where: str = "") -> T:
    """Build dataclass `cls` from a nested dict; an unknown key, a value of the wrong type or one its section's
    checks refuse raises UserError naming it."""
    hints = _hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - names
    if unknown:
        raise UserError(f"{where or 'config'}: unknown key(s) {sorted(unknown)}; known: {sorted(names)}")
    kwargs = {k: _coerce(v, hints[k], f"{where}.{k}" if where else k) for k, v in data.items()}
    try:
        return cls(**kwargs)
    except UserError:
        raise
    except ValueError as err:  # a section's __post_init__ check; its message names the key
        raise UserError(str(err)) from None


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def _section_type(cls: type, key: str, where: str) -> type | None:
    """Type of field `key` of dataclass `cls` if it is itself a dataclass (a section), else None."""
    names = {f.name for f in dataclasses.fields(cls)}
    if key not in names:
        raise UserError(f"{where}: unknown key {key!r} (known: {sorted(names)})")
    tp = _hints(cls)[key]
    return tp if dataclasses.is_dataclass(tp) else None


def apply_overrides(cfg: T, overrides: list[str]) -> T:
    """Apply `a.b.c=value` strings to a (nested) dataclass instance; returns a new instance.

    Keys must name fields of the dataclass sections; inside a free-form mapping field (`dict`) any key may be set.
    """
    data = to_dict(cfg)
    for item in overrides:
        if "=" not in item:
            raise UserError(f"override {item!r} is not of the form key=value")
        key, raw = item.split("=", 1)
        node, parts, cls = data, key.split("."), type(cfg)
        for part in parts[:-1]:
            if cls is not None:
                sub = _section_type(cls, part, f"override {item!r}")
                if sub is None and not isinstance(node.get(part), dict):
                    raise UserError(f"override {item!r}: {part!r} is not a section of the config")
                cls = sub
            node = node.setdefault(part, {})
        if cls is not None:
            _section_type(cls, parts[-1], f"override {item!r}")
        try:
            node[parts[-1]] = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError as err:
            raise UserError(f"override {item!r}: the value is not valid YAML ({str(err).splitlines()[0]})") from None
    return from_dict(type(cfg), data)


def file_overrides(cls: type, data: dict, prefix: str = "") -> list[str]:
    """A YAML mapping as `a.b=value` overrides: sections (dataclass fields) are walked into, every other value
    (free-form mappings such as model.engine_kwargs included) is set whole."""
    hints = _hints(cls) if dataclasses.is_dataclass(cls) else {}
    out = []
    for key, value in data.items():
        sub = hints.get(key)
        if isinstance(value, dict) and sub is not None and dataclasses.is_dataclass(sub):
            out += file_overrides(sub, value, f"{prefix}{key}.")
        else:
            out.append(f"{prefix}{key}={json.dumps(value)}")  # JSON is YAML: read back by apply_overrides
    return out


def load(cls: type[T], path: str | Path | None = None, overrides: list[str] | None = None) -> T:
    """Defaults of `cls`, then the YAML file at `path` (any subset of keys), then dotted `key=value` overrides;
    errors name the file or the override and the key.

    The file goes through the same dotted path as the command line, so a free-form mapping (engine_kwargs,
    *_resources) is replaced whole rather than merged key by key into its default."""
    return apply_overrides(cls(), read_file_overrides(cls, path) + list(overrides or []))


def read_file_overrides(cls: type, path: str | Path | None) -> list[str]:
    """The YAML file at `path` as dotted overrides of `cls`, checked on its own so that errors name the file."""
    if path is None:
        return []
    if not Path(path).is_file():
        raise UserError(f"config file {str(path)!r} does not exist")
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except yaml.YAMLError as err:
        raise UserError(f"{path}: not valid YAML ({' '.join(str(err).split())})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a mapping of config sections, got {type(data).__name__}")
    args = file_overrides(cls, data)
    try:
        apply_overrides(cls(), args)
    except ValueError as err:
        raise UserError(f"{path}: {err}") from None
    return args
