"""LooGLE loader: official prompts, fixtures through the real parser, pooled cloze scoring, errors, offline (§3)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from core_kv.eval import loogle, scorers
from core_kv.eval.loogle import aggregate_loogle, load_loogle
from tests.helpers import offline_hub_error

FIXTURES = Path(__file__).parent / "fixtures" / "loogle"

# LooGLE config/task2prompt.json, as quoted in benchmarks.md §3.
OFFICIAL_PROMPTS = {
    "shortdep_qa": "Please answer the question based on the long texts below. \n{input}\nQuestion: {Q}\nAnswer: ",
    "longdep_qa": "Please answer the question based on the long texts below. \n{input}\nQuestion: {Q}\nAnswer: ",
    "longdep_summarization": "Please generate a summary of the below paper. \n{input}\n Summarization: ",
    "shortdep_cloze": "Please fill in the clozes based on the given long texts below. Each of the placeholder '<mask-n>' in the question could be an entity of Person, Location or Organiocation. The same masks represent the same entity. Output a json format answer, for example: {{'<mask-0>': 'Bob', '<mask-1>': 'Gorrosion Magazine','<mask-2>': 'Bethel Horizon'}}\n{input}\n Question: {Q} What are the masked entities? \nAnswer:",  # noqa: E501
}


def test_task_tables():
    assert loogle.LOOGLE_TASKS == ("shortdep_qa", "longdep_qa", "shortdep_cloze", "longdep_summarization")
    assert loogle.MAX_NEW_TOKENS == {
        "shortdep_qa": 300,
        "longdep_qa": 500,
        "shortdep_cloze": 50,
        "longdep_summarization": 500,
    }
    assert all(m in scorers.METRICS for ms in loogle.TASK_METRICS.values() for m in ms)


@pytest.mark.parametrize("task", loogle.LOOGLE_TASKS)
def test_split_matches_the_official_prompt(task):
    doc = "Doc with {braces} and\nlines."
    pairs = "none" if task == "longdep_summarization" else repr([{"Q": "Who {is} it?", "A": "x", "S": []}])
    [(context, question, answer_prefix, _, _)] = loogle.format_raw_row(
        task, {"input": doc, "qa_pairs": pairs, "output": "x"}
    )
    official = OFFICIAL_PROMPTS[task].format(input=doc, Q="" if task == "longdep_summarization" else "Who {is} it?")
    joined = context + question + answer_prefix
    if task in ("shortdep_qa", "longdep_qa"):
        assert joined == official
    else:  # kvpress's split drops the space before the last line (documented in the module)
        assert joined == official.replace(" \nAnswer:", "\nAnswer:").replace("\n Summarization: ", "\nSummarization: ")
    assert context.endswith(doc)


def test_load_fixtures_through_the_real_parser():
    samples = load_loogle(source=FIXTURES)
    counts = {t: sum(s.task == t for s in samples) for t in loogle.LOOGLE_TASKS}
    assert counts == {"shortdep_qa": 2, "longdep_qa": 1, "shortdep_cloze": 2, "longdep_summarization": 1}
    for s in samples:
        assert s.benchmark == "loogle" and s.max_new_tokens == loogle.MAX_NEW_TOKENS[s.task]
        assert s.metric == loogle.TASK_METRICS[s.task][0] and s.extra["metrics"] == list(loogle.TASK_METRICS[s.task])
        assert len(s.answers) == 1 and s.length == len(s.context.split())
        assert s.answer_prefix == loogle.ANSWER_PREFIX[s.task]
    qa = [s for s in samples if s.task == "shortdep_qa"]
    assert qa[0].context == qa[1].context and qa[0].extra["doc_id"] == qa[1].extra["doc_id"]
    assert qa[0].question == "\nQuestion: Who cast the Copperleaf Bell?\n" and qa[0].answers == ["Maren Holt"]
    cloze = [s for s in samples if s.task == "shortdep_cloze"]
    assert json.loads(cloze[0].answers[0]) == {"<mask-0>": "Maren Holt", "<mask-1>": "Ardenmoor"}


def test_raw_layout_gives_the_same_samples():
    formatted = load_loogle(source=FIXTURES)
    raw = load_loogle(source=FIXTURES / "raw")
    assert [(s.task, s.context, s.question, s.answer_prefix, s.answers, s.length) for s in raw] == [
        (s.task, s.context, s.question, s.answer_prefix, s.answers, s.length) for s in formatted
    ]
    longdep = [s for s in raw if s.task == "longdep_qa"]
    assert longdep[0].extra["type"] == "computation" and longdep[0].extra["title"] == "The Chronicle of Ardenmoor"


def test_max_samples_counts_questions():
    samples = load_loogle(tasks="shortdep_qa", max_samples=1, source=FIXTURES / "raw")
    assert len(samples) == 1
    with pytest.raises(ValueError, match="max_samples"):
        load_loogle(tasks="shortdep_qa", max_samples=0, source=FIXTURES)


def test_aggregate_cloze_pools_masks():
    samples = load_loogle(tasks="shortdep_cloze", source=FIXTURES)
    # sample 0 has 2 masks (1 right), sample 1 has 1 mask (right): pooled 2/3, not the mean of ratios 3/4.
    preds = ["{'<mask-0>': 'Maren Holt', '<mask-1>': 'Lowmarsh'}", "{'<mask-0>': 'Tobin Reyes'}"]
    result = aggregate_loogle("shortdep_cloze", samples, preds)
    assert result["scores"] == {"loogle_cloze_exact": 66.67, "loogle_cloze_partial": 66.67}
    assert set(result["not_computed"]) >= {"loogle_bertscore", "loogle_gpt4_judge"} and result["n"] == 2


def test_aggregate_qa_offline_metrics():
    samples = load_loogle(tasks="shortdep_qa", source=FIXTURES)
    result = aggregate_loogle("shortdep_qa", samples, [s.answers[0] for s in samples])
    assert result["scores"]["loogle_rouge1"] == pytest.approx(100.0) and result["scores"]["loogle_bleu1"] == 100.0
    assert "loogle_bertscore" in result["not_computed"]
    assert ("loogle_meteor" in result["scores"]) != ("loogle_meteor" in result["not_computed"])
    with pytest.raises(ValueError, match="other tasks"):
        aggregate_loogle("longdep_qa", samples, ["x", "y"])
    with pytest.raises(ValueError, match="predictions"):
        aggregate_loogle("shortdep_qa", samples, ["x"])


def test_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown LooGLE task 'summarization'.*longdep_summarization"):
        load_loogle(tasks="summarization", source=FIXTURES)
    with pytest.raises(FileNotFoundError, match="longdep_qa"):
        load_loogle(tasks="longdep_qa", source=tmp_path)
    (tmp_path / "longdep_qa.jsonl").write_text("")
    with pytest.raises(ValueError, match="no rows"):
        load_loogle(tasks="longdep_qa", source=tmp_path)
    row = json.loads((FIXTURES / "shortdep_qa.jsonl").read_text().splitlines()[0])
    with pytest.raises(ValueError, match="belongs to 'shortdep_qa'"):
        loogle.parse_rows("longdep_qa", [row])
    with pytest.raises(ValueError, match="layout"):
        loogle.parse_rows("longdep_qa", [{"context": "x"}])
    with pytest.raises(ValueError, match="task instruction"):
        loogle.parse_rows("shortdep_qa", [{**row, "context": "raw document"}])
    with pytest.raises(ValueError, match="only summarization"):
        loogle.parse_rows("shortdep_qa", [{"input": "doc", "qa_pairs": "none", "output": "x"}])


def test_offline_hub_load_fails_clearly(tmp_path):
    code = "from core_kv.eval.loogle import load_loogle\nload_loogle(tasks='shortdep_qa')\n"
    last = offline_hub_error(code, tmp_path)
    assert last.startswith("RuntimeError") and "'simonjegou/loogle'" in last and "source=" in last, last
