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
        "core_kv.files",
        "core_kv.corpus",
        "core_kv.nystrom",
        "core_kv.budget",
        "core_kv.models",
    ),
    ("core_kv.proxy",),  # the proxy LM's tokenizer, data and trainer: the teacher makes its documents with them
    ("core_kv.features",),
    ("core_kv.teacher",),
    ("core_kv.memory", "core_kv.indexer", "core_kv.core_model", "core_kv.policy"),
    ("core_kv.distill",),
    ("core_kv.presses", "core_kv.pipeline"),
    ("core_kv.eval",),
    ("core_kv.proxy.evaluate", "core_kv.run"),  # the proxy scored with RULER; train.py's run (distil + policy)
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
    """``(line, module)`` of every ``core_kv`` import in ``path``; ``top_level_only``: those the module runs (or a type
    checker reads) at import time, i.e. its body and top-level ``if`` blocks (``if TYPE_CHECKING:`` included: an
    annotation-only import still ties two modules into a circle)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    if top_level_only:
        nodes = [n for top in tree.body for n in ([top] if not isinstance(top, ast.If) else ast.walk(top))]
    else:
        nodes = ast.walk(tree)
    found = []
    for node in nodes:
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "core_kv"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "core_kv":  # from core_kv import corpus
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


# What inference loads (the artifact, the presses, the pipeline) never reaches into the offline stages: the teacher,
# distillation and the proxy LM's trainer.
INFERENCE = ("core_kv.presses", "core_kv.pipeline", "core_kv.core_model", "core_kv.indexer", "core_kv.memory",
             "core_kv.geometry", "core_kv.features", "core_kv.budget")  # fmt: skip
OFFLINE = ("core_kv.teacher", "core_kv.distill", "core_kv.proxy")


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n.startswith(INFERENCE)))
def test_inference_imports_no_offline_stage(name):
    bad = [f"line {line}: {t}" for line, t in imports(MODULES[name]) if t.startswith(OFFLINE)]
    assert not bad, f"{name} is on the inference path but imports an offline stage: {bad}"


def test_the_product_imports_no_research():
    """``research/`` (the released recipe among them) stands on the product and registers into it
    (``register_artifact``, ``register_recipe``, press classes); the product never imports it."""
    bad = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                mods = [node.module or ""]
            else:
                continue
            if any(m.split(".")[0] == "research" for m in mods):
                bad.append(f"{name}:{node.lineno}")
    assert not bad, f"product modules import research/: {bad}"


def test_the_checker_sees_a_type_checking_import(tmp_path):
    """An import under ``if TYPE_CHECKING:`` counts toward module-level cycles (the distill/ circle of a Trainer)."""
    f = tmp_path / "m.py"
    f.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from core_kv.distill.trainer import Trainer\n"
    )
    assert imports(f, top_level_only=True) == [(3, "core_kv.distill.trainer")]


def test_no_compatibility_shims():
    """No module answers for names it does not define (a module-level ``__getattr__``): moved code is imported from
    where it lives. A package's ``__init__`` may still export its own submodules' names lazily."""
    shims = [n for n, p in MODULES.items() if p.name != "__init__.py" and any(
        isinstance(node, ast.FunctionDef) and node.name == "__getattr__" for node in ast.parse(p.read_text()).body
    )]  # fmt: skip
    assert not shims, f"module-level __getattr__ shims: {shims}"


def test_the_checker_sees_an_upward_import(tmp_path):
    """The checker is not vacuous: a floor-0 file importing the eval floor is caught."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from core_kv.eval.runner import run_eval\n")
    assert imports(bad) == [(2, "core_kv.eval.runner")]
    assert floor_of("core_kv.eval.runner") > floor_of("core_kv.models.loading")
    assert len(MODULES) > 40
