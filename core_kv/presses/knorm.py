"""KNorm: keep keys with the smallest L2 norm (Devoto et al., 2024, "A Simple and Effective L2 Norm-Based
Strategy for KV Cache Compression"; kvpress ``knorm_press.py``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from core_kv.presses.base import ScorerPress


@dataclass
class KnormPress(ScorerPress, name="knorm"):
    """Score ``-||k||_2`` on post-RoPE keys, as kvpress 0.5.5."""

    def score(self, module, hidden_states, keys, values, attentions, kwargs) -> torch.Tensor:
        return -keys.norm(dim=-1)  # (B, Hkv, S)
