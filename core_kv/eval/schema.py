"""The one row schema every benchmark yields, and the results-folder layout (one folder per cell)."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from core_kv.config import check_config, option
from core_kv.models.loading import TINY


@dataclass
class Sample:
    """One evaluation item: a context to compress and one question answered on top of it.

    Several samples may share a ``context`` (LongBench/LooGLE-style multi-question documents); the runner
    compresses each distinct context once and answers all of its questions on that cache.

    Attributes:
        benchmark: e.g. ``"ruler"``, ``"niah"``, ``"longbench"``, ``"loogle"``.
        task: task name inside the benchmark (``"niah_single_1"``, ``"narrativeqa"``, ...).
        context: the text that is compressed.
        question: text fed on top of the compressed cache (may be empty).
        answer_prefix: text fed after the question, before generation starts.
        answers: reference answers.
        max_new_tokens: greedy generation budget.
        metric: scorer name in ``core_kv.eval.scorers.METRICS``.
        length: nominal length bucket (target tokens for RULER/NIAH, real length otherwise).
        extra: benchmark-specific fields kept for reports (depth, sample index, ...).
    """

    benchmark: str
    task: str
    context: str
    question: str
    answer_prefix: str
    answers: list[str]
    max_new_tokens: int = option(ge=0)
    metric: str
    length: int = option(ge=0)
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_config(self)  # every field's type (a jsonl row with "max_new_tokens": "8" is named, not run)

    def to_dict(self) -> dict:
        return asdict(self)


def model_slug(name: str) -> str:
    """Folder-safe model name: ``meta-llama/Llama-3.1-8B`` -> ``meta-llama--Llama-3.1-8B``; a local folder -> its name."""
    if name == TINY:
        return "tiny-random"
    path = Path(name)
    if path.is_dir():
        return path.resolve().name
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name.replace("/", "--"))


def ratio_label(ratio: float) -> str:
    """The compression ratio as folders and reports name it: two decimals (``0.75``, ``0.50``) when they are the ratio
    exactly, else its shortest exact form (``0.125``, ``0.7549``), so two ratios never share a label."""
    two = f"{ratio:.2f}"
    return two if float(two) == ratio else repr(float(ratio))


def folder_name_problem(label: str) -> str | None:
    """Why ``label`` (a method or benchmark label) cannot be part of a results folder's name (``None``: it can): a
    path separator or ``..`` would write a nested folder or one outside the results root."""
    if not isinstance(label, str) or not label.strip():
        return "it is empty"
    if "/" in label or "\\" in label:
        return "it contains a path separator"
    if ".." in label or label.startswith("."):
        return "it contains '..' or starts with '.'"
    if not label.isprintable():
        return "it contains control characters"
    return None


def cell_dir(output_dir: str | Path, benchmark: str, model: str, method: str, ratio: float) -> Path:
    """``{output_dir}/{benchmark}__{model}__{method}__{ratio_label(ratio)}`` (kvpress's layout)."""
    for what, label in (("benchmark", benchmark), ("method", method)):
        problem = folder_name_problem(label)
        if problem:
            raise ValueError(f"{what} label {label!r} names a results folder, but {problem}")
    return Path(output_dir) / f"{benchmark}__{model_slug(model)}__{method}__{ratio_label(ratio)}"
