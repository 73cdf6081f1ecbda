"""StreamingLLM: attention sinks plus a recent window (Xiao et al., 2024, "Efficient Streaming Language Models with
Attention Sinks", https://arxiv.org/abs/2309.17453; kvpress ``streaming_llm_press.py``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from core_kv.presses.base import ScorerPress


@dataclass
class StreamingLLMPress(ScorerPress, name="streaming_llm"):
    """StreamingLLM (https://arxiv.org/abs/2309.17453), kvpress 0.5.5 defaults: keep the first ``n_sink`` tokens and
    the most recent ones, evict the middle. Original RoPE positions are kept (kvpress issue #158).

    Deviation from kvpress (scores only, not the kept set): kvpress scores 1 everywhere except 0 on
    ``[n_sink, n_sink + n_pruned)``, which encodes the ratio in the score. Here the score is the position
    (sinks above everything), a rank-equivalent form that is correct for any budget, per-layer target or
    decode-time eviction; the top-``n_kept`` set is identical to kvpress's.

    Args:
        n_sink: number of initial tokens always kept.
    """

    n_sink: int = 4

    def validate(self) -> None:
        super().validate()
        if isinstance(self.n_sink, bool) or not isinstance(self.n_sink, int) or self.n_sink < 0:
            raise ValueError(f"n_sink must be a non-negative integer, got {self.n_sink!r}")

    def score(self, module, hidden_states, keys, values, attentions, kwargs) -> torch.Tensor:
        b, hkv, s, _ = keys.shape
        pos = torch.arange(s, device=keys.device, dtype=torch.float32)
        scores = torch.where(pos < self.n_sink, float(s + 1), pos)  # sinks first, then recency
        return scores.expand(b, hkv, s).clone()
