"""The one row schema every benchmark yields."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


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
    max_new_tokens: int
    metric: str
    length: int
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)
