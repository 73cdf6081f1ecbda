"""Every ``python`` and ``bash`` code block of README.md and docs/**/*.md works (issue 47): a snippet that does not run
fails CI.

- ``python`` blocks run, each in a fresh interpreter from the repository root (offline, one thread), so each must be
  self-contained, as a reader copies it.
- ``bash`` blocks are checked command by command without running anything long: ``make`` targets exist in the
  Makefile; the entry points' arguments are a dry run of their config (``eval.py``, ``train.py``, ``python -m
  core_kv.teacher`` / ``core_kv.proxy.train``: the YAML files and ``a.b=v`` overrides load exactly as the command
  would load them, ``make eval/train ARGS="..."`` included); ``accelerate launch`` options parse with accelerate's own
  parser; the other scripts' ``--options`` appear in their ``--help``; every file, config and checkpoint named exists
  (a file made by an earlier ``cp`` of the same block counts; ``runs/`` and ``results/``, which the documented runs
  write, are not checked).

A marker comment on the line just before the fence changes that:

- ``<!-- snippet: illustrative -- <why it cannot run offline> -->``: compiled (python) or ``bash -n`` checked only.
  Keep it rare: an 8B model on GPUs, a hub download.
- ``<!-- snippet: slow -->``: a python block run only with ``-m slow`` (e.g. a long SmolLM2 forward).
- ``<!-- snippet: continues -->``: a python block that runs after the file's previous python block (same process).
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```(\w*)\s*$")
MARK = re.compile(r"^<!--\s*snippet:\s*(illustrative|slow|continues)\b\s*(?:--)?\s*(.*?)\s*-->\s*$")
PYTHONS = {"python", "python3", ".venv/bin/python"}
OUTPUTS = ("runs/", "results/")  # git-ignored folders the documented runs write (their paths are not checked)
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


@dataclass
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    mark: str = ""
    reason: str = ""
    before: list[str] = field(default_factory=list)  # earlier python blocks it continues

    @property
    def id(self) -> str:
        path = self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path
        return f"{path}:{self.line}"


def parse_blocks(path: Path) -> list[Block]:
    """The fenced ``python``/``bash``/``sh`` blocks of a markdown file, with their markers."""
    lines = path.read_text(encoding="utf-8").splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        j = i + 1
        while j < len(lines) and lines[j].strip() != "```":
            j += 1
        lang = {"sh": "bash", "shell": "bash"}.get(m.group(1), m.group(1))
        prev = next((lines[k] for k in range(i - 1, -1, -1) if lines[k].strip()), "")
        mark = MARK.match(prev.strip())
        if lang in ("python", "bash"):
            block = Block(path, i + 1, lang, "\n".join(lines[i + 1 : j]) + "\n", *(mark.groups() if mark else ("", "")))
            if block.mark == "continues":
                earlier = [b for b in out if b.lang == "python"]
                assert earlier, f"{block.id}: 'continues' needs an earlier python block in the file"
                block.before = [*earlier[-1].before, earlier[-1].code]
            out.append(block)
        i = j + 1
    return out


BLOCKS = [b for path in DOCS for b in parse_blocks(path)]


def _param(block: Block):
    marks = [pytest.mark.slow] if block.mark == "slow" else []
    return pytest.param(block, id=block.id, marks=marks)


def test_the_docs_have_snippets_and_markers_are_explained():
    """The collection sees README's blocks (a parser that found none would pass vacuously); illustrative blocks say
    why they cannot run."""
    assert any(b.path.name == "README.md" and b.lang == "python" for b in BLOCKS)
    assert any(b.path.name == "README.md" and b.lang == "bash" for b in BLOCKS)
    for b in BLOCKS:
        if b.mark == "illustrative":
            assert len(b.reason) > 10, f"{b.id}: say why the block cannot run: <!-- snippet: illustrative -- why -->"


# ------------------------------------------------------------------------------------------------------------ python
@pytest.mark.parametrize("block", [_param(b) for b in BLOCKS if b.lang == "python"])
def test_python_snippet_runs(block: Block):
    if block.mark == "illustrative":
        compile(block.code, block.id, "exec")
        return
    code = "\n".join([*block.before, block.code])
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, f"{block.id} failed:\n{block.code}\n--- stderr ---\n{res.stderr[-3000:]}"


# -------------------------------------------------------------------------------------------------------------- bash
def commands(code: str) -> list[list[str]]:
    """Shell words of each command of a block (continuations joined, comments dropped, split at ``&&``/``;``/``|``),
    leading ``VAR=value`` assignments removed."""
    out = []
    for line in code.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        cmd: list[str] = []
        for w in [*words, ";"]:
            if w in ("&&", ";", "||", "|"):
                while cmd and re.match(r"^[A-Z_][A-Z0-9_]*=", cmd[0]):
                    cmd.pop(0)
                if cmd:
                    out.append(cmd)
                cmd = []
            else:
                cmd.append(w)
    return out


@functools.cache
def make_targets() -> set[str]:
    return set(re.findall(r"^([A-Za-z0-9_.-]+):", (ROOT / "Makefile").read_text(encoding="utf-8"), re.M))


@functools.cache
def script_help(path: str) -> str:
    res = subprocess.run([sys.executable, path, "--help"], cwd=ROOT, env=ENV, capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert res.returncode == 0, f"{path} --help failed: {res.stderr[-2000:]}"
    return res.stdout


CONFIGS = {  # entry point -> (module, config class) whose load_config is the command's dry run
    "eval.py": ("core_kv.eval.runner", "EvalConfig"),
    "train.py": ("core_kv.distill.config", "TrainConfig"),
    "core_kv.teacher": ("core_kv.teacher.config", "TeacherConfig"),
    "core_kv.proxy.train": ("core_kv.proxy.train", "ProxyTrainConfig"),
}
MAKE_ENTRY = {  # make target -> (entry point, arguments it adds before ARGS)
    "eval": ("eval.py", []),
    "train": ("train.py", []),
    "train-smollm2": ("train.py", ["--config", "configs/train/smollm2.yaml"]),
    "bench": ("benchmarks/press_overhead.py", []),
}


class Checker:
    """Checks the commands of one bash block; ``made`` maps files an earlier ``cp`` created to their source."""

    def __init__(self, block: Block):
        self.block, self.made = block, {}

    def fail(self, cmd: list[str], why: str):
        pytest.fail(f"{self.block.id}: `{shlex.join(cmd)}`: {why}", pytrace=False)

    def exists(self, cmd: list[str], path: str) -> Path:
        p = self.made.get(path, path)
        if p.startswith(OUTPUTS):  # a run or results folder an earlier step (train.py, eval.py) writes
            return ROOT / p
        if not (ROOT / p).exists():
            self.fail(cmd, f"{path} does not exist")
        return ROOT / p

    def check(self, cmd: list[str]) -> None:
        head, args = cmd[0], cmd[1:]
        if head in ("nohup", "time", "env"):
            return self.check(args)
        if head == "make":
            targets = [a for a in args if "=" not in a and not a.startswith("-")]
            extra = next((a.removeprefix("ARGS=") for a in args if a.startswith("ARGS=")), "")
            for t in targets or ["setup"]:
                if t not in make_targets():
                    self.fail(cmd, f"make target {t!r} is not in the Makefile ({sorted(make_targets())})")
                if t in MAKE_ENTRY:
                    entry, pre = MAKE_ENTRY[t]
                    self.entry(cmd, entry, [*pre, *shlex.split(extra)])
                elif extra:
                    self.fail(cmd, f"make {t} takes no ARGS")
        elif head in PYTHONS:
            if args[:1] == ["-m"]:
                self.entry(cmd, args[1], args[2:])
            elif args[:1] == ["-c"]:
                compile(args[1], self.block.id, "exec")
            else:
                self.entry(cmd, args[0], args[1:])
        elif head in ("accelerate", ".venv/bin/accelerate"):
            if args[:1] != ["launch"]:
                self.fail(cmd, "only `accelerate launch` is known")
            from accelerate.commands.launch import launch_command_parser

            try:
                ns = launch_command_parser().parse_args(args[1:])
            except SystemExit:
                self.fail(cmd, "accelerate launch rejects these options")
            if ns.config_file:
                self.exists(cmd, ns.config_file)
            self.entry(cmd, ns.training_script, ns.training_script_args)
        elif head == "cp":
            src, dst = [a for a in args if not a.startswith("-")][-2:]
            self.exists(cmd, src)
            self.made[dst] = self.made.get(src, src)
        elif head in ("source", "."):
            self.exists(cmd, args[0])
        elif head in ("pip", ".venv/bin/pip", "cd", "export", "git", "ls", "cat", "tail", "du", "mkdir", "wandb"):
            return
        else:
            self.fail(cmd, "unknown command: make the block runnable or mark it <!-- snippet: illustrative -- why -->")

    def entry(self, cmd: list[str], target: str, args: list[str]) -> None:
        """Dry-run one entry point with its arguments."""
        if target.endswith(".py"):
            self.exists(cmd, target)
        args = [self.made.get(a, a) for a in args]
        for a in args:
            if a.endswith((".yaml", ".yml")) and "=" not in a:
                self.exists(cmd, a)
            key, eq, value = a.partition("=")
            if eq and key.endswith("checkpoint"):
                self.exists(cmd, value)
        if target in CONFIGS:
            import importlib

            from core_kv.config import load_config

            module, name = CONFIGS[target]
            schema = getattr(importlib.import_module(module), name)
            try:
                load_config(schema, args)
            except Exception as e:  # any refusal is the snippet's failure ...
                produced = [v for a in args for k, _, v in [a.partition("=")] if v.startswith(OUTPUTS)]
                if any(v in str(e) for v in produced) and "no CORE artifact" in str(e):
                    return  # ... but an artifact an earlier documented run writes under runs/ is not there yet
                self.fail(cmd, f"{target} refuses these arguments: {type(e).__name__}: {e}")
        elif target.endswith(".py"):
            text = script_help(target)
            for a in args:
                if a.startswith("--") and a.split("=")[0] not in text:
                    self.fail(cmd, f"{a.split('=')[0]} is not an option of {target} (its --help)")
        else:
            import importlib.util

            if importlib.util.find_spec(target) is None:
                self.fail(cmd, f"no module {target}")


@pytest.mark.filterwarnings("ignore:press_options for methods not in the run")  # a documented narrowing
@pytest.mark.parametrize("block", [_param(b) for b in BLOCKS if b.lang == "bash"])
def test_bash_snippet_commands_exist_and_parse(block: Block):
    res = subprocess.run(["bash", "-n"], input=block.code, capture_output=True, text=True)
    assert res.returncode == 0, f"{block.id}: bash syntax: {res.stderr}"
    if block.mark == "illustrative":
        return
    checker = Checker(block)
    cmds = commands(block.code)
    assert cmds, f"{block.id}: no command"
    for cmd in cmds:
        checker.check(cmd)


def test_the_checker_catches_what_it_should(tmp_path):
    """A snippet naming a missing config, a wrong override, a missing make target or an unknown script option fails."""
    bad = [
        "python eval.py configs/eval/nope.yaml",
        "python eval.py methods=[nope]",
        "make trian",
        'make eval ARGS="ratios=[2]"',
        "python train.py teacher.lamda=2",
        ".venv/bin/python benchmarks/press_overhead.py --no-such-option 3",
        "accelerate launch --no-such-flag train.py",
        "python eval.py press_options.core.checkpoint=checkpoints/none/final",
        "frobnicate --all",
    ]
    for code in bad:
        block = Block(tmp_path / "x.md", 1, "bash", code + "\n")
        with pytest.raises(pytest.fail.Exception):
            for cmd in commands(code):
                Checker(block).check(cmd)
    good = Block(
        tmp_path / "x.md", 1, "bash", "cp configs/train/quick.yaml mine.yaml\nmake train ARGS='--config mine.yaml'\n"
    )
    checker = Checker(good)
    for cmd in commands(good.code):
        checker.check(cmd)


def _measure_docs():
    import importlib.util

    spec = importlib.util.spec_from_file_location("measure_docs", ROOT / "scripts" / "measure_docs.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["measure_docs"] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def test_every_quoted_time_and_count_is_the_measured_one():
    """The times and counts the README, the guides, train.py --help, default.yaml and the Makefile quote are the
    numbers of docs/measured.json, which scripts/measure_docs.py writes (issue 59: they had drifted by 2x)."""
    import json

    measure = _measure_docs()
    measured = json.loads((ROOT / "docs" / "measured.json").read_text())
    assert measure.check(measured) == []
    files = {q.file for q in measure.QUOTES}
    assert {"README.md", "train.py", "Makefile", "docs/train-your-model.md", "docs/evaluation.md"} <= files
    slower = {**measured, "make_train": {**measured["make_train"], "seconds": measured["make_train"]["seconds"] + 60}}
    problems = measure.check(slower)  # a re-measurement that moves a number names every quote to update
    assert len(problems) == sum(q.key == "make_train" for q in measure.QUOTES), problems
    assert all("docs/measured.json gives" in p for p in problems)
