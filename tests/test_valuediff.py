"""ValueDiff (``../shared/papers/004_e4fd5de70ac2a9d7.txt``): scores, fixed-budget block/decode eviction, ratio mode."""

from __future__ import annotations

import pytest
import torch

from core_kv.models.cache import kv_bytes, layer_lengths
from core_kv.pipeline import greedy_answer, prefill
from core_kv.presses import build_press
from core_kv.presses.valuediff import value_scores


def test_scores_match_definitions():
    v = torch.randn(1, 2, 50, 8, generator=torch.Generator().manual_seed(0))
    mean = v.mean(dim=2, keepdim=True)
    assert torch.allclose(value_scores(v, "diff"), (v - mean).norm(dim=-1))
    assert torch.allclose(value_scores(v, "vnorm"), v.norm(dim=-1))
    cos = (v * mean).sum(-1) / (v.norm(dim=-1) * mean.norm(dim=-1))
    assert torch.allclose(value_scores(v, "vdir"), 1 - cos, atol=1e-6)


def test_valid_mask_ignores_padding():
    v = torch.randn(1, 2, 40, 8, generator=torch.Generator().manual_seed(1))
    valid = torch.zeros(2, 40, dtype=torch.bool)
    valid[0, :25], valid[1, :40] = True, True
    padded = v.clone()
    padded[0, 0, 25:] = 0
    got = value_scores(padded, "diff", valid)
    assert torch.allclose(got[0, 0, :25], value_scores(v[:, :1, :25], "diff")[0, 0])
    assert torch.allclose(got[0, 1], value_scores(v[:, 1:], "diff")[0, 0])


def test_keeps_highest_deviation():
    v = torch.zeros(1, 1, 10, 4)
    v[0, 0, 3] = 5.0
    v[0, 0, 7] = -3.0
    press = build_press("valuediff", budget=2)
    kept = press.compress(None, None, torch.randn(1, 1, 10, 4), v, None, {}, 2)
    assert kept[0, 0].tolist() == [3, 7]


@pytest.mark.parametrize("variant", ["diff", "vnorm", "vdir"])
def test_ratio_mode(llama, variant):
    ids = torch.randint(0, 256, (1, 200), generator=torch.Generator().manual_seed(0))
    cache = prefill(llama, ids, build_press("valuediff", compression_ratio=0.75, variant=variant))
    assert all(row == [50, 50] for row in kv_bytes(cache)["tokens_per_head"])


def test_block_boundaries_and_decode_steps_hold_fixed_budget(llama):
    ids = torch.randint(0, 256, (1, 300), generator=torch.Generator().manual_seed(1))
    press = build_press("valuediff", budget=64, decoding=True, decoding_slack=0)
    sizes = []
    original = press.compress

    def spy(module, *args, **kwargs):
        sizes.append(args[1].shape[2])  # keys seen at each eviction event
        return original(module, *args, **kwargs)

    press.compress = spy
    cache = prefill(llama, ids, press, chunk_size=50)
    # layer 0's eviction events (the two layers alternate): the first block of 50 fits the budget, then every
    # block boundary evicts 64 + 50 back to 64
    assert sizes[::2] == [100, 114, 114, 114, 114]
    assert all(lengths.tolist() == [64, 64] for lengths in map(layer_lengths, cache.layers))
    sizes.clear()
    question = torch.tensor([[5, 6, 7]])
    greedy_answer(llama, cache, 300, question, max_new_tokens=4, press=press, eos_token_ids=[], trim=False)
    assert sizes[::2] == [67, 65, 65, 65]  # the question (3 tokens), then every decoding step
    assert all(lengths.tolist() == [64, 64] for lengths in map(layer_lengths, cache.layers))


def test_chunked_prefill_attends_to_compressed_past(llama):
    ids = torch.randint(0, 256, (1, 200), generator=torch.Generator().manual_seed(2))
    one_shot = prefill(llama, ids, build_press("valuediff", budget=64))
    chunked = prefill(llama, ids, build_press("valuediff", budget=64), chunk_size=50)
    assert not torch.equal(one_shot.layers[1].keys, chunked.layers[1].keys)


def test_bad_variant():
    with pytest.raises(ValueError):
        build_press("valuediff", compression_ratio=0.5, variant="keydiff")
