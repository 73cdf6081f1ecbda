"""LongBench v1, English: the 16 tasks, official prompts split into context / question / answer prefix.

Everything here follows ``../shared/research/benchmarks.md`` §2:

- Data (§2.1): the parquet re-upload ``Xnhyacinth/LongBench`` (one ``data_dir`` per task, split ``test``), because
  the original ``THUDM/LongBench`` is a loading script that ``datasets`` >= 4 refuses. Its rows are the original
  LongBench rows with ``context`` and ``question`` already formatted by kvpress's split of the official prompt,
  plus ``answer_prefix``, ``task`` and ``max_new_tokens`` (= official + 20). Rows in the original THUDM layout
  (``input``, raw ``context``, no ``answer_prefix``; e.g. LongBench's ``data.zip``) are formatted here with the
  same split (§2.2, §6.3). Hub and local files go through one parser, ``parse_rows``.
- Prompts (§2.2): LongBench ``config/dataset2prompt.json`` cut the way kvpress's
  ``evaluation/benchmarks/longbench/create_huggingface_dataset.py`` does (§2.5). For the 16 English tasks
  ``context + question + answer_prefix`` is the official prompt, character for character; what differs from the
  official ``pred.py`` is how a model sees it (chat template placement, truncation; §2.5).
- Generation budgets: the official ``dataset2maxlen.json`` values, not kvpress's +20 (kept in ``extra``).
- Metrics (§2.3): ``core_kv.eval.scorers``; trec, triviaqa and samsum use the first-line variants, as LongBench's
  ``eval.py`` cuts their predictions to the first line.
- Aggregation (§2.4): per-task scores, the six official English category means, their mean (the official
  "Avg"), and the plain 16-task mean many KV-compression papers report — each labelled.

``Sample.length`` is LongBench's own ``length`` field: whitespace words of input + context + answers for English
and code (§2.1); rows without it fall back to whitespace words of the formatted context.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from core_kv.eval import hub
from core_kv.eval.schema import Sample

DATASET_ID = "Xnhyacinth/LongBench"
# benchmarks.md §2.1 gives this commit as a third party's pin (from the GRKV README). It could not be checked
# against the hub offline; pass ``revision=`` to override (e.g. "main").
REVISION = "2e9ade51ebf45d98942056c0716234f9d5d257d5"

CATEGORIES: dict[str, tuple[str, ...]] = {
    "Single-Doc QA": ("narrativeqa", "qasper", "multifieldqa_en"),
    "Multi-Doc QA": ("hotpotqa", "2wikimqa", "musique"),
    "Summarization": ("gov_report", "qmsum", "multi_news"),
    "Few-shot Learning": ("trec", "triviaqa", "samsum"),
    "Synthetic Tasks": ("passage_count", "passage_retrieval_en"),
    "Code Completion": ("lcc", "repobench-p"),
}
LONGBENCH_TASKS: tuple[str, ...] = tuple(t for tasks in CATEGORIES.values() for t in tasks)
CHINESE_TASKS = ("multifieldqa_zh", "dureader", "vcsum", "lsht", "passage_retrieval_zh")

# Official ``dataset2maxlen.json`` (§2.2).
MAX_NEW_TOKENS: dict[str, int] = {
    "narrativeqa": 128,
    "qasper": 128,
    "multifieldqa_en": 64,
    "hotpotqa": 32,
    "2wikimqa": 32,
    "musique": 32,
    "gov_report": 512,
    "qmsum": 512,
    "multi_news": 512,
    "trec": 64,
    "triviaqa": 32,
    "samsum": 128,
    "passage_count": 32,
    "passage_retrieval_en": 32,
    "lcc": 64,
    "repobench-p": 64,
}

# ``LongBench/eval.py::dataset2metric`` with its first-line cut folded into the metric name (§2.3).
METRIC: dict[str, str] = {
    "narrativeqa": "qa_f1",
    "qasper": "qa_f1",
    "multifieldqa_en": "qa_f1",
    "hotpotqa": "qa_f1",
    "2wikimqa": "qa_f1",
    "musique": "qa_f1",
    "gov_report": "rouge",
    "qmsum": "rouge",
    "multi_news": "rouge",
    "trec": "classification_first_line",
    "triviaqa": "qa_f1_first_line",
    "samsum": "rouge_first_line",
    "passage_count": "count",
    "passage_retrieval_en": "retrieval",
    "lcc": "code_sim",
    "repobench-p": "code_sim",
}

_MULTI_DOC = (
    "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\n"
    "The following are given passages.\n{context}\n\n"
    "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\n"
)

# kvpress's split of dataset2prompt.json (§2.2): context prefix with ``{context}``, question template, answer prefix.
# Strings are verbatim, typos included ("asconcisely").
CONTEXT_TEMPLATE: dict[str, str] = {
    "narrativeqa": (
        "You are given a story, which can be either a novel or a movie script, and a question. Answer the question "
        "asconcisely as you can, using a single phrase if possible. Do not provide any explanation.\n\n"
        "Story: {context}\n\n"
        "Now, answer the question based on the story asconcisely as you can, using a single phrase if possible. "
        "Do not provide any explanation.\n\n"
    ),
    "qasper": (
        "You are given a scientific article and a question. Answer the question as concisely as you can, using a "
        "single phrase or sentence if possible. If the question cannot be answered based on the information in the "
        'article, write "unanswerable". If the question is a yes/no question, answer "yes", "no", or "unanswerable". '
        "Do not provide any explanation.\n\n"
        "Article: {context}\n\n"
        " Answer the question based on the above article as concisely as you can, using a single phrase or sentence "
        "if possible. If the question cannot be answered based on the information in the article, write "
        '"unanswerable". If the question is a yes/no question, answer "yes", "no", or "unanswerable". Do not provide '
        "any explanation.\n\n"
    ),
    "multifieldqa_en": (
        "Read the following text and answer briefly.\n\n{context}\n\n"
        "Now, answer the following question based on the above text, only give me the answer and do not output any "
        "other words.\n\n"
    ),
    "hotpotqa": _MULTI_DOC,
    "2wikimqa": _MULTI_DOC,
    "musique": _MULTI_DOC,
    "gov_report": (
        "You are given a report by a government agency. Write a one-page summary of the report.\n\n"
        "Report:\n{context}\n\n"
    ),
    "qmsum": (
        "You are given a meeting transcript and a query containing a question or instruction. Answer the query in "
        "one or more sentences.\n\nTranscript:\n{context}\n\n"
        "Now, answer the query based on the above meeting transcript in one or more sentences.\n\n"
    ),
    "multi_news": "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n{context}\n\n",
    "trec": "Please determine the type of the question below. Here are some examples of questions.\n\n{context}\n",
    "triviaqa": (
        "Answer the question based on the given passage. Only give me the answer and do not output any other words. "
        "The following are some examples.\n\n{context}\n\n"
    ),
    "samsum": "Summarize the dialogue into a few short sentences. The following are some examples.\n\n{context}\n\n",
    "passage_count": (
        "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please carefully "
        "read these paragraphs and determine how many unique paragraphs there are after removing duplicates. In "
        "other words, how many non-repeating paragraphs are there in total?\n\n{context}\n\n"
    ),
    "passage_retrieval_en": (
        "Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which paragraph the "
        "abstract is from.\n\n{context}\n\nThe following is an abstract.\n\n"
    ),
    "lcc": "Please complete the code given below. \n{context}",
    "repobench-p": "Please complete the code given below. \n{context}",
}
QUESTION_TEMPLATE: dict[str, str] = {
    "narrativeqa": "Question: {input}\n\n",
    "qasper": "Question: {input}\n\n",
    "multifieldqa_en": "Question: {input}\n",
    "hotpotqa": "Question: {input}\n",
    "2wikimqa": "Question: {input}\n",
    "musique": "Question: {input}\n",
    "gov_report": "Now, write a one-page summary of the report.\n\n",
    "qmsum": "Query: {input}\n",
    "multi_news": "Now, write a one-page summary of all the news.\n\n",
    "trec": "{input}",  # the raw input ends with the answer prefix, which is cut off (kvpress removesuffix)
    "triviaqa": "{input}",
    "samsum": "{input}",
    "passage_count": "Please enter the final count of unique paragraphs after removing duplicates. The output format "
    "should only contain the number, such as 1, 2, 3, and so on.\n\n",
    "passage_retrieval_en": "{input}\n\nPlease enter the number of the paragraph that the abstract is from. The answer "
    'format must be like "Paragraph 1", "Paragraph 2", etc.\n\n',
    "lcc": "",  # the official lcc prompt has no {input} (lcc inputs are empty); kvpress's "{input}" is the same there
    "repobench-p": "{input}",
}
ANSWER_PREFIX: dict[str, str] = {
    **dict.fromkeys(("narrativeqa", "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "musique"), "Answer:"),
    "gov_report": "Summary:",
    "qmsum": "Answer:",
    "multi_news": "Summary:",
    "trec": "Type:",
    "triviaqa": "Answer:",
    "samsum": "Summary:",
    "passage_count": "The final answer is: ",
    "passage_retrieval_en": "The answer is: ",
    "lcc": "Next line of code:\n",
    "repobench-p": "Next line of code:\n",
}
# Few-shot inputs end with their own answer prefix; kvpress strips it from the question (§2.2).
_INPUT_SUFFIX = {"trec": "Type:", "triviaqa": "Answer:", "samsum": "Summary:"}


def length_bucket(length: int) -> str:
    """LongBench-E length interval of a row: ``0-4k`` (< 4000), ``4-8k`` (< 8000) or ``8k+`` (§2.4)."""
    return "0-4k" if length < 4000 else "4-8k" if length < 8000 else "8k+"


def format_raw_row(task: str, row: Mapping) -> tuple[str, str, str]:
    """Split one original-layout row (THUDM/LongBench: ``input``, raw ``context``) into context / question / prefix.

    This is kvpress's ``create_huggingface_dataset.py`` formatting (§2.2); the three parts concatenate to the
    official ``dataset2prompt.json`` prompt.
    """
    _check_task(task)
    context = CONTEXT_TEMPLATE[task].format(context=row["context"])
    text = row["input"] or ""
    if task in _INPUT_SUFFIX:
        text = text.removesuffix(_INPUT_SUFFIX[task])
    question = QUESTION_TEMPLATE[task].format(input=text)
    return context, question, ANSWER_PREFIX[task]


def parse_rows(task: str, rows: Sequence[Mapping]) -> list[Sample]:
    """Turn dataset rows of one task into ``Sample`` s; the one parser for hub and local data (§6.3).

    Accepts the ``Xnhyacinth/LongBench`` layout (pre-formatted, has ``answer_prefix``) and the original
    ``THUDM/LongBench`` layout (``input`` + raw ``context``), detected per row.

    Args:
        task: one of ``LONGBENCH_TASKS``.
        rows: mappings with at least ``context`` and ``answers``.

    Raises:
        ValueError: unknown task, no rows, a row of another task, a row in neither layout, or a pre-formatted
            row whose context does not start with this task's instruction.
    """
    _check_task(task)
    if len(rows) == 0:
        raise ValueError(f"LongBench task {task!r}: the dataset has no rows")
    head = CONTEXT_TEMPLATE[task].split("{context}", 1)[0]
    samples = []
    for i, row in enumerate(rows):
        row_task = row.get("task") or row.get("dataset")
        if row_task is not None and row_task != task:
            raise ValueError(f"LongBench task {task!r}: row {i} belongs to {row_task!r}")
        if "answer_prefix" in row and "question" in row:
            context, question, answer_prefix = row["context"], row["question"], row["answer_prefix"]
            if not context.startswith(head):
                raise ValueError(
                    f"LongBench task {task!r}: row {i} has an answer_prefix but its context does not start with the "
                    f"task instruction {head[:60]!r}; not the kvpress-formatted layout this loader expects"
                )
        elif "input" in row:
            context, question, answer_prefix = format_raw_row(task, row)
        else:
            raise ValueError(
                f"LongBench task {task!r}: row {i} has columns {sorted(row)}; expected the Xnhyacinth/LongBench "
                "layout (context, question, answer_prefix, answers, ...) or the THUDM/LongBench layout (input, "
                "context, answers, ...)"
            )
        answers = row["answers"]
        if isinstance(answers, str) or not answers:
            raise ValueError(f"LongBench task {task!r}: row {i} needs a non-empty list of answers, got {answers!r}")
        if row.get("length") is not None:
            length, unit = int(row["length"]), "words (LongBench length field)"
        else:
            length, unit = len(context.split()), "words (formatted context)"
        extra = {
            "_id": row.get("_id"),
            "all_classes": list(row["all_classes"]) if row.get("all_classes") is not None else None,
            "language": row.get("language"),
            "length_unit": unit,
            "length_bucket": length_bucket(length),
            "row_index": i,
        }
        if row.get("max_new_tokens") is not None:
            extra["row_max_new_tokens"] = int(row["max_new_tokens"])  # kvpress stores official + 20
        samples.append(
            Sample(
                benchmark="longbench",
                task=task,
                context=context,
                question=question,
                answer_prefix=answer_prefix,
                answers=[str(a) for a in answers],
                max_new_tokens=MAX_NEW_TOKENS[task],
                metric=METRIC[task],
                length=length,
                extra=extra,
            )
        )
    return samples


def load_longbench(
    tasks: str | Sequence[str] | None = None,
    max_samples: int | None = None,
    source: str | os.PathLike | Mapping[str, str | os.PathLike] | None = None,
    revision: str = REVISION,
) -> list[Sample]:
    """Load LongBench v1 English tasks as ``Sample`` s (benchmarks.md §2, §6.3).

    Args:
        tasks: a task name, a list of them, or None for all 16 (``LONGBENCH_TASKS``).
        max_samples: keep the first N rows of each task (None: all).
        source, revision: where the rows come from: None reads ``DATASET_ID`` from the Hugging Face hub at
            ``revision`` (commit, tag or branch), else local files (see ``core_kv.eval.hub.load_rows``).

    Returns:
        Samples in task order, rows in dataset order.

    Raises:
        ValueError: unknown task, empty dataset, bad ``max_samples`` or a malformed row; FileNotFoundError or
            RuntimeError from ``hub.load_rows`` (no local file for a task; the hub load failed).
    """
    samples: list[Sample] = []
    for task in hub.task_names(tasks, LONGBENCH_TASKS, _check_task, max_samples):
        samples += parse_rows(task, _load_rows(task, source, revision, max_samples))
    return samples


def aggregate_longbench(per_task_scores: Mapping[str, float]) -> dict:
    """Official LongBench aggregation of per-task scores (0–100) for the English tasks (benchmarks.md §2.4).

    Args:
        per_task_scores: task → score, e.g. ``scorers.task_score`` of each task.

    Returns:
        ``{"tasks": {...}, "categories": {category: mean}, "avg": mean of the 6 category means (the official
        "Avg"), "task_mean": plain mean over the 16 tasks (what many KV-compression papers report),
        "missing": [tasks not given]}``. A category with a missing task is left out of ``categories``; ``avg`` and
        ``task_mean`` are None unless all 16 tasks are present. Values are rounded to 2 decimals.

    Raises:
        ValueError: a name that is not an English LongBench task.
    """
    unknown = sorted(set(per_task_scores) - set(LONGBENCH_TASKS))
    if unknown:
        raise ValueError(f"not English LongBench tasks: {unknown}; expected names from {list(LONGBENCH_TASKS)}")
    missing = [t for t in LONGBENCH_TASKS if t not in per_task_scores]
    categories = {
        name: round(sum(per_task_scores[t] for t in members) / len(members), 2)
        for name, members in CATEGORIES.items()
        if all(t in per_task_scores for t in members)
    }
    complete = not missing
    # The official Avg averages the unrounded category means; rounding happens only for display.
    category_means = [sum(per_task_scores[t] for t in m) / len(m) for m in CATEGORIES.values()] if complete else []
    return {
        "tasks": {t: per_task_scores[t] for t in LONGBENCH_TASKS if t in per_task_scores},
        "categories": categories,
        "avg": round(sum(category_means) / len(category_means), 2) if complete else None,
        "task_mean": round(sum(per_task_scores.values()) / len(LONGBENCH_TASKS), 2) if complete else None,
        "missing": missing,
    }


def _check_task(task: str) -> None:
    if task in LONGBENCH_TASKS:
        return
    hint = " (Chinese tasks are not supported)" if task in CHINESE_TASKS else ""
    raise ValueError(f"unknown LongBench task {task!r}{hint}; choose from {list(LONGBENCH_TASKS)}")


def _load_rows(task: str, source, revision: str, max_samples: int | None) -> list[dict]:
    hint = "rows in the Xnhyacinth/LongBench or THUDM/LongBench layout, e.g. a copy of the hub's task parquet folder"
    return hub.load_rows("LongBench", DATASET_ID, task, source, revision, hint, max_samples)
