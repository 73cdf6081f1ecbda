"""Tokenizer of the proxy LM: byte-level BPE with one token per digit and one token per RULER key word.

Built offline in about a second from the training essays, the wonderwords lists and a few template strings; the
recipe is the measured one of ``shared/research/proxy_feasibility.md`` ("Exact final recipe", tokenizer):

- ``Sequence([Digits(individual_digits=True), ByteLevel(add_prefix_space=False)])`` pre-tokenization, so a 7-digit
  RULER value is ``Ġ`` + 7 digit tokens (3-digit chunks did not learn to copy on the CPU budget, run C of the note).
- RULER keys are ``{adjective}-{noun}`` (``benchmarks.md`` §1.3). The byte-level pre-tokenizer splits
  ``" capable-percent"`` into ``Ġcapable``, ``-``, ``percent``; BPE merges are appended until every ``Ġ{adjective}``
  and every ``{noun}`` of wonderwords 2.2.0 is a single token, so a key costs 3 tokens. The feasibility note found
  multikey at chance with 4-10 pieces per key; whole-word keys make key matching a 3-token induction problem.
- ``uuid_chars``: every hexadecimal letter within three characters of a digit is its own pre-token, so a RULER UUID
  (``str(uuid4)``) is usually ``Ġ`` + 36 single-character tokens, like a number is ``Ġ`` + 7 digits, instead of a mix
  of digits and BPE letter runs (``fa``, ``bed``). Exactly character-level for 92.6% of random UUIDs; the rest hold a
  letter run farther than three characters from any digit (e.g. an all-letter 4-character group), which BPE may
  merge. English is unaffected except for the rare letter glued to a digit (``3d`` -> ``3``, ``d``).
- ``<|endoftext|>`` is bos, eos and pad; the post-processor prepends it (Llama-style), while
  ``tokenizer.tokenize(text)`` (RULER's token counter) adds nothing.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from core_kv.corpus import NOISE_LINE, essay_files, held_out_essays, words

SPECIAL = "<|endoftext|>"


def key_word_pieces(adjectives: Iterable[str], nouns: Iterable[str]) -> list[str]:
    """The byte-level pre-tokens that must become single tokens: ``Ġ{adjective}`` and ``{noun}`` (after ``-``)."""
    bl = pre_tokenizers.ByteLevel(add_prefix_space=False)
    pieces: set[str] = set()
    for adj in adjectives:
        pieces.update(p for p, _ in bl.pre_tokenize_str(" " + adj) if p != "Ġ")
    for noun in nouns:
        pieces.update(p for p, _ in bl.pre_tokenize_str("-" + noun)[1:])
    return sorted(pieces)


# A hex letter at most three characters from a digit (fixed-length look-arounds: Oniguruma has no unbounded ones).
HEX_LETTER_NEAR_DIGIT = r"(?<=[0-9]|[0-9][a-f]|[0-9][a-f][a-f])[a-f]|[a-f](?=[0-9]|[a-f][0-9]|[a-f][a-f][0-9])"


def _pre_tokenizer(uuid_chars: bool = False) -> pre_tokenizers.PreTokenizer:
    steps = [pre_tokenizers.Split(Regex(HEX_LETTER_NEAR_DIGIT), "isolated")] if uuid_chars else []
    steps += [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    return pre_tokenizers.Sequence(steps)


def build_tokenizer(
    corpus: Iterable[str],
    adjectives: Iterable[str],
    nouns: Iterable[str],
    base_vocab: int = 4096,
    key_words: bool = True,
    uuid_chars: bool = False,
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on ``corpus`` and (``key_words``) extend its merges so every key word is one token.

    Args:
        corpus: Training text (training essays, template strings, word lists).
        adjectives: wonderwords adjectives (the first half of a RULER key).
        nouns: wonderwords nouns (the second half of a RULER key).
        base_vocab: Size of the BPE trained on ``corpus`` before the key-word merges are appended.
        key_words: Append the key-word merges. ``False`` gives the plain BPE of the feasibility note (vocab exactly
            ``base_vocab``, keys split into several pieces, every token frequent), which learned to copy on the CPU
            budget where the whole-word vocabulary (~16k mostly rare tokens) did not.
        uuid_chars: One token per character of a UUID (see the module docstring).

    Returns:
        The wrapped tokenizer; ``len(tok)`` is the vocabulary size the model must use.
    """
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = _pre_tokenizer(uuid_chars)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=base_vocab,
        min_frequency=2,
        special_tokens=[SPECIAL],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(corpus, trainer=trainer)
    targets = key_word_pieces(adjectives, nouns) if key_words else []

    # Append left-to-right merge chains for target pieces that are still split; a later chain can alter an
    # earlier piece's split (a merge it shares), so repeat until every target is one token.
    state = json.loads(bpe.to_str())
    vocab: dict[str, int] = state["model"]["vocab"]
    merges: list = state["model"]["merges"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in merges]
    known = set(merges)
    for _ in range(8):
        model = models.BPE(vocab=vocab, merges=merges)
        split = [(t, [tok.value for tok in model.tokenize(t)]) for t in targets]
        todo = [(t, parts) for t, parts in split if len(parts) > 1]
        if not todo:
            break
        for _t, parts in todo:
            cur = parts[0]
            for nxt in parts[1:]:
                merged = cur + nxt
                if merged not in vocab:
                    vocab[merged] = len(vocab)
                if (cur, nxt) not in known:
                    known.add((cur, nxt))
                    merges.append((cur, nxt))
                cur = merged
    else:
        raise RuntimeError(f"{len(todo)} key words are still split after extending the merges")
    state["model"]["vocab"] = vocab
    state["model"]["merges"] = [list(m) for m in merges]
    tok = Tokenizer.from_str(json.dumps(state))
    eos = tok.token_to_id(SPECIAL)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{SPECIAL} $A", pair=f"{SPECIAL} $A $B", special_tokens=[(SPECIAL, eos)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=SPECIAL, eos_token=SPECIAL, pad_token=SPECIAL, unk_token=None
    )


def default_corpus(
    essays: Iterable[str], adjectives: Iterable[str], nouns: Iterable[str], key_sentences: int | None = None
) -> list[str]:
    """Tokenizer training text: essays, the noise line, and key words in needle sentences (so BPE learns the
    template words; the key words themselves are forced afterwards).

    Args:
        key_sentences: Needle sentences to include; ``None`` = one per noun (6,786 with wonderwords 2.2.0, which then
            outweigh the essays in the BPE statistics: 1.50 tokens per held-out essay word at ``base_vocab`` 8192,
            against 1.45 with 200 sentences).
    """
    adjectives, nouns = list(adjectives), list(nouns)
    lines = list(essays)
    lines += [NOISE_LINE] * 200
    pairs = list(zip(adjectives * (len(nouns) // len(adjectives) + 1), nouns, strict=False))
    lines += [
        f"One of the special magic numbers for {a}-{n} is: 1234567. What is the special magic number for {a}-{n} "
        f"mentioned in the provided text? The special magic number for {a}-{n} mentioned in the provided text is"
        for a, n in pairs[:key_sentences]
    ]
    lines += [
        "Memorize and track the chain(s) of variable assignment hidden in the following text. VAR ABCDE = 12345 "
        "Question: Find all variables that are assigned the value 12345 in the text above. Answer: According to "
        "the chain(s) of variable assignment in the text above, 5 variables are assigned the value 12345, they are: "
    ] * 50
    return lines


def build_proxy_tokenizer(
    base_vocab: int = 4096, key_words: bool = True, uuid_chars: bool = False, key_sentences: int | None = None
):
    """The proxy tokenizer trained on the training essays only (see :mod:`core_kv.proxy.tokenizer`)."""
    held = held_out_essays()
    essays = [f.read_text(encoding="utf-8") for f in essay_files() if f.stem not in held]
    adjs, nouns = words("adjectives"), words("nouns")
    corpus = default_corpus(essays, adjs, nouns, key_sentences)
    return build_tokenizer(corpus, adjs, nouns, base_vocab=base_vocab, key_words=key_words, uuid_chars=uuid_chars)
