"""The import direction of ``docs/architecture.md``, read from the source with ``ast`` (nothing is imported).

Every ``core_kv`` module sits on one declared floor; a module may import its own floor and the floors below, never one
above (no back-arrow). Counted per file, function-local and ``if TYPE_CHECKING:`` imports included (a lazy or an
annotation-only import is still a dependency): no import circle, and at most ``MAX_FLOORS`` floors, where a file's
floor is 1 + the highest floor among the ``core_kv`` files it imports. Tests share helpers through ``tests/conftest.py``
and ``tests/helpers.py``, never by importing another test module.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "core_kv"
MAX_FLOORS = 10

# Declared floors, lowest first. A module belongs to the longest prefix that names it.
FLOORS: list[tuple[str, ...]] = [
    (
        "core_kv",
        "core_kv.config",
        "core_kv.files",
        "core_kv.lock",
        "core_kv.corpus",
        "core_kv.documents",
        "core_kv.schedules",
        "core_kv.nystrom",
        "core_kv.budget",
        "core_kv.models",
    ),
    ("core_kv.proxy",),  # the proxy LM (stage 0): its tokenizer and trainer; nothing but its evaluation reads it
    ("core_kv.features", "core_kv.geometry"),
    ("core_kv.teacher",),
    ("core_kv.memory", "core_kv.indexer", "core_kv.core_model", "core_kv.policy"),
    ("core_kv.distill", "core_kv.presses", "core_kv.pipeline"),  # two towers on one floor: neither imports the other
    ("core_kv.eval",),
    ("core_kv.run", "core_kv.search"),  # train.py's run: distillation, the policy stage; the recipe search of runs
]


def floor_of(module: str) -> int:
    best, depth = None, -1
    for level, prefixes in enumerate(FLOORS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and prefix.count(".") > depth:
                best, depth = level, prefix.count(".")
    assert best is not None, f"{module} is on no floor: add it to FLOORS and docs/architecture.md"
    return best


def modules(package: Path = PACKAGE) -> dict[str, Path]:
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(path: Path, prefix: str = "core_kv") -> list[tuple[int, str]]:
    """``(line, module)`` of every import of ``prefix`` in ``path``, wherever it stands (module body, ``if`` blocks,
    functions); ``from core_kv import corpus`` reads as ``core_kv.corpus``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == prefix]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == prefix:
                found += [(node.lineno, f"{prefix}.{a.name}") for a in node.names]
            elif node.module.startswith(prefix + "."):
                found.append((node.lineno, node.module))
    return found


def import_graph(mods: dict[str, Path], leave_out: frozenset[str] = frozenset()) -> dict[str, set[str]]:
    """File -> the ``core_kv`` files it imports (a package import is its ``__init__``; an imported name that is a
    submodule, ``from core_kv.eval import ruler``, is that file)."""

    def resolve(target: str) -> str | None:
        while target and target not in mods:
            target = target.rpartition(".")[0]
        return target or None

    graph = {}
    for name, path in mods.items():
        if name in leave_out:
            continue
        targets = {resolve(t) for _, t in imports(path)}
        graph[name] = {t for t in targets if t is not None and t != name and t not in leave_out}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one file (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def floors(graph: dict[str, set[str]]) -> dict[str, int]:
    """Each file's floor: 1 + the highest floor among the files it imports (1 for a file importing none). The graph
    must have no circle."""
    out: dict[str, int] = {}

    def floor(v: str) -> int:
        if v not in out:
            out[v] = 1 + max((floor(w) for w in graph[v]), default=0)
        return out[v]

    for v in graph:
        floor(v)
    return out


def tallest(graph: dict[str, set[str]], level: dict[str, int]) -> list[str]:
    """One longest chain of imports, top file first."""
    chain = [max(sorted(level), key=level.get)]
    while graph[chain[-1]]:
        chain.append(max(sorted(graph[chain[-1]]), key=level.get))
    return chain


MODULES = modules()
GRAPH = import_graph(MODULES)


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


def test_no_import_circles():
    """No circle, function-local imports included."""
    found = circles(GRAPH)
    assert not found, f"import circles: {found}"


def test_at_most_ten_floors():
    level = floors(GRAPH)
    chain = tallest(GRAPH, level)
    print(f"{len(GRAPH)} files on {max(level.values())} floors; tallest: {' -> '.join(chain)}")
    assert max(level.values()) <= MAX_FLOORS, f"{max(level.values())} floors > {MAX_FLOORS}: {' -> '.join(chain)}"


# What inference loads (the artifact, the presses, the pipeline) never reaches into the offline stages: the teacher,
# distillation and the proxy LM.
INFERENCE = ("core_kv.presses", "core_kv.pipeline", "core_kv.core_model", "core_kv.indexer", "core_kv.memory",
             "core_kv.geometry", "core_kv.features", "core_kv.budget", "core_kv.policy", "core_kv.models")  # fmt: skip
OFFLINE = ("core_kv.teacher", "core_kv.distill", "core_kv.proxy")


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n.startswith(INFERENCE)))
def test_inference_imports_no_offline_stage(name):
    bad = [f"line {line}: {t}" for line, t in imports(MODULES[name]) if t.startswith(OFFLINE)]
    assert not bad, f"{name} is on the inference path but imports an offline stage: {bad}"


def test_the_product_imports_no_research():
    """``research/`` (the released recipe among them) stands on the product and registers into it
    (``register_artifact``, ``register_recipe``, press classes); the product never imports it."""
    bad = [f"{name}:{line}" for name, path in MODULES.items() for line, _ in imports(path, prefix="research")]
    assert not bad, f"product modules import research/: {bad}"


def test_no_compatibility_shims():
    """No module answers for names it does not define (a module-level ``__getattr__``): moved code is imported from
    where it lives. A package's ``__init__`` may still export its own submodules' names lazily."""
    shims = [n for n, p in MODULES.items() if p.name != "__init__.py" and any(
        isinstance(node, ast.FunctionDef) and node.name == "__getattr__" for node in ast.parse(p.read_text()).body
    )]  # fmt: skip
    assert not shims, f"module-level __getattr__ shims: {shims}"


TEST_FILES = sorted([*(ROOT / "tests").glob("*.py"), *(ROOT / "research").rglob("tests/*.py")])


def imported_test_modules(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` of every import of a ``test_*`` module or of a ``conftest`` in ``path`` (``from
    tests.test_x import ...``, ``from test_x import ...``, ``import tests.test_x``, ``from conftest import ...``,
    ``__import__("conftest")``, ``importlib.import_module("tests.test_x")``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names if node.module == "tests"]
        elif isinstance(node, ast.ImportFrom) and node.level:  # from . import test_x
            names = [a.name for a in node.names]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if func in ("__import__", "import_module") and isinstance(node.args[0].value, str):
                names = [node.args[0].value]
        found += [
            (node.lineno, n) for n in names if any(p.startswith("test_") or p == "conftest" for p in n.split("."))
        ]
    return found


@pytest.mark.parametrize("path", TEST_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_test_module_imports_another(path):
    """Shared fixtures live in ``tests/conftest.py`` (pytest supplies them), shared helpers in ``tests/helpers.py``."""
    bad = imported_test_modules(path)
    assert not bad, f"{path.relative_to(ROOT)} imports test modules (move the shared part to tests/helpers.py): {bad}"


# ---- the checker is not vacuous --------------------------------------------------------------------------------


def test_the_checker_sees_local_and_type_checking_imports(tmp_path):
    f = tmp_path / "m.py"
    f.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from core_kv.distill.trainer import Trainer\n"
        "def f():\n    from core_kv.eval.runner import run_eval\n"
    )
    assert imports(f) == [(3, "core_kv.distill.trainer"), (5, "core_kv.eval.runner")]
    assert floor_of("core_kv.eval.runner") > floor_of("core_kv.models.loading")
    assert len(MODULES) > 40


def test_the_checker_finds_circles_and_floors(tmp_path):
    pkg = tmp_path / "core_kv"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from core_kv import b\n")
    (pkg / "b.py").write_text("def f():\n    from core_kv.sub.c import x\n")  # function-local
    (pkg / "sub" / "c.py").write_text("import core_kv.a\n")
    graph = import_graph(modules(pkg))
    assert graph["core_kv.a"] == {"core_kv.b"} and graph["core_kv.b"] == {"core_kv.sub.c"}
    assert circles(graph) == [["core_kv.a", "core_kv.b", "core_kv.sub.c"]]
    (pkg / "sub" / "c.py").write_text("x = 1\n")
    graph = import_graph(modules(pkg))
    assert circles(graph) == [] and floors(graph)["core_kv.a"] == 3
    assert tallest(graph, floors(graph)) == ["core_kv.a", "core_kv.b", "core_kv.sub.c"]


def test_the_checker_sees_a_test_module_import(tmp_path):
    f = tmp_path / "test_x.py"
    f.write_text(
        "from tests.test_core_press import artifact\nfrom tests import helpers, test_runner\nimport pytest\n"
        "from tests.conftest import llama\nx = __import__('conftest').tiny_model()\n"
    )
    assert imported_test_modules(f) == [
        (1, "tests.test_core_press"), (2, "tests.test_runner"), (4, "tests.conftest"), (5, "conftest")
    ]  # fmt: skip
