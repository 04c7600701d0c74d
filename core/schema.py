"""Strict loading of YAML into frozen dataclass trees.

The config tree is plain frozen dataclasses; this module turns a parsed YAML mapping into
that tree and refuses anything it does not understand. Every failure is a `ConfigError`
carrying the dotted path of the offending key, so the CLI can print exactly one line:

    config error: learner.lr: must be > 0 (got -1)

Field constraints live in `dataclasses.field(metadata=...)`, written with `spec()`:
`gt`, `ge`, `lt`, `le` for numbers, `min_len` for strings and lists, `pattern` for
strings. Enumerations are `typing.Literal`. A dataclass may define `validate(self)`
returning `(dotted_suffix, message)` pairs for checks across fields.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from typing import Any, Literal, get_args, get_origin

import yaml

__all__ = [
    "ConfigError",
    "spec",
    "from_dict",
    "to_dict",
    "apply_overrides",
    "load_yaml_text",
    "leaf_paths",
    "check_bounds",
]


class ConfigError(ValueError):
    """A config value is wrong; `path` is dotted (`learner.lr`), `message` says what to do."""

    def __init__(self, path: str, message: str, origin: str | None = None):
        self.path = path
        self.message = message
        self.origin = origin
        where = f"{path}: " if path else ""
        suffix = f" [{origin}]" if origin else ""
        super().__init__(f"{where}{message}{suffix}")


def spec(default: Any = dataclasses.MISSING, *, help: str, factory: Any = None, **checks: Any) -> Any:
    """A dataclass field with a one-line help text and optional range/shape checks."""
    unknown = set(checks) - {"gt", "ge", "lt", "le", "min_len", "pattern"}
    if unknown:
        raise TypeError(f"spec(): unknown checks {sorted(unknown)}")
    meta = {"help": help, **checks}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


# PyYAML implements YAML 1.1, where `3e-4` is a *string*. Users write learning rates
# that way, so the loader also resolves exponent floats without a dot.
class _Loader(yaml.SafeLoader):
    def compose_node(self, parent, index):
        # An alias (*name) repeats a node; nested ones grow exponentially (a few hundred bytes
        # expand to megabytes, for seconds). A config has no need of them: refuse every one.
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(
                None,
                None,
                f"alias *{event.anchor} is not accepted in a config (no anchors or aliases); write the value out",
                event.start_mark,
            )
        return super().compose_node(parent, index)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def _no_duplicates(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, yaml.Node] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            mark = key_node.start_mark
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (line {mark.line + 1}); each key may appear once", mark
            )
        seen[key] = key_node
    return loader.construct_mapping(node, deep=deep)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _no_duplicates)


def load_yaml_text(text: str, source: str = "<string>") -> Any:
    """Parse YAML text; syntax errors become ConfigError naming file, line and column, and so
    does input no config has any business holding (a number of thousands of digits, thousands
    of nested brackets): one line, never a traceback."""
    try:
        return yaml.load(text, Loader=_Loader)  # SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark else source
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError("", f"{where}: invalid YAML: {_clip(problem, 200)}") from None
    except RecursionError:
        raise ConfigError("", f"{source}: nested too deeply to be a config; flatten it") from None
    except ValueError as exc:  # int(): more digits than Python converts (sys.int_info.str_digits_check_threshold)
        raise ConfigError("", f"{source}: a value is out of range: {_clip(str(exc).split(';')[0], 200)}") from None


def _clip(text: str, limit: int = 80) -> str:
    """Text as it goes into a one-line error: cut short if it is long."""
    return text if len(text) <= limit else f"{text[: limit - 20]}... ({len(text)} characters)"


def _short(value: Any, limit: int = 80) -> str:
    return _clip(repr(value), limit)


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(str(a) for a in get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in get_args(tp))
    if origin in (list, tuple):
        return f"list of {_type_name(get_args(tp)[0])}"
    if origin is dict:
        return f"mapping of str to {_type_name(get_args(tp)[1])}"
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return "mapping"
    return getattr(tp, "__name__", str(tp))


def _got(value: Any) -> str:
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return f"{type(value).__name__} {_short(value)}"


def _join(path: str, key: str | int) -> str:
    return f"{path}.{key}" if path else str(key)


def _check_bounds(path: str, value: Any, meta: typing.Mapping[str, Any], shown: Any = None) -> None:
    shown = _short(value if shown is None else shown)
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(path, f"must be a finite number (got {shown})")
    for op, test, word in (
        ("gt", lambda v, b: v > b, ">"),
        ("ge", lambda v, b: v >= b, ">="),
        ("lt", lambda v, b: v < b, "<"),
        ("le", lambda v, b: v <= b, "<="),
    ):
        if op in meta and value is not None and not test(value, meta[op]):
            raise ConfigError(path, f"must be {word} {meta[op]} (got {shown})")
    if "min_len" in meta and value is not None and len(value) < meta["min_len"]:
        raise ConfigError(path, f"must have at least {meta['min_len']} item(s)/character(s) (got {_short(value)})")
    if "pattern" in meta and value is not None and not re.fullmatch(meta["pattern"], value):
        raise ConfigError(path, f"must match {meta['pattern']} (got {_short(value)})")


def check_bounds(obj: Any, where: str) -> None:
    """Apply each field's spec() bounds to a dataclass built in code rather than from YAML:
    ConfigError naming `where.field`, so code and config are held to the same rules."""
    for f in dataclasses.fields(obj):
        _check_bounds(f"{where}.{f.name}", getattr(obj, f.name), f.metadata)


def _convert(tp: Any, value: Any, path: str, base: Any = None) -> Any:
    origin = get_origin(tp)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, path, base=base)
    if origin is Literal:
        choices = get_args(tp)
        if value not in choices or isinstance(value, bool) != any(isinstance(c, bool) for c in choices):
            raise ConfigError(path, f"must be one of {', '.join(map(str, choices))} (got {value!r})")
        return value
    if origin in (typing.Union, types.UnionType):
        args = get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise ConfigError(path, f"must not be null; expected {_type_name(tp)}")
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(arg, value, path)
            except ConfigError as exc:
                errors.append(exc)
        if len(errors) == 1:
            raise errors[0]
        raise ConfigError(path, f"expected {_type_name(tp)} (got {_got(value)})")
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(path, f"expected {_type_name(tp)} (got {_got(value)})")
        args = get_args(tp)
        if origin is tuple and (len(args) != 2 or args[1] is not Ellipsis):
            raise TypeError(f"schema: only tuple[X, ...] is supported at {path}")
        items = [_convert(args[0], v, _join(path, i)) for i, v in enumerate(value)]
        # Frozen configs hold tuples so a loaded tree is immutable all the way down.
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(path, f"expected {_type_name(tp)} (got {_got(value)})")
        _, val_tp = get_args(tp)
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ConfigError(_join(path, str(k)), f"keys must be strings (got {_got(k)})")
            out[k] = _convert(val_tp, v, _join(path, k))
        return out
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(path, f"expected bool (true/false) (got {_got(value)})")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(path, f"expected int (got {_got(value)})")
        if not -(2**63) <= value < 2**63:
            raise ConfigError(path, f"must fit in 64 bits (got an int of {len(str(abs(value)))} digits)")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(path, f"expected float (got {_got(value)})")
        try:
            value = float(value)
        except OverflowError:
            raise ConfigError(path, f"must be a finite number (got an int of {len(str(abs(value)))} digits)") from None
        if not math.isfinite(value):
            raise ConfigError(path, f"must be a finite number (got {value})")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(path, f"expected str (got {_got(value)}); quote it in YAML")
        return value
    raise TypeError(f"schema: unsupported field type {tp!r} at {path}")


def _default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def from_dict(cls: type, data: Any, path: str = "", base: Any = None) -> Any:
    """Build dataclass `cls` from a mapping, strictly.

    Missing keys take their values from `base` when given, else the field defaults. A nested
    section that is given only in part keeps the rest of *its field's* default (so
    `slurm.learner: {time_min: 5}` leaves the learner on the `gpu` partition rather than
    falling back to SlurmRoleConfig's class defaults).
    """
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(
            path,
            f"expected a mapping with keys {', '.join(f.name for f in dataclasses.fields(cls))} (got {_got(data)})",
        )
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = typing.get_type_hints(cls)
    for key in data:
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(_join(path, str(key)), f"unknown key{hint}; valid keys: {', '.join(fields) or '(none)'}")
    kwargs = {}
    for name, f in fields.items():
        sub = _join(path, name)
        default = getattr(base, name) if base is not None else _default_of(f)
        if name in data:
            nested_base = (
                default if dataclasses.is_dataclass(hints[name]) and default is not dataclasses.MISSING else None
            )
            value = _convert(hints[name], data[name], sub, base=nested_base)
            _check_bounds(sub, value, f.metadata, shown=data[name])
            kwargs[name] = value
        elif default is dataclasses.MISSING:
            raise ConfigError(sub, "required key is missing")
        else:
            kwargs[name] = default
    obj = cls(**kwargs)
    validate = getattr(obj, "validate", None)
    if callable(validate):
        for suffix, message in validate() or ():
            raise ConfigError(_join(path, suffix), message)
    return obj


def to_dict(obj: Any) -> Any:
    """Plain YAML-able data (tuples become lists) from a config tree."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def apply_overrides(data: dict, overrides: typing.Sequence[str]) -> tuple[dict, dict[str, str]]:
    """Apply `dotted.key=value` overrides to raw YAML data (values parsed as YAML).

    Returns the new data and a map from dotted key to the override text, so a validation
    error can say that an override, not the file, carried the bad value.
    """
    import copy

    data = copy.deepcopy(data) if data is not None else {}
    origins: dict[str, str] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key or any(part == "" for part in key.split(".")):
            raise ConfigError("", f"override {item!r}: expected KEY=VALUE with a dotted key, e.g. learner.lr=3e-4")
        value = load_yaml_text(raw, source=f"override {_clip(item, 60)!r}") if raw.strip() else ""
        parts = key.split(".")
        node: Any = data
        for depth, part in enumerate(parts[:-1]):
            here = ".".join(parts[: depth + 1])
            if isinstance(node, list):
                node = _list_slot(node, part, here, item)
                continue
            if not isinstance(node, dict):
                raise ConfigError(here, f"cannot set a sub-key of a {type(node).__name__} [override {item}]")
            if node.get(part) is None:
                node[part] = {}
            node = node[part]
        last = parts[-1]
        if isinstance(node, list):
            idx = _list_index(node, last, key, item)
            node[idx] = value
        elif isinstance(node, dict):
            node[last] = value
        else:
            raise ConfigError(
                ".".join(parts[:-1]), f"cannot set a sub-key of a {type(node).__name__} [override {item}]"
            )
        origins[key] = item
    return data, origins


def _list_index(node: list, part: str, path: str, item: str) -> int:
    if not part.isdigit() or int(part) >= len(node):
        raise ConfigError(path, f"list index must be 0..{len(node) - 1} (got {part!r}) [override {item}]")
    return int(part)


def _list_slot(node: list, part: str, path: str, item: str) -> Any:
    return node[_list_index(node, part, path, item)]


def leaf_paths(cls: type, prefix: str = "") -> list[tuple[str, str]]:
    """(dotted path, help text) of every field, for docs and completeness tests."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        path = _join(prefix, f.name)
        tp = hints[f.name]
        out.append((path, f.metadata.get("help", "")))
        if get_origin(tp) in (list, tuple) and dataclasses.is_dataclass(get_args(tp)[0]):
            tp = get_args(tp)[0]  # list items are documented once, without an index
        if dataclasses.is_dataclass(tp):
            out.extend(leaf_paths(tp, path))
    return out
