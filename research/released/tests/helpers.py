"""Shared helpers of the released recipe's tests: a tiny train config (the tiny teacher of ``tests.helpers``) and
the train.py entry point."""

from __future__ import annotations

from pathlib import Path

from tests.helpers import TINY_TEACHER, run  # noqa: F401  (run: train.py's main, re-exported for the tests here)

ROOT = Path(__file__).resolve().parents[3]
CONFIGS = ROOT / "research" / "released" / "configs"


def tiny_args(out: Path, *extra: str) -> list[str]:
    return [
        f"out_dir={out}",
        "plugins=[research.released]",
        "recipe=released",
        *TINY_TEACHER,
        "train_docs=4",
        "eval_docs=1",
        "eval_ratios=[0.75]",
        "released.schedule.total_steps=6",
        "released.schedule.indexer_steps=3",
        "released.schedule.warmup=1",
        "released.schedule.stable=3",
        "released.schedule.decay=2",
        "released.schedule.short_len=96",
        "released.schedule.long_len=128",
        "released.schedule.long_every=4",
        "released.schedule.decode_every=2",
        "released.schedule.decode_window=16",
        "released.memory.dim=32",
        "save_every=1",
        "progress=false",
        *extra,
    ]
