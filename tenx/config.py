"""Typed configuration trees: dataclasses loaded from TOML with dotted-key overrides.

Each component owns a small dataclass `Config` whose fields carry a `help` string and, for numbers, bounds
(`ge`, `gt`, `le`, `lt`) in their metadata; choices are Literal types. `validate_tree` checks every node's
bounds under its dotted path, then calls the node's `validate()`, if it has one, for what bounds cannot say
(what relates several fields), naming the bad field. A config also validated on its own (a `LadderConfig`
built from flags) names its section once, `SECTION: ClassVar[str] = "ladder"`, and its `validate()` calls
`check_bounds(self)`. This module only knows how to turn a TOML table into such a tree, checking every key,
type and bound before any work starts, and how to turn the tree back into plain data.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import operator
import reprlib
import sys
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

from tenx.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

T = TypeVar("T")


BOUNDS = {
    "ge": (">=", operator.ge),
    "gt": (">", operator.gt),
    "le": ("<=", operator.le),
    "lt": ("<", operator.lt),
}
"""The bounds a numeric field may carry (`field(..., ge=1)`): how a message writes each, and its test."""
INT_MIN, INT_MAX = -(2**63), 2**63 - 1
"""An int field holds a 64-bit signed integer, as TOML defines them (tomllib reads larger ones)."""

_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 80
_REPR.maxlevel = 3


def _show(value: Any) -> str:
    """repr of a value for a message, cut short when long or deeply nested (a huge integer as 2.01e+281)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**20:
        return (
            f"{float(value):.3g}" if abs(value) < 10**308 else f"an integer of {len(str(abs(value)))} digits"
        )
    return _REPR.repr(value)


def field(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    default_factory: Any = dataclasses.MISSING,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
) -> Any:
    """A dataclass field with a help string (shown in errors and docs) and optional numeric bounds.

    `ge`/`gt`/`le`/`lt` bound a number (value >= ge, > gt, <= le, < lt); `check_bounds` enforces them
    (a None value and a non-number alternative such as 'auto' are not bounded). Choices are a Literal type.
    """
    bounds = {k: v for k, v in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt)) if v is not None}
    metadata = {"help": help, **({"bounds": bounds} if bounds else {})}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def bounds_text(f: dataclasses.Field) -> str:  # type: ignore[type-arg]
    """What a field's bounds allow, as a message writes it: '>= 1', 'in [0, 1)'; '' when unbounded."""
    bounds = f.metadata.get("bounds", {})
    lower = next(((k, bounds[k]) for k in ("ge", "gt") if k in bounds), None)
    upper = next(((k, bounds[k]) for k in ("le", "lt") if k in bounds), None)
    if lower and upper:
        return (
            f"in {'[' if lower[0] == 'ge' else '('}{lower[1]}, {upper[1]}{']' if upper[0] == 'le' else ')'}"
        )
    bound = lower or upper
    return f"{BOUNDS[bound[0]][0]} {bound[1]}" if bound else ""


def _check_node_bounds(cfg: Any, where: str) -> None:
    """Check the bounds of `cfg`'s own fields (not of nested configs)."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        path = f"{where}.{f.name}" if where else f.name
        if isinstance(value, float) and not math.isfinite(value):  # a flag's float() takes inf and nan
            raise ConfigError(f"{path}: must be a finite number, got {value}")
        if isinstance(value, int) and not INT_MIN <= value <= INT_MAX:
            raise ConfigError(f"{path}: {_show(value)} does not fit in a 64-bit integer")
        if "bounds" not in f.metadata:
            continue
        if not all(BOUNDS[k][1](value, bound) for k, bound in f.metadata["bounds"].items()):  # NaN fails
            others = _literals(get_type_hints(type(cfg))[f.name])  # 'auto' of `int | Literal['auto']`
            alternatives = "".join(f" or {a!r}" for a in others if not isinstance(a, (int, float)))
            raise ConfigError(f"{path}: must be {bounds_text(f)}{alternatives}, got {value}")


def _literals(tp: Any) -> list[Any]:
    """The Literal values an annotation allows."""
    if get_origin(tp) is Literal:
        return list(get_args(tp))
    if get_origin(tp) in (Union, types.UnionType):
        return [v for arg in get_args(tp) for v in _literals(arg)]
    return []


def check_bounds(cfg: Any, where: str | None = None) -> None:
    """Check the `ge`/`gt`/`le`/`lt` bounds of every field of a config tree; the error names the field.

    `where` is the tree's dotted path ('parallel.replicas'; by default the config's `SECTION`, else none).
    `from_dict` checks every node it builds and `validate_tree` every node of a tree, so a tree built in
    Python is checked too.
    """
    where = getattr(cfg, "SECTION", "") if where is None else where
    _check_node_bounds(cfg, where)
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        path = f"{where}.{f.name}" if where else f.name
        if dataclasses.is_dataclass(value):
            check_bounds(value, path)
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if dataclasses.is_dataclass(item):
                    check_bounds(item, f"{path}[{i}]")


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in get_args(tp))
    if origin is list:
        (inner,) = get_args(tp)
        return f"list[{_type_name(inner)}]"
    if tp is type(None):
        return "none (omit the key)"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check `value` against the annotation `tp`; return it (ints widen to float). Raise ConfigError."""
    origin = get_origin(tp)
    if origin is Literal:
        allowed = get_args(tp)
        if value in allowed and type(value) is type(allowed[0]):
            return value
        raise ConfigError(
            f"{where}: {_show(value)} is not allowed; choose one of {', '.join(map(repr, allowed))}"
        )
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:  # Optional[X]: X's own message is the most specific
            return _coerce(value, options[0], where)
        for arg in options:
            try:
                return _coerce(value, arg, where)
            except ConfigError:
                pass
        raise ConfigError(f"{where}: expected {_type_name(tp)}, got {_show(value)} ({type(value).__name__})")
    if origin is list:
        (inner,) = get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(
                f"{where}: expected {_type_name(tp)}, got {_show(value)} ({type(value).__name__})"
            )
        return [_coerce(v, inner, f"{where}[{i}]") for i, v in enumerate(value)]
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):  # TOML and overrides accept inf and nan; no tenx field does
                raise ConfigError(f"{where}: must be a finite number, got {_show(value)}")
            return float(value)
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            if not INT_MIN <= value <= INT_MAX:  # TOML integers are 64-bit; so are torch's and numpy's
                raise ConfigError(f"{where}: {_show(value)} does not fit in a 64-bit integer")
            return value
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is str:
        if isinstance(value, str):
            if "\x00" in value:
                raise ConfigError(f"{where}: {_show(value)} contains a NUL character")
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:  # lone surrogates: bytes of a command-line argument that are not UTF-8
                raise ConfigError(f"{where}: {_show(value)} is not valid UTF-8 text") from None
            return value
    elif isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if isinstance(value, dict):
            return from_dict(tp, value, where)
    else:  # pragma: no cover - a programming error in a Config definition
        raise TypeError(f"unsupported config annotation {tp!r} at {where}")
    raise ConfigError(f"{where}: expected {_type_name(tp)}, got {_show(value)} ({type(value).__name__})")


def from_dict(cls: type[T], data: dict[str, Any], where: str = "") -> T:
    """Build dataclass `cls` from a dict, rejecting unknown keys and ill-typed values."""
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{where}.{key}" if where else key
        if key not in fields:
            allowed = ", ".join(sorted(fields))
            raise ConfigError(
                f"unknown key {_show(path)}; allowed keys{' in [' + where + ']' if where else ''}: {allowed}"
            )
        kwargs[key] = _coerce(value, hints[key], path)
    cfg = cls(**kwargs)
    _check_node_bounds(cfg, where)  # nested configs were checked as they were built
    return cfg


def to_dict(cfg: Any) -> dict[str, Any]:
    """Plain-data form of a config tree (None values dropped, so the result is valid TOML/JSON)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            value = to_dict(value)
        if value is not None:
            out[f.name] = value
    return out


def parse_override(text: str) -> tuple[list[str], Any]:
    """Parse `section.key=value`; the value is read as a TOML literal, else taken as a bare string."""
    if "=" not in text:
        raise ConfigError(
            f"override {_show(text)} must look like section.key=value (e.g. --set optim.lr=3e-4)"
        )
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {_show(text)}: empty key")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except (tomllib.TOMLDecodeError, RecursionError):  # RecursionError: brackets nested too deeply
        value = raw
    return key.split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply dotted-key overrides to a nested dict (in place) and return it."""
    for text in overrides:
        keys, value = parse_override(text)
        node = data
        for k in keys[:-1]:
            child = node.setdefault(k, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {_show(text)}: '{k}' is a value, not a section")
            node = child
        node[keys[-1]] = value
    return data


def drop_replaced_alternatives(cls: type, data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Remove from `data` (in place) the values that `overrides` replace by setting an alternative to them.

    A config node lists its mutually exclusive fields as `ALTERNATIVES`, a tuple of groups of field names.
    Overrides that set two of one group are left to the node's own check, which refuses them."""
    overridden = {tuple(parse_override(text)[0]) for text in overrides}
    for keys in overridden:
        node_cls: Any = cls
        for k in keys[:-1]:
            hints = get_type_hints(node_cls) if dataclasses.is_dataclass(node_cls) else {}
            node_cls = hints.get(k)
        if node_cls is None or not dataclasses.is_dataclass(node_cls):
            continue
        node: Any = data
        for k in keys[:-1]:
            node = node.get(k) if isinstance(node, dict) else None
        if not isinstance(node, dict):
            continue
        for group in getattr(node_cls, "ALTERNATIVES", ()):
            if keys[-1] in group:
                for other in group:
                    if other != keys[-1] and (*keys[:-1], other) not in overridden:
                        node.pop(other, None)
    return data


def read_toml(path: str | Path) -> dict[str, Any]:
    """Read a TOML file, naming it in any error."""
    path = Path(path)
    try:
        is_file = path.is_file()
    except (OSError, ValueError) as e:  # a name too long for the file system, an embedded NUL byte
        raise ConfigError(f"config file {str(path)!r} cannot be used: {e}") from None  # the whole path
    if not is_file:
        if path.exists():
            raise ConfigError(f"config file {path} is not a regular file; give a .toml file")
        raise ConfigError(f"config file {path} does not exist (shipped configs live in configs/)")
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"config file {path} cannot be read ({e.strerror or e})") from None
    try:
        return tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{path}: not valid TOML: the file is not UTF-8 text (byte {e.object[e.start]:#04x} at offset "
            f"{e.start}); save it as UTF-8"
        ) from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    except RecursionError:
        raise ConfigError(f"{path}: not valid TOML: arrays or tables nested too deeply") from None


def load(cls: type[T], path: str | Path | None, overrides: list[str] | None = None) -> T:
    """Load config tree `cls` from an optional TOML file plus overrides, then validate it.

    An override of one of a node's `ALTERNATIVES` (train.steps or train.tokens) replaces the file's value
    of the others: `--set train.steps=40` shortens a config that sets a token budget."""
    data = read_toml(path) if path is not None else {}
    drop_replaced_alternatives(cls, data, overrides or [])
    apply_overrides(data, overrides or [])
    source = str(path) if path is not None else "<defaults>"
    try:
        cfg = from_dict(cls, data)
        validate_tree(cfg)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    return cfg


def validate_tree(cfg: Any, where: str = "") -> None:
    """Check every config node's bounds and call its `validate()`, children first; an error names the
    node's path (`where` is the tree's own, with a trailing dot: 'parallel.')."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            validate_tree(value, f"{where}{f.name}.")
    _check_node_bounds(cfg, where.removesuffix(".") if where else getattr(cfg, "SECTION", ""))
    validate = getattr(cfg, "validate", None)
    if validate is not None:
        try:
            validate()
        except ConfigError as e:
            raise ConfigError(f"{where}{e}" if where and not str(e).startswith(where) else str(e)) from None


def describe(cls: type, prefix: str = "") -> list[tuple[str, str, str, str, str]]:
    """(key, type, default, help, bounds) rows for every field of a config tree, for docs and `--help`."""
    rows: list[tuple[str, str, str, str, str]] = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            rows.extend(describe(tp, f"{prefix}{f.name}."))  # type: ignore[arg-type]
            continue
        default = (
            f.default
            if f.default is not dataclasses.MISSING
            else (f.default_factory() if f.default_factory is not dataclasses.MISSING else "(required)")
        )
        rows.append(
            (prefix + f.name, _type_name(tp), repr(default), f.metadata.get("help", ""), bounds_text(f))
        )
    return rows


def field_reference(cls: type) -> str:
    """Markdown tables of every field of a config tree, one per section (docs/config.md embeds this)."""

    def esc(text: str) -> str:
        return text.replace("|", "\\|")

    out: list[str] = []
    current = None
    for key, type_name, default, help_text, bounds in describe(cls):
        section = key.rsplit(".", 1)[0]
        if section != current:
            if current is not None:
                out.append("")
            out += [
                f"### `[{section}]`",
                "",
                "| key | type | range | default | meaning |",
                "|-----|------|-------|---------|---------|",
            ]
            current = section
        out.append(f"| `{key}` | {esc(type_name)} | {esc(bounds)} | `{esc(default)}` | {esc(help_text)} |")
    return "\n".join(out) + "\n"


# ----- command-line flags from config fields (the packages' cli.py) -----------------------------------------
def add_config_arguments(
    parser: argparse.ArgumentParser,
    cls: type,
    fields: Sequence[str],
    *,
    flags: dict[str, str] | None = None,
    overrides: bool = False,
    show_defaults: bool = False,
) -> None:
    """Add a flag for each of `fields` of config dataclass `cls`, its type, default, help and choices taken
    from the field: `--vocab-size` for `vocab_size`; a Literal gives choices, a list a repeatable flag, a
    bool (default False) a switch; a field without a default is a required flag.

    `flags` renames flags ({"patterns": "--pattern"}); with `overrides` every default is None (the flag
    overrides a value read elsewhere, e.g. from a TOML file); `show_defaults` appends "(default X)" to help.
    """
    hints = get_type_hints(cls)
    by_name = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    for f in (by_name[name] for name in fields):
        flag = (flags or {}).get(f.name, "--" + f.name.replace("_", "-"))
        tp = hints[f.name]
        if get_origin(tp) in (Union, types.UnionType):  # X | None: a flag of X, default None
            (tp,) = [a for a in get_args(tp) if a is not type(None)]
        default = None if overrides or f.default is dataclasses.MISSING else f.default
        kw: dict[str, Any] = {"dest": f.name, "help": f.metadata["help"].replace("%", "%%")}
        if tp is bool:
            if f.default is not False:
                raise TypeError(f"{cls.__name__}.{f.name}: a switch (bool flag) must default to False")
            parser.add_argument(flag, action="store_true", **kw)
            continue
        kw.update(default=default, metavar=flag.lstrip("-").replace("-", "_").upper())
        no_default = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        kw["required"] = no_default and not overrides
        if get_origin(tp) is Literal:
            kw.update(choices=get_args(tp), metavar=None)
            tp = type(get_args(tp)[0])
        elif get_origin(tp) is list:
            (tp,) = get_args(tp)
            kw.update(action="append", help=kw["help"] + " (repeatable)")
        if tp is not str:
            kw["type"] = tp
        if show_defaults and default is not None:
            kw["help"] += f" (default {default})"
        parser.add_argument(flag, **kw)


def config_from_args(cls: type[T], args: argparse.Namespace, fields: Sequence[str]) -> T:
    """Config dataclass `cls` from the flags `add_config_arguments` added for `fields`; a flag not given
    (None) leaves the field's default."""
    return cls(**{name: getattr(args, name) for name in fields if getattr(args, name) is not None})


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} as TOML")


def dumps_toml(cfg: Any) -> str:
    """TOML text of a config tree (sections of scalars, nested sections as [a.b]), readable by `load`."""
    lines: list[str] = []

    def section(name: str, values: dict[str, Any]) -> None:
        lines.append(f"\n[{name}]")
        nested = {k: v for k, v in values.items() if isinstance(v, dict)}
        lines.extend(f"{k} = {_toml_value(v)}" for k, v in values.items() if k not in nested)
        for k, v in nested.items():
            section(f"{name}.{k}", v)

    top = to_dict(cfg)
    for key, values in top.items():
        if not isinstance(values, dict):
            lines.append(f"{key} = {_toml_value(values)}")
    for key, values in top.items():
        if isinstance(values, dict):
            section(key, values)
    return "\n".join(lines).lstrip("\n") + "\n"
