"""Usage: ``python -m core_kv.teacher --config configs/teacher/default.yaml [a.b=v ...]`` (also under accelerate launch).

Builds the teacher dataset (allocations, features, geometry) for one base model; ``--help`` lists every option.
"""

from __future__ import annotations

import sys

from core_kv.config import load_config
from core_kv.teacher.config import TeacherConfig
from core_kv.teacher.run import run_teacher


def main(argv: list[str] | None = None) -> dict:
    cfg = load_config(TeacherConfig, sys.argv[1:] if argv is None else argv, usage=__doc__)
    return run_teacher(cfg)


if __name__ == "__main__":
    main()
