"""``--help`` on every command-line entry point prints its usage and options and exits 0 (issue 16 item 12).

Entry points are run in-process (``runpy``, as ``python FILE --help`` / ``python -m MODULE --help`` would), so the
test costs imports only. The config-driven ones (``load_config``) must list every field of their config tree, nested
dataclasses included, with its type and default.
"""

from __future__ import annotations

import dataclasses
import re
import runpy
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# runpy warns when re-running a module that an earlier test imported; the rerun is what `python -m` does
pytestmark = pytest.mark.filterwarnings("ignore:.*found in sys.modules after import:RuntimeWarning")

# (how to run it, what it is: a file relative to the repository or a module)
ENTRY_POINTS = [
    ("train.py", "file"),
    ("eval.py", "file"),
    ("core_kv.teacher", "module"),
    ("core_kv.proxy.train", "module"),
    ("core_kv.eval.proxy_ruler", "module"),
    ("core_kv.eval.fidelity", "module"),
    ("scripts/kvpress_fidelity.py", "file"),
    ("scripts/kvpress_compare.py", "file"),
    ("scripts/plot_grid.py", "file"),
    ("scripts/measure_docs.py", "file"),
    ("scripts/revalidate_policy.py", "file"),
    *[(f"benchmarks/{p.name}", "file") for p in sorted((ROOT / "benchmarks").glob("*.py")) if p.stem != "__init__"],
]


def test_every_entry_point_is_listed():
    """Every file with a ``__main__`` block is in ENTRY_POINTS, so a new CLI is tested automatically."""

    def path(target: str, kind: str) -> Path:
        if kind == "file":
            return ROOT / target
        module = ROOT / target.replace(".", "/")
        return module / "__main__.py" if module.is_dir() else module.with_suffix(".py")

    listed = {path(t, k) for t, k in ENTRY_POINTS}
    files = [*ROOT.glob("*.py"), *(p for d in ("core_kv", "scripts", "benchmarks") for p in (ROOT / d).rglob("*.py"))]
    found = {p for p in files if 'if __name__ == "__main__"' in p.read_text(encoding="utf-8")}
    assert found <= listed, sorted(map(str, found - listed))


def test_benchmarks_readme_lists_every_script():
    """``benchmarks/README.md``'s table names every script of ``benchmarks/`` (as ``python -m benchmarks.<name>``)."""
    readme = (ROOT / "benchmarks" / "README.md").read_text(encoding="utf-8")
    scripts = [p.stem for p in sorted((ROOT / "benchmarks").glob("*.py")) if not p.stem.startswith("_")]
    missing = [s for s in scripts if f"| `{s}` |" not in readme or f"python -m benchmarks.{s}" not in readme]
    assert not missing, f"benchmarks/README.md does not list {missing}"


def _run_help(target: str, kind: str, capsys, monkeypatch) -> str:
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", [target, "--help"])
    with pytest.raises(SystemExit) as e:
        if kind == "file":
            runpy.run_path(str(ROOT / target), run_name="__main__")
        else:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
    out = capsys.readouterr().out
    assert e.value.code in (0, None), out
    return out


@pytest.mark.parametrize("target, kind", ENTRY_POINTS, ids=[t for t, _ in ENTRY_POINTS])
def test_help_prints_usage_and_exits_0(target, kind, capsys, monkeypatch):
    out = _run_help(target, kind, capsys, monkeypatch)
    assert "usage" in out.lower(), out[:2000]


def _leaves(cls, prefix=""):
    """Dotted names of every field in a config tree (dict-of-dataclass fields by their value type)."""
    import typing

    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        t = hints[f.name]
        if dataclasses.is_dataclass(t):
            yield from _leaves(t, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}"


CONFIG_ENTRY_POINTS = {
    "train.py": ("core_kv.distill.config", "TrainConfig"),
    "eval.py": ("core_kv.eval.runner", "EvalConfig"),
    "core_kv.teacher": ("core_kv.teacher.config", "TeacherConfig"),
    "core_kv.proxy.train": ("core_kv.proxy.train", "ProxyTrainConfig"),
}


def _blocks(out: str) -> dict[str, str]:
    """Option name -> its help block (the ``name  type  = default`` line and the indented doc lines below it)."""
    blocks: dict[str, str] = {}
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("options ("))
    name = None
    for line in lines[start + 1 :]:
        if line.startswith("  ") and not line.startswith("      "):
            name = line.split()[0]
            blocks[name] = line
        elif name is not None:
            blocks[name] += "\n" + line
    return blocks


@pytest.mark.parametrize("target", sorted(CONFIG_ENTRY_POINTS))
def test_help_lists_every_config_field_with_type_default_and_doc(target, capsys, monkeypatch):
    """Every field has a block with its type, its default and its doc, whole (issue 47: texts were cut at the first
    line, and teacher.lam, features, utility_pool, d_z, qa_weight had none)."""
    import importlib

    kind = "file" if target.endswith(".py") else "module"
    out = _run_help(target, kind, capsys, monkeypatch)
    module, name = CONFIG_ENTRY_POINTS[target]
    schema = getattr(importlib.import_module(module), name)
    blocks = _blocks(out)
    for leaf in _leaves(schema):
        assert leaf in blocks, f"{leaf} missing from --help:\n{out[:3000]}"
        assert len(blocks[leaf].splitlines()) >= 2, f"{leaf} has no doc:\n{blocks[leaf]}"
    if target == "train.py":
        row = blocks["memory.lr"].splitlines()[0]
        assert "float" in row and "0.002" in row
        text = " ".join(blocks["out_dir"].split())
        assert "runs/core-proxy" in text and "Run folder" in text and "refused unless ``overwrite``" in text
        assert "teacher records" in blocks["indexer.records_per_micro"]  # the doc from the field's comment
        for leaf in ("teacher.lam", "teacher.features", "teacher.utility_pool", "teacher.d_z", "teacher.qa_weight"):
            assert len(" ".join(blocks[leaf].split()[4:])) > 40, blocks[leaf]  # a real sentence, not a stub
        assert "docs/method.md" in blocks["teacher.lam_layers"]  # a comment block above the field, joined
    if target == "eval.py":
        text = " ".join(blocks["model.name"].split())
        assert text.endswith("else the tiny random model, labelled as such).")  # the whole Args entry
        assert "checkpoints/core-smollm2/final" in blocks["press_options"]  # defaults are shown whole


def test_help_names_presses_benchmarks_configs_and_examples(capsys, monkeypatch):
    """eval.py --help names every registered press and benchmark; each config entry point lists its shipped configs
    (path and first sentence) and shows examples."""
    import core_kv.presses  # noqa: F401
    from core_kv.eval.benchmarks import BENCHMARKS
    from core_kv.presses.base import PRESSES

    for target, kind, folder in [("eval.py", "file", "eval"), ("train.py", "file", "train"),
                                 ("core_kv.teacher", "module", "teacher")]:  # fmt: skip
        out = _run_help(target, kind, capsys, monkeypatch)
        head = out[: out.index("\noptions (")]
        assert "Examples::" in head, target
        for path in sorted((ROOT / "configs" / folder).glob("*.yaml")):
            assert f"  configs/{folder}/{path.name}\n      " in head, (target, path.name)
        if target == "eval.py":
            listed = head[head.index("registered presses") :]
            for name in list(PRESSES) + list(BENCHMARKS):
                assert f" {name}," in listed or f" {name}\n" in listed, name
            assert "press_options.core.checkpoint" in head


def test_a_no_argument_train_runs_default_yaml_and_help_shows_those_values(capsys, monkeypatch):
    """One source of defaults (issue 59): ``train.py`` with no arguments builds exactly the config of
    configs/train/default.yaml (its policy section included: 4 candidates x 8 prompts of 512 tokens, not the 14-grid
    at 2,048), and ``--help`` shows those values."""
    from core_kv.config import load_config, to_dict
    from core_kv.distill.config import TrainConfig

    default_yaml = load_config(TrainConfig, [str(ROOT / "configs" / "train" / "default.yaml")])
    assert to_dict(load_config(TrainConfig, [])) == to_dict(default_yaml)
    blocks = _blocks(_run_help("train.py", "file", capsys, monkeypatch))
    assert blocks["policy.lengths"].split("\n")[0].endswith("= [512]")
    assert blocks["policy.per_task"].split("\n")[0].endswith("= 2")
    shown = blocks["policy.candidates"].split("\n")[0]
    assert shown.endswith("= [{}, {'memory': False}, {'head_budgets': 'adaptive', 'memory': False}, {'head_budgets': "
                          "'adaptive', 'head_pool': 'output', 'memory': False}]")  # fmt: skip


def test_eval_help_prints_nothing_before_its_usage():
    """``python eval.py --help`` printed a "Loading weights" bar (the default config's CORE artifact) before the
    usage (issue 59): a fresh process writes nothing to stderr and starts its output with the usage."""
    import os
    import subprocess

    res = subprocess.run([sys.executable, "eval.py", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert res.returncode == 0 and res.stderr == "", res.stderr[-2000:]
    assert res.stdout.startswith("usage: Evaluate KV-cache compression")


def test_eval_help_presses_lists_every_press_option_with_its_type_and_default(capsys, monkeypatch):
    """``eval.py --help presses``: the options every press shares, then each registered press's own, read from the
    dataclass fields of PRESSES (name, type, the declared default)."""
    import core_kv.presses  # noqa: F401
    from core_kv.presses.base import PRESSES, BasePress

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", ["eval.py", "--help", "presses"])
    runpy.run_path(str(ROOT / "eval.py"), run_name="__main__")
    out = capsys.readouterr().out
    shared = {f.name for f in dataclasses.fields(BasePress)}
    sections = out.split("\n\n")
    for name, cls in PRESSES.items():
        section = next(s for s in sections if s.startswith(f"{name} ({cls.__name__})"))
        own = [f for f in dataclasses.fields(cls) if f.init and f.name not in shared]
        for f in own:
            assert re.search(rf"^  {f.name}\s+\S.*=", section, re.M), (name, f.name, section)
        assert bool(own) != section.endswith("no options of its own"), section
    snapkv = next(s for s in sections if s.startswith("snapkv ("))
    window = next(f for f in dataclasses.fields(PRESSES["snapkv"]) if f.name == "window_size")
    assert re.search(rf"^  window_size\s+int\s+= {window.default}$", snapkv, re.M), snapkv
    assert re.search(r"^  compression_ratio\s+float\s+= 0.0$", sections[1], re.M)  # every press's options
