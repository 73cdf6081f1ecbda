"""Build the CORE teacher dataset (allocations, features, geometry, Table 5/7 report) for one base model.

Usage::

    python -m core_kv.teacher --config configs/teacher/X.yaml [a.b=v ...]      (also under ``accelerate launch``)

``train.py`` builds the teacher data itself when it is missing; run this alone to sweep teacher options (λ) before a
distillation, reading each run's ``<out_dir>/report.md``.

Examples::

    python -m core_kv.teacher --config configs/teacher/default.yaml                     # the proxy LM, CPU
    python -m core_kv.teacher --config configs/teacher/smollm2.yaml lam=4 out_dir=runs/teacher/smollm2-lam4
    python -m core_kv.teacher model.path=<hub id or folder> data.source=hf data.hf_dataset=<dataset or folder>
"""

from __future__ import annotations

import sys

from core_kv.config import load_config, shipped_configs
from core_kv.models.loading import PROXY_PATH
from core_kv.teacher.config import TeacherConfig
from core_kv.teacher.run import run_teacher

ROOT = PROXY_PATH.parents[1]


def usage() -> str:
    """The docstring and the shipped configs (``--help``)."""
    return f"{__doc__.strip()}\n\nshipped configs (configs/teacher/):\n{shipped_configs(ROOT / 'configs' / 'teacher', ROOT)}"


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    cfg = load_config(TeacherConfig, argv, usage=usage() if {"-h", "--help"} & set(argv) else __doc__)
    return run_teacher(cfg)


if __name__ == "__main__":
    main()
