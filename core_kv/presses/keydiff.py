"""KeyDiff: keep keys that differ most from the mean key direction (Park et al., 2025, "KeyDiff: Key Similarity-Based
KV Cache Eviction for Long-Context LLM Inference in Resource-Constrained Environments",
https://arxiv.org/abs/2504.15364; kvpress ``keydiff_press.py``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from core_kv.presses.base import ScorerPress


@dataclass
class KeyDiffPress(ScorerPress, name="keydiff"):
    """KeyDiff (https://arxiv.org/abs/2504.15364), as kvpress 0.5.5: score ``-cos(k, mean(normalize(k)))``.

    Like kvpress (and the TwinKV baseline, App. A.5) this is the one-shot per-prefix scorer, not the paper's
    block-iterative eviction. Zero-padded rows of a ragged cache only rescale the anchor, which cosine ignores.
    """

    def score(self, module, hidden_states, keys, values, attentions, kwargs) -> torch.Tensor:
        anchor = F.normalize(keys, p=2, dim=-1).mean(dim=2, keepdim=True)  # (B, Hkv, 1, D)
        return -F.cosine_similarity(keys, anchor, dim=-1)  # (B, Hkv, S)
