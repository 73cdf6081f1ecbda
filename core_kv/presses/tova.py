"""TOVA: keep what the last token attends to, averaged over all heads (Oren et al., 2024, "Transformers are
Multi-State RNNs", https://arxiv.org/abs/2401.06104; kvpress ``tova_press.py``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from core_kv.presses.base import ScorerPress
from core_kv.presses.window import head_lengths, window_attention


@dataclass
class TOVAPress(ScorerPress, name="tova"):
    """TOVA (https://arxiv.org/abs/2401.06104), as kvpress 0.5.5.

    The last token's (recomputed, RoPE'd) attention over the cache, averaged over *all* query heads and shared by
    every KV head; the last token itself is kept (scored ``max + 1``), as kvpress does.

    Deviation from kvpress: on a right-padded ragged cache (decode-time eviction after a per-head press) positions
    do not line up across heads, so the average runs over each KV head's own query heads instead.
    """

    def score(self, module, hidden_states, keys, values, attentions, kwargs) -> torch.Tensor:
        b, hkv, s, _ = keys.shape
        groups = module.config.num_attention_heads // hkv
        lengths = head_lengths(module, keys, kwargs)
        attn = window_attention(module, hidden_states, keys, 1, kwargs["position_embeddings"], lengths)[:, :, 0]
        if bool((lengths == s).all()):
            scores = attn.mean(1, keepdim=True).repeat(1, hkv, 1)  # (B, Hkv, S)
        else:
            scores = attn.view(b, hkv, groups, s).mean(2)
        last = torch.arange(s, device=keys.device)[None] >= (lengths - 1)[:, None]  # (Hkv, S): last token, padding
        top = scores.masked_fill(last[None], float("-inf")).max().item() + 1
        return scores.masked_fill(last[None], top)
