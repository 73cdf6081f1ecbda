"""TwinKV repair pass (``../shared/papers/001_e5fc3a72c13765dd.txt`` §3.4): reference, budget, no-op, wrapping."""

from __future__ import annotations

import pytest
import torch

from core_kv.models.cache import kv_bytes
from core_kv.pipeline import prefill
from core_kv.presses import PRESSES, build_press
from core_kv.presses.twin_repair import TwinRepairPress, best_twin, naive_best_twin, repair

INNER = "snapkv" if "snapkv" in PRESSES else "knorm"


def clustered_keys(n: int, d: int = 16, seed: int = 0) -> torch.Tensor:
    """``(n, d)``: two thirds of the keys near one of 10 directions (twins), the rest unique."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(10, d, generator=g)[torch.randint(10, (n,), generator=g)]
    unique = torch.rand(n, generator=g) < 0.33
    keys[unique] = torch.randn(int(unique.sum()), d, generator=g)
    return keys + 0.05 * torch.randn(n, d, generator=g)


@pytest.mark.parametrize("block", [1, 50, 512])
@pytest.mark.parametrize("kept", [0, 1, 37, 300])
def test_best_twin_matches_naive(block, kept):
    keys = clustered_keys(300)
    retained = torch.randperm(300, generator=torch.Generator().manual_seed(kept))[:kept].sort().values
    b = best_twin(keys, retained, 32, block)
    ref = naive_best_twin(keys, retained, 32)
    assert torch.allclose(b, ref, atol=1e-5)
    if kept == 0:
        assert bool((b == -1).all())


def test_repair_swaps_most_severe_pairs():
    n = 200
    g = torch.Generator().manual_seed(0)
    keys = torch.nn.functional.normalize(torch.randn(n, 64, generator=g), dim=-1)
    keys[150] = keys[100]  # 100 and 150 retained twins (b = 1): donors
    keys[120] = 0.9 * keys[80] + 0.1 * keys[5]  # 120 retained, near twin of evicted 80: b_120 < 1 unless 80 kept
    retained = torch.tensor([0, 1, 100, 120, 150, 190, 199])
    out = repair(keys, retained, threshold=0.85, local_window=32, sinks=2, recent=2)
    assert out.numel() == retained.numel()
    b = naive_best_twin(keys, retained, 32)
    donors = [j for j in retained.tolist() if 2 <= j < n - 2 and b[j] >= 0.85]
    assert sorted(donors) == [100, 150]
    orphans = sorted((i for i in range(n) if i not in retained.tolist() and b[i] < 0.85), key=lambda i: (b[i], i))
    expected = (set(retained.tolist()) - {100, 150}) | set(orphans[:2])
    assert set(out.tolist()) == expected
    assert out.tolist() == sorted(out.tolist())


def test_redundancy_consistent_selection_is_unchanged():
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        keys = torch.randn(400, 64, generator=g)
        keys[200:] = keys[:200]  # every evicted i >= 200 has its twin i - 200 retained; retained keys are distinct
        retained = torch.arange(200)
        assert torch.equal(repair(keys, retained), retained)


def test_budget_exact_on_random_selections():
    keys = clustered_keys(500)
    for seed in range(5):
        retained = torch.randperm(500, generator=torch.Generator().manual_seed(seed))[:120]
        out = repair(keys, retained)
        assert out.numel() == 120 and out.unique().numel() == 120
        kept_protected = {int(j) for j in retained if j < 4 or j >= 500 - 64}
        assert kept_protected <= set(out.tolist())  # protected positions are never donated


def test_wraps_by_name_with_same_budget(llama):
    ids = torch.randint(0, 256, (1, 300), generator=torch.Generator().manual_seed(0))
    press = build_press("twin_repair", press=INNER, compression_ratio=0.75)
    assert type(press.press) is PRESSES[INNER] and press.press.compression_ratio == 0.75
    alone = kv_bytes(prefill(llama, ids, build_press(INNER, compression_ratio=0.75)))
    repaired = kv_bytes(prefill(llama, ids, press))
    assert repaired["tokens_per_head"] == alone["tokens_per_head"]
    assert repaired["total"] == alone["total"]
    assert press.config_dict()["press"]["name"] == INNER


def test_wraps_per_head_budgets(llama):
    ids = torch.randint(0, 256, (1, 400), generator=torch.Generator().manual_seed(1))
    alone = kv_bytes(prefill(llama, ids, build_press("twinkv", compression_ratio=0.5)))
    inner = build_press("twinkv", compression_ratio=0.5)
    repaired = kv_bytes(prefill(llama, ids, TwinRepairPress(press=inner, threshold=0.90)))
    assert repaired["tokens_per_head"] == alone["tokens_per_head"]
    assert len(set(alone["tokens_per_head"][0] + alone["tokens_per_head"][1])) > 1  # really ragged


def test_options():
    inner = build_press("knorm", compression_ratio=0.5)
    assert TwinRepairPress(press=inner).compression_ratio == 0.5
    with pytest.raises(ValueError):
        TwinRepairPress(press=inner, compression_ratio=0.25)
    with pytest.raises(ValueError):
        build_press("twin_repair", press="nope", compression_ratio=0.5)
    with pytest.raises(ValueError):
        build_press("twin_repair", press="knorm", compression_ratio=0.5, threshold=2.0)
    p = build_press("twin_repair", press="knorm", budget=64, press_options={"protected_sinks": 2})
    assert p.press.budget == 64 and p.press.protected_sinks == 2
