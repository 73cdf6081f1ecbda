"""SnapKV: keep what the last queries of the prompt attend to (Li et al., 2024, "SnapKV: LLM Knows What You are
Looking for Before Generation", https://arxiv.org/abs/2404.14469; kvpress ``snapkv_press.py``).

Also home of the observation-window helpers shared by PyramidKV and TOVA.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from core_kv.models.attention import apply_rope, prerope_queries
from core_kv.presses.base import ScorerPress


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
    _, hkv, s, d = keys.shape
    groups = module.config.num_attention_heads // hkv
    cos, sin = position_embeddings
    q = prerope_queries(module, hidden_states[:, -window:])  # (B, H, w, D)
    q = apply_rope(module, q, (cos[:, -window:], sin[:, -window:]))
    k = keys.repeat_interleave(groups, dim=1)  # (B, H, S, D)
    attn = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(d)  # (B, H, w, S)
    last = lengths[:, None] - window + torch.arange(window, device=keys.device)[None]  # (Hkv, w)
    hidden = torch.arange(s, device=keys.device)[None, None] > last.repeat_interleave(groups, 0)[..., None]
    attn = attn.masked_fill(hidden[None], float("-inf"))
    return F.softmax(attn, dim=-1, dtype=torch.float32).to(q.dtype)


@dataclass
class SnapKVPress(ScorerPress, name="snapkv"):
    """SnapKV (https://arxiv.org/abs/2404.14469), kvpress 0.5.5 defaults.

    The last ``window_size`` queries are recomputed with RoPE and attend causally to every key; their attention
    is averaged over the window, smoothed by ``avg_pool1d(kernel_size)`` (zero padding), averaged over the query
    heads of each KV head (GQA), and the window itself is kept by scoring it ``max + 1``.

    Deviations from kvpress: the window shrinks to ``min(window_size, new tokens, length - 1)`` instead of
    asserting on short inputs (chunked prefill, decode-time eviction); the window attention is always recomputed
    (kvpress reuses eager attention weights when given; the values agree to float rounding); a right-padded ragged
    cache is masked per head. RoPE is applied by the family's own function, so Phi3's partial rotary is exact.

    Args:
        window_size: observation window (last queries of the prompt).
        kernel_size: width of the average pooling over key positions.
    """

    window_size: int = 64
    kernel_size: int = 5

    def validate(self) -> None:
        super().validate()
        if self.window_size < 1 or self.kernel_size < 1 or self.kernel_size % 2 == 0:
            raise ValueError(
                f"window_size must be >= 1 and kernel_size odd, got {self.window_size}, {self.kernel_size}"
            )

    def score(self, module, hidden_states, keys, values, attentions, kwargs) -> torch.Tensor:
        b, hkv, s, _ = keys.shape
        groups = module.config.num_attention_heads // hkv
        lengths = head_lengths(module, keys, kwargs)
        w = max(1, min(self.window_size, hidden_states.shape[1], int(lengths.min()) - 1))
        attn = window_attention(module, hidden_states, keys, w, kwargs["position_embeddings"], lengths)
        pos = torch.arange(s, device=keys.device)
        outside = pos[None] >= (lengths - w)[:, None]  # (Hkv, S): window and padding
        scores = attn.mean(dim=-2).masked_fill(outside.repeat_interleave(groups, 0)[None], 0.0)  # (B, H, S)
        # zeros beyond the window reproduce kvpress's zero padding of the truncated sequence
        scores = F.avg_pool1d(scores, kernel_size=self.kernel_size, padding=self.kernel_size // 2, stride=1)
        scores = scores.view(b, hkv, groups, s).mean(2)  # (B, Hkv, S)
        top = scores.masked_fill(outside[None], float("-inf")).max().item() + 1
        return scores.masked_fill(outside[None], top)
