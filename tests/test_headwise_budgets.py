"""Head-wise (AdaKV) budgets everywhere (issue 43 item 2): around every scorer press and CORE's scorer, under
chunked prefill and decode-time eviction, on a ragged cache that is re-scored at every event.

At every event each layer keeps exactly ``Hkv · B`` entries in all (B the event's per-head budget), the stored bytes
are exactly those entries, and with a single event the result is the one-shot prefill's.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from core_kv.models.cache import cache_kwarg, kv_bytes, layer_lengths
from core_kv.pipeline import greedy_answer, prefill
from core_kv.presses import PRESSES, ScorerPress, build_press
from core_kv.presses import base as press_base
from core_kv.presses.adakv import AdaKVPress
from tests.helpers import N, fit_tiny_artifact, ids

SCORERS = sorted(
    name for name, cls in PRESSES.items()
    if issubclass(cls, ScorerPress) and not cls.needs_attentions
    and name not in ("adakv", "adakv_expected_attention")
    and cls.__module__.startswith("core_kv.")  # the product's; research/ plugins test their own presses
)  # fmt: skip

HEAD_SHARED = {"streaming_llm", "tova"}  # scores shared by every KV head: AdaKV's split stays even


@pytest.fixture(scope="module")
def core_path(tmp_path_factory, llama):
    path = tmp_path_factory.mktemp("core") / "final"
    fit_tiny_artifact(llama, seed=0).save_pretrained(path)
    return path


def headwise(name: str, core_path, **budget) -> AdaKVPress:
    options = {"checkpoint": str(core_path)} if name == "core_scorer" else {}
    return AdaKVPress(press=build_press(name, **options), **budget)


def spy_events():
    """Record (layer, kept count per head) of every event through the one physical-eviction function."""
    events, apply = [], press_base.BasePress._apply

    def spy(cache, idx, keys, values, kept):
        heads = kept[0] if isinstance(kept, torch.Tensor) else kept
        events.append((idx, [int(h.numel()) for h in heads]))
        return apply(cache, idx, keys, values, kept)

    return events, apply, spy


@pytest.mark.parametrize("name", SCORERS)
def test_chunked_prefill_keeps_exact_totals_on_a_ragged_cache(name, llama, core_path):
    press = headwise(name, core_path, compression_ratio=0.75)
    events, apply, spy = spy_events()
    press_base.BasePress._apply = staticmethod(spy)
    try:
        cache = prefill(llama, ids(), press, chunk_size=48)
    finally:
        press_base.BasePress._apply = staticmethod(apply)
    seen = {0: 0, 1: 0}
    chunks = [48, 48, 48, 48, 8]
    assert len(events) == 2 * len(chunks)
    for i, (layer, counts) in enumerate(events):
        seen[layer] = sum(chunks[: i // 2 + 1])
        assert sum(counts) == 2 * int(seen[layer] * 0.25), (name, i)  # Hkv · floor(t_e (1 − r)), exactly
    if name not in HEAD_SHARED:
        assert any(len(set(c)) > 1 for _, c in events), name  # the heads' budgets did differ: the cache was ragged
    per_head = kv_bytes(cache)["tokens_per_head"]
    assert [sum(h) for h in per_head] == [2 * 50, 2 * 50]
    d = llama.config.hidden_size // llama.config.num_attention_heads
    assert kv_bytes(cache)["total"] == sum(sum(h) for h in per_head) * 2 * d * 4  # bytes of exactly those entries
    answer = greedy_answer(llama, cache, N, ids(5, seed=2), 3, press, eos_token_ids=[])
    assert len(answer) == 3 and kv_bytes(cache)["tokens_per_head"] == per_head


@pytest.mark.parametrize("name", SCORERS)
def test_decode_time_eviction_keeps_exact_totals_on_a_ragged_cache(name, llama, core_path):
    budget, slack, steps = 40, 6, 21
    press = headwise(name, core_path, budget=budget, decoding=True, decoding_slack=slack)
    events, apply, spy = spy_events()
    cache, key = DynamicCache(), cache_kwarg(llama)
    press_base.BasePress._apply = staticmethod(spy)
    try:
        with torch.inference_mode(), press(llama):
            llama(input_ids=ids(100), use_cache=True, **{key: cache})
            token = ids(1, seed=4)
            for step in range(steps):
                out = llama(input_ids=token, position_ids=torch.tensor([[100 + step]]), use_cache=True, **{key: cache})
                token = out.logits[:, -1:].argmax(-1)
                for layer in cache.layers:  # between events the average head grows by one token a step
                    assert int(layer_lengths(layer).sum()) <= 2 * (budget + slack), (name, step)
    finally:
        press_base.BasePress._apply = staticmethod(apply)
    assert len(events) == 2 * (1 + steps // (slack + 1))  # prefill + one event every slack + 1 steps, per layer
    for layer, counts in events:
        assert sum(counts) == 2 * budget, (name, layer, counts)


@pytest.mark.parametrize("name", ["snapkv", "knorm", "core_scorer"])
def test_one_event_equals_the_one_shot_prefill(name, llama, core_path):
    """A chunk as long as the context is one event: the same cache as the one-shot prefill, bit for bit."""
    caches = [prefill(llama, ids(), headwise(name, core_path, compression_ratio=0.6), chunk) for chunk in (None, N)]
    assert kv_bytes(caches[0]) == kv_bytes(caches[1])
    for a, b in zip(caches[0].layers, caches[1].layers, strict=True):
        ka, kb = a.padded()[0] if hasattr(a, "padded") else a.keys, b.padded()[0] if hasattr(b, "padded") else b.keys
        torch.testing.assert_close(ka, kb, rtol=0, atol=0)
