"""Scorers against the golden values of benchmarks.md §2.6 and the reference formulas (RULER, LongBench, LooGLE)."""

from __future__ import annotations

import random
import string

import pytest

from core_kv.eval import scorers
from core_kv.eval.schema import Sample
from core_kv.eval.scorers import METRICS, MetricUnavailableError, score

TREC_LIKE_CLASSES = ["Location", "Description", "Entity", "City"]


def make_sample(answers, metric, **extra) -> Sample:
    return Sample("test", "t", "", "", "", list(answers), 8, metric, 0, extra)


# --------------------------------------------------------------------------------------------- golden values (§2.6)
@pytest.mark.parametrize(
    ("fn", "prediction", "ground_truth", "expected"),
    [
        (scorers.qa_f1_score, "The Eiffel Tower", "Eiffel tower in Paris", 0.6666666666666666),
        (scorers.qa_f1_score, "an apple a day", "apple", 0.6666666666666666),
        (scorers.rouge_score, "the cat sat on the mat", "a cat sat on a mat", 0.7999999950000002),
        (scorers.rouge_score, "", "a cat sat on a mat", 0.0),
        (scorers.retrieval_score, "Paragraph 12 and Paragraph 3", "Paragraph 12", 0.5),
        (scorers.count_score, "7 or 8", "7", 0.5),
        (scorers.code_sim_score, "```python\n    return self.model(inputs)\n", "    return self.model(x)", 0.87),
        (scorers.qa_f1_zh_score, "北京是中国的首都", "北京", 0.33333333333333337),
        (scorers.rouge_zh_score, "会议讨论了预算问题", "会议讨论预算", 0.7499999953125),
    ],
)
def test_longbench_golden(fn, prediction, ground_truth, expected):
    assert fn(prediction, ground_truth) == expected


def test_classification_golden():
    assert scorers.classification_score("Type: location and city", "city", ["city", "location", "country"]) == 0.5


def test_trec_scorer_golden():
    # scorer("trec", ["\n Location\nDescription"], [["Location"]], classes) == 100.0 (first-line cut, then match)
    sample = make_sample(["Location"], "classification_first_line", all_classes=TREC_LIKE_CLASSES)
    assert scorers.task_score([sample], ["\n Location\nDescription"]) == 100.0
    # Without the cut both classes match and the score halves.
    assert score("classification", "\n Location\nDescription", ["Location"], all_classes=TREC_LIKE_CLASSES) == 50.0


def test_ruler_golden():
    assert round(score("string_match_all", "The numbers are 123 and 456.", ["123", "456", "789"]), 2) == 66.67
    assert score("string_match_part", "Paris, France", ["paris", "London"]) == 100.0
    assert score("string_match_part", "Rome", ["paris", "London"]) == 0.0


def test_ruler_task_score_matches_upstream_formula():
    rng = random.Random(0)
    preds, refs = [], []
    for _ in range(200):
        ref = [str(rng.randint(100, 999)) for _ in range(rng.choice([1, 3, 4]))]
        preds.append(" ".join(r for r in ref if rng.random() < 0.6))
        refs.append(ref)
    upstream = round(
        sum(
            sum(1.0 if r.lower() in p.lower() else 0.0 for r in ref) / len(ref)
            for p, ref in zip(preds, refs, strict=True)
        )
        / len(preds)
        * 100,
        2,
    )
    samples = [make_sample(r, "string_match_all") for r in refs]
    assert scorers.task_score(samples, preds) == upstream
    # The naive mean of the 0–100 per-sample values lands on the other side of this .xx5 tie.
    assert (
        round(sum(score("string_match_all", p, r) for p, r in zip(preds, refs, strict=True)) / len(preds), 2)
        != upstream
    )


def test_longbench_task_score_matches_eval_py_formula():
    rng = random.Random(2)
    preds = [" ".join(rng.choice(["a", "b", "c", "d"]) for _ in range(rng.randint(1, 4))) for _ in range(200)]
    golds = [[" ".join(rng.choice(["a", "b", "c"]) for _ in range(rng.randint(1, 3)))] for _ in range(200)]
    total = 0.0
    for p, g in zip(preds, golds, strict=True):
        total += max(0.0, scorers.qa_f1_score(p, g[0]))
    upstream = round(100 * total / len(preds), 2)
    assert scorers.task_score([make_sample(g, "qa_f1") for g in golds], preds) == upstream


def test_task_score_errors():
    with pytest.raises(ValueError, match="empty"):
        scorers.task_score([], [])
    with pytest.raises(ValueError, match="predictions"):
        scorers.task_score([make_sample(["a"], "qa_f1")], [])
    with pytest.raises(ValueError, match="different metrics"):
        scorers.task_score([make_sample(["a"], "qa_f1"), make_sample(["a"], "rouge")], ["a", "a"])


def test_ruler_postprocess():
    assert scorers.ruler_postprocess("  \x00 12\t34 \n") == "12\n34"
    assert score("string_match_all", "\t 7\x1f", ["7"]) == 100.0


# ------------------------------------------------------------------------------------------ LongBench reproduction
def test_classification_reproduces_list_mutation_quirk():
    # Upstream removes from the list it iterates over: "ab" is removed and "a" is then skipped, so the score is
    # 1/2 (matches ["abc", "a"]) rather than 1.
    assert scorers.classification_score("abc", "abc", ["abc", "ab", "a"]) == 0.5


def test_classification_needs_all_classes():
    with pytest.raises(ValueError, match="all_classes"):
        score("classification", "City", ["City"])


def test_first_line_cut_matches_eval_py():
    assert scorers.longbench_first_line("\n\nParis\nFrance") == "Paris"
    assert scorers.longbench_first_line(" \nParis") == " "  # only newlines are stripped, as upstream
    assert score("qa_f1_first_line", "\nParis\nLondon", ["Paris"]) == 100.0
    assert score("qa_f1", "\nParis\nLondon", ["Paris"]) == pytest.approx(100 * 2 / 3)


def test_max_over_answers():
    assert score("qa_f1", "Eiffel Tower", ["Louvre", "Eiffel Tower"]) == 100.0
    assert score("rouge", "", ["a b"]) == 0.0


@pytest.mark.parametrize("prediction", ["", "   ", "...", "\n"])
def test_rouge_degenerate_predictions_score_zero(prediction):
    assert scorers.rouge_score(prediction, "the cat sat") == 0.0


def test_code_sim_skips_comment_lines():
    pred = "\n# comment\n// other\n    x = 1\n"
    assert scorers.code_sim_score(pred, "    x = 1") == 1.0
    assert scorers.code_sim_score("# only comments", "x") == 0.0


def test_fuzz_ratio_edge_cases():
    assert scorers.fuzz_ratio("", "") == 100
    assert scorers.fuzz_ratio("", "a") == 0
    assert scorers.fuzz_ratio("abc", "abc") == 100


def test_fuzz_ratio_matches_fuzzywuzzy_difflib_path():
    fuzz = pytest.importorskip("fuzzywuzzy.fuzz")
    import difflib

    if fuzz.SequenceMatcher is not difflib.SequenceMatcher:
        pytest.skip("python-Levenshtein is installed; fuzzywuzzy is not on its difflib path")
    rng = random.Random(1)
    alphabet = string.ascii_lowercase[:6] + " ()._"
    for _ in range(300):
        a = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        b = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        assert scorers.fuzz_ratio(a, b) == fuzz.ratio(a, b), (a, b)


# ------------------------------------------------------------------------------------------------------- LooGLE
def test_loogle_bleu_and_rouge_hand_values():
    ref, hyp = "the cat sat on the mat", "the cat sat"
    # BLEU-1: precision 3/3, brevity penalty exp(1 - 6/3).
    assert score("loogle_bleu1", hyp, [ref]) == pytest.approx(100 * 2.718281828459045**-1)
    # rouge-1 recall over unique unigrams {the, cat, sat, on, mat}: 3/5.
    assert score("loogle_rouge1", hyp, [ref]) == pytest.approx(60.0)
    from rouge import Rouge

    r = Rouge().get_scores(hyps=[hyp], refs=[ref])[0]
    assert score("loogle_rouge2", hyp, [ref]) == pytest.approx(100 * r["rouge-2"]["r"])
    assert score("loogle_rougeL", hyp, [ref]) == pytest.approx(100 * r["rouge-l"]["r"])


def test_loogle_empty_prediction_becomes_none_string():
    # automatic_eval.py scores "" as "None".
    assert score("loogle_rouge1", "", ["None of them"]) == pytest.approx(100 / 3)


def test_cloze_counts():
    answer = '{"<mask-0>": "Maren Holt", "<mask-1>": "Ardenmoor"}'
    assert scorers.cloze_match_counts("{'<mask-0>': 'Maren Holt', '<mask-1>': 'Lowmarsh'}", answer) == (1, 2)
    assert scorers.cloze_match_counts("{'<mask-0>': 'Holt', '<mask-1>': 'Ardenmoor'}", answer, partial=True) == (2, 2)
    assert scorers.cloze_match_counts("Maren Holt and Ardenmoor", answer) == (0, 2)
    assert scorers.cloze_match_counts("__import__('os')", answer) == (0, 2)  # never evaluated
    assert score("loogle_cloze_exact", "{'<mask-0>': 'Maren Holt'}", [answer]) == 50.0


def test_cloze_task_score_pools_masks():
    two, one = '{"<mask-0>": "A", "<mask-1>": "B"}', '{"<mask-0>": "C"}'
    samples = [make_sample([two], "loogle_cloze_exact"), make_sample([one], "loogle_cloze_exact")]
    # 1 of 2 masks + 1 of 1 mask: pooled 2/3 (LooGLE), not the per-sample mean 3/4.
    assert scorers.task_score(samples, ["{'<mask-0>': 'A'}", "{'<mask-0>': 'C'}"]) == 66.67
    with pytest.raises(ValueError, match="mask mapping"):
        scorers.cloze_match_counts("{}", "not a mapping")


@pytest.mark.parametrize("metric", ["loogle_bertscore", "loogle_gpt4_judge"])
def test_online_only_metrics_raise(metric):
    with pytest.raises(MetricUnavailableError, match="offline"):
        score(metric, "a", ["a"])


def test_meteor_needs_wordnet():
    from nltk.corpus import wordnet

    try:
        wordnet.ensure_loaded()
    except LookupError:
        with pytest.raises(MetricUnavailableError, match="WordNet"):
            score("loogle_meteor", "the cat", ["the cat"])
    else:
        assert 0.0 < score("loogle_meteor", "the cat", ["the cat"]) <= 100.0


# ------------------------------------------------------------------------------------------------------ registry
def test_registry_errors():
    with pytest.raises(KeyError, match="unknown metric"):
        score("bleu", "a", ["a"])
    with pytest.raises(ValueError, match="no reference"):
        score("qa_f1", "a", [])
    with pytest.raises(TypeError):
        score("qa_f1", "a", "a")
    with pytest.raises(ValueError, match="already registered"):
        scorers.register("qa_f1")(lambda p, a, **_: 0.0)
    with pytest.raises(ValueError, match="formula"):
        scorers.register("new_metric", formula="median")


@pytest.mark.parametrize("name", sorted(METRICS))
def test_every_metric_is_on_0_100(name):
    answers = {
        "classification": ["City"],
        "classification_first_line": ["City"],
        "retrieval": ["Paragraph 1"],
        "retrieval_zh": ["段落1"],
        "count": ["1"],
        "loogle_cloze_exact": ['{"<mask-0>": "Bob"}'],
        "loogle_cloze_partial": ['{"<mask-0>": "Bob"}'],
    }.get(name, ["the answer is 1"])
    prediction = {"loogle_cloze_exact": "{'<mask-0>': 'Bob'}", "loogle_cloze_partial": "{'<mask-0>': 'Bob'}"}.get(
        name, answers[0]
    )
    try:
        value = score(name, prediction, answers, all_classes=TREC_LIKE_CLASSES)
    except MetricUnavailableError as e:
        pytest.skip(f"{name}: {e}")
    assert isinstance(value, float)
    assert 99.0 <= value <= 100.0  # a perfect prediction scores (about) 100 on every metric


def test_score_sample_forwards_all_classes():
    sample = make_sample(["City"], "classification_first_line", all_classes=TREC_LIKE_CLASSES, _id="x")
    assert scorers.score_sample(sample, " City\nLocation") == 100.0
