"""kvpress's leaderboard ``expected_attention``: AdaKV head-wise budgets around ExpectedAttention with ε = 1e-2
(kvpress 0.5.5 ``evaluation/evaluate_registry.py``: ``AdaKVPress(ExpectedAttentionPress(epsilon=1e-2))``; papers:
https://arxiv.org/abs/2407.11550 and https://arxiv.org/abs/2510.00636)."""

from __future__ import annotations

from dataclasses import dataclass, field

from core_kv.presses.adakv import AdaKVPress
from core_kv.presses.base import ScorerPress
from core_kv.presses.expected_attention import ExpectedAttentionPress


@dataclass
class AdaKVExpectedAttentionPress(AdaKVPress, name="adakv_expected_attention"):
    """``AdaKVPress(ExpectedAttentionPress(epsilon=1e-2))`` under its own name, as kvpress's evaluation registry
    runs it; ``expected_attention`` alone is kvpress's class (ε = 0). Options as :class:`AdaKVPress`; another inner
    press may be given, but then use ``adakv`` instead."""

    press: ScorerPress | str = field(default_factory=lambda: ExpectedAttentionPress(epsilon=1e-2))
