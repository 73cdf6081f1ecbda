"""Shared helpers of the released recipe's tests: a tiny train config and the train.py entry point."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
CONFIGS = ROOT / "research" / "released" / "configs"


def tiny_args(out: Path, *extra: str) -> list[str]:
    return [
        f"out_dir={out}",
        "plugins=[research.released]",
        "recipe=released",
        "teacher.model.random_init=true",
        "teacher.model.path=''",
        "teacher.model.hidden_size=64",
        "teacher.model.num_layers=2",
        "teacher.model.num_heads=4",
        "teacher.model.num_kv_heads=2",
        "teacher.model.intermediate_size=128",
        "teacher.data.source=random",
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


def run(args: list[str]) -> dict:
    import train

    return train.main(args)
