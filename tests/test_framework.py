"""Framework pieces: typed config loading, atomic IO, cache helpers, the ragged cache layer and pipeline."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from core_kv.config import load_config, to_dict
from core_kv.files import atomic_write_json, read_jsonl
from core_kv.models.attention import UnsupportedModelError, decoder_layers, ragged_sdpa
from core_kv.models.cache import RESERVE_TOKENS, RaggedKV, RaggedLayer, kv_bytes
from core_kv.pipeline import greedy_answer, prefill
from core_kv.presses import build_press
from tests.helpers import tiny_model


@dataclass
class _Inner:
    lr: float = 1e-3
    steps: int = 10


@dataclass
class _Cfg:
    name: str = "x"
    ratios: list[float] = field(default_factory=lambda: [0.5])
    inner: _Inner = field(default_factory=_Inner)

    def __post_init__(self):
        if self.inner.steps < 0:
            raise ValueError("steps must be >= 0")


def test_config_yaml_and_overrides(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("inner:\n  lr: 0.01\n")
    cfg = load_config(_Cfg, [str(y), "inner.steps=3", "ratios=[0.25,0.75]"])
    assert isinstance(cfg, _Cfg) and cfg.inner.lr == 0.01 and cfg.inner.steps == 3 and cfg.ratios == [0.25, 0.75]
    assert to_dict(cfg)["inner"] == {"lr": 0.01, "steps": 3}


@pytest.mark.parametrize("argv", [["nope=1"], ["inner.steps=abc"], ["inner.steps=-1"], ["missing.yaml"], ["what"]])
def test_config_errors(argv):
    with pytest.raises((ValueError, FileNotFoundError)):
        load_config(_Cfg, argv)


def test_atomic_json_and_corrupt_jsonl(tmp_path):
    p = atomic_write_json(tmp_path / "a" / "m.json", {"x": 1})
    assert json.loads(p.read_text()) == {"x": 1}
    assert [f.name for f in p.parent.iterdir()] == ["m.json"]  # no temp files left
    bad = tmp_path / "b.jsonl"
    bad.write_text('{"a": 1}\n{"a": ')
    with pytest.raises(ValueError, match="corrupt"):
        read_jsonl(bad)


def _naive_attention(q, k, v, keep):
    """Dense causal attention with evicted positions masked per KV head; q (1,H,T,D), k/v (1,Hkv,S,D)."""
    h, t, g = q.shape[1], q.shape[2], q.shape[1] // k.shape[1]
    s = k.shape[2]
    out = torch.empty_like(q)
    for head in range(h):
        kv = head // g
        scores = q[0, head] @ k[0, kv].T / q.shape[-1] ** 0.5  # (T, S)
        allowed = keep[kv][None, :] & (torch.arange(s)[None, :] <= (s - t + torch.arange(t))[:, None])
        out[0, head] = scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v[0, kv]
    return out.transpose(1, 2)


def test_ragged_attention_matches_masked_dense():
    torch.manual_seed(0)
    s, t, d = 40, 3, 8
    k, v = torch.randn(1, 2, s, d), torch.randn(1, 2, s, d)
    q = torch.randn(1, 4, t, d)
    past = s - t
    kept = [torch.tensor(sorted(set(range(0, past, 2)))), torch.tensor(list(range(past - 11, past)))]
    layer = RaggedLayer.from_kept(k[:, :, :past], v[:, :, :past], kept)
    assert isinstance(layer, RaggedLayer) and layer.lengths().tolist() == [len(kept[0]), 11]
    view, _ = layer.update(k[:, :, past:], v[:, :, past:])
    keep = torch.zeros(2, s, dtype=torch.bool)
    for h in range(2):
        keep[h, kept[h]] = True
        keep[h, past:] = True
    assert torch.allclose(ragged_sdpa(None, q, view), _naive_attention(q, k, v, keep), atol=1e-5)
    assert layer.payload_bytes() == 2 * 4 * d * (len(kept[0]) + 11 + 2 * t)  # fp32, the kept entries
    # the append re-laid the pools out with RESERVE_TOKENS free rows per head left after it (K and V, fp32, 2 heads);
    # nothing is padded to the longest head
    assert layer.nbytes() == layer.payload_bytes() + 2 * 4 * d * 2 * RESERVE_TOKENS
    assert isinstance(view, RaggedKV)


def test_equal_quotas_stay_rectangular():
    k = torch.randn(1, 2, 10, 4)
    out = RaggedLayer.from_kept(k, k, [torch.tensor([1, 3]), torch.tensor([0, 9])])
    assert isinstance(out, tuple) and out[0].shape == (1, 2, 2, 4)
    assert torch.equal(out[0][0, 1], k[0, 1, [0, 9]])


def test_full_press_reproduces_uncompressed_answer(llama):
    ids, q = torch.randint(0, 256, (1, 120)), torch.randint(0, 256, (1, 5))
    ref = greedy_answer(llama, prefill(llama, ids), 120, q, 8)
    press = build_press("full")
    assert greedy_answer(llama, prefill(llama, ids, press), 120, q, 8, press) == ref


def test_chunked_prefill_full_equals_one_shot(llama):
    ids, q = torch.randint(0, 256, (1, 100)), torch.randint(0, 256, (1, 4))
    one = prefill(llama, ids)
    chunked = prefill(llama, ids, build_press("full"), chunk_size=32)
    assert torch.allclose(one.layers[0].keys, chunked.layers[0].keys, atol=1e-5)
    assert greedy_answer(llama, one, 100, q, 6) == greedy_answer(llama, chunked, 100, q, 6)


def test_kv_bytes_counts_payload(llama):
    press = build_press("knorm", compression_ratio=0.75)
    cache = prefill(llama, torch.randint(0, 256, (1, 64)), press)
    info = kv_bytes(cache)
    assert info["tokens_per_head"] == [[16, 16], [16, 16]]
    assert info["total"] == 2 * 2 * (2 * 16 * 16 * 4)  # layers * (K+V) * (Hkv * S * D * fp32)


def test_hooks_removed_even_on_error(llama):
    press = build_press("knorm", compression_ratio=0.5)
    with pytest.raises(RuntimeError), press(llama):
        raise RuntimeError("boom")
    for layer in decoder_layers(llama):
        assert not layer.self_attn._forward_hooks and not layer.self_attn._forward_pre_hooks
    assert llama.config._attn_implementation == "sdpa"


def test_unsupported_architecture_raises():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(UnsupportedModelError), build_press("knorm", compression_ratio=0.5)(model):
        pass


def test_supported_families_run(llama):
    for family in ("qwen3", "mistral", "qwen2", "phi3"):
        model = tiny_model(family)
        press = build_press("knorm", compression_ratio=0.5)
        cache = prefill(model, torch.randint(0, 256, (1, 50)), press)
        assert kv_bytes(cache)["tokens_per_head"] == [[25, 25], [25, 25]]
        assert len(greedy_answer(model, cache, 50, torch.randint(0, 256, (1, 3)), 3, press)) <= 3


def test_layers_with_different_budgets_answer_multi_token_questions(llama):
    """Per-layer budgets (PyramidKV) leave layers of different lengths; a multi-token question must still get a
    correct causal mask in every layer (transformers builds one mask from layer 0's length)."""
    from dataclasses import dataclass

    from core_kv.presses.knorm import KnormPress

    @dataclass
    class PerLayer(KnormPress):
        def layer_target(self, module, n):
            return n // 2 if module.layer_idx == 0 else n // 4

    for attn in ("sdpa", "eager"):
        model = tiny_model("llama", attn=attn)
        ids, q = torch.randint(0, 256, (1, 96)), torch.randint(0, 256, (1, 6))
        press = PerLayer(compression_ratio=0.5)
        cache = prefill(model, ids, press)
        assert kv_bytes(cache)["tokens_per_head"] == [[48, 48], [24, 24]]
        # reference: feed the question token by token (a single query needs no mask)
        one_shot = greedy_answer(model, cache, 96, q, 4, press)
        stepwise_logits = []
        with press(model):
            for i in range(q.shape[1]):
                out = model(input_ids=q[:, i : i + 1], past_key_values=cache, position_ids=torch.tensor([[96 + i]]))
                stepwise_logits.append(out.logits[0, -1])
        assert int(stepwise_logits[-1].argmax()) == one_shot[0]


def test_ratio_is_a_share_of_everything_seen_in_chunked_prefill_and_decoding(llama):
    """Chunked prefill keeps floor(N (1 - r)) of the whole context (not of the compressed cache + chunk), and
    decode-time eviction after re-entering the press keeps the ratio of all tokens seen."""
    ids = torch.randint(0, 256, (1, 256))
    press = build_press("knorm", compression_ratio=0.75)
    cache = prefill(llama, ids, press, chunk_size=64)
    assert kv_bytes(cache)["tokens_per_head"] == [[64, 64], [64, 64]]
    press = build_press("knorm", compression_ratio=0.5, decoding=True, decoding_slack=8)
    cache = prefill(llama, ids, press)
    assert kv_bytes(cache)["tokens_per_head"][0] == [128, 128]
    greedy_answer(llama, cache, 256, torch.randint(0, 256, (1, 6)), 20, press, eos_token_ids=[], trim=False)
    seen = 256 + 6 + 19  # the last generated token is never fed
    kept = kv_bytes(cache)["tokens_per_head"][0][0]
    assert seen // 2 <= kept <= seen // 2 + 8


def test_stop_tokens_end_the_answer_only_after_it_began(llama):
    g = torch.Generator().manual_seed(5)
    ids, q = torch.randint(0, 256, (1, 120), generator=g), torch.randint(0, 256, (1, 4), generator=g)
    full = greedy_answer(llama, prefill(llama, ids), 120, q, 12, eos_token_ids=[])
    later = next(t for t in full[1:] if t != full[0])  # a token first generated after position 0
    cut = full.index(later)
    assert greedy_answer(llama, prefill(llama, ids), 120, q, 12, eos_token_ids=[], stop_token_ids=[later]) == full[:cut]
    # the first generated token never stops decoding: the answer runs on to that token's next occurrence (or the end)
    first = full[0]
    nxt = full.index(first, 1) if first in full[1:] else len(full)
    assert greedy_answer(llama, prefill(llama, ids), 120, q, 12, eos_token_ids=[], stop_token_ids=[first]) == full[:nxt]


def test_first_token_is_never_eos_by_default(llama):
    """The eos protocol (docs/evaluation.md): eos is excluded from the first token's argmax (transformers'
    ``min_new_tokens=1``), so a model that would close its turn at once answers with its best other token; later
    eos tokens end the answer. ``min_new_tokens=0`` is the earlier rule: a first-token eos is the empty answer."""
    g = torch.Generator().manual_seed(7)
    ids, q = torch.randint(0, 256, (1, 120), generator=g), torch.randint(0, 256, (1, 4), generator=g)
    free = greedy_answer(llama, prefill(llama, ids), 120, q, 10, eos_token_ids=[])
    eos = free[0]  # make the model's own first choice the eos token
    assert greedy_answer(llama, prefill(llama, ids), 120, q, 10, eos_token_ids=[eos], min_new_tokens=0) == []
    # the naive reference: the first step's logits with the eos column removed
    cache = prefill(llama, ids)
    with torch.inference_mode():
        logits = llama(input_ids=q, position_ids=torch.arange(120, 124)[None], past_key_values=cache).logits[0, -1]
    logits = logits.clone()
    logits[eos] = float("-inf")
    answer = greedy_answer(llama, prefill(llama, ids), 120, q, 10, eos_token_ids=[eos])
    assert answer and answer[0] == int(logits.argmax()) and eos not in answer
    if len(answer) < 10:  # it stopped early: only because the next token was the eos (teacher-forced check)
        fed = torch.cat([q, torch.tensor([answer])], dim=1)
        with torch.inference_mode():
            out = llama(input_ids=fed, position_ids=torch.arange(120, 120 + fed.shape[1])[None],
                        past_key_values=prefill(llama, ids)).logits[0, -1]  # fmt: skip
        assert int(out.argmax()) == eos


def test_newline_token_ids_are_exactly_the_tokens_with_a_newline():
    from transformers import AutoTokenizer

    from core_kv.pipeline import newline_token_ids

    tok = AutoTokenizer.from_pretrained(Path(__file__).resolve().parents[1] / "checkpoints" / "proxy-lm")
    ids = set(newline_token_ids(tok))
    texts = tok.batch_decode([[i] for i in range(len(tok))])
    assert ids == {i for i, t in enumerate(texts) if "\n" in t}
    assert tok.encode("\n", add_special_tokens=False)[0] in ids and len(ids) < len(tok) // 4


@pytest.mark.parametrize(
    "context, questions, match",
    [("some text", [], "questions"), ("", ["What?"], "context"), ("   \n", ["What?"], "context"),
     ("some text", "What?", "list")],
)  # fmt: skip
def test_answer_questions_rejects_empty_inputs(context, questions, match):
    """``questions=[]`` was an UnboundLocalError, ``context=""`` answered from BOS alone, a bare string was split
    into one question per character: all are ValueErrors naming the argument (issue 16)."""
    from core_kv.models.loading import tiny_model as build_tiny
    from core_kv.models.loading import tiny_tokenizer
    from core_kv.pipeline import answer_questions

    tok = tiny_tokenizer()
    model = build_tiny(tok)
    with pytest.raises(ValueError, match=match):
        answer_questions(model, tok, context=context, questions=questions, max_new_tokens=2)
