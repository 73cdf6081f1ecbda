"""Scorers for RULER, LongBench v1 and LooGLE, reproduced from the reference code.

``METRICS`` maps a name (``Sample.metric``) to a ``Metric``: called as ``metric(prediction, answers, **kwargs)`` it
returns the per-sample score on a **0–100** scale. Task scores must come from ``task_score``, which applies the
reference's own arithmetic to the reference's own per-sample values (fractions in 0–1): RULER computes
``round(sum / n * 100, 2)``, LongBench ``round(100 * sum / n, 2)``, LooGLE cloze pools ``Σ matched / Σ masks``.
Averaging the 0–100 per-sample values instead differs in the last floating-point bit, which flips the rounded
score on ``.xx5`` ties — common with RULER's 1/3, 1/4 fractions (``../shared/research/benchmarks.md`` §1.2, §2.3, §3).

Sources reproduced (with attribution; RULER Apache-2.0, LongBench MIT, LooGLE MIT, kvpress Apache-2.0):

- RULER ``scripts/eval/synthetic/constants.py`` (``string_match_all``/``string_match_part``) and
  ``scripts/eval/evaluate.py::postprocess_pred`` (§1.2).
- LongBench ``LongBench/metrics.py`` + ``LongBench/eval.py`` (§2.3), including the first-line cut that
  ``eval.py`` applies to trec, triviaqa, samsum and lsht: those tasks use the ``*_first_line`` metrics.
- LooGLE ``Evaluation/automatic_metrics.py`` + ``automatic_eval.py`` and kvpress's LooGLE copy (§3). LooGLE's own
  tables print fractions (0–1); ours are ×100.

Scorer packages (§5.1): ``rouge==1.0.1`` (not ``rouge-score``), ``jieba``, ``nltk`` (BLEU; METEOR needs a local
WordNet and never downloads). LongBench ``code_sim`` is fuzzywuzzy 0.18.0's difflib path, reimplemented here so
that an installed ``python-Levenshtein`` cannot change the numbers.

Metrics that cannot run offline (LooGLE BERTScore, GPT-4 judge) are registered but raise
``MetricUnavailableError``; they never return a stand-in value.
"""

from __future__ import annotations

import ast
import difflib
import json
import re
import string
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from core_kv.eval.schema import Sample

# Sample.extra keys that score_sample / task_score forward to metrics (classification needs the label set).
SIDE_INPUTS = ("all_classes",)


class MetricUnavailableError(RuntimeError):
    """A metric needs something this machine does not have (model weights, an API, a corpus)."""


@dataclass(frozen=True)
class Metric:
    """A registered scorer: the reference's per-sample function and the formula its task score uses.

    Attributes:
        name: registry name.
        fraction: ``fraction(prediction, answers, **kwargs) -> float`` in 0–1, exactly the reference's value.
        formula: ``"ruler"`` (``sum / n * 100``), ``"mean"`` (``100 * sum / n``; LongBench, LooGLE similarity) or
            ``"pooled"`` (``100 * Σ matched / Σ counted``; LooGLE cloze, which then needs ``counts``).
        counts: for ``"pooled"``: ``counts(prediction, answers, **kwargs) -> (matched, counted)``.
    """

    name: str
    fraction: Callable[..., float]
    formula: str = "mean"
    counts: Callable[..., tuple[int, int]] | None = None

    def __call__(self, prediction: str, answers: Sequence[str], **kwargs) -> float:
        """Per-sample score on 0–100."""
        return 100 * self.fraction(prediction, answers, **kwargs)


METRICS: dict[str, Metric] = {}


def register(name: str, formula: str = "mean", counts: Callable[..., tuple[int, int]] | None = None):
    """Decorator: register a per-sample 0–1 function under ``name`` (see ``Metric``); returns it unchanged."""
    if formula not in ("ruler", "mean", "pooled") or (formula == "pooled") != (counts is not None):
        raise ValueError(f"metric {name!r}: formula must be ruler/mean, or pooled with counts")

    def wrap(fn: Callable[..., float]) -> Callable[..., float]:
        if name in METRICS:
            raise ValueError(f"metric {name!r} is already registered")
        METRICS[name] = Metric(name, fn, formula, counts)
        return fn

    return wrap


def _get(metric: str) -> Metric:
    if metric not in METRICS:
        raise KeyError(f"unknown metric {metric!r}; registered: {sorted(METRICS)}")
    return METRICS[metric]


def _check_answers(metric: str, answers: Sequence[str]) -> list[str]:
    if isinstance(answers, str):
        raise TypeError("answers must be a list of strings, not a single string")
    if len(answers) == 0:
        raise ValueError(f"{metric}: no reference answers to score against")
    return list(answers)


def score(metric: str, prediction: str, answers: Sequence[str], **kwargs) -> float:
    """Score one prediction against its reference answers (benchmarks.md §1.2, §2.3, §3).

    Args:
        metric: a name in ``METRICS`` (a ``Sample.metric``).
        prediction: the generated text only (the answer prefix is not part of it).
        answers: the reference answers of the sample; must be non-empty.
        **kwargs: side inputs, e.g. ``all_classes`` for LongBench ``classification``.

    Returns:
        The per-sample score on 0–100. For a task score use ``task_score``, not the mean of these.

    Raises:
        KeyError: unknown metric name.
        ValueError: empty ``answers`` or a missing side input.
        MetricUnavailableError: the metric cannot run offline (LooGLE BERTScore / GPT-4 judge, or METEOR
            without a local WordNet).
    """
    m = _get(metric)
    return float(m(prediction, _check_answers(metric, answers), **kwargs))


def _side_inputs(sample: Sample) -> dict:
    return {k: sample.extra[k] for k in SIDE_INPUTS if sample.extra.get(k) is not None}


def score_sample(sample: Sample, prediction: str) -> float:
    """``score(sample.metric, prediction, sample.answers)`` with the side inputs kept in ``sample.extra``."""
    return score(sample.metric, prediction, sample.answers, **_side_inputs(sample))


def task_score(samples: Sequence[Sample], predictions: Sequence[str], metric: str | None = None) -> float:
    """Task score on 0–100 with the reference's arithmetic (benchmarks.md §1.2, §2.3, §3).

    Args:
        samples: the samples of one task.
        predictions: one generated text per sample, same order.
        metric: metric name; default: the samples' shared ``Sample.metric``.

    Returns:
        RULER: ``round(Σ fraction / n * 100, 2)``; LongBench: ``round(100 * Σ fraction / n, 2)``; LooGLE
        similarity: the same mean, rounded to 2; LooGLE cloze: ``round(100 * Σ matched / Σ masks, 2)``.

    Raises:
        ValueError: no samples, a length mismatch, or samples with different metrics.
    """
    if len(samples) != len(predictions):
        raise ValueError(f"{len(samples)} samples but {len(predictions)} predictions")
    if len(samples) == 0:
        raise ValueError("cannot score an empty task")
    if metric is None:
        names = {s.metric for s in samples}
        if len(names) != 1:
            raise ValueError(f"samples use different metrics {sorted(names)}; score one task at a time")
        metric = names.pop()
    m = _get(metric)
    args = [(p, _check_answers(metric, s.answers), _side_inputs(s)) for s, p in zip(samples, predictions, strict=True)]
    if m.formula == "pooled":
        counts = [m.counts(p, a, **kw) for p, a, kw in args]
        return round(100 * sum(c[0] for c in counts) / sum(c[1] for c in counts), 2)
    total = sum(m.fraction(p, a, **kw) for p, a, kw in args)
    if m.formula == "ruler":
        return round(total / len(args) * 100, 2)
    return round(100 * total / len(args), 2)


# ----------------------------------------------------------------------------------------------------------- RULER
_CONTROL_CHARS = re.compile(r"[\x00-\x1f]")


def ruler_postprocess(prediction: str) -> str:
    """RULER ``evaluate.py::postprocess_pred``: strip, control characters → ``\\n``, strip (§1.2).

    kvpress deletes the control characters instead; substring matches can differ only when one sits inside a
    reference string.
    """
    return _CONTROL_CHARS.sub("\n", prediction.strip()).strip()


@register("string_match_all", formula="ruler")
def string_match_all(prediction: str, answers: Sequence[str], **_) -> float:
    """RULER ``string_match_all`` for one sample: fraction of references found as case-insensitive substrings."""
    pred = ruler_postprocess(prediction).lower()
    return sum(1.0 if r.lower() in pred else 0.0 for r in answers) / len(answers)


@register("string_match_part", formula="ruler")
def string_match_part(prediction: str, answers: Sequence[str], **_) -> float:
    """RULER ``string_match_part`` for one sample: 1 if any reference is a case-insensitive substring, else 0."""
    pred = ruler_postprocess(prediction).lower()
    return max(1.0 if r.lower() in pred else 0.0 for r in answers)


# ------------------------------------------------------------------------------------------------------- LongBench
# Each LongBench function below scores one (prediction, ground_truth) pair on 0–1, verbatim in behaviour with
# LongBench/metrics.py; ``_longbench`` adds eval.py's max over ground truths and its first-line cut.

_ZH_PUNCTUATION = "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."
_EN_PUNCT = set(string.punctuation)
_ALL_PUNCT = set(string.punctuation + _ZH_PUNCTUATION)


def normalize_answer(s: str) -> str:
    """SQuAD normalization used by LongBench ``qa_f1``: lower, drop punctuation, articles, extra whitespace."""
    s = "".join(ch for ch in s.lower() if ch not in _EN_PUNCT)
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def normalize_zh_answer(s: str) -> str:
    """LongBench ``normalize_zh_answer``: lower, drop Chinese + ASCII punctuation, remove all whitespace."""
    return "".join("".join(ch for ch in s.lower() if ch not in _ALL_PUNCT).split())


def _f1(prediction: Sequence[str], ground_truth: Sequence[str]) -> float:
    common = Counter(prediction) & Counter(ground_truth)
    num_same = sum(common.values())
    if num_same == 0:
        return 0.0
    precision = 1.0 * num_same / len(prediction)
    recall = 1.0 * num_same / len(ground_truth)
    return (2 * precision * recall) / (precision + recall)


def qa_f1_score(prediction: str, ground_truth: str) -> float:
    """LongBench ``qa_f1_score``: token-multiset F1 after SQuAD normalization (0–1)."""
    return _f1(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


def _jieba_cut(text: str) -> list[str]:
    import jieba

    return list(jieba.cut(text, cut_all=False))


def qa_f1_zh_score(prediction: str, ground_truth: str) -> float:
    """LongBench ``qa_f1_zh_score``: jieba tokens, ``normalize_zh_answer`` per token, empties dropped, F1 (0–1)."""
    pred = [t for t in (normalize_zh_answer(t) for t in _jieba_cut(prediction)) if len(t) > 0]
    gold = [t for t in (normalize_zh_answer(t) for t in _jieba_cut(ground_truth)) if len(t) > 0]
    return _f1(pred, gold)


# What the ``rouge`` package raises on degenerate input: an empty hypothesis (ValueError), a whitespace-only one
# (ZeroDivisionError in ROUGE-L), and a sentence whose LCS is deeper than the recursion limit (RecursionError in
# its recursive LCS reconstruction; long unpunctuated text such as space-joined Chinese hits this). LongBench
# catches every exception and scores 0, so these are scored 0 here too.
_ROUGE_FAILURES = (ValueError, ZeroDivisionError, RecursionError)


def rouge_score(prediction: str, ground_truth: str) -> float:
    """LongBench ``rouge_score``: PyPI ``rouge`` ROUGE-L F (0–1); 0 where the package raises (§2.3, §5.1)."""
    from rouge import Rouge

    try:
        scores = Rouge().get_scores([prediction], [ground_truth], avg=True)
    except _ROUGE_FAILURES:
        return 0.0
    return scores["rouge-l"]["f"]


def rouge_zh_score(prediction: str, ground_truth: str) -> float:
    """LongBench ``rouge_zh_score``: ``rouge_score`` on space-joined jieba tokens (0–1)."""
    return rouge_score(" ".join(_jieba_cut(prediction)), " ".join(_jieba_cut(ground_truth)))


def classification_score(prediction: str, ground_truth: str, all_classes: Sequence[str]) -> float:
    """LongBench ``classification_score`` (0–1), quirk included.

    Classes found in the prediction are collected; a match that is a substring of the gold label but not equal
    to it is removed. Upstream removes from the list it is iterating over, which skips the element after each
    removal; that is reproduced on purpose.
    """
    em_match_list = [c for c in all_classes if c in prediction]
    for match_term in em_match_list:
        if match_term in ground_truth and match_term != ground_truth:
            em_match_list.remove(match_term)  # mutating while iterating, exactly as LongBench/metrics.py does
    return 1.0 / len(em_match_list) if ground_truth in em_match_list else 0.0


def _number_share(prediction: str, target: str) -> float:
    numbers = re.findall(r"\d+", prediction)
    if len(numbers) == 0:
        return 0.0
    return sum(1 for n in numbers if n == str(target)) / len(numbers)


def retrieval_score(prediction: str, ground_truth: str) -> float:
    """LongBench ``retrieval_score``: share of numbers in the prediction equal to ``Paragraph (\\d+)``'s id."""
    return _number_share(prediction, re.findall(r"Paragraph (\d+)", ground_truth)[0])


def retrieval_zh_score(prediction: str, ground_truth: str) -> float:
    """LongBench ``retrieval_zh_score``: as ``retrieval_score`` with the id from ``段落(\\d+)``."""
    return _number_share(prediction, re.findall(r"段落(\d+)", ground_truth)[0])


def count_score(prediction: str, ground_truth: str) -> float:
    """LongBench ``count_score``: share of numbers in the prediction equal to the gold count."""
    return _number_share(prediction, ground_truth)


def fuzz_ratio(s1: str, s2: str) -> int:
    """``fuzzywuzzy.fuzz.ratio`` 0.18.0 on its difflib path (no python-Levenshtein), as an int in 0–100.

    Decorator order upstream: None → 0, equal → 100, either empty → 0, else ``int(round(100 * ratio))``.
    """
    if s1 is None or s2 is None:
        return 0
    if s1 == s2:
        return 100
    if len(s1) == 0 or len(s2) == 0:
        return 0
    return int(round(100 * difflib.SequenceMatcher(None, s1, s2).ratio()))


def code_sim_score(prediction: str, ground_truth: str) -> float:
    """LongBench ``code_sim_score``: first line of ``prediction.lstrip('\\n')`` without `` ` ``, ``#``, ``//``,
    then ``fuzz.ratio / 100`` (0–1, in steps of 0.01)."""
    line = ""
    for candidate in prediction.lstrip("\n").split("\n"):
        if "`" not in candidate and "#" not in candidate and "//" not in candidate:
            line = candidate
            break
    return fuzz_ratio(line, ground_truth) / 100


def longbench_first_line(prediction: str) -> str:
    """LongBench ``eval.py``'s cut for trec, triviaqa, samsum, lsht: ``prediction.lstrip('\\n').split('\\n')[0]``.

    kvpress uses ``lstrip()`` (all whitespace) instead; only a leading space or tab changes the result.
    """
    return prediction.lstrip("\n").split("\n")[0]


def _longbench(fn: Callable[..., float], first_line: bool = False, needs_classes: bool = False):
    def metric(prediction: str, answers: Sequence[str], **kwargs) -> float:
        if first_line:
            prediction = longbench_first_line(prediction)
        extra = {}
        if needs_classes:
            if kwargs.get("all_classes") is None:
                raise ValueError(f"{fn.__name__} needs all_classes=[...] (LongBench row field `all_classes`)")
            extra["all_classes"] = kwargs["all_classes"]
        best = 0.0  # eval.py: max over ground truths, starting from 0
        for ground_truth in answers:
            best = max(best, fn(prediction, ground_truth, **extra))
        return best

    metric.__doc__ = f"LongBench {fn.__name__}, max over answers{' after the first-line cut' * first_line} (0–1)."
    return metric


for _name, _fn in {
    "qa_f1": qa_f1_score,
    "qa_f1_zh": qa_f1_zh_score,
    "rouge": rouge_score,
    "rouge_zh": rouge_zh_score,
    "retrieval": retrieval_score,
    "retrieval_zh": retrieval_zh_score,
    "count": count_score,
    "code_sim": code_sim_score,
}.items():
    register(_name)(_longbench(_fn))
register("classification")(_longbench(classification_score, needs_classes=True))
# eval.py cuts the prediction to its first line for trec, triviaqa, samsum and lsht (§2.3).
register("qa_f1_first_line")(_longbench(qa_f1_score, first_line=True))
register("rouge_first_line")(_longbench(rouge_score, first_line=True))
register("classification_first_line")(_longbench(classification_score, first_line=True, needs_classes=True))


# ---------------------------------------------------------------------------------------------------------- LooGLE
def _loogle_hypothesis(prediction: str) -> str:
    # automatic_eval.py replaces an empty prediction by the string "None" before every similarity metric.
    return "None" if prediction == "" else prediction


def bleu_scores(reference: str, hypothesis: str) -> tuple[float, float]:
    """LooGLE ``get_bleu_score``: nltk ``sentence_bleu`` on whitespace tokens, weights (1,0,0,0) and (0,0,0,1).

    Returns (BLEU-1, BLEU-4) on 0–1. nltk's "0 counts of n-gram overlaps" warnings are silenced; values are
    unchanged (BLEU-4 is then ``sys.float_info.min``, as upstream).
    """
    from nltk.translate.bleu_score import sentence_bleu

    ref = reference.replace("\n", " ").split()
    hyp = hypothesis.replace("\n", " ").split()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return (
            float(sentence_bleu([ref], hyp, weights=(1, 0, 0, 0))),
            float(sentence_bleu([ref], hyp, weights=(0, 0, 0, 1))),
        )


def rouge_recalls(reference: str, hypothesis: str) -> tuple[float, float, float]:
    """LooGLE ``get_rouge_score``: PyPI ``rouge`` recall for ROUGE-1/2/L (0–1).

    Upstream raises where ``rouge`` does (whitespace-only hypothesis); kvpress scores those 0, as here.
    """
    from rouge import Rouge

    try:
        r = Rouge().get_scores(hyps=[hypothesis], refs=[reference])[0]
    except _ROUGE_FAILURES:
        return 0.0, 0.0, 0.0
    return r["rouge-1"]["r"], r["rouge-2"]["r"], r["rouge-l"]["r"]


def meteor(reference: str, hypothesis: str) -> float:
    """LooGLE ``get_meteor_score``: nltk ``single_meteor_score`` on whitespace-token *sets* (0–1).

    Needs WordNet installed locally (benchmarks.md §5.1 recipe); nothing is downloaded. Upstream passes Python
    sets, whose iteration order depends on ``PYTHONHASHSEED``, so the fragmentation penalty (and the score) can
    vary between processes unless the seed is fixed.

    Raises:
        MetricUnavailableError: WordNet is not found by nltk.
    """
    try:
        from nltk.corpus import wordnet
        from nltk.translate.meteor_score import single_meteor_score

        wordnet.ensure_loaded()
    except LookupError as e:
        raise MetricUnavailableError(
            "LooGLE METEOR needs nltk's WordNet corpus, which is not installed and is never downloaded here; "
            "install it offline as in benchmarks.md §5.1 (Debian wordnet-base + wordnet-sense-index copied into "
            "$NLTK_DATA/corpora/wordnet) or leave METEOR out"
        ) from e
    ref = reference.replace("\n", " ").split()
    hyp = hypothesis.replace("\n", " ").split()
    return float(single_meteor_score(set(ref), set(hyp)))


def _parse_mapping(text: str) -> dict | None:
    try:
        value = ast.literal_eval(text)  # never eval() model output
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def cloze_match_counts(prediction: str, answer: str, partial: bool = False) -> tuple[int, int]:
    """LooGLE cloze matches for one sample: ``(matched masks, masks)`` (§3).

    ``answer`` is the mask→entity mapping as JSON or a Python literal (``simonjegou/loogle`` stores JSON). The
    prediction is parsed with ``ast.literal_eval`` (upstream uses ``eval``). Exact: the entity strings are equal.
    Partial: they share at least one whitespace token. An unparsable prediction, or one that is not a dict,
    matches nothing; an entity that is not a string does too for the whole sample (kvpress; upstream crashes).
    Task score upstream: ``round(Σ matched / Σ masks, 4)``.
    """
    reference = _parse_mapping(answer)
    if reference is None:
        try:
            reference = json.loads(answer)
        except json.JSONDecodeError:
            reference = None
    if not isinstance(reference, dict) or len(reference) == 0:
        raise ValueError(f"LooGLE cloze answer is not a non-empty mask mapping: {answer[:200]!r}")
    count = len(reference)
    hypothesis = _parse_mapping(prediction)
    if hypothesis is None:
        return 0, count
    matched = 0
    for key, value in reference.items():
        if key not in hypothesis:
            continue
        if partial:
            if not isinstance(hypothesis[key], str):
                return 0, count
            matched += int(len(set(value.split()) & set(hypothesis[key].split())) > 0)
        else:
            matched += int(hypothesis[key] == value)
    return matched, count


def _loogle_similarity(pick: Callable[[str, str], float], label: str):
    def metric(prediction: str, answers: Sequence[str], **_) -> float:
        hyp = _loogle_hypothesis(prediction)
        return max(pick(ref, hyp) for ref in answers)

    metric.__doc__ = f"LooGLE {label} against the best answer (0–1)."
    return metric


register("loogle_bleu1")(_loogle_similarity(lambda r, h: bleu_scores(r, h)[0], "BLEU-1"))
register("loogle_bleu4")(_loogle_similarity(lambda r, h: bleu_scores(r, h)[1], "BLEU-4"))
register("loogle_rouge1")(_loogle_similarity(lambda r, h: rouge_recalls(r, h)[0], "ROUGE-1 recall"))
register("loogle_rouge2")(_loogle_similarity(lambda r, h: rouge_recalls(r, h)[1], "ROUGE-2 recall"))
register("loogle_rougeL")(_loogle_similarity(lambda r, h: rouge_recalls(r, h)[2], "ROUGE-L recall"))
register("loogle_meteor")(_loogle_similarity(meteor, "METEOR"))


def _cloze_counts(partial: bool):
    def counts(prediction: str, answers: Sequence[str], **_) -> tuple[int, int]:
        # LooGLE cloze rows have one answer; with several, the best-matching one counts.
        return max((cloze_match_counts(prediction, a, partial=partial) for a in answers), key=lambda mc: mc[0] / mc[1])

    return counts


def _cloze_fraction(partial: bool):
    def fraction(prediction: str, answers: Sequence[str], **_) -> float:
        matched, count = _cloze_counts(partial)(prediction, answers)
        return matched / count

    fraction.__doc__ = f"LooGLE cloze {'partial' if partial else 'exact'} match of one sample: matched / masks."
    return fraction


register("loogle_cloze_exact", formula="pooled", counts=_cloze_counts(False))(_cloze_fraction(False))
register("loogle_cloze_partial", formula="pooled", counts=_cloze_counts(True))(_cloze_fraction(True))


@register("loogle_bertscore")
def loogle_bertscore(prediction: str, answers: Sequence[str], **_) -> float:
    """LooGLE BERTScore: not available offline; always raises ``MetricUnavailableError`` (§3, §5.1)."""
    raise MetricUnavailableError(
        "LooGLE BERTScore cannot run offline: bert_score needs roberta-large weights from the Hugging Face hub; "
        "report it as null/unavailable"
    )


@register("loogle_gpt4_judge")
def loogle_gpt4_judge(prediction: str, answers: Sequence[str], **_) -> float:
    """LooGLE GPT-4 judge: not available offline; always raises ``MetricUnavailableError`` (§3)."""
    raise MetricUnavailableError(
        "LooGLE's GPT-4 judge (Evaluation/llm_score.py) needs the OpenAI API and cannot run offline; "
        "report it as null/unavailable"
    )
