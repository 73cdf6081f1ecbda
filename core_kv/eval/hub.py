"""Rows of a hub dataset or of local files, through one code path (benchmarks.md §6.3).

``datasets.load_dataset`` reads the pinned hub dataset, or local JSONL/JSON/parquet files with the same column
layout, so tests run the exact parsing code users run on the real data.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

SUFFIXES = (".jsonl", ".json", ".parquet")


def local_files(benchmark: str, task: str, source: str | os.PathLike | Mapping) -> list[Path]:
    """Files for ``task`` in ``source``: a mapping task -> file, or a folder with ``<task>.jsonl|.json|.parquet``
    or a ``<task>/`` folder of such files (a hub snapshot)."""
    if isinstance(source, Mapping):
        if task not in source:
            raise FileNotFoundError(f"{benchmark} task {task!r}: no entry in the source mapping {sorted(source)}")
        paths = [Path(source[task])]
    else:
        folder = Path(source)
        paths = [p for p in (folder / f"{task}{ext}" for ext in SUFFIXES) if p.is_file()][:1]
        paths = paths or sorted(p for p in (folder / task).glob("*") if p.suffix in SUFFIXES)
        if not paths:
            raise FileNotFoundError(
                f"{benchmark} task {task!r}: no {task}.jsonl, {task}.json, {task}.parquet or {task}/*.parquet in {folder}"
            )
    for p in paths:
        if not p.is_file():
            raise FileNotFoundError(f"{benchmark} task {task!r}: {p} does not exist")
    return paths


def task_names(tasks, all_tasks, check_task, max_samples: int | None) -> list[str]:
    """The tasks a loader reads: ``tasks`` is a task name, a list of them, or None for ``all_tasks``; each is
    checked by ``check_task`` (which raises ``ValueError`` naming the benchmark), and ``max_samples`` must be
    None or >= 1, all before any row is read."""
    names = [tasks] if isinstance(tasks, str) else list(all_tasks if tasks is None else tasks)
    for task in names:
        check_task(task)
    if max_samples is not None and max_samples < 1:
        raise ValueError(f"max_samples must be >= 1 or None, got {max_samples}")
    return names


def load_rows(
    benchmark: str,
    dataset_id: str,
    task: str,
    source,
    revision: str,
    layout_hint: str,
    max_samples: int | None = None,
) -> list[dict]:
    """Rows of ``task``: from the hub (``dataset_id``, ``data_dir=task``, split ``test``, at ``revision``) when
    ``source`` is None, else from local files: a folder holding ``<task>.jsonl`` / ``<task>.json`` /
    ``<task>.parquet`` or a ``<task>/`` folder of parquet or jsonl files (a hub snapshot), or a mapping task → file
    (``FileNotFoundError`` when it has no file for ``task``); local files go through the same parser. Hub failures (offline, no network, missing revision) raise one ``RuntimeError`` that
    names the dataset and how to pass a local file; an empty file raises ``ValueError``."""
    import datasets

    if source is None:
        try:
            ds = datasets.load_dataset(dataset_id, data_dir=task, split="test", revision=revision)
        except Exception as e:  # any hub failure gets one clear message (re-raised, never swallowed)
            raise RuntimeError(
                f"could not load {benchmark} task {task!r} from the Hugging Face hub dataset {dataset_id!r} "
                f"(data_dir={task!r}, revision={revision!r}): {type(e).__name__}: {e}. Offline, pass "
                f"source=<folder with {task}.jsonl> ({layout_hint}) or source={{{task!r}: <file>}}"
            ) from e
    else:
        paths = local_files(benchmark, task, source)
        builder = "parquet" if paths[0].suffix == ".parquet" else "json"
        try:
            ds = datasets.load_dataset(builder, data_files=[str(p) for p in paths], split="train")
        except StopIteration as e:  # what the json builder raises on an empty file
            raise ValueError(
                f"{benchmark} task {task!r}: the dataset has no rows ({', '.join(map(str, paths))})"
            ) from e
    if max_samples is not None:
        ds = ds.select(range(min(max_samples, len(ds))))
    return list(ds)
