"""One loader for every settings section: TOML tables, `QUICEDGE_*` environment, command line.

A section is a plain `@dataclass` (typed fields, a docstring under each, a `validate()` method)
registered as a `Section` under its TOML table name. From that one declaration the loader makes
the command-line flags (help text = the field's docstring, plus its default), the environment
variables and the TOML reader, and checks every value against the field's type.

Precedence, highest first: flags, environment, TOML, the dataclass defaults.

Types understood: `int`, `float` (an int is accepted), `str`, `bool`, enums and `Literal[...]`
(by value), `X | None`, `list[X]`, `dict[str, X]` (TOML only), nested dataclasses (a TOML
sub-table) and `list[SomeDataclass]` (a TOML array of tables, `[[name]]` at the top level).
Field metadata can rename a field's flag (`"flag": "--retries"`, or `False` for none), read a
custom type from text (`"parse": callable`), show its default (`"format": callable`), name its
value in `--help` (`"metavar"`), leave a
field to the caller (`"load": False`), or read a nested dataclass's keys from the parent's own
table (`"flatten": True`, with `"flags": {child: "--name"}` to rename its children's flags).

Every mistake is a `SettingsError` (a `ValueError`) whose message is one line naming the
setting and where it came from (`--workers`, `$QUICEDGE_WORKERS`, `[serve] workers`).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import enum
import functools
import inspect
import math
import textwrap
import types
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

T = TypeVar("T")

ENV_PREFIX = "QUICEDGE_"


class SettingsError(ValueError):
    """A setting that cannot be used: the message is one line for the user."""


@dataclass(frozen=True)
class Section:
    """One TOML table (or top-level array of tables) read into `kind`."""

    name: str
    """TOML table name; also the prefix of its settings in messages (`proxy.max_retries`)."""
    kind: Any
    """A dataclass, or `list[SomeDataclass]` for a TOML array of tables."""
    flags: Mapping[str, str | bool] = field(default_factory=dict)
    """Flag name per field where it is not `--field-name` (False: no flag, no variable)."""
    title: str | None = None
    """Heading of the section's flags in `--help`."""


@dataclass(frozen=True)
class _Leaf:
    """One setting that has a flag and an environment variable."""

    section: str
    path: tuple[str, ...]  # field names from the section's dataclass down (flattened children)
    tp: Any
    flag: str
    help: str
    meta: Mapping[str, Any]

    @property
    def dest(self) -> str:
        return ".".join((self.section, *self.path))

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.flag.lstrip("-").upper().replace("-", "_")


# -- field documentation -------------------------------------------------------------------------


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass (from its source; {} when there is none)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs: dict[str, str] = {}
    for node, after in zip(body, [*body[1:], None], strict=True):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


# -- types ---------------------------------------------------------------------------------------


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _optional(tp: Any) -> Any | None:
    """`X` for `X | None`, else None."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0]
    return None


def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _choices(tp: Any) -> tuple[str, ...] | None:
    if typing.get_origin(tp) is Literal:
        return tuple(str(a) for a in typing.get_args(tp))
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return tuple(str(m.value) for m in tp)
    return None


def _describe(tp: Any) -> str:
    inner = _optional(tp)
    if inner is not None:
        return f"{_describe(inner)} or none"
    choices = _choices(tp)
    if choices is not None:
        return "one of " + ", ".join(choices)
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    if tp in names:
        return names[tp]
    origin = typing.get_origin(tp)
    if origin is list:
        return f"a list of {_describe(typing.get_args(tp)[0]).removeprefix('a ')}s"
    if origin is dict:
        return "a table"
    if _is_dataclass_type(tp):
        return "a table"
    return getattr(tp, "__name__", str(tp))


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def convert(value: Any, tp: Any, where: str, *, text: bool) -> Any:
    """`value` as type `tp`, or SettingsError naming `where`. `text`: it came from a flag or an
    environment variable (a string to parse), not from TOML (already typed)."""

    def bad() -> SettingsError:
        return SettingsError(f"{where}: expected {_describe(tp)}, got {value!r}")

    inner = _optional(tp)
    if inner is not None:
        if value is None or (text and isinstance(value, str) and value.lower() in ("", "none")):
            return None
        return convert(value, inner, where, text=text)
    choices = _choices(tp)
    if choices is not None:
        if isinstance(value, enum.Enum):
            value = value.value
        if not isinstance(value, str) or value not in choices:
            raise bad()
        return tp(value) if isinstance(tp, type) else value
    if tp is bool:
        if isinstance(value, bool):
            return value
        if text and isinstance(value, str) and value.lower() in (*_TRUE, *_FALSE):
            return value.lower() in _TRUE
        raise bad()
    if tp is int:
        if text and isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                raise bad() from None
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad()
        return value
    if tp is float:
        if text and isinstance(value, str):
            try:
                number = float(value.strip())
            except ValueError:
                raise bad() from None
        elif isinstance(value, bool) or not isinstance(value, int | float):
            raise bad()
        else:
            try:
                number = float(value)
            except OverflowError:  # a TOML integer past a float's range (~1.8e308)
                number = math.inf
        if not math.isfinite(number):
            # No setting gives nan or inf a meaning: nan passed every `<= 0` check and then
            # broke each request or timer that read it, and inf is a wait without a bound.
            raise SettingsError(f"{where}: expected a finite number, got {value!r}")
        return number
    if tp is str:
        if not isinstance(value, str):
            raise bad()
        return value
    origin = typing.get_origin(tp)
    if origin is list:
        (item,) = typing.get_args(tp)
        if text and isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise bad()
        return [convert(v, item, f"{where}[{i}]", text=text) for i, v in enumerate(value)]
    if origin is dict:
        key_type, item = typing.get_args(tp)
        if key_type is not str or not isinstance(value, Mapping):
            raise bad()
        return {str(k): convert(v, item, f"{where}.{k}", text=text) for k, v in value.items()}
    if _is_dataclass_type(tp):
        if not isinstance(value, Mapping):
            raise bad()
        return load_dataclass(tp, value, where)
    raise SettingsError(f"{where}: settings of type {_describe(tp)} are not supported")


# -- dataclasses ---------------------------------------------------------------------------------


def _loaded_fields(cls: type) -> Iterator[dataclasses.Field[Any]]:
    for f in dataclasses.fields(cls):
        if f.init and f.metadata.get("load", True):
            yield f


def _keys(cls: type) -> list[str]:
    """The TOML keys of `cls`'s table (flattened children's included)."""
    hints = _hints(cls)
    keys: list[str] = []
    for f in _loaded_fields(cls):
        if f.metadata.get("flatten"):
            keys.extend(_keys(hints[f.name]))
        else:
            keys.append(f.name)
    return keys


def unknown_key(where: str, key: str, known: Sequence[str]) -> SettingsError:
    close = difflib.get_close_matches(key, known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return SettingsError(f"{where}: unknown setting {key!r}{hint}")


def load_dataclass(
    cls: type[T],
    table: Mapping[str, Any],
    where: str,
    overrides: Mapping[tuple[str, ...], tuple[Any, str]] | None = None,
    *,
    nested: bool = True,
) -> T:
    """Build `cls` from a TOML table; `overrides` maps a field path to (text value, its source)
    from flags or the environment. A nested dataclass is validated here; a section is validated
    by `Settings.validate`, so that a caller can leave one out (`serve --demo`: no backends)."""
    known = _keys(cls)
    for key in table:
        if key not in known:
            raise unknown_key(where if nested else f"[{where}]", key, known)
    made = _build(cls, table, where, overrides or {}, ())
    if nested:
        check(made, where)
    return made


def _build(
    cls: type[T],
    table: Mapping[str, Any],
    where: str,
    overrides: Mapping[tuple[str, ...], tuple[Any, str]],
    prefix: tuple[str, ...],
) -> T:
    hints = _hints(cls)
    kwargs: dict[str, Any] = {}
    for f in _loaded_fields(cls):
        tp = hints[f.name]
        path = (*prefix, f.name)
        if f.metadata.get("flatten"):
            kwargs[f.name] = _build(tp, table, where, overrides, path)
            continue
        if path in overrides:
            raw, source = overrides[path]
            kwargs[f.name] = _value(raw, tp, f.metadata, source, text=True)
        elif f.name in table:
            kwargs[f.name] = _value(table[f.name], tp, f.metadata, f"{where}.{f.name}", text=False)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise SettingsError(f"{where}.{f.name}: required ({_describe(tp)})")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise SettingsError(f"{where}: {exc}") from None


def _value(raw: Any, tp: Any, meta: Mapping[str, Any], where: str, *, text: bool) -> Any:
    parse: Callable[[str], Any] | None = meta.get("parse")
    if parse is None:
        return convert(raw, tp, where, text=text)
    if not isinstance(raw, str):
        raise SettingsError(f"{where}: expected a string, got {raw!r}")
    try:
        return parse(raw)
    except ValueError as exc:
        raise SettingsError(f"{where}: {exc}") from None


def check(value: Any, where: str | None = None) -> None:
    """Run `value.validate()` if it has one; its ValueError becomes a one-line SettingsError.
    `where` (`[[tenants]][3]`) goes to a `validate(where)` that names the setting with it, so a
    mistake in one table of an array says which table."""
    validate = getattr(value, "validate", None)
    if validate is None:
        return
    try:
        if where is not None and "where" in inspect.signature(validate).parameters:
            validate(where)
        else:
            validate()
    except SettingsError:
        raise
    except ValueError as exc:
        raise SettingsError(str(exc)) from None


def from_mapping(cls: type[T], values: Mapping[str, Any], where: str) -> T:
    """`cls` from one TOML-style table, not validated (for tests and in-process callers)."""
    return load_dataclass(cls, values, where, nested=False)


# -- flags and environment -----------------------------------------------------------------------


def _leaves(section: Section) -> Iterator[_Leaf]:
    if not _is_dataclass_type(section.kind):
        return  # an array of tables: TOML only

    def walk(cls: type, prefix: tuple[str, ...], renames: Mapping[str, Any]) -> Iterator[_Leaf]:
        hints = _hints(cls)
        docs = field_docs(cls)
        for f in _loaded_fields(cls):
            tp = hints[f.name]
            if f.metadata.get("flatten"):
                yield from walk(tp, (*prefix, f.name), f.metadata.get("flags", {}))
                continue
            flag = renames.get(f.name, f.metadata.get("flag", "--" + f.name.replace("_", "-")))
            if flag is False or not _flaggable(tp, f.metadata):
                continue
            fmt: Callable[[Any], str] = f.metadata.get("format", _show)
            text = (f.metadata.get("help") or docs.get(f.name, "")).rstrip(".")
            default = fmt(_default(f))
            leaf = _Leaf(section.name, (*prefix, f.name), tp, str(flag), "", f.metadata)
            help_text = f"{text} (default: {default}; ${leaf.env})".replace("%", "%%")
            yield dataclasses.replace(leaf, help=help_text)

    yield from walk(section.kind, (), section.flags)


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _flaggable(tp: Any, meta: Mapping[str, Any]) -> bool:
    if "parse" in meta:
        return True
    base = _optional(tp) or tp
    if typing.get_origin(base) is list:
        return typing.get_args(base)[0] in (str, int, float)
    return base in (bool, int, float, str) or _choices(base) is not None


def _show(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, list):
        return ", ".join(map(str, value)) or "none"
    return str(value)


_METAVARS = {int: "N", float: "X", str: "TEXT"}


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage block) and exit status 2."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: {message}\n")


def parser(**kwargs: Any) -> argparse.ArgumentParser:
    """An `ArgumentParser` whose errors are one line on stderr and exit status 2."""
    return _Parser(**kwargs)


def add_flags(parser: argparse.ArgumentParser, sections: Sequence[Section]) -> None:
    """One flag per setting; values stay text until `load` converts them (so a bad value reads
    the same from a flag as from the environment)."""
    for section in sections:
        leaves = list(_leaves(section))
        if not leaves:
            continue
        group = parser.add_argument_group(section.title or f"[{section.name}]")
        for leaf in leaves:
            base = _optional(leaf.tp) or leaf.tp
            kw: dict[str, Any] = {"dest": leaf.dest, "default": argparse.SUPPRESS}
            choices = _choices(base)
            if base is bool and "parse" not in leaf.meta:
                kw["action"] = argparse.BooleanOptionalAction
            elif typing.get_origin(base) is list:
                kw["action"] = "append"
                kw["metavar"] = _METAVARS.get(typing.get_args(base)[0], "VALUE")
            elif choices is not None:
                kw["metavar"] = "{" + ",".join(choices) + "}"
            else:
                kw["metavar"] = leaf.meta.get("metavar", _METAVARS.get(base, "VALUE"))
            group.add_argument(leaf.flag, help=leaf.help, **kw)


# -- loading -------------------------------------------------------------------------------------


class Settings:
    """The loaded sections, by name."""

    def __init__(self, values: dict[str, Any]) -> None:
        self._values = values

    def __getitem__(self, name: str) -> Any:
        return self._values[name]

    def names(self) -> list[str]:
        return list(self._values)

    def get(self, name: str, kind: type[T]) -> T:
        value = self._values[name]
        if not isinstance(value, kind):
            raise TypeError(f"settings section {name!r} is {type(value).__name__}, not {kind}")
        return value

    def validate(self, *, skip: Sequence[str] = ()) -> Settings:
        """Each section's own `validate()` (each element's, for an array of tables)."""
        for name, value in self._values.items():
            if name in skip:
                continue
            for item in value if isinstance(value, list) else [value]:
                check(item)
        return self


def load(
    sections: Sequence[Section],
    *,
    toml: Mapping[str, Any],
    environ: Mapping[str, str],
    flags: Mapping[str, Any],
) -> Settings:
    """Read every section: flags (from `vars(args)`) over `QUICEDGE_*` variables over `toml`
    over the defaults. Unknown tables and keys are refused. Not yet validated."""
    names = [s.name for s in sections]
    for key in toml:
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            hint = f" (did you mean [{close[0]}]?)" if close else ""
            raise SettingsError(f"config: unknown table [{key}]{hint}")
    out: dict[str, Any] = {}
    for section in sections:
        raw = toml.get(section.name, [] if typing.get_origin(section.kind) is list else {})
        if typing.get_origin(section.kind) is list:
            out[section.name] = convert(raw, section.kind, f"[[{section.name}]]", text=False)
            continue
        if not isinstance(raw, Mapping):
            raise SettingsError(f"config: [{section.name}] must be a table")
        overrides: dict[tuple[str, ...], tuple[Any, str]] = {}
        for leaf in _leaves(section):
            if leaf.dest in flags:
                overrides[leaf.path] = (flags[leaf.dest], leaf.flag)
            elif leaf.env in environ:
                overrides[leaf.path] = (environ[leaf.env], f"${leaf.env}")
        out[section.name] = load_dataclass(section.kind, raw, section.name, overrides, nested=False)
    return Settings(out)


def environment_names(sections: Sequence[Section]) -> dict[str, str]:
    """Environment variable → the setting it sets (`serve.workers`), for documentation."""
    return {leaf.env: leaf.dest for s in sections for leaf in _leaves(s)}


__all__ = [
    "ENV_PREFIX",
    "Section",
    "Settings",
    "SettingsError",
    "add_flags",
    "check",
    "convert",
    "environment_names",
    "field_docs",
    "from_mapping",
    "load",
    "load_dataclass",
    "parser",
]
