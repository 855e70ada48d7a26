"""Typed configuration: dataclasses, loaded from YAML, overridden by dotted `key=value` arguments.

Each layer defines the dataclass of its own settings next to the code that reads them (one place per default);
the job's top-level config composes them. Unknown keys are errors, never silently ignored.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import difflib
import json
import math
import re
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


class UserError(ValueError):
    """A mistake in what the user gave (a config key or value, a model or data path, a dataset row): the commands
    report it as one line naming the key, path or row, and exit with status 2 (cli.py)."""


class UnknownKey(UserError):
    """A key no section has: one line naming it, its section and the closest keys there are (difflib), never the
    section's whole key list. `key` is the dotted key as given, `bad` its part up to the first unknown name; a
    `reason` (a verl key's, job/verl_keys.py) is said instead of 'unknown key'."""

    def __init__(self, key: str, bad: str, hint: str, where: str = "", reason: str = ""):
        self.key, self.bad, self.hint, self.where, self.reason = key, bad, hint, where, reason
        section, _, name = bad.rpartition(".")
        super().__init__(where + (reason or f"unknown key {name!r}{f' in {section}' if section else ''}; {hint}"))

    def within(self, where: str) -> UnknownKey:
        """The same error said of a file (its keys are read as overrides)."""
        return UnknownKey(self.key, self.bad, self.hint, where + self.where, self.reason)

    def because(self, reason: str) -> UnknownKey:
        return UnknownKey(self.key, self.bad, self.hint, self.where, reason)


def dotted_keys(cls: type, prefix: str = "") -> list[str]:
    """Every key of dataclass `cls` as a dotted path, sections included (`learner`, `learner.loss`,
    `learner.loss.clip_low`, ...)."""
    out = []
    for name, tp in _hints(cls).items():
        if name not in {f.name for f in dataclasses.fields(cls)}:
            continue
        out.append(prefix + name)
        if dataclasses.is_dataclass(tp):
            out += dotted_keys(tp, f"{prefix}{name}.")
    return out


def closest_keys(cls: type, key: str, bad: str = "") -> list[str]:
    """The keys of `cls` closest to a mistyped dotted `key` whose part `bad` names nothing: a name of the same section
    close to it (`trainer.stepz` -> trainer.steps, `learner.los.kl_coef` -> learner.loss.kl_coef), else a key of the
    same last name wherever it lives (`lr` -> learner.lr, `learner.clip_high` -> learner.loss.clip_high)."""
    bad = bad or key
    keys = dotted_keys(cls)
    section, _, name = bad.rpartition(".")
    last = lambda k: k.rpartition(".")[2]  # noqa: E731
    siblings = [last(k) for k in keys if k.rpartition(".")[0] == section]
    close = _closest(name, siblings, 0.75)
    if close:
        found = [f"{section}.{c}" if section else c for c in close]
        rest = key[len(bad):]  # the keys under a mistyped section
        return [f + rest if f + rest in keys else f for f in found]
    ancestors = {key.rsplit(".", i)[0] for i in range(1, key.count(".") + 1)}
    names = _closest(last(key), sorted({last(k) for k in keys}), 0.8)
    return sorted((k for k in keys if last(k) in names and k not in ancestors),
                  key=lambda k: (names.index(last(k)), -difflib.SequenceMatcher(None, key, k).ratio()))[:3]


def _closest(word: str, options: list[str], cutoff: float) -> list[str]:
    """The options about as close to `word` as the closest one (difflib's ratio, at least `cutoff`), closest first."""
    scored = sorted(((difflib.SequenceMatcher(None, word, o).ratio(), o) for o in options), reverse=True)
    best = scored[0][0] if scored else 0.0
    return [o for r, o in scored if r >= max(cutoff, best - 0.05)]


def unknown_key(cls: type, key: str, bad: str, where: str = "", prefix: str = "") -> UnknownKey:
    """The error for `key` whose part `bad` names nothing in `cls` (the section at `prefix`), with the closest keys
    as the hint."""
    close = [prefix + k for k in closest_keys(cls, key, bad)]
    section = prefix + bad.rpartition(".")[0]
    hint = (f"did you mean {' or '.join(close)}?" if close else
            f"`treepo-ray train --print-config {section}` lists its keys" if section else
            f"the top-level keys are {', '.join(f.name for f in dataclasses.fields(cls))}")
    return UnknownKey(key, bad, hint, where)


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
    unknown = sorted(set(data) - names)
    if unknown:
        raise unknown_key(cls, unknown[0], unknown[0], f"{where}: " if where else "", f"{where}." if where else "")
    kwargs = {k: _coerce(v, hints[k], f"{where}.{k}" if where else k) for k, v in data.items()}
    try:
        return cls(**kwargs)
    except ValueError as err:  # a section's __post_init__ check; its message names the key (said with its origin)
        if isinstance(err, UserError) and (type(err) is not UserError or _ORIGINS.get() is None):
            raise
        raise UserError(str(err) + _origin_note(cls, data, where, str(err))) from None


_ORIGINS: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar("key_origins", default=None)


@contextlib.contextmanager
def key_origins(origins: dict[str, str]):
    """While inside, a section's check that refuses a value says where each key it names got its value: `origins`
    maps a dotted key (or a section) to e.g. 'from my.yaml' or 'command line'; a key it lacks is 'default'."""
    token = _ORIGINS.set(origins)
    try:
        yield
    finally:
        _ORIGINS.reset(token)


def origin_of(key: str, origins: dict[str, str]) -> str:
    """Where `key` got its value: its own entry in `origins`, else its closest section's, else 'default'."""
    while key:
        if key in origins:
            return origins[key]
        key = key.rpartition(".")[0]
    return "default"


def _origin_note(cls: type, data: dict, where: str, message: str) -> str:
    """' [key = value (origin); ...]' for each key of section `cls` (at `where`, built from `data`) that `message`
    names, dotted (`rollout.treepo.width`) or bare (`width`, `TreePOConfig.width`); '' outside key_origins."""
    origins = _ORIGINS.get()
    if origins is None:
        return ""
    prefix, said = f"{where}." if where else "", []
    sections = {k for k in dotted_keys(cls) if _is_section(cls, k)}
    for key in dotted_keys(cls):
        if key in sections:
            continue
        full = prefix + key
        named = re.search(rf"(?<![\w.]){re.escape(full)}(?!\w)", message) or ("." not in key and re.search(
            rf"(?:(?<![\w.])|{re.escape(cls.__name__)}\.){re.escape(key)}(?!\w)", message))
        if not named:
            continue
        node: Any = data
        for part in key.split("."):
            node = node.get(part, "?") if isinstance(node, dict) else "?"
        value = "" if node == "?" else f" = {node!r}"
        said.append(f"{full}{value} ({origin_of(full, origins)})")
    return f" [{'; '.join(said)}]" if said else ""


def _is_section(cls: type, key: str) -> bool:
    for part in key.split("."):
        cls = _hints(cls)[part]
    return dataclasses.is_dataclass(cls)


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def select(cls: type, data: dict, keys: list[str]) -> dict:
    """The parts of `data` (a `cls` as a dict) that the dotted `keys` name (a section or a key each), nested as in
    `data`; all of it when `keys` is empty. A key `cls` lacks is an UnknownKey."""
    if not keys:
        return data
    known = set(dotted_keys(cls))
    out: dict = {}
    for key in keys:
        if key not in known:
            parts = key.split(".")
            bad = next(".".join(parts[:i]) for i in range(1, len(parts) + 1) if ".".join(parts[:i]) not in known)
            raise unknown_key(cls, key, bad)
        source, target, parts = data, out, key.split(".")
        for part in parts[:-1]:
            source, target = source[part], target.setdefault(part, {})
        target[parts[-1]] = source[parts[-1]]
    return out


def _section_type(cls: type, parts: list[str], depth: int, where: str, root: type) -> type | None:
    """Type of field parts[depth] of dataclass `cls` (the section at parts[:depth] of `root`) if it is itself a
    dataclass (a section), else None; UnknownKey when `cls` has no such field."""
    key = parts[depth]
    if key not in {f.name for f in dataclasses.fields(cls)}:
        raise unknown_key(root, ".".join(parts), ".".join(parts[:depth + 1]), f"{where}: ")
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
        for depth, part in enumerate(parts[:-1]):
            if cls is not None:
                sub = _section_type(cls, parts, depth, f"override {item!r}", type(cfg))
                if sub is None and not isinstance(node.get(part), dict):
                    raise UserError(f"override {item!r}: {part!r} is not a section of the config")
                cls = sub
            node = node.setdefault(part, {})
        if cls is not None:
            _section_type(cls, parts, len(parts) - 1, f"override {item!r}", type(cfg))
        try:
            node[parts[-1]] = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError as err:
            raise UserError(f"override {item!r}: the value is not valid YAML ({str(err).splitlines()[0]})") from None
    return from_dict(type(cfg), data)


def file_overrides(cls: type | None, data: dict, prefix: str = "") -> list[str]:
    """A YAML mapping as `a.b=value` overrides: sections (dataclass fields) are walked into, every other value
    (free-form mappings such as model.engine_kwargs included) is set whole."""
    hints = _hints(cls) if dataclasses.is_dataclass(cls) else {}
    out = []
    for key, value in data.items():
        sub = hints.get(key)
        # A mapping under a key no section has (verl's `actor_rollout_ref: {rollout: {n: 8}}`) is walked too, so
        # that the error names the whole dotted key, not only its first part.
        unknown = cls is None or (dataclasses.is_dataclass(cls) and key not in hints)
        if isinstance(value, dict) and value and (dataclasses.is_dataclass(sub) or unknown):
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
        with key_origins({arg.partition("=")[0]: f"from {path}" for arg in args}):
            apply_overrides(cls(), args)
    except UnknownKey as err:
        raise err.within(f"{path}: ") from None
    except ValueError as err:
        raise UserError(f"{path}: {err}") from None
    return args
