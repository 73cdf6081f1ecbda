"""CORE's learned indexer (CORE.md stage 2; paper Table 9).

The indexer is ``Linear(14,128) → GELU → Linear(128,128) → GELU → Linear(128,1)`` [paper Table 9], one per layer,
shared by that layer's KV heads, plus a per-(layer, KV head) bias [choice]. Its inputs are the 14 features of
:mod:`core_kv.features`, standardised with the teacher data's statistics. One calibrated distribution serves both
channels [paper]: ``p = softmax(s / T_l)`` over the candidates of an event; the retention channel is Top-B of ``p``
(invariant to ``T_l``), the mass channel is the excluded mass ``ε̂ = Σ_{i∈E} p_i`` and the conditional weights
``p_i / ε̂`` that drive the memory writes (:mod:`core_kv.memory`).

The whole artifact (indexer + memory + geometry + config), :class:`~core_kv.core_model.CoreModel`, is in
:mod:`core_kv.core_model`.

Shapes: L layers, Hkv KV heads, N candidates, F = 14 features.
"""

from __future__ import annotations

import torch
from torch import nn

from core_kv.features import NUM_FEATURES, FeatureStats

HIDDEN = 128  # [paper Table 9]


def indexer_mlp() -> nn.Sequential:
    """``14 → 128 → 128 → 1`` with GELU [paper Table 9]: 18,561 parameters."""
    return nn.Sequential(
        nn.Linear(NUM_FEATURES, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, 1)
    )


class CoreIndexer(nn.Module):
    """The per-layer indexer MLPs, per-head biases and temperatures, with the feature statistics.

    Args:
        num_layers: L.
        num_kv_heads: Hkv.
    """

    def __init__(self, num_layers: int, num_kv_heads: int):
        super().__init__()
        self.layers = nn.ModuleList(indexer_mlp() for _ in range(num_layers))
        self.head_bias = nn.Parameter(torch.zeros(num_layers, num_kv_heads))
        self.register_buffer("temperature", torch.ones(num_layers))  # fitted by calibration (stage 3)
        self.register_buffer("feature_mean", torch.zeros(num_layers, num_kv_heads, NUM_FEATURES))
        self.register_buffer("feature_std", torch.ones(num_layers, num_kv_heads, NUM_FEATURES))

    def set_feature_stats(self, stats: FeatureStats) -> None:
        if stats.mean.shape != self.feature_mean.shape:
            raise ValueError(f"feature stats {tuple(stats.mean.shape)} vs indexer {tuple(self.feature_mean.shape)}")
        self.feature_mean.copy_(stats.mean)
        self.feature_std.copy_(stats.std)

    def feature_stats(self) -> FeatureStats:
        return FeatureStats(self.feature_mean.clone(), self.feature_std.clone())

    def standardize(self, layer: int, features: torch.Tensor, heads: torch.Tensor | None = None) -> torch.Tensor:
        """``(x − μ) / σ`` for raw features (Hkv, N, F) (or (n, N, F) of the KV heads ``heads``)."""
        mu, sd = self.feature_mean[layer], self.feature_std[layer]
        if heads is not None:
            mu, sd = mu[heads], sd[heads]
        return (features.float() - mu[:, None]) / sd[:, None]

    def scores(self, layer: int, features: torch.Tensor, heads: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``s`` (Hkv, N) from raw (un-standardised) features (Hkv, N, F)."""
        x = self.standardize(layer, features, heads)
        bias = self.head_bias[layer] if heads is None else self.head_bias[layer, heads]
        return self.layers[layer](x).squeeze(-1) + bias[:, None]

    def distribution(self, layer: int, scores: torch.Tensor, calibrated: bool = True) -> torch.Tensor:
        """``p = softmax(s / T_l)`` (Hkv, N); ``calibrated=False`` uses T = 1."""
        t = self.temperature[layer] if calibrated else scores.new_ones(())
        return (scores.float() / t).softmax(-1)

    def forward(self, layer: int, features: torch.Tensor) -> torch.Tensor:
        return self.scores(layer, features)


__all__ = ["CoreIndexer", "indexer_mlp"]
