"""Validation prompts of the policy stage: needle retrieval in the pipeline's own wording, seeds and haystacks.

The policy stage (:mod:`core_kv.eval.policy_stage`) chooses a CORE artifact's inference policy on these prompts, so
they are built to be disjoint from everything the project reports on:

- **wording**: archive records ("the registration code of harbor-417 is 4817263"), not RULER's "special magic
  number" templates (:mod:`core_kv.eval.ruler`) nor the held-out wordings of :mod:`core_kv.eval.needles`
  (``tests/test_policy_stage.py`` checks that no template sentence is shared);
- **keys**: ``<noun>-<3 digits>`` (RULER and the held-out prompts use adjective-noun pairs);
- **haystacks**: the pipeline's own filler lines (``noise``) and natural prose from the Python reference
  documentation that ships with every CPython (``pydoc_data.topics``: its prose sentences, code and tables left out;
  ``prose``), not RULER's noise lines or the essays;
- **seeds**: :data:`MIN_SEED` and above only (evaluation seeds are 42-46 for RULER and single digits for the held-out
  prompts); a lower seed is refused.

Four tasks mirror the kinds of RULER's needle tasks (single needle in noise, single needle in prose, several keys
with one asked, several values of one key), each prompt with an answer prefix so the answer can be scored by teacher
forcing. Token counts are measured with the model's tokenizer.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from functools import lru_cache

from core_kv.policy import MIN_SEED, VALIDATION_TASKS

NEEDLE = "Archive record: the registration code of {key} is {value}."
NEEDLE_MULTI = "Archive record: one registration code of {key} is {value}."
QUESTION = "What is the registration code of {key}?"
QUESTION_MULTI = "What are the registration codes of {key}?"
PREFIX = "The registration code of {key} is"
PREFIX_MULTI = "The registration codes of {key} are"
FILLER = ("The hills are quiet tonight. A cart rolls down the lane. The well is deep and cold. Smoke rises from the "
          "mill. ")  # fmt: skip


@dataclass(frozen=True)
class ValidationPrompt:
    """One prompt: the context, the question, the answer prefix and the answer the model must produce."""

    task: str
    context: str
    question: str
    prefix: str
    answer: str
    depth: float


def check_seed(seed: int) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < MIN_SEED:
        raise ValueError(
            f"policy.seed must be an integer >= {MIN_SEED} (lower seeds are the evaluation draws), got {seed!r}"
        )
    return seed


def build(tokenizer, task: str, length: int, n: int, seed: int) -> list[ValidationPrompt]:
    """``n`` prompts of ``task`` with about ``length`` context tokens (the tokenizer counts)."""
    from core_kv.corpus import words

    if task not in VALIDATION_TASKS:
        raise ValueError(f"unknown validation task {task!r}; tasks: {', '.join(VALIDATION_TASKS)}")
    check_seed(seed)
    rng = random.Random(f"policy-validation-{seed}-{task}-{length}")
    nouns = [w for w in words("nouns") if w.isalpha() and w.islower()]
    out = []
    for _ in range(n):
        keys = rng.sample(nouns, 4)
        keys = [f"{k}-{rng.randint(100, 999)}" for k in keys]
        values = [str(rng.randint(1_000_000, 9_999_999)) for _ in range(2)]
        if task.startswith("multivalue"):
            needles = [NEEDLE_MULTI.format(key=keys[0], value=v) for v in values]
            question, prefix, answer = QUESTION_MULTI, PREFIX_MULTI, f" {values[0]} and {values[1]}."
        elif task.startswith("multikey"):
            needles = [NEEDLE.format(key=k, value=str(rng.randint(1_000_000, 9_999_999))) for k in keys[1:]]
            needles.insert(rng.randrange(len(needles) + 1), NEEDLE.format(key=keys[0], value=values[0]))
            question, prefix, answer = QUESTION, PREFIX, f" {values[0]}."
        else:
            needles = [NEEDLE.format(key=keys[0], value=values[0])]
            question, prefix, answer = QUESTION, PREFIX, f" {values[0]}."
        budget = length - sum(len(tokenizer.encode(x, add_special_tokens=False)) for x in needles) - 8
        units = _haystack(tokenizer, task.split("_")[-1], budget, rng)
        cuts = sorted(rng.randint(0, len(units)) for _ in needles)
        pieces, last = [], 0
        for cut, needle in zip(cuts, needles, strict=True):
            pieces += [*units[last:cut], needle + " "]
            last = cut
        pieces += units[last:]
        out.append(ValidationPrompt(task, "".join(pieces).strip(), question.format(key=keys[0]),
                                    prefix.format(key=keys[0]), answer, cuts[0] / max(1, len(units))))  # fmt: skip
    return out


def _haystack(tokenizer, kind: str, budget: int, rng: random.Random) -> list[str]:
    """Filler units (sentences) of at most ``budget`` tokens in all: the filler lines, or a run of consecutive prose
    sentences from a random start."""
    if kind == "noise":
        per = len(tokenizer.encode(FILLER, add_special_tokens=False))
        return [FILLER] * max(1, budget // per)
    sentences = prose_sentences()
    start = rng.randrange(len(sentences))
    units, used = [], 0
    for i in range(len(sentences)):
        s = sentences[(start + i) % len(sentences)] + " "
        used += len(tokenizer.encode(s, add_special_tokens=False))
        if used > budget:
            break
        units.append(s)
    return units or [sentences[start] + " "]


@lru_cache(maxsize=1)
def prose_sentences() -> tuple[str, ...]:
    """The prose sentences of the Python reference documentation (``pydoc_data.topics``, part of CPython): sentences
    of 6-40 words made of letters, digits, quotes, parentheses and ordinary punctuation only (code, tables and markup
    left out), in document order."""
    from pydoc_data.topics import topics

    text = re.sub(r"\s+", " ", " ".join(topics[k] for k in sorted(topics)))
    out = []
    for sentence in re.split(r"(?<=[.!?]) (?=[A-Z])", text):
        words = sentence.split()
        if (6 <= len(words) <= 40 and sentence[-1] in ".!?" and "()" not in sentence
                and re.fullmatch(r"[A-Za-z0-9 ,;:.'!?\-\"()\u2018\u2019\u201c\u201d]+", sentence)):  # fmt: skip
            out.append(sentence.strip())
    return tuple(out)


def validation_set(tokenizer, tasks: tuple[str, ...] | list[str], length: int, per_task: int, seed: int) -> list:
    """Every task's prompts, in task order (the same for every candidate)."""
    return [p for task in tasks for p in build(tokenizer, task, length, per_task, seed)]


__all__ = ["MIN_SEED", "VALIDATION_TASKS", "ValidationPrompt", "build", "check_seed", "validation_set"]
