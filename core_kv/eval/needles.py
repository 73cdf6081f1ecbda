"""Held-out needle prompts: does a model (and a press) retrieve a needle beyond RULER's exact wording?

One needle sentence in a haystack of RULER's noise lines or of essay text, placed at a random depth, then a question
(greedy answer, or the answer's teacher-forced likelihood). Four wordings: RULER's own (``ruler``) and three
rewordings that share none of its template words:

| wording  | needle                                                      | question                                   |
|----------|-------------------------------------------------------------|--------------------------------------------|
| ruler    | One of the special magic numbers for {key} is: {value}.     | What is the special magic number for {key} mentioned in the provided text? |
| secret   | Remember this: the secret code of {key} is {value}.         | What is the secret code of {key}?          |
| password | The password for the {key} vault is {value}.                | What is the password for the {key} vault?  |
| locker   | Note: the locker number assigned to {key} is {value}.       | Which locker number was assigned to {key}? |

Keys are adjective-noun pairs (``amber-falcon``), values 7-digit numbers, both drawn with the seed (never 42, so the
prompts are disjoint from RULER's evaluation draws). The question carries no answer prefix, except for ``ruler``
(RULER's own). Prompts are built with the model's tokenizer as counter so every method sees identical token ids.
These are *evaluation* prompts (``benchmarks/needle_wording.py``); the policy stage validates on its own, disjoint
generator (:mod:`core_kv.eval.validation`).
"""

from __future__ import annotations

import random

WORDINGS = {
    "ruler": (
        "One of the special magic numbers for {key} is: {value}.",
        "What is the special magic number for {key} mentioned in the provided text?",
        "The special magic number for {key} mentioned in the provided text is",
    ),
    "secret": ("Remember this: the secret code of {key} is {value}.", "What is the secret code of {key}?", ""),
    "password": ("The password for the {key} vault is {value}.", "What is the password for the {key} vault?", ""),
    "locker": ("Note: the locker number assigned to {key} is {value}.", "Which locker number was assigned to {key}?",
               ""),
}  # fmt: skip
HAYSTACKS = ("noise", "essay")
ADJ = ("amber", "silent", "crimson", "brave", "lucky", "frozen", "golden", "hidden", "quiet", "rapid", "wild", "pale")
NOUN = ("falcon", "river", "lantern", "meadow", "harbor", "compass", "orchid", "glacier", "violin", "beacon", "otter")


def build_prompts(tokenizer, wording: str, haystack: str, length: int, n: int, seed: int) -> list[dict]:
    """``n`` prompts of about ``length`` context tokens (the tokenizer counts), needle at a uniform random depth."""
    from core_kv.corpus import essays_text
    from core_kv.eval.ruler import NOISE

    needle_t, question_t, prefix_t = WORDINGS[wording]
    rng = random.Random(f"{seed}-{wording}-{haystack}-{length}")
    if haystack == "noise":
        unit = NOISE + " "
        per = len(tokenizer.encode(unit, add_special_tokens=False))
        filler_units = [unit] * (length // per + 1)
    else:
        words = essays_text().split()
        filler_units = None
    out = []
    for _ in range(n):
        key = f"{rng.choice(ADJ)}-{rng.choice(NOUN)}"
        value = str(rng.randint(1_000_000, 9_999_999))
        needle = needle_t.format(key=key, value=value)
        budget = length - len(tokenizer.encode(needle, add_special_tokens=False)) - 8
        if filler_units is not None:
            pieces = filler_units[: max(1, budget // per)]
        else:
            start = rng.randrange(0, len(words) - 4 * length)
            pieces, used = [], 0
            for w in words[start:]:
                used += 1
                pieces.append(w + " ")
                if used >= int(budget * 0.72):  # ~0.72 words per token for English BPE; refined below
                    break
            while len(tokenizer.encode("".join(pieces), add_special_tokens=False)) > budget:
                pieces = pieces[: int(len(pieces) * 0.95)]
        cut = rng.randint(0, len(pieces))
        context = "".join(pieces[:cut]) + needle + " " + "".join(pieces[cut:])
        out.append(
            {"context": context.strip(), "question": question_t.format(key=key), "prefix": prefix_t.format(key=key),
             "value": value, "needle": needle, "depth": cut / max(1, len(pieces))}
        )  # fmt: skip
    return out
