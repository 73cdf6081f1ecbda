"""LongBench v1 loader: official prompts, fixtures through the real parser, aggregation, errors, offline (§2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from core_kv.eval import longbench, scorers
from core_kv.eval.longbench import aggregate_longbench, load_longbench
from tests.helpers import offline_hub_error

FIXTURES = Path(__file__).parent / "fixtures" / "longbench"
FIXTURE_TASKS = sorted(p.stem for p in FIXTURES.glob("*.jsonl"))

# LongBench/config/dataset2prompt.json, verbatim from benchmarks.md §2.2 (written out independently of the module).
_MULTI = (
    "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\n"
    "The following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give me "
    "the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:"
)
OFFICIAL_PROMPTS = {
    "narrativeqa": "You are given a story, which can be either a novel or a movie script, and a question. Answer the question asconcisely as you can, using a single phrase if possible. Do not provide any explanation.\n\nStory: {context}\n\nNow, answer the question based on the story asconcisely as you can, using a single phrase if possible. Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:",  # noqa: E501
    "qasper": 'You are given a scientific article and a question. Answer the question as concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered based on the information in the article, write "unanswerable". If the question is a yes/no question, answer "yes", "no", or "unanswerable". Do not provide any explanation.\n\nArticle: {context}\n\n Answer the question based on the above article as concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered based on the information in the article, write "unanswerable". If the question is a yes/no question, answer "yes", "no", or "unanswerable". Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:',  # noqa: E501
    "multifieldqa_en": "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following question based on the above text, only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",  # noqa: E501
    "hotpotqa": _MULTI,
    "2wikimqa": _MULTI,
    "musique": _MULTI,
    "gov_report": "You are given a report by a government agency. Write a one-page summary of the report.\n\nReport:\n{context}\n\nNow, write a one-page summary of the report.\n\nSummary:",  # noqa: E501
    "qmsum": "You are given a meeting transcript and a query containing a question or instruction. Answer the query in one or more sentences.\n\nTranscript:\n{context}\n\nNow, answer the query based on the above meeting transcript in one or more sentences.\n\nQuery: {input}\nAnswer:",  # noqa: E501
    "multi_news": "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n{context}\n\nNow, write a one-page summary of all the news.\n\nSummary:",  # noqa: E501
    "trec": "Please determine the type of the question below. Here are some examples of questions.\n\n{context}\n{input}",
    "triviaqa": "Answer the question based on the given passage. Only give me the answer and do not output any other words. The following are some examples.\n\n{context}\n\n{input}",  # noqa: E501
    "samsum": "Summarize the dialogue into a few short sentences. The following are some examples.\n\n{context}\n\n{input}",
    "passage_count": "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please carefully read these paragraphs and determine how many unique paragraphs there are after removing duplicates. In other words, how many non-repeating paragraphs are there in total?\n\n{context}\n\nPlease enter the final count of unique paragraphs after removing duplicates. The output format should only contain the number, such as 1, 2, 3, and so on.\n\nThe final answer is: ",  # noqa: E501
    "passage_retrieval_en": 'Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which paragraph the abstract is from.\n\n{context}\n\nThe following is an abstract.\n\n{input}\n\nPlease enter the number of the paragraph that the abstract is from. The answer format must be like "Paragraph 1", "Paragraph 2", etc.\n\nThe answer is: ',  # noqa: E501
    "lcc": "Please complete the code given below. \n{context}Next line of code:\n",
    "repobench-p": "Please complete the code given below. \n{context}{input}Next line of code:\n",
}
OFFICIAL_MAXLEN = {
    **dict(narrativeqa=128, qasper=128, multifieldqa_en=64, hotpotqa=32, musique=32, gov_report=512, qmsum=512),
    **dict(multi_news=512, trec=64, triviaqa=32, samsum=128, passage_count=32, passage_retrieval_en=32, lcc=64),
    **{"2wikimqa": 32, "repobench-p": 64},
}


def test_task_tables_are_consistent():
    assert len(longbench.LONGBENCH_TASKS) == 16 and len(set(longbench.LONGBENCH_TASKS)) == 16
    assert sorted(t for ts in longbench.CATEGORIES.values() for t in ts) == sorted(longbench.LONGBENCH_TASKS)
    assert longbench.MAX_NEW_TOKENS == OFFICIAL_MAXLEN
    for table in (longbench.METRIC, longbench.CONTEXT_TEMPLATE, longbench.QUESTION_TEMPLATE, longbench.ANSWER_PREFIX):
        assert set(table) == set(longbench.LONGBENCH_TASKS)
    assert all(m in scorers.METRICS for m in longbench.METRIC.values())
    assert {t for t, m in longbench.METRIC.items() if m.endswith("_first_line")} == {"trec", "triviaqa", "samsum"}


@pytest.mark.parametrize("task", longbench.LONGBENCH_TASKS)
def test_split_concatenates_to_the_official_prompt(task):
    suffix = {"trec": "\nType:", "triviaqa": "\nAnswer:", "samsum": "\nSummary:"}.get(task, "")
    row = {"context": "CTX {not a field}\nline two", "input": "What is {x}?" + suffix}
    context, question, answer_prefix = longbench.format_raw_row(task, row)
    assert context + question + answer_prefix == OFFICIAL_PROMPTS[task].format(**row)
    assert "CTX {not a field}" in context and "What is {x}?" not in context  # the question stays out of the context


def test_load_fixtures_through_the_real_parser():
    samples = load_longbench(tasks=FIXTURE_TASKS, source=FIXTURES)
    assert [s.task for s in samples] == [t for t in FIXTURE_TASKS for _ in range(2)]
    for s in samples:
        assert s.benchmark == "longbench"
        assert s.max_new_tokens == OFFICIAL_MAXLEN[s.task]
        assert s.extra["row_max_new_tokens"] == OFFICIAL_MAXLEN[s.task] + 20  # kvpress's +20 is kept aside
        assert s.metric == longbench.METRIC[s.task]
        assert isinstance(s.answers, list) and s.answers and all(isinstance(a, str) for a in s.answers)
        assert s.length > 0 and s.extra["length_bucket"] == "0-4k" and s.extra["length_unit"].startswith("words")
        assert s.extra["_id"].startswith(f"synthetic-{s.task}-")
        assert s.context.startswith(longbench.CONTEXT_TEMPLATE[s.task].split("{context}")[0])
    trec = [s for s in samples if s.task == "trec"]
    assert trec[0].answer_prefix == "Type:" and not trec[0].question.endswith("Type:")
    assert "City" in trec[0].extra["all_classes"]
    assert all(s.extra["all_classes"] is None for s in samples if s.task != "trec")


def test_raw_layout_gives_the_same_samples():
    formatted = load_longbench(tasks=FIXTURE_TASKS, source=FIXTURES)
    raw = load_longbench(tasks=FIXTURE_TASKS, source=FIXTURES / "raw")
    assert len(raw) == len(formatted)
    for a, b in zip(raw, formatted, strict=True):
        b_extra = {k: v for k, v in b.extra.items() if k != "row_max_new_tokens"}
        assert (a.context, a.question, a.answer_prefix, a.answers, a.length, a.extra) == (
            b.context,
            b.question,
            b.answer_prefix,
            b.answers,
            b.length,
            b_extra,
        )


def test_perfect_predictions_score_100():
    samples = load_longbench(tasks=FIXTURE_TASKS, source=FIXTURES)
    for task in FIXTURE_TASKS:
        rows = [s for s in samples if s.task == task]
        assert scorers.task_score(rows, [s.answers[0] for s in rows]) == 100.0, task


def test_max_samples_and_mapping_source():
    samples = load_longbench(tasks="trec", max_samples=1, source={"trec": FIXTURES / "trec.jsonl"})
    assert len(samples) == 1 and samples[0].task == "trec"
    with pytest.raises(ValueError, match="max_samples"):
        load_longbench(tasks="trec", max_samples=0, source=FIXTURES)


def test_unknown_tasks_are_rejected():
    with pytest.raises(ValueError, match="unknown LongBench task 'nope'"):
        load_longbench(tasks=["nope"], source=FIXTURES)
    with pytest.raises(ValueError, match="Chinese"):
        load_longbench(tasks="dureader", source=FIXTURES)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="qasper"):
        load_longbench(tasks="qasper", source=tmp_path)
    with pytest.raises(FileNotFoundError, match="no entry"):
        load_longbench(tasks="qasper", source={"trec": FIXTURES / "trec.jsonl"})


def test_empty_dataset(tmp_path):
    (tmp_path / "qasper.jsonl").write_text("")
    with pytest.raises(ValueError, match="no rows"):
        load_longbench(tasks="qasper", source=tmp_path)
    with pytest.raises(ValueError, match="no rows"):
        longbench.parse_rows("qasper", [])


def test_malformed_rows():
    row = json.loads((FIXTURES / "qasper.jsonl").read_text().splitlines()[0])
    with pytest.raises(ValueError, match="belongs to 'qasper'"):
        longbench.parse_rows("trec", [row])
    with pytest.raises(ValueError, match="layout"):
        longbench.parse_rows("qasper", [{"context": "x", "answers": ["y"]}])
    with pytest.raises(ValueError, match="task instruction"):
        longbench.parse_rows("qasper", [{**row, "context": "unformatted document"}])
    with pytest.raises(ValueError, match="answers"):
        longbench.parse_rows("qasper", [{**row, "answers": []}])


def test_aggregate_reproduces_the_leaderboard_row():
    # GPT-3.5-Turbo-16k, LongBench README (English): category means 39.8/38.7/26.5/67.1/37.8/54.1, Avg 44.0.
    gpt35 = {
        **dict(narrativeqa=23.6, qasper=43.3, multifieldqa_en=52.3, hotpotqa=51.6, musique=26.9, gov_report=29.5),
        **dict(qmsum=23.4, multi_news=26.7, trec=68.0, triviaqa=91.4, samsum=41.7, passage_count=4.5, lcc=54.7),
        **{"2wikimqa": 37.7, "passage_retrieval_en": 71.0, "repobench-p": 53.6},
    }
    result = aggregate_longbench(gpt35)
    published = {
        "Single-Doc QA": 39.8,
        "Multi-Doc QA": 38.7,
        "Summarization": 26.5,
        "Few-shot Learning": 67.1,
        "Synthetic Tasks": 37.8,
        "Code Completion": 54.1,
    }
    for name, value in published.items():
        assert result["categories"][name] == pytest.approx(value, abs=0.1)  # README rounds unrounded task scores
    assert round(result["avg"], 1) == 44.0
    assert result["task_mean"] == round(sum(gpt35.values()) / 16, 2)
    assert result["missing"] == []


def test_aggregate_partial_and_unknown():
    result = aggregate_longbench({"lcc": 50.0, "repobench-p": 60.0, "trec": 10.0})
    assert result["categories"] == {"Code Completion": 55.0}
    assert result["avg"] is None and result["task_mean"] is None
    assert "qasper" in result["missing"] and "trec" not in result["missing"]
    with pytest.raises(ValueError, match="not English LongBench tasks"):
        aggregate_longbench({"dureader": 1.0})


def test_offline_hub_load_fails_clearly(tmp_path):
    code = "from core_kv.eval.longbench import load_longbench\nload_longbench(tasks='qasper')\n"
    last = offline_hub_error(code, tmp_path)
    assert last.startswith("RuntimeError") and "'Xnhyacinth/LongBench'" in last and "source=" in last, last
