"""H2O / observed attention: keep the heavy hitters of the prompt's own attention (Zhang et al., 2023, "H2O:
Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models", https://arxiv.org/abs/2306.14048;
kvpress ``observed_attention_press.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from core_kv.presses.base import ScorerPress


@dataclass
class H2OPress(ScorerPress, name="h2o"):
    """Observed attention, the prefix-only H2O adaptation of kvpress 0.5.5's ``ObservedAttentionPress``.

    As in the TwinKV paper (App. A.5): the causal attention the prefix pays to each key is summed over queries,
    normalized by the number of queries that can see the key, and averaged over the query heads of each KV head;
    no extra sink/recent reservation and no decoding-time eviction (the original H2O evicts online). Needs the
    attention weights, hence ``attn_implementation="eager"``.

    Deviation from kvpress: the visible-query count is ``min(T, S - j)`` for ``T`` new queries over ``S`` cached
    keys, which equals kvpress's ``S - j`` at prefill and stays correct for chunked prefill and decoding.
    """

    needs_attentions: ClassVar[bool] = True

    def score(self, module, hidden_states, keys, values, attentions, kwargs) -> torch.Tensor:
        if attentions is None:
            raise ValueError(
                "h2o scores from observed attention weights: load the model with attn_implementation='eager' "
                "(per-head ragged caches are read without weights, so h2o cannot re-score them)"
            )
        b, hkv, s, _ = keys.shape
        t = attentions.shape[2]
        scores = attentions.sum(2)  # (B, H, S)
        visible = (s - torch.arange(s, device=attentions.device)).clamp(max=t).to(attentions.dtype)
        scores = scores / visible
        return scores.view(b, hkv, -1, s).mean(2)  # (B, Hkv, S)
