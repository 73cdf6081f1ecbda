"""Typed configs: a dataclass tree, YAML files that only override its defaults, and ``a.b=v`` overrides.

Example::

    cfg = load_config(EvalConfig, ["configs/eval/ruler.yaml", "methods=[snapkv,knorm]", "ratios=[0.5]"])

``--help``/``-h`` among the arguments prints the entry point's usage and every field of the config tree (dotted name,
type, default, and the whole doc from the dataclass's ``Args:`` section or the field's comment) and exits 0.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import sys
import textwrap
import typing
from pathlib import Path
from typing import Any, TypeVar

from omegaconf import OmegaConf

T = TypeVar("T")


def load_config(schema: type[T], argv: list[str] | None = None, usage: str | None = None) -> T:
    """Build ``schema`` from defaults, then YAML files (``*.yaml``/``--config F``), then ``a.b=v`` dotlist overrides.

    Unknown keys and wrongly typed values raise, naming the key; ``__post_init__`` validation runs on the result.
    With ``--help``/``-h`` in ``argv`` it prints ``usage`` (the entry point's docstring) and :func:`config_help`,
    then exits 0.
    """
    argv = list(argv or [])
    if {"-h", "--help"} & set(argv):
        print(config_help(schema, usage))
        sys.exit(0)
    base = OmegaConf.structured(schema)
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
            layers.append(OmegaConf.from_dotlist([arg.removeprefix("--")]))
        elif arg.endswith((".yaml", ".yml")):
            path = Path(arg)
            if not path.is_file():
                raise FileNotFoundError(f"config file not found: {path}")
            layers.append(OmegaConf.load(path))
        else:
            raise ValueError(f"cannot parse argument {arg!r}: expected a YAML file or key=value")
        i += 1
    try:
        merged = OmegaConf.merge(base, *layers)
    except Exception as e:  # omegaconf's errors name the key; re-raise as ValueError for one error type
        raise ValueError(f"invalid config for {schema.__name__}: {e}") from e
    return OmegaConf.to_object(merged)  # type: ignore[return-value]  # runs __post_init__


def config_help(schema: type, usage: str | None = None, width: int = 118) -> str:
    """``usage`` plus every field of ``schema``'s tree: a line ``dotted.name  type  = default`` and below it the field's
    whole doc (its ``Args:`` entry, or its trailing ``# comment``), wrapped at ``width`` columns, never cut."""
    head = (usage or schema.__doc__ or schema.__name__).strip()
    if not head.lower().startswith("usage"):
        head = "usage: " + head
    rows: list[tuple[str, str, str, str]] = []
    _field_rows(schema, schema(), "", rows)
    wn, wt = max(len(r[0]) for r in rows), min(max(len(r[1]) for r in rows), 28)
    lines = [head, "", f"options ({schema.__name__}: YAML files and a.b=v overrides; nested fields by dotted name):"]
    for n, t, d, doc in rows:
        lines.append(f"  {n:<{wn}}  {t:<{wt}}  = {d}")
        lines += textwrap.wrap(doc, width, initial_indent=" " * 6, subsequent_indent=" " * 6) if doc else []
    return "\n".join(lines)


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
