"""LooGLE: the 4 long-document tasks, one ``Sample`` per question over a shared document.

Everything here follows ``../shared/research/benchmarks.md`` §3:

- Data: the parquet ``simonjegou/loogle`` that kvpress uses (``data_dir`` = task, split ``test``; columns
  ``context, question, answer_prefix, answer, task, max_new_tokens``, already split kvpress's way). The original
  ``bigainlco/LooGLE`` is a loading script that ``datasets`` >= 4 refuses. Rows in LooGLE's raw layout
  (``input, title, qa_pairs, output``; e.g. ``LooGLE-testdata/*.jsonl``) are exploded and formatted here the same
  way. Hub and local files go through one parser, ``parse_rows`` (§6.3).
- Prompts: ``config/task2prompt.json`` split as kvpress's ``create_huggingface_dataset.py`` does. For the two QA
  tasks ``context + question + answer_prefix`` is the official prompt; for cloze and summarization the split
  drops one space before the final line (official ``"... entities? \\nAnswer:"`` / ``"\\n Summarization: "``).
- Budgets: ``config/task2maxlen.json``.
- Metrics (``core_kv.eval.scorers``): BLEU-1/4, ROUGE-1/2/L recall and METEOR (needs a local WordNet) for QA and
  summarization; exact and partial mask matches for cloze, pooled over masks. BERTScore and the GPT-4 judge
  cannot run offline; ``aggregate_loogle`` lists them as not computed and the registry raises for them.

``Sample.length`` is the whitespace word count of the formatted context (instruction + document): the dataset
carries no token length.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
from collections.abc import Mapping, Sequence

from core_kv.eval import hub, scorers
from core_kv.eval.schema import Sample

DATASET_ID = "simonjegou/loogle"
# benchmarks.md §3 names no commit of simonjegou/loogle and the hub cannot be reached here, so the default is the
# branch "main" (unpinned). Pin a commit with ``revision=`` once one has been checked.
REVISION = "main"

LOOGLE_TASKS: tuple[str, ...] = ("shortdep_qa", "longdep_qa", "shortdep_cloze", "longdep_summarization")

# Official ``config/task2maxlen.json``.
MAX_NEW_TOKENS: dict[str, int] = {
    "shortdep_qa": 300,
    "longdep_qa": 500,
    "shortdep_cloze": 50,
    "longdep_summarization": 500,
}

_QA_CONTEXT = "Please answer the question based on the long texts below. \n{input}"
CONTEXT_TEMPLATE: dict[str, str] = {
    "shortdep_qa": _QA_CONTEXT,
    "longdep_qa": _QA_CONTEXT,
    "shortdep_cloze": (
        "Please fill in the clozes based on the given long texts below. Each of the placeholder '<mask-n>' in the "
        "question could be an entity of Person, Location or Organiocation. The same masks represent the same entity. "
        "Output a json format answer, for example: {{'<mask-0>': 'Bob', '<mask-1>': 'Gorrosion Magazine',"
        "'<mask-2>': 'Bethel Horizon'}}\n{input}"
    ),  # "Organiocation" sic upstream
    "longdep_summarization": "Please generate a summary of the below paper. \n{input}",
}
QUESTION_TEMPLATE: dict[str, str] = {
    "shortdep_qa": "\nQuestion: {Q}\n",
    "longdep_qa": "\nQuestion: {Q}\n",
    "shortdep_cloze": "\n Question: {Q} What are the masked entities?\n",
    "longdep_summarization": "{Q}\n",
}
ANSWER_PREFIX: dict[str, str] = {
    "shortdep_qa": "Answer: ",
    "longdep_qa": "Answer: ",
    "shortdep_cloze": "Answer:",
    "longdep_summarization": "Summarization: ",
}

_SIMILARITY = ("loogle_bleu1", "loogle_bleu4", "loogle_rouge1", "loogle_rouge2", "loogle_rougeL", "loogle_meteor")
# Offline metrics per task; the first one is ``Sample.metric`` (our choice of headline: LooGLE has none).
TASK_METRICS: dict[str, tuple[str, ...]] = {
    "shortdep_qa": ("loogle_rougeL", *(m for m in _SIMILARITY if m != "loogle_rougeL")),
    "longdep_qa": ("loogle_rougeL", *(m for m in _SIMILARITY if m != "loogle_rougeL")),
    "longdep_summarization": ("loogle_rougeL", *(m for m in _SIMILARITY if m != "loogle_rougeL")),
    "shortdep_cloze": ("loogle_cloze_exact", "loogle_cloze_partial"),
}
OFFLINE_UNAVAILABLE: dict[str, str] = {
    "loogle_bertscore": "needs roberta-large weights from the Hugging Face hub",
    "loogle_gpt4_judge": "needs the OpenAI API",
}


def format_raw_row(task: str, row: Mapping) -> list[tuple[str, str, str, str, dict]]:
    """Explode one raw LooGLE row (``input, title, qa_pairs, output``) into formatted questions.

    ``qa_pairs`` is the string repr of ``[{"Q", "A", "S", ...}]`` (parsed with ``ast.literal_eval``) or ``"none"``
    for summarization, whose answer is ``output``. Cloze answers (mask → entity dicts) are stored as JSON, as in
    ``simonjegou/loogle``.

    Returns:
        ``(context, question, answer_prefix, answer, extra)`` per question.
    """
    _check_task(task)
    context = CONTEXT_TEMPLATE[task].format(input=row["input"])
    pairs = row["qa_pairs"]
    if isinstance(pairs, str):
        pairs = None if pairs.strip().lower() == "none" else ast.literal_eval(pairs)
    if pairs is None:
        if task != "longdep_summarization":
            raise ValueError(f"LooGLE task {task!r}: a row has qa_pairs 'none', which only summarization rows have")
        pairs = [{"Q": "", "A": row["output"]}]
    out = []
    for pair in pairs:
        answer = pair["A"]
        if task == "shortdep_cloze":
            answer = json.dumps(answer, ensure_ascii=False) if isinstance(answer, dict) else str(answer)
        extra = {"title": row.get("title")}
        if pair.get("type") is not None:
            extra["type"] = pair["type"]
        out.append((context, QUESTION_TEMPLATE[task].format(Q=pair["Q"]), ANSWER_PREFIX[task], str(answer), extra))
    return out


def parse_rows(task: str, rows: Sequence[Mapping]) -> list[Sample]:
    """Turn dataset rows of one LooGLE task into ``Sample`` s; the one parser for hub and local data (§3, §6.3).

    Accepts the ``simonjegou/loogle`` layout (one row per question, has ``answer_prefix``) and the raw LooGLE layout
    (one row per document with ``qa_pairs``), detected per row.

    Raises:
        ValueError: unknown task, no rows, a row of another task, or a row in neither layout.
    """
    _check_task(task)
    if len(rows) == 0:
        raise ValueError(f"LooGLE task {task!r}: the dataset has no rows")
    head = CONTEXT_TEMPLATE[task].split("{input}", 1)[0].replace("{{", "{").replace("}}", "}")
    items = []
    for i, row in enumerate(rows):
        if row.get("task") is not None and row["task"] != task:
            raise ValueError(f"LooGLE task {task!r}: row {i} belongs to {row['task']!r}")
        if "answer_prefix" in row and "question" in row:
            if not row["context"].startswith(head):
                raise ValueError(
                    f"LooGLE task {task!r}: row {i} has an answer_prefix but its context does not start with the "
                    f"task instruction {head[:60]!r}; not the kvpress-formatted layout this loader expects"
                )
            if not isinstance(row["answer"], str) or not row["answer"]:
                raise ValueError(
                    f"LooGLE task {task!r}: row {i} needs a non-empty string answer, got {row['answer']!r}"
                )
            extra = {"row_max_new_tokens": row.get("max_new_tokens")}
            items.append((row["context"], row["question"], row["answer_prefix"], row["answer"], extra, i))
        elif "qa_pairs" in row and "input" in row:
            items += [(*parts, i) for parts in format_raw_row(task, row)]
        else:
            raise ValueError(
                f"LooGLE task {task!r}: row {i} has columns {sorted(row)}; expected the simonjegou/loogle layout "
                "(context, question, answer_prefix, answer, ...) or the raw LooGLE layout (input, title, qa_pairs, "
                "output)"
            )
    samples = []
    for context, question, answer_prefix, answer, extra, row_index in items:
        samples.append(
            Sample(
                benchmark="loogle",
                task=task,
                context=context,
                question=question,
                answer_prefix=answer_prefix,
                answers=[answer],
                max_new_tokens=MAX_NEW_TOKENS[task],
                metric=TASK_METRICS[task][0],
                length=len(context.split()),
                extra={
                    **{k: v for k, v in extra.items() if v is not None},
                    "doc_id": hashlib.sha256(context.encode("utf-8")).hexdigest()[:12],
                    "row_index": row_index,
                    "length_unit": "words (formatted context)",
                    "metrics": list(TASK_METRICS[task]),
                },
            )
        )
    return samples


def load_loogle(
    tasks: str | Sequence[str] | None = None,
    max_samples: int | None = None,
    source: str | os.PathLike | Mapping[str, str | os.PathLike] | None = None,
    revision: str = REVISION,
) -> list[Sample]:
    """Load LooGLE tasks as ``Sample`` s (benchmarks.md §3, §6.3).

    Args:
        tasks: a task name, a list of them, or None for all 4 (``LOOGLE_TASKS``).
        max_samples: keep the first N questions of each task (None: all).
        source, revision: None reads ``DATASET_ID`` from the hub at ``revision`` (default ``REVISION``, unpinned
            "main"); a folder or a mapping task → file reads local files through the same parser
            (``core_kv.eval.hub.load_rows``, which raises FileNotFoundError or RuntimeError with a clear message).

    Returns:
        Samples in task order, questions in dataset order; questions on one document share ``context`` and
        ``extra["doc_id"]``.

    Raises:
        ValueError: an unknown task, an empty dataset, a bad ``max_samples`` or a malformed row.
    """
    samples: list[Sample] = []
    for task in hub.task_names(tasks, LOOGLE_TASKS, _check_task, max_samples):
        samples += parse_rows(task, _load_rows(task, source, revision))[:max_samples]
    return samples


def aggregate_loogle(task: str, samples: Sequence[Sample], predictions: Sequence[str]) -> dict:
    """Score one LooGLE task with every offline metric, aggregated as LooGLE does (benchmarks.md §3).

    Similarity metrics (BLEU, ROUGE recall, METEOR) are means over samples; cloze exact/partial are pooled,
    ``Σ matched / Σ masks`` (``scorers.task_score``). Scores are on 0–100 (LooGLE prints 0–1 fractions), rounded to
    2 decimals. METEOR is computed only where nltk finds WordNet.

    Returns:
        ``{"scores": {metric: value}, "not_computed": {metric: reason}, "n": number of samples}``; BERTScore and
        the GPT-4 judge are always in ``not_computed``.

    Raises:
        ValueError: unknown task, length mismatch, no samples, or samples of another task.
    """
    _check_task(task)
    if any(s.task != task for s in samples):
        raise ValueError(f"LooGLE task {task!r}: samples of other tasks were passed")
    scores: dict[str, float] = {}
    not_computed = dict(OFFLINE_UNAVAILABLE)
    for name in TASK_METRICS[task]:
        try:
            scores[name] = scorers.task_score(samples, predictions, metric=name)
        except scorers.MetricUnavailableError as e:
            not_computed[name] = str(e)
    return {"scores": scores, "not_computed": not_computed, "n": len(samples)}


def _check_task(task: str) -> None:
    if task not in LOOGLE_TASKS:
        hint = (
            " (LooGLE's raw config 'summarization' is 'longdep_summarization' here)" if task == "summarization" else ""
        )
        raise ValueError(f"unknown LooGLE task {task!r}{hint}; choose from {list(LOOGLE_TASKS)}")


def _load_rows(task: str, source, revision: str) -> list[dict]:
    hint = "rows in the simonjegou/loogle layout or LooGLE's raw layout, e.g. LooGLE-testdata/<task>.jsonl"
    return hub.load_rows("LooGLE", DATASET_ID, task, source, revision, hint)
