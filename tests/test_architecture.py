"""The import direction of ``docs/architecture.md``, read from the source with ``ast`` (nothing is imported).

Every ``core_kv`` module sits on one floor; a module may import its own floor and the floors below, never one above
(function-local imports included: a lazy import is still a dependency). Module-level imports also form no cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "core_kv"

# Lowest first. A module belongs to the longest prefix that names it.
FLOORS: list[tuple[str, ...]] = [
    (
        "core_kv",
        "core_kv.config",
        "core_kv.io",
        "core_kv.resources",
        "core_kv.kernels",
        "core_kv.budget",
        "core_kv.models",
    ),
    ("core_kv.proxy",),  # the proxy LM's tokenizer, data and trainer: the teacher makes its documents with them
    ("core_kv.features", "core_kv.features_v3", "core_kv.key_geometry"),
    ("core_kv.teacher",),
    ("core_kv.memory", "core_kv.fast_memory", "core_kv.indexer", "core_kv.core_model"),
    ("core_kv.distill",),
    ("core_kv.presses", "core_kv.pipeline"),
    ("core_kv.eval",),
    ("core_kv.proxy.evaluate",),  # the proxy scored with RULER from core_kv.eval
]


def floor_of(module: str) -> int:
    best, depth = None, -1
    for level, prefixes in enumerate(FLOORS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and prefix.count(".") > depth:
                best, depth = level, prefix.count(".")
    assert best is not None, f"{module} is on no floor: add it to FLOORS and docs/architecture.md"
    return best


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(path: Path, top_level_only: bool = False) -> list[tuple[int, str]]:
    """``(line, module)`` of every ``core_kv`` import in ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    nodes = tree.body if top_level_only else ast.walk(tree)
    found = []
    for node in nodes:
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "core_kv"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "core_kv":  # from core_kv import resources
                found += [(node.lineno, f"core_kv.{a.name}") for a in node.names]
            elif node.module.startswith("core_kv."):
                found.append((node.lineno, node.module))
    return found


MODULES = modules()


def test_every_module_has_a_floor():
    for name in MODULES:
        floor_of(name)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_imports_a_higher_floor(name):
    mine = floor_of(name)
    bad = [
        f"line {line}: {target} (floor {floor_of(target)} > {mine})"
        for line, target in imports(MODULES[name])
        if floor_of(target) > mine
    ]
    assert not bad, f"{name} (floor {mine}) imports upward: {bad}"


def test_no_import_cycles_at_module_level():
    def resolve(target: str) -> str | None:
        while target and target not in MODULES:
            target = target.rpartition(".")[0]
        return target or None

    graph = {
        name: {m for _, t in imports(path, top_level_only=True) if (m := resolve(t)) not in (None, name)}
        for name, path in MODULES.items()
    }
    done: set[str] = set()

    def visit(node: str, stack: list[str]) -> None:
        if node in stack:
            raise AssertionError("import cycle: " + " -> ".join([*stack[stack.index(node) :], node]))
        if node in done:
            return
        for nxt in sorted(graph[node]):
            visit(nxt, [*stack, node])
        done.add(node)

    for name in sorted(graph):
        visit(name, [])


def test_the_checker_sees_an_upward_import(tmp_path):
    """The checker is not vacuous: a floor-0 file importing the eval floor is caught."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from core_kv.eval.runner import run_eval\n")
    assert imports(bad) == [(2, "core_kv.eval.runner")]
    assert floor_of("core_kv.eval.runner") > floor_of("core_kv.models.loading")
    assert len(MODULES) > 40
