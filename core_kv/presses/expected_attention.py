"""Expected attention: score keys by the attention that future queries are expected to pay them (Devoto et al.,
2025, "Expected Attention: KV Cache Compression by Estimating Attention from Future Queries Distribution",
https://arxiv.org/abs/2510.00636; kvpress ``expected_attention_press.py``)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from core_kv.models.attention import attention_scale, layer_rotary, prerope_queries
from core_kv.presses.base import ScorerPress
from core_kv.presses.window import head_lengths


@dataclass
class ExpectedAttentionPress(ScorerPress, name="expected_attention"):
    """Expected attention (https://arxiv.org/abs/2510.00636), kvpress 0.5.5 defaults.

    1. Mean ``mu`` and covariance ``Sigma`` of the pre-RoPE queries of the prompt, without the first ``n_sink``.
    2. Both rotated by the RoPE matrix averaged over the next ``n_future_positions`` positions.
    3. ``softmax_j(k_j . mu / sqrt(d) + k_j^T Sigma k_j / (2 d))`` over keys, averaged over the query heads of each
       KV head, then ``(score + epsilon) * ||v_j||`` if ``use_vnorm``; the sinks are kept (``max + 1``).

    ``epsilon`` defaults to 0, kvpress's class default. kvpress's evaluation registry runs
    ``AdaKVPress(ExpectedAttentionPress(epsilon=1e-2))`` under the name ``expected_attention``; that variant is
    registered here as ``adakv_expected_attention``.

    Deviations from kvpress's ``ExpectedAttentionPress``:

    - The future positions start after the last position of the current forward (``position_ids``), which is
      kvpress's ``q_len`` at prefill and stays right for chunked prefill and decode-time eviction.
    - Fewer than ``n_sink + 1`` new queries (decoding) use all of them; padding of a ragged cache is masked out of
      the softmax; Phi3's partial rotary rotates only the rotary dimensions (kvpress's matrix assumes full RoPE).
    - The logit scale is the model's own (``module.scaling``: ``query_pre_attn_scalar ** -0.5`` for Gemma; kvpress
      divides by ``sqrt(d)``, the same number for every other family), and the RoPE is the layer's own (Gemma 3's
      global layers rotate with base 1M). A logit softcap (Gemma 2) has no closed form under the Gaussian
      expectation and is not applied.

    Args:
        n_future_positions: future positions the RoPE rotation is averaged over.
        n_sink: initial tokens excluded from the statistics and always kept.
        use_covariance: include the query covariance term.
        use_vnorm: rescale by the value norm.
        epsilon: added to the attention before the value-norm rescaling.
    """

    n_future_positions: int = 512
    n_sink: int = 4
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0

    _rotary: Callable | None = field(default=None, init=False, repr=False, compare=False)  # layer_rotary(model)

    def validate(self) -> None:
        super().validate()
        if self.n_future_positions < 1 or self.n_sink < 0:
            raise ValueError(
                f"need n_future_positions >= 1 and n_sink >= 0, got {self.n_future_positions}, {self.n_sink}"
            )

    def on_enter(self, model: nn.Module) -> None:
        self._rotary = layer_rotary(model)

    def _avg_rope(self, module, mu: torch.Tensor, cov: torch.Tensor | None, start: int):
        """Rotate ``mu`` ``(B, H, D)`` and ``cov`` ``(B, H, D, D)`` by RoPE averaged over ``start...+n_future``."""
        if self._rotary is None:
            raise ValueError("expected_attention must be used as a context manager (`with press(model):`)")
        d = module.head_dim
        position_ids = torch.arange(start, start + self.n_future_positions, device=mu.device)[None]
        cos, sin = self._rotary(module, mu, position_ids)
        cos, sin = cos[0], sin[0]  # (n, r): r = rotary dims (= d unless partial rotary)
        r = cos.shape[-1]
        eye = torch.eye(r, device=cos.device, dtype=cos.dtype)
        perm = torch.zeros((r, r), device=cos.device, dtype=cos.dtype)
        perm[r // 2 :, : r // 2], perm[: r // 2, r // 2 :] = torch.eye(r // 2), -torch.eye(r // 2)
        rot = (cos.unsqueeze(1) * eye + sin.unsqueeze(1) * perm).mean(dim=0)  # (r, r)
        if r < d:
            full = torch.eye(d, device=cos.device, dtype=cos.dtype)
            full[:r, :r] = rot
            rot = full
        mu = torch.matmul(mu, rot.T)
        if cov is not None:
            cov = torch.matmul(rot, torch.matmul(cov, rot.T))
        return mu, cov

    def score(self, module, hidden_states, keys, values, attentions, kwargs) -> torch.Tensor:
        b, hkv, s, d = keys.shape
        groups = module.config.num_attention_heads // hkv
        n_sink = min(self.n_sink, s - 1)
        t = hidden_states.shape[1]
        position_ids = kwargs.get("position_ids")
        start = int(position_ids[0, -1]) + 1 if position_ids is not None else t

        h = hidden_states[:, self.n_sink :] if t > self.n_sink else hidden_states
        q = prerope_queries(module, h)  # (B, H, T', D)
        mu = q.mean(dim=2, keepdim=True)
        cov = None
        if self.use_covariance:
            centered = q - mu
            cov = torch.einsum("bnsi,bnsj->bnij", centered, centered) / h.shape[1]  # (B, H, D, D)
        mu, cov = self._avg_rope(module, mu.squeeze(2), cov, start)

        k = keys[:, :, n_sink:].repeat_interleave(groups, dim=1).transpose(2, 3)  # (B, H, D, S')
        scale = attention_scale(module)  # the model's q·k factor: 1/sqrt(d), or query_pre_attn_scalar^-1/2 (Gemma)
        if scale == d**-0.5:  # kvpress's expressions, bit for bit
            scores = torch.matmul(mu.unsqueeze(2), k).squeeze(2) / math.sqrt(d)  # (B, H, S')
            if self.use_covariance:
                scores += torch.einsum("bhin, bhij, bhjn->bhn", k, cov, k) / d / 2
        else:
            scores = torch.matmul(mu.unsqueeze(2), k).squeeze(2) * scale
            if self.use_covariance:
                scores += torch.einsum("bhin, bhij, bhjn->bhn", k, cov, k) * (scale * scale / 2)
        lengths = head_lengths(module, keys, kwargs)
        pad = torch.arange(n_sink, s, device=keys.device)[None] >= lengths[:, None]  # (Hkv, S')
        if pad.any():
            scores = scores.masked_fill(pad.repeat_interleave(groups, 0)[None], float("-inf"))
        scores = F.softmax(scores, dim=-1)
        scores = scores.view(b, hkv, groups, s - n_sink).mean(dim=2)  # (B, Hkv, S')
        if self.use_vnorm:
            scores = (scores + self.epsilon) * values[:, :, n_sink:].norm(dim=-1)
        return F.pad(scores, (n_sink, 0), value=scores.max().item() + 1)
