"""``research/gemma_diagnosis.py``: the teacher's allocation served as a press keeps exactly its Top-B (with the
protected positions), and the rank correlation against the textbook formula."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from core_kv.budget import budget_split, protected_mask, top_free
from research.gemma_diagnosis import TargetPress, spearman
from research.retention_audit import kept_positions
from tests.helpers import ids, tiny_model


def test_target_press_keeps_the_top_b_of_its_targets():
    """One-shot prefill with :class:`TargetPress`: every layer keeps the protected sinks / recent window plus the
    Top-(B − protected) positions of the given targets (``core_kv.budget.top_free``, the teacher's selection rule)."""
    model = tiny_model("llama")
    x = ids()
    n = x.shape[1]
    hkv = model.config.num_key_value_heads
    gen = torch.Generator().manual_seed(3)
    targets = {i: torch.rand(hkv, n, generator=gen) for i in range(model.config.num_hidden_layers)}
    ratio, sinks, recent = 0.75, 4, 8
    press = TargetPress(compression_ratio=ratio, protected_sinks=sinks, protected_recent=recent, targets=targets)
    with torch.no_grad():
        full = DynamicCache()
        model.model(input_ids=x, past_key_values=full)
        cache = DynamicCache()
        with press(model):
            model.model(input_ids=x, past_key_values=cache)
    kept = kept_positions(cache, [layer.keys for layer in full.layers])
    b, s, w = budget_split(n, ratio, sinks, recent)
    prot = protected_mask(n, s, w)
    for layer, heads in enumerate(kept):
        want = top_free(targets[layer], prot, b - int(prot.sum()))
        for h, got in enumerate(heads):
            assert got == set(want[h].nonzero().flatten().tolist()), (layer, h)


def test_spearman_against_the_rank_difference_formula():
    a = torch.tensor([0.3, 2.0, -1.0, 5.0, 0.1])
    b = torch.tensor([1.0, 3.0, 0.0, 2.0, -4.0])
    # ranks by hand: a -> [2, 3, 0, 4, 1], b -> [2, 4, 1, 3, 0]; d = [0, -1, -1, 1, 1]: 1 - 6 * 4 / (5 * 24) = 0.8
    assert abs(spearman(a, b) - 0.8) < 1e-12
    assert abs(spearman(a, a) - 1.0) < 1e-12 and abs(spearman(a, -a) + 1.0) < 1e-12
