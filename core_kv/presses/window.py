"""Observation-window helpers shared by the attention-scored presses (SnapKV, PyramidKV, TOVA, Expected Attention):
valid lengths per KV head and the causal attention of the last queries over the cache. No press is registered here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from core_kv.models.attention import apply_rope, attention_logits, prerope_queries


def head_lengths(module, keys: torch.Tensor, kwargs: dict) -> torch.Tensor:
    """Valid tokens per KV head ``(Hkv,)``: ``kwargs["kv_lengths"]`` from the framework, else all of ``keys``."""
    lengths = kwargs.get("kv_lengths")
    if lengths is not None:
        return lengths.to(keys.device)
    return torch.full((keys.shape[1],), keys.shape[2], device=keys.device, dtype=torch.long)


def window_attention(
    module, hidden_states: torch.Tensor, keys: torch.Tensor, window: int, position_embeddings, lengths: torch.Tensor
) -> torch.Tensor:
    """Causal attention of the last ``window`` queries over the cached keys, ``(B, H, window, S)`` (kvpress's
    ``compute_window_attention`` without dropping the window columns).

    Queries are recomputed from ``hidden_states`` (pre-RoPE projection, q_norm, the family's RoPE at the window's
    positions). Query ``i`` of KV head ``h`` sees keys ``j <= lengths[h] - window + i``: the new tokens are the
    last entries of every head's valid prefix, so a right-padded ragged cache is masked exactly.
    """
    _, hkv, s, _ = keys.shape
    groups = module.config.num_attention_heads // hkv
    cos, sin = position_embeddings
    q = prerope_queries(module, hidden_states[:, -window:])  # (B, H, w, D)
    q = apply_rope(module, q, (cos[:, -window:], sin[:, -window:]))
    k = keys.repeat_interleave(groups, dim=1)  # (B, H, S, D)
    attn = attention_logits(module, q, k)  # (B, H, w, S): the model's scale (and softcap, Gemma 2)
    last = lengths[:, None] - window + torch.arange(window, device=keys.device)[None]  # (Hkv, w)
    hidden = torch.arange(s, device=keys.device)[None, None] > last.repeat_interleave(groups, 0)[..., None]
    attn = attn.masked_fill(hidden[None], float("-inf"))
    return F.softmax(attn, dim=-1, dtype=torch.float32).to(q.dtype)
