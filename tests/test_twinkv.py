"""TwinKV (``../shared/papers/000_b875d3eb09a55c6d.txt``): the paper's worked examples and budget guarantees."""

from __future__ import annotations

import math
from fractions import Fraction
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from core_kv.models.cache import RaggedLayer, kv_bytes
from core_kv.pipeline import greedy_answer, prefill
from core_kv.presses import build_press
from core_kv.presses.twinkv import (
    TwinKVPress,
    head_quotas,
    naive_nonlocal_counts,
    nonlocal_counts,
    protected_mask,
    twin_order,
    twin_select,
)


def prototype_keys(n: int, heads: int = 2, d: int = 16, prototypes: int = 12, noise: float = 0.05, seed: int = 0):
    """Keys drawn around a few directions, so many nonlocal pairs clear the 0.85 threshold."""
    g = torch.Generator().manual_seed(seed)
    protos = torch.randn(heads, prototypes, d, generator=g)
    pick = torch.randint(prototypes, (heads, n), generator=g)
    keys = torch.stack([protos[h, pick[h]] for h in range(heads)])  # (H, N, D)
    unique = torch.rand(heads, n, generator=g) < 0.3  # a third without twins
    keys[unique] = torch.randn(int(unique.sum()), d, generator=g)
    return (keys + noise * torch.randn(heads, n, d, generator=g))[None]  # (1, H, N, D)


@pytest.mark.parametrize("block", [5, 37, 512, 2048])
def test_blockwise_counts_equal_naive(block):
    keys = prototype_keys(700)
    ref = naive_nonlocal_counts(keys)
    assert ref.sum() > 0 and (ref == 0).any()
    assert torch.equal(nonlocal_counts(keys, block_size=block), ref)


def test_counts_exclude_local_window_and_self():
    keys = torch.ones(1, 1, 100, 4)  # every pair identical: counts = positions farther than 32
    c = nonlocal_counts(keys)[0, 0]
    pos = torch.arange(100)
    expected = torch.tensor([int(((pos - i).abs() > 32).sum()) for i in range(100)])
    assert torch.equal(c, expected)


def figure3_head(n: int = 512, d: int = 64, seed: int = 0):
    """One head of the Figure 3 construction: A (energy 0.95) has two far twins, B (energy 0.80) has none."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(n, d, generator=g)
    a, b = 150, 250
    keys[300] = keys[a]
    keys[400] = keys[a]
    energy = torch.full((n,), 0.10)
    energy[a], energy[b] = 0.95, 0.80
    return keys, energy, a, b


def test_figure3_rank_reversal():
    n = 512
    keys, energy, a, b = figure3_head(n)
    counts = nonlocal_counts(keys[None, None])[0, 0]
    assert (int(counts[a]), int(counts[b])) == (2, 0)
    norm = energy * torch.log((n + 1) / (counts.double() + 1)) / math.log(n + 1)
    assert float(norm[a]) == pytest.approx(0.783, abs=5e-4)
    assert float(norm[b]) == pytest.approx(0.800, abs=5e-4)
    twin = twin_order(energy, counts, "twin").tolist()
    value = twin_order(energy, counts, "value").tolist()
    assert twin.index(b) < twin.index(a)  # reversal under frequency weighting
    assert value.index(a) < value.index(b)


def test_figure3_capacities():
    # H=2, N=512, r=0.5: B=256, s=4, w=64, P=68, U=188; g=(80, 296) -> u=(134, 242) -> b=(202, 310)
    press = TwinKVPress(compression_ratio=0.5)
    n = 512
    big = press.target(n)
    s, w = press.protected(big)
    assert (big, s + w, big - s - w) == (256, 68, 188)
    z = torch.zeros(2, n - 68)
    z[0, :80] = 1.0
    z[1, 10:306] = 1.0
    u = head_quotas(z, 188)
    assert (u + 68).tolist() == [202, 310]
    order = torch.stack([torch.randperm(n, generator=torch.Generator().manual_seed(h)) for h in range(2)])
    kept = twin_select(order, u, protected_mask(n, s, w))
    assert [k.numel() for k in kept] == [202, 310]
    assert sum(k.numel() for k in kept) == 2 * 256


def test_quota_rounding_gives_leftovers_to_first_half_heads():
    # U=3, g=(4, 2, 3, 3): 2ũ=(7, 5, 6, 6) -> floors (3, 2, 3, 3) sum 11, R=1 -> first half head (0) gets it
    z = torch.zeros(4, 10)
    z[0, :4] = 1.0
    z[1, :2] = 1.0
    z[2, :3] = 1.0
    z[3, :3] = 1.0
    assert head_quotas(z, 3).tolist() == [4, 2, 3, 3]
    assert head_quotas(torch.zeros(4, 10), 3).tolist() == [3, 3, 3, 3]  # all-zero scores: g_h = U


def test_equal_capacity_scores_ordered_by_head_then_position():
    z = torch.ones(3, 5)  # nonzero, all tied: the top 3·2 = 6 go to head 0 (5) then head 1 (1)
    assert head_quotas(z, 2).tolist() == [4, 1, 1]  # g=(5,1,0): 2ũ=(7,3,2) -> (3,1,1), R=1 to head 0


@settings(max_examples=100, deadline=None)
@given(
    n=st.integers(1, 300),
    ratio=st.floats(0.0, 0.95),
    heads=st.integers(1, 8),
    data=st.data(),
)
def test_budget_conservation_property(n, ratio, heads, data):
    press = TwinKVPress(compression_ratio=ratio)
    big = press.target(n)
    s, w = press.protected(big)
    p, u_total = s + w, big - s - w
    m = n - p
    values = data.draw(st.lists(st.sampled_from([0.0, 0.0, 0.5, 1.0, 2.0]), min_size=heads * m, max_size=heads * m))
    z = torch.tensor(values, dtype=torch.float32).reshape(heads, m)
    b = head_quotas(z, u_total) + p
    assert int(b.sum()) == heads * big
    assert int(b.min()) >= p + u_total // 2
    assert int(b.max()) <= n


def test_tie_breaks_energy_then_position():
    n = 6
    energy = torch.tensor([1.0, 2.0, 0.0, 1.0, 3.0, 1.0])
    counts = torch.tensor([n, n, n, 0, 0, 0])  # rarity log((n+1)/(n+1)) = 0: the first three score exactly 0
    order = twin_order(energy, counts, "twin").tolist()
    assert order[:3] == [4, 3, 5]  # positive scores, e 3 > e 1 = e 1 (position)
    assert order[3:] == [1, 0, 2]  # zero scores by energy 2 > 1 > 0
    assert twin_order(energy, counts, "rarity").tolist() == [3, 4, 5, 0, 1, 2]  # count ties by position
    assert twin_order(energy, counts, "value").tolist() == [4, 1, 0, 3, 5, 2]


def test_compress_on_tensors_uniform_and_controls():
    n = 400
    keys = prototype_keys(n, heads=2, d=16)
    values = torch.randn(1, 2, n, 16, generator=torch.Generator().manual_seed(1))
    module = SimpleNamespace(layer_idx=0)
    kept = {}
    for opts in [{}, {"scoring": "value"}, {"scoring": "rarity"}, {"permute_seed": 11}, {"permute_seed": 29}]:
        press = TwinKVPress(compression_ratio=0.5, capacity="uniform", **opts)
        out = press.compress(module, None, keys, values, None, {}, press.target(n))
        assert [k.numel() for k in out] == [200, 200]
        for k in out:  # protected 4 sinks and 64 recent are kept
            assert set(range(4)) | set(range(n - 64, n)) <= set(k.tolist())
        kept[str(opts)] = out
    twin, value = kept["{}"], kept["{'scoring': 'value'}"]
    perm11, perm29 = kept["{'permute_seed': 11}"], kept["{'permute_seed': 29}"]
    assert not torch.equal(twin[0], value[0])
    assert not torch.equal(twin[0], perm11[0]) and not torch.equal(perm11[0], perm29[0])
    again = TwinKVPress(compression_ratio=0.5, capacity="uniform", permute_seed=11)
    assert all(
        torch.equal(x, y)
        for x, y in zip(again.compress(module, None, keys, values, None, {}, 200), perm11, strict=True)
    )


def test_permutation_preserves_unprotected_multiset():
    press = TwinKVPress(compression_ratio=0.5, permute_seed=47)
    counts = torch.randint(0, 9, (1, 3, 300))
    prot = protected_mask(300, 4, 64)
    out = press._permute(counts, prot, layer_idx=0)
    assert torch.equal(out[..., prot], counts[..., prot])
    for h in range(3):
        assert torch.equal(out[0, h, ~prot].sort().values, counts[0, h, ~prot].sort().values)


def test_short_prefix_keeps_sinks_and_recent(llama):
    ids = torch.randint(0, 256, (1, 172), generator=torch.Generator().manual_seed(0))
    full = prefill(llama, ids)
    cache = prefill(llama, ids, build_press("twinkv", compression_ratio=0.75))
    expected = list(range(4)) + list(range(172 - 39, 172))  # 43 = 4 sinks + 39 recent
    for layer, ref in zip(cache.layers, full.layers, strict=True):
        assert layer.keys.shape[2] == 43
        assert torch.equal(layer.keys, ref.keys[:, :, expected])
        assert torch.equal(layer.values, ref.values[:, :, expected])


@pytest.mark.parametrize("ratio", [0.5, 0.75, 0.9])
def test_exact_quotas_and_payload(llama, ratio):
    n = 400
    ids = torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(1))
    full = prefill(llama, ids)
    press = build_press("twinkv", compression_ratio=ratio)
    cache = prefill(llama, ids, press)
    big = math.floor(n * (1 - Fraction(str(ratio))))  # exact: 400·0.1 is 39.99... in floats
    s, w = min(4, big), min(64, big - min(4, big))
    u_total = big - s - w
    acc = kv_bytes(cache)
    heads, d = 2, 16
    for i, (layer, ref) in enumerate(zip(cache.layers, full.layers, strict=True)):
        per_head = acc["tokens_per_head"][i]
        assert sum(per_head) == heads * big
        assert min(per_head) >= s + w + u_total // 2
        assert per_head == press.capacities[i][0]
        es = ref.keys.element_size()
        assert acc["payload_per_layer"][i] == 2 * d * heads * big * es  # 2·d·H·B
        if not isinstance(layer, RaggedLayer):
            assert acc["per_layer"][i] == acc["payload_per_layer"][i]
            continue
        assert acc["per_layer"][i] == acc["payload_per_layer"][i]  # after the eviction: the kept entries, no padding
        groups = layer.groups
        for grp in groups:  # stored rows are original keys, in sequence order
            for j, h in enumerate(grp.heads.tolist()):
                rows = grp.keys[0, j]
                match = (rows[:, None, :] == ref.keys[0, h][None, :, :]).all(-1).float().argmax(-1)
                assert torch.equal(ref.keys[0, h, match], rows)
                assert bool((match.diff() > 0).all())
    if ratio == 0.5:
        assert any(isinstance(layer, RaggedLayer) for layer in cache.layers)  # adapted capacities are unequal
    tokens = greedy_answer(llama, cache, n, torch.tensor([[1, 2, 3]]), max_new_tokens=3, press=press)
    assert len(tokens) <= 3


def test_uniform_capacity_stays_rectangular(llama):
    ids = torch.randint(0, 256, (1, 300), generator=torch.Generator().manual_seed(2))
    cache = prefill(llama, ids, build_press("twinkv", compression_ratio=0.5, capacity="uniform"))
    assert all(not isinstance(layer, RaggedLayer) and layer.keys.shape[2] == 150 for layer in cache.layers)


def test_qwen3_runs(qwen3):
    ids = torch.randint(0, 256, (1, 256), generator=torch.Generator().manual_seed(3))
    cache = prefill(qwen3, ids, build_press("twinkv", compression_ratio=0.5))
    assert all(sum(row) == 2 * 128 for row in kv_bytes(cache)["tokens_per_head"])


@pytest.mark.parametrize(
    "opts",
    [
        {"scoring": "nope"},
        {"capacity": "nope"},
        {"threshold": 1.5},
        {"kernel_size": 6},
        {"block_size": 0},
        {"scoring": "value", "permute_seed": 11},
        {"decoding": True},
    ],
)
def test_bad_options_raise(opts):
    with pytest.raises(ValueError):
        build_press("twinkv", compression_ratio=0.5, **opts)


def test_recompression_of_a_compressed_cache_raises(llama):
    ids = torch.randint(0, 256, (1, 300), generator=torch.Generator().manual_seed(4))
    with pytest.raises(ValueError, match="whole prefix once"):
        prefill(llama, ids, build_press("twinkv", compression_ratio=0.5), chunk_size=150)
