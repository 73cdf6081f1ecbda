"""SnapKV: keep what the last queries of the prompt attend to (Li et al., 2024, "SnapKV: LLM Knows What You are
Looking for Before Generation", https://arxiv.org/abs/2404.14469; kvpress ``snapkv_press.py``).

The observation-window helpers it shares with PyramidKV, TOVA and Expected Attention are in
:mod:`core_kv.presses.window`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from core_kv.presses.base import ScorerPress
from core_kv.presses.window import head_lengths, window_attention


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
