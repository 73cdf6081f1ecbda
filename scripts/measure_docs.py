"""Measure again every time and count the docs quote, and keep them in ``docs/measured.json``.

The README, ``docs/train-your-model.md``, ``docs/evaluation.md``, ``train.py --help``, ``configs/train/default.yaml``
and the Makefile quote how long ``make train``, the quick recipe, ``make test`` and ``python eval.py`` take and how
many tests run. Each quote is listed in :data:`QUOTES` (file, the sentence around the number, the measurement it
shows); ``tests/test_doc_snippets.py`` checks that every quoted number is the one ``docs/measured.json`` holds, so
a re-measurement that changes a number fails the tests until the docs say it (``--check`` prints the lines to fix).

Usage (from the repository root, after ``make setup``; each measurement runs on a fresh output folder)::

    .venv/bin/python scripts/measure_docs.py make_train              # ~7 min: the proxy recipe, teacher included
    .venv/bin/python scripts/measure_docs.py quick_policy            # ~1 min: SmolLM2's prompt time -> the quick
                                                                     #   recipe's policy-stage estimate
    .venv/bin/python scripts/measure_docs.py quick make_test eval    # ~30 + ~15 + ~10 min
    .venv/bin/python scripts/measure_docs.py --check                 # the docs' numbers against docs/measured.json

Every entry records the command, the date, the CPU count and model and the load average before and after (other
jobs on a shared machine slow a run: compare entries measured under similar load).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # measure this checkout's core_kv, whatever the environment's editable install points at
MEASURED = ROOT / "docs" / "measured.json"
PY = ROOT / ".venv" / "bin" / "python"
MAKE = ["make"]  # --make: e.g. "make -o .venv/.installed" where .venv is another checkout's


@dataclass(frozen=True)
class Quote:
    """A number the docs quote: in ``file``, ``pattern``'s group 1 must read ``fmt`` of ``measured[key][field]``."""

    file: str
    pattern: str
    key: str
    field: str = "seconds"
    fmt: str = "min"  # "min": seconds as minutes, one decimal; "int": a count with thousands separators

    def expected(self, measured: dict) -> str:
        value = measured[self.key][self.field]
        return f"{value / 60:.1f}" if self.fmt == "min" else f"{value:,}"


QUOTES = [
    Quote("README.md", r"runs/core-proxy/final \(([\d.]+) min", "make_train"),
    Quote("README.md", r"CPU: ([\d,]+) tests", "make_test", "passed", "int"),
    Quote("README.md", r"tests in ([\d.]+) min", "make_test"),
    Quote("README.md", r"at 75% \(([\d.]+) min, docs/measured.json\)", "eval"),
    Quote("train.py", r"the proxy LM, CPU, ([\d.]+) min", "make_train"),
    Quote("configs/train/default.yaml", r"About ([\d.]+) min on 2 CPU cores", "make_train"),
    Quote("Makefile", r"the proxy recipe, ([\d.]+) min on 2 cores", "make_train"),
    Quote("docs/train-your-model.md", r"SmolLM2-135M: ([\d.]+) min on one shared CPU core", "quick"),
    Quote("docs/train-your-model.md", r"the proxy LM's `make train` took ([\d.]+) min", "make_train"),
    Quote("docs/train-your-model.md", r"quick recipe's policy stage: about ([\d.]+) min", "quick_policy", "estimate_s"),
    Quote("docs/evaluation.md", r"the default suite took ([\d.]+) min", "eval"),
]


def host() -> dict:
    """When and where: the date, CPUs, the CPU model and the load average now."""
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").is_file() else ""  # fmt: skip
    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpus": os.cpu_count(), "cpu": model,
            "load_before": [round(x, 2) for x in os.getloadavg()]}  # fmt: skip


def timed(command: list[str], log: Path) -> tuple[float, str]:
    """Run ``command`` from the repository root (its output to ``log`` and the console); its wall seconds and
    output. A failing command raises, naming the log."""
    t0 = time.perf_counter()
    with log.open("w") as f:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            sys.stdout.write(line)
            f.write(line)
    seconds = time.perf_counter() - t0
    if proc.wait() != 0:
        raise SystemExit(f"{' '.join(command)} failed (exit {proc.returncode}); its output: {log}")
    return seconds, log.read_text()


def train_stages(out: Path, teacher: Path) -> dict:
    """The stages' own clocks: the teacher's wall time, the distillation's (the run's ``wall_s``, which includes the
    teacher it built, less the teacher) and the policy stage's."""
    built = json.loads((teacher / "metrics.json").read_text())["throughput"]["wall_s"]
    stages = {"teacher": built, "distillation": json.loads((out / "summary.json").read_text())["wall_s"] - built}
    recorded = json.loads((out / "final" / "config.json").read_text()).get("inference_policy")
    if recorded:
        from core_kv.policy import InferencePolicy

        lengths = InferencePolicy.from_dict(recorded).lengths
        stages["policy"] = sum(lb.validation["seconds"] for lb in lengths)
        stages["policy_prompts"] = sum(lb.validation["prompts"] for lb in lengths)
    return {k: round(v, 1) for k, v in stages.items()}


def measure_train(name: str, config: list[str], work: Path) -> dict:
    out, teacher = work / name, work / f"{name}-teacher"
    args = " ".join([*config, f"out_dir={out}", f"teacher.out_dir={teacher}"])
    command = [*MAKE, "train", f"ARGS={args}"]
    seconds, _ = timed(command, work / f"{name}.log")
    shown = " ".join([*config, "out_dir=<fresh> teacher.out_dir=<fresh>-teacher"])
    return {"command": f'make train ARGS="{shown}"', "seconds": round(seconds, 1), "stages": train_stages(out, teacher)}


def measure_make_test(work: Path) -> dict:
    seconds, text = timed([*MAKE, "test"], work / "make_test.log")
    m = re.search(r"(\d+) passed.* in ([\d.]+)s", text)
    if m is None:
        raise SystemExit(f"make test printed no pytest summary; its output: {work / 'make_test.log'}")
    return {"command": "make test", "seconds": round(seconds, 1), "passed": int(m.group(1)),
            "pytest_seconds": float(m.group(2))}  # fmt: skip


def measure_eval(work: Path) -> dict:
    command = [str(PY), "eval.py", f"output_dir={work / 'eval'}", "progress=false"]
    seconds, _ = timed(command, work / "eval.log")
    return {"command": "python eval.py output_dir=<fresh> progress=false", "seconds": round(seconds, 1)}


def measure_quick_policy(work: Path, prompts: int = 2) -> dict:
    """The quick recipe's policy stage on SmolLM2, estimated from timed prompts: ``prompts`` of its validation
    prompts, each scored with the full cache and with every candidate at 75% (the shipped SmolLM2 artifact), give the
    seconds per prefill; times its size."""
    import torch

    from core_kv.config import load_config
    from core_kv.distill.config import TrainConfig
    from core_kv.eval.policy_stage import cost_line, score_prompt
    from core_kv.eval.validation import validation_set
    from core_kv.models.loading import load_model
    from core_kv.presses.core import compose
    from core_kv.presses.core_scorer import CoreScorerPress

    torch.set_num_threads(1)
    recipe = load_config(TrainConfig, [str(ROOT / "configs" / "train" / "quick.yaml")])
    cfg = recipe.policy
    model, tok = load_model(recipe.teacher.model.path)
    artifact = str(ROOT / "checkpoints" / "core-smollm2" / "final")
    ((length, per_task),) = cfg.per_length()  # the quick recipe validates at one length
    chosen = validation_set(tok, cfg.tasks, length, per_task, cfg.seed)[:prompts]
    presses = [None] + [compose(CoreScorerPress(checkpoint=artifact, compression_ratio=0.75), c)
                        for c in cfg.candidate_options()]  # fmt: skip
    score_prompt(model, tok, chosen[0], None)  # warm-up
    t0 = time.perf_counter()
    for p in chosen:
        for press in presses:
            score_prompt(model, tok, p, press)
    per = (time.perf_counter() - t0) / (len(chosen) * len(presses))
    n = len(cfg.tasks) * per_task
    total = n * (1 + len(cfg.ratios) * len(cfg.candidate_options()))
    return {"command": "scripts/measure_docs.py quick_policy (one thread)", "seconds_per_prefill": round(per, 2),
            "size": cost_line(n, length, len(cfg.ratios), len(cfg.candidate_options())),
            "estimate_s": round(per * total, 1)}  # fmt: skip


MEASUREMENTS = {
    "make_train": lambda work: measure_train("make_train", [], work),
    "quick": lambda work: measure_train("quick", ["--config", "configs/train/quick.yaml"], work),
    "make_test": measure_make_test,
    "eval": measure_eval,
    "quick_policy": measure_quick_policy,
}


def check(measured: dict) -> list[str]:
    """Every quote whose number differs from ``measured`` (or is missing): ``file: what it says, what it should``."""
    problems = []
    for q in QUOTES:
        text = (ROOT / q.file).read_text(encoding="utf-8")
        found = re.findall(q.pattern, text)
        if q.key not in measured:
            problems.append(f"{q.file}: {q.pattern!r} quotes {q.key}, which docs/measured.json lacks")
        elif not found:
            problems.append(f"{q.file}: no quote matches {q.pattern!r} (should read {q.expected(measured)})")
        else:
            problems += [f"{q.file}: {q.pattern!r} reads {f}, docs/measured.json gives {q.expected(measured)}"
                         for f in found if f != q.expected(measured)]  # fmt: skip
    return problems


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("measurements", nargs="*", metavar="MEASUREMENT",
                        help=f"what to measure again: {', '.join(MEASUREMENTS)}")  # fmt: skip
    parser.add_argument("--check", action="store_true", help="compare the docs' numbers with docs/measured.json")
    parser.add_argument("--make", default="make", help="the make command (a worktree sharing another checkout's "
                        ".venv: 'make -o .venv/.installed', so make does not reinstall it)")  # fmt: skip
    args = parser.parse_args(argv)
    MAKE[:] = args.make.split()
    unknown = [m for m in args.measurements if m not in MEASUREMENTS]
    if unknown:
        parser.error(f"unknown measurement(s) {unknown}; measurements: {', '.join(MEASUREMENTS)}")
    measured = json.loads(MEASURED.read_text()) if MEASURED.is_file() else {}
    if args.check or not args.measurements:
        problems = check(measured)
        print("\n".join(problems) or f"every quoted number matches {MEASURED.relative_to(ROOT)}")
        raise SystemExit(1 if problems else 0)
    from core_kv.files import atomic_write_json

    with tempfile.TemporaryDirectory(prefix="measure_docs-") as tmp:
        for name in args.measurements:
            where = host()
            entry = MEASUREMENTS[name](Path(tmp))
            measured[name] = {**entry, **where, "load_after": [round(x, 2) for x in os.getloadavg()]}
            atomic_write_json(MEASURED, measured)
            print(f"{name}: {json.dumps(measured[name])}")
    problems = check(measured)
    print("\n".join(["the docs to update:", *problems]) if problems else "every quoted number matches")


if __name__ == "__main__":
    main()
