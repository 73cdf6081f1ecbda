"""Typed configs: a dataclass tree, YAML files that only override its defaults, and ``a.b=v`` overrides.

Example::

    cfg = load_config(EvalConfig, ["configs/eval/ruler.yaml", "methods=[snapkv,knorm]", "ratios=[0.5]"])

``--help``/``-h`` among the arguments prints the entry point's usage and every field of the config tree (dotted name,
type, default, the whole doc from the dataclass's ``Args:`` section or the field's comment) and exits 0.

Every option is checked when the config loads, by one rule (:func:`check_config`): its value against the field's
annotation (a finite number for ``float``, an integer for ``int``, ``true``/``false`` for ``bool``, lists and dicts item
by item, nested dataclasses field by field) and against the constraints declared with the field
(:func:`option`: ``ge``/``gt``/``le``/``lt``, ``choices``, ``check``), then each dataclass's own cross-field
``check(prefix)``. A bad value raises :class:`ConfigError` naming the dotted option, what is wrong and what would be
valid: ``teacher.lam must be a finite number >= 0, got nan``.
"""

from __future__ import annotations

import contextvars
import dataclasses
import importlib
import inspect
import math
import numbers
import os
import re
import sys
import textwrap
import types
import typing
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any, TypeVar

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

T = TypeVar("T")


def load_config(
    schema: type[T],
    argv: list[str] | None = None,
    usage: str | None = None,
    resolve: Callable[[DictConfig], type[T]] | None = None,
) -> T:
    """Build ``schema`` from defaults, then YAML files (``*.yaml``/``--config F``), then ``a.b=v`` dotlist overrides.

    Unknown keys and wrongly typed values raise, naming the key; then :func:`check_config` checks every option of the
    tree (dotted names) before anything runs. With ``--help``/``-h`` in ``argv`` it prints ``usage`` (the entry
    point's docstring) and :func:`config_help`, then exits 0. ``resolve`` picks the schema from the YAML files and
    overrides merged as given (unchecked), before they are read into it (as transformers' ``AutoConfig`` picks a
    class by ``model_type``): e.g. a train config's ``recipe``.
    """
    argv = list(argv or [])
    help_asked = bool({"-h", "--help"} & set(argv))
    argv = [a for a in argv if a not in ("-h", "--help")]
    layers = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("--config", "-c"):
            if i + 1 >= len(argv):
                raise ValueError("--config needs a YAML path")
            arg = argv[i + 1]
            i += 1
        if "=" in arg and not arg.endswith((".yaml", ".yml")):
            try:
                layers.append(OmegaConf.from_dotlist([arg.removeprefix("--")]))
            except Exception as e:  # e.g. an unbalanced bracket in a list value
                raise ConfigError(f"cannot parse override {arg!r}: {_first(e)}") from None
        elif arg.endswith((".yaml", ".yml")):
            layers.append(read_yaml_config(Path(arg)))
        else:
            raise ValueError(f"cannot parse argument {arg!r}: expected a YAML file or key=value")
        i += 1
    if resolve is not None:
        schema = resolve(OmegaConf.merge(*layers) if layers else OmegaConf.create())
    if help_asked:
        print(config_help(schema, usage))
        sys.exit(0)
    base = OmegaConf.structured(schema)
    try:
        merged = OmegaConf.merge(base, *layers)
    except (OmegaConfBaseException, TypeError) as e:  # omegaconf's errors name the key: "threads: Value 'x' ..."
        key = getattr(e, "full_key", None) or next(
            filter(None, (_offending_key(base, layer) for layer in layers)), None
        )
        hint = " (a list where a mapping is expected, or the reverse)" if isinstance(e, TypeError) else ""
        raise ConfigError(
            f"invalid config for {schema.__name__}: {f'{key}: ' if key else ''}{_first(e)}{hint}"
        ) from None
    return built(merged)


def built(merged: DictConfig) -> Any:
    """The config object of a merged structured config, checked from the root (:func:`check_config`), so a nested
    option's error carries its dotted name (``teacher.lam must be ...``)."""
    token = _LOADING.set(True)  # the tree is checked once, from the root, so nested errors carry their dotted names
    try:
        cfg = OmegaConf.to_object(merged)
    finally:
        _LOADING.reset(token)
    check_config(cfg)
    return cfg


def import_plugins(raw: Any, name: str = "plugins") -> list[str]:
    """Import the modules a config's ``plugins`` lists in ``raw`` (its YAML files and overrides, before they are
    read into a schema): a plugin registers what it adds (presses, artifact kinds, recipes). For ``resolve``."""
    plugins = raw.get(name) or []
    if isinstance(plugins, str) or not all(isinstance(p, str) for p in plugins):
        raise ConfigError(f"{name} must be a list of module names, got {plugins!r}")
    for module in plugins:
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise ConfigError(f"{name}: cannot import {module!r} ({e}); run from the repository root") from None
    return list(plugins)


def _offending_key(base: DictConfig, layer: DictConfig, prefix: str = "") -> str | None:
    """The dotted key of ``layer`` that cannot be merged into ``base`` (omegaconf's "Cannot merge incompatible
    container types" names none), e.g. a list given where a mapping is expected."""
    for key in layer:
        try:
            OmegaConf.merge(base, {key: layer[key]})
        except Exception:
            inner, sub = base.get(key) if key in base else None, layer[key]
            if isinstance(inner, DictConfig) and isinstance(sub, DictConfig):
                return _offending_key(inner, sub, f"{prefix}{key}.") or f"{prefix}{key}"
            return f"{prefix}{key}"
    return None


def read_yaml_config(path: Path) -> DictConfig:
    """A config file as a mapping of options; a missing, binary, malformed or non-mapping file raises naming it."""
    if not path.is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"config file {path} is not UTF-8 text ({e.reason} at byte {e.start}): is it a YAML file?"
        ) from None
    try:
        top = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {_first(e)}") from None
    if top is not None and not isinstance(top, dict):
        kind = "a list" if isinstance(top, list) else f"a single value ({type(top).__name__})"
        raise ConfigError(f"config file {path}: the top level must be a mapping of options (key: value), got {kind}")
    try:
        return OmegaConf.create(text) if top is not None else OmegaConf.create({})
    except Exception as e:
        raise ConfigError(f"config file {path} is not valid YAML: {_first(e)}") from None


def _first(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


# ------------------------------------------------------------------------------------------------------------------
# Checking options: one rule for every config dataclass (and for press options, samples and generation arguments)


class ConfigError(ValueError):
    """An option has a bad value; the message names the option, what is wrong and what would be valid."""


_LOADING: contextvars.ContextVar[bool] = contextvars.ContextVar("core_kv_config_loading", default=False)


def option(
    default: Any = dataclasses.MISSING,
    *,
    factory: Callable[[], Any] | Any = dataclasses.MISSING,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    choices: tuple | None = None,
    check: Callable[[Any], str | None] | None = None,
) -> Any:
    """A dataclass field with its constraints, checked by :func:`check_config` when the config loads.

    ``ge``/``gt``/``le``/``lt`` bound a number and ``choices`` lists the valid values (each item of a list); ``check``
    gets the whole value and returns what a valid one would be (``"'auto' or a number in (0, 1]"``), else ``None``.
    The annotation alone already requires a finite number for ``float``, an integer for ``int`` and so on.
    """
    meta = {k: v for k, v in {"ge": ge, "gt": gt, "le": le, "lt": lt, "choices": choices, "check": check}.items()
            if v is not None}  # fmt: skip
    return dataclasses.field(default=default, default_factory=factory, metadata=meta)


def check_on_init(cfg: Any) -> None:
    """For a root config's ``__post_init__``: :func:`check_config` now, unless :func:`load_config` is building the
    tree (it checks it from the root afterwards, so a nested config's errors carry their dotted names)."""
    if not _LOADING.get():
        check_config(cfg)


def check_config(cfg: Any, prefix: str = "") -> None:
    """Check every init field of the dataclass ``cfg`` (recursively) against its annotation and :func:`option`
    constraints, then call its ``check(prefix)`` for cross-field rules; raise :class:`ConfigError` naming
    ``prefix + field``."""
    hints = field_types(type(cfg))
    for f in dataclasses.fields(cfg):
        if f.init:
            check_value(getattr(cfg, f.name), hints.get(f.name, Any), prefix + f.name, **f.metadata)
    own = getattr(cfg, "check", None)
    if callable(own):
        own(prefix)


@cache
def field_types(cls: type) -> dict[str, Any]:
    """The resolved annotation of every field of the dataclass ``cls`` (``from __future__ import annotations`` strings
    evaluated in the defining class's module); a field whose annotation cannot be resolved is left out (unchecked)."""
    try:
        return typing.get_type_hints(cls)
    except Exception:  # one unresolvable annotation: resolve the others one by one
        pass
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if not isinstance(f.type, str):
            out[f.name] = f.type
            continue
        owner = next((k for k in cls.__mro__ if f.name in getattr(k, "__annotations__", {})), cls)
        try:
            out[f.name] = eval(f.type, vars(sys.modules[owner.__module__]), dict(vars(owner)))  # noqa: S307
        except Exception:
            continue
    return out


def check_value(value: Any, annotation: Any, name: str, **constraints: Any) -> None:
    """Raise :class:`ConfigError` ``"<name> must be <what>, got <value>"`` when ``value`` does not match
    ``annotation`` or the :func:`option` ``constraints``; ``None`` passes the constraints (``X | None`` decides)."""
    bounds = [(op, constraints[op]) for op in ("ge", "gt", "le", "lt") if op in constraints]
    _check_type(value, annotation, name, bounds)  # "lam must be a finite number >= 0, got nan": type and range
    if value is None or not constraints:
        return
    custom = constraints.get("check")
    if custom is not None:  # the whole value (a list as a list)
        wanted = custom(value)
        if wanted:
            raise ConfigError(f"{name} must be {wanted}, got {shown(value)}")
    items = list(enumerate(value)) if isinstance(value, (list, tuple)) else [(None, value)]
    for i, v in items:  # bounds and choices: each item of a list
        where = name if i is None else f"{name}[{i}]"
        choices = constraints.get("choices")
        if choices is not None and v not in choices:
            raise ConfigError(f"{where} must be one of {', '.join(map(repr, choices))}, got {shown(v)}")
        if bounds and isinstance(v, numbers.Real) and not isinstance(v, bool):
            if not all(_OPS[op][0](v, b) for op, b in bounds):
                raise ConfigError(f"{where} must be {_bounds_text(bounds)}, got {shown(v)}")


def shown(value: Any, width: int = 80) -> str:
    """``value`` as messages quote it: its repr cut to ``width`` characters, with its type unless a number/bool/None
    (``'4' (str)``, ``b'The grass...' (bytes)``)."""
    text = repr(value)
    text = text if len(text) <= width else text[: width - 3] + "..."
    return text if value is None or isinstance(value, (bool, int, float)) else f"{text} ({type(value).__name__})"


def folder(value: Any) -> str | None:
    """An :func:`option` ``check``: a non-empty path that is not an existing file (an output folder)."""
    if not len(str(value)):
        return "a folder path (non-empty)"
    return "a folder path, not an existing file" if Path(value).is_file() else None


def non_empty(value: Any) -> str | None:
    """An :func:`option` ``check``: a string or list that is not empty."""
    return None if len(value) else "non-empty"


_OPS = {
    "ge": (lambda v, b: v >= b, ">="),
    "gt": (lambda v, b: v > b, ">"),
    "le": (lambda v, b: v <= b, "<="),
    "lt": (lambda v, b: v < b, "<"),
}


def _bounds_text(bounds: list[tuple[str, float]]) -> str:
    ops = dict(bounds)
    low = ("ge" in ops and "[") or ("gt" in ops and "(")
    high = ("le" in ops and "]") or ("lt" in ops and ")")
    if low and high:
        return f"in {low}{ops.get('ge', ops.get('gt'))}, {ops.get('le', ops.get('lt'))}{high}"
    return " and ".join(f"{_OPS[op][1]} {b}" for op, b in bounds)


def _check_type(value: Any, ann: Any, name: str, bounds: list | tuple = ()) -> None:
    if not _matches(value, ann, name, bounds):
        raise ConfigError(f"{name} must be {describe_type(ann, bounds)}, got {shown(value)}")


def _matches(value: Any, ann: Any, name: str, bounds: list | tuple = ()) -> bool:
    """Whether ``value`` fits ``ann``; an item of a list or dict that does not fit raises naming the item."""
    if ann is Any or ann is object or isinstance(ann, (str, typing.TypeVar)):
        return True
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin in (typing.Union, types.UnionType):
        if value is None:
            return type(None) in args
        arms = [a for a in args if a is not type(None)]
        if len(arms) == 1:  # X | None with a value: X's own (more precise) error
            return _matches(value, arms[0], name, bounds)
        return any(_safe_matches(value, a, name) for a in arms)
    if origin is typing.Literal:
        return value in args
    if ann is type(None) or ann is None:
        return value is None
    if ann is bool:
        return isinstance(value, bool)
    if ann is int:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if ann is float:
        return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    if ann is str:
        return isinstance(value, (str, os.PathLike))
    if origin in (list, tuple) or ann in (list, tuple):
        if not isinstance(value, (list, tuple)):
            return False
        item = args[0] if args and (origin is list or (len(args) == 2 and args[1] is Ellipsis)) else None
        if item is not None:
            for i, v in enumerate(value):
                _check_type(v, item, f"{name}[{i}]", bounds)
        return True
    if origin is dict or ann is dict:
        if not isinstance(value, dict):
            return False
        if len(args) == 2:
            for k, v in value.items():
                _check_type(k, args[0], f"{name} key {k!r}")
                _check_type(v, args[1], f"{name}.{k}")
        return True
    if dataclasses.is_dataclass(ann) and isinstance(ann, type):
        if not isinstance(value, ann):
            return False
        check_config(value, name + ".")
        return True
    if isinstance(ann, type):
        return isinstance(value, ann)
    return True  # an annotation this checker does not know (Callable, ...): left to the code that uses it


def _safe_matches(value: Any, ann: Any, name: str) -> bool:
    try:
        return _matches(value, ann, name)
    except ConfigError:
        return False


def describe_type(ann: Any, bounds: list | tuple = ()) -> str:
    """``float | None`` -> ``"a finite number or null"`` (what a valid value is, for messages); ``bounds`` (``[("ge",
    0)]``) qualify a number: ``"a finite number >= 0"``."""
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe_type(a, bounds) for a in args)
    if bounds and ann in (int, float):
        return f"{describe_type(ann)} {_bounds_text(list(bounds))}"
    if origin is typing.Literal:
        return "one of " + ", ".join(map(repr, args))
    names = {bool: "true or false", int: "an integer", float: "a finite number", str: "a string",
             type(None): "null", None: "null"}  # fmt: skip
    if ann in names:
        return names[ann]
    if origin in (list, tuple) or ann in (list, tuple):
        return f"a list of {_plural(args[0])}" if args else "a list"
    if origin is dict or ann is dict:
        return "a mapping (key: value)" if not args else f"a mapping of {_plural(args[0])} to {_plural(args[1])}"
    return f"a {getattr(ann, '__name__', str(ann))}"


def _plural(ann: Any) -> str:
    text = describe_type(ann)
    for article in ("a ", "an "):
        if text.startswith(article):
            return (
                text[len(article) :]
                .replace("integer", "integers")
                .replace("number", "numbers")
                .replace("string", "strings")
            )
    return text


def config_help(schema: type, usage: str | None = None, width: int = 118) -> str:
    """``usage`` plus every field of ``schema``'s tree: a line ``dotted.name  type  = default`` and below it the field's
    whole doc (its ``Args:`` entry, or its trailing ``# comment``), wrapped at ``width`` columns, never cut."""
    head = (usage or schema.__doc__ or schema.__name__).strip()
    if not head.lower().startswith("usage"):
        head = "usage: " + head
    rows: list[tuple[str, str, str, str]] = []
    _field_rows(schema, schema(), "", rows)
    lines = [head, "", f"options ({schema.__name__}: YAML files and a.b=v overrides; nested fields by dotted name):"]
    return "\n".join(lines + _format_rows(rows, width))


def options_help(cls: type, skip: tuple[str, ...] = (), width: int = 118) -> list[str]:
    """The constructor options of dataclass ``cls`` (its ``init`` fields but ``skip``), as :func:`config_help` lists
    a config's: ``name  type  = default`` (``required`` when it has none) and the field's doc below. The defaults are
    the declared ones: ``cls`` is never instantiated (a press would load its checkpoint)."""
    hints, docs = typing.get_type_hints(cls), {}
    for klass in reversed(cls.__mro__):  # a subclass's doc of a field wins over its base's
        if dataclasses.is_dataclass(klass):
            docs.update(_field_docs(klass))
    rows = []
    for f in dataclasses.fields(cls):
        if not f.init or f.name in skip:
            continue
        if f.default is not dataclasses.MISSING:
            default = _show(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()  # a nested press (a dataclass but no config) shows as its class
            default = f"{type(value).__name__}()" if dataclasses.is_dataclass(value) else _show(value)
        else:
            default = "required"
        rows.append((f.name, _type_name(hints.get(f.name, f.type)), default, docs.get(f.name, "")))
    return _format_rows(rows, width)


def _format_rows(rows: list[tuple[str, str, str, str]], width: int) -> list[str]:
    if not rows:
        return []
    wn, wt = max(len(r[0]) for r in rows), min(max(len(r[1]) for r in rows), 28)
    lines = []
    for n, t, d, doc in rows:
        lines.append(f"  {n:<{wn}}  {t:<{wt}}  = {d}")
        lines += textwrap.wrap(doc, width, initial_indent=" " * 6, subsequent_indent=" " * 6) if doc else []
    return lines


def shipped_configs(folder: str | Path, root: str | Path | None = None) -> str:
    """One line per YAML file of ``folder``: its path (relative to ``root``) and the first sentence of its leading
    comment, for an entry point's ``--help``."""
    folder = Path(folder)
    lines = []
    for path in sorted(folder.glob("*.yaml")):
        comment = []
        for line in path.read_text(encoding="utf-8").splitlines():
            text = line[1:].removeprefix(" ")
            if not line.startswith("#") or not text.strip() or text[0].isspace():
                break  # the description ends at code, a blank comment or an indented (command, arithmetic) line
            comment.append(text.strip())
        first = re.split(r"(?<=\.)\s", " ".join(comment), maxsplit=1)[0]  # the first sentence, whole
        lines.append(f"  {path.relative_to(root) if root is not None else path}")
        lines += textwrap.wrap(first, 116, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return "\n".join(lines)


def _field_rows(cls: type, value: Any, prefix: str, rows: list) -> None:
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # an unresolvable annotation: fall back to the annotation strings
        hints = {}
    docs = _field_docs(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        name, t, v = prefix + f.name, hints.get(f.name, f.type), getattr(value, f.name)
        if dataclasses.is_dataclass(t) and isinstance(t, type):
            rows.append((name, t.__name__, "{...}", docs.get(f.name, _first_line(t.__doc__))))
            _field_rows(t, v, name + ".", rows)
            continue
        rows.append((name, _type_name(t), _show(v), docs.get(f.name, "")))
        inner = typing.get_args(t)
        if typing.get_origin(t) is dict and len(inner) == 2 and dataclasses.is_dataclass(inner[1]):
            for key, item in (v or {}).items():  # e.g. EvalConfig.datasets: its default entries, field by field
                _field_rows(inner[1], item, f"{name}.{key}.", rows)
            _field_rows(inner[1], inner[1](), f"{name}.<key>.", rows)


def _type_name(t: Any) -> str:
    if isinstance(t, type) and not typing.get_args(t):
        return t.__name__
    return re.sub(r"\b(typing|builtins|core_kv)\.([\w.]*\.)?", "", str(t)).replace("NoneType", "None")


def _show(v: Any) -> str:
    """The default as written on the command line would read it back (whole, however long)."""
    if dataclasses.is_dataclass(v):
        v = to_dict(v)
    elif isinstance(v, dict):
        v = {k: to_dict(x) if dataclasses.is_dataclass(x) else x for k, x in v.items()}
    return repr(v)


def _first_line(doc: str | None) -> str:
    """A class docstring's first paragraph, as one line."""
    return " ".join(inspect.cleandoc(doc or "").split("\n\n")[0].split())


def _field_docs(cls: type) -> dict[str, str]:
    """Whole docs per field: the Google-style ``Args:`` entry of the class docstring with its continuation lines
    (``a / b:`` and ``a, b:`` name several fields), else the field's comment in the source (the ``#`` lines just
    above it, then its trailing ``# comment``)."""
    docs: dict[str, str] = {}
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        source = ""
    block: list[str] = []  # the comment lines just above a field
    for line in source.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            block.append(stripped.lstrip("#").strip())
            continue
        m = re.match(r"^\s+(\w+)\s*:[^=]+=[^#]*(?:#\s*(.+))?$", line)
        if m:
            trailing = (m.group(2) or "").strip()
            if trailing.startswith(("fmt:", "noqa", "type:")):
                trailing = ""
            text = " ".join([*block, trailing]).strip()
            if text:
                docs[m.group(1)] = text
        block = []
    lines = inspect.cleandoc(cls.__doc__ or "").splitlines()
    if "Args:" in lines:
        names: list[str] = []
        for line in lines[lines.index("Args:") + 1 :]:
            if line and not line.startswith(" "):
                break  # the next section
            m = re.match(r"^    ([\w ,/]+):\s*(.*)$", line)
            if m:
                names = [n.strip() for n in re.split(r"[,/]", m.group(1))]
                for n in names:
                    docs[n] = m.group(2).strip()
            elif line.startswith("     ") and names:  # a continuation line of the current entry
                for n in names:
                    docs[n] = f"{docs[n]} {line.strip()}"
    return docs


def to_dict(cfg: Any) -> dict:
    """Resolved config as a plain dict (for saving beside outputs and for trackers)."""
    if dataclasses.is_dataclass(cfg):
        return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)  # type: ignore[return-value]
    return dict(cfg)


def parse_layers(text: str, what: str = "layers") -> list[int]:
    """``"0-3,8"`` -> ``[0, 1, 2, 3, 8]`` (sorted, unique); an empty string is no layer. ``what`` names the option in
    the error a malformed range raises."""
    out: list[int] = []
    for part in filter(None, str(text).replace(" ", "").split(",")):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()) or (hi and int(hi) < int(lo)):
            raise ValueError(f"{what} expects layer ranges like 0-3,8; got {text!r}")
        out += range(int(lo), int(hi or lo) + 1)
    return sorted(set(out))
