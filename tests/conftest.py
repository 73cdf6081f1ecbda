"""Shared fixtures: tiny models built from config (no downloads), offline environment."""

from __future__ import annotations

import os

import pytest
import torch

from core_kv.models.tiny import tiny_lm

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(min(2, torch.get_num_threads()))


def tiny_model(family: str = "llama", attn: str = "sdpa", seed: int = 0):
    """A 2-layer GQA model (4 query heads, 2 KV heads) of the given family, random weights, eval mode."""
    return tiny_lm(family, seed, attn)


@pytest.fixture(scope="session")
def llama():
    return tiny_model("llama")


@pytest.fixture(scope="session")
def qwen3():
    return tiny_model("qwen3")


def record_core_kept(press, layers) -> dict[int, list[torch.Tensor]]:
    """Wrap ``press``'s CORE scorer so that every eviction event of ``layers`` appends the kept positions
    ``(Hkv, k)`` the scorer holds after it; returns the (filling) record."""
    kept: dict[int, list[torch.Tensor]] = {layer: [] for layer in layers}
    scorer, evicted = press.scorer, press.scorer.evicted

    def recording(module, *args):
        evicted(module, *args)
        kept[module.layer_idx].append(scorer._layers[module.layer_idx].pos.clone())

    scorer.evicted = recording
    return kept


def masked_full_cache_logits(model, family_module, cache, keep, question, positions) -> torch.Tensor:
    """The reference for a compressed cache: ``question``'s logits over the full ``cache`` with each KV head's
    evicted keys masked out in eager attention. ``keep`` maps a layer index to its ``(Hkv, S)`` boolean mask of kept
    positions (the question's included); other layers run the model's own eager attention (sliding windows too)."""
    import torch.nn.functional as F

    from core_kv.models.cache import cache_kwarg

    eager = family_module.eager_attention_forward

    def masked_eager(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        if module.layer_idx not in keep:
            return eager(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
        groups = query.shape[1] // key.shape[1]
        k, v = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
        logits = query @ k.transpose(2, 3) * scaling  # (1, H, T, S)
        t, s = logits.shape[-2:]
        visible = keep[module.layer_idx][:, :s].repeat_interleave(groups, 0)[None, :, None]
        visible = visible & (torch.arange(s)[None, :] <= (s - t + torch.arange(t))[:, None])[None, None]
        out = F.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1) @ v
        return out.transpose(1, 2).contiguous(), None

    implementation = model.config._attn_implementation
    try:
        family_module.eager_attention_forward = masked_eager
        model.config._attn_implementation = "eager"
        with torch.inference_mode():
            return model(input_ids=question, position_ids=positions, **{cache_kwarg(model): cache}).logits
    finally:
        family_module.eager_attention_forward = eager
        model.config._attn_implementation = implementation
