"""AdaKV: head-wise budgets by a global top-k across the KV heads of a layer (Feng et al., 2024, "Ada-KV:
Optimizing KV Cache Eviction by Adaptive Budget Allocation for Efficient LLM Inference",
https://arxiv.org/abs/2407.11550; kvpress ``adakv_press.py``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from core_kv.presses.base import ScorerPress, build_press


@dataclass
class AdaKVPress(ScorerPress, name="adakv"):
    """AdaKV (https://arxiv.org/abs/2407.11550) around any scorer press, kvpress 0.5.5 defaults.

    The inner ``press`` only scores (this press's :meth:`score` is its score, :meth:`select` the per-head budgets
    below). The layer keeps ``Hkv * n_kept`` positions in total (``n_kept`` from this
    wrapper's ``compression_ratio``/``budget``): every head first keeps its top ``max(1, int(alpha_safeguard *
    n_kept))`` positions, then the globally lowest scores across all heads of the layer are evicted. The
    resulting per-head index lists are stored physically by the framework (a ragged cache: each head's tokens
    contiguous, nothing padded), so the memory saving is real and attention is exact.

    Deviations from kvpress: kvpress keeps the full cache and hides evicted keys behind "fake keys" inside a
    patched attention function (no memory saved, not eager-compatible); here they are removed, and eager models
    work, so the inner press may be ``h2o``. With ``alpha_safeguard=0`` a head still keeps one token (an empty head
    cannot be attended); kvpress's safeguard is otherwise identical. The budget may also be absolute (``budget``).

    ``build_press("adakv", press="expected_attention", compression_ratio=0.5)`` is kvpress's leaderboard
    ``"expected_attention"``. An inner press given with its own ``compression_ratio``/``budget`` (kvpress style,
    ``AdaKVPress(ExpectedAttentionPress(0.5))``) lends it to the wrapper when the wrapper has none.

    Args:
        press: the scorer, as a ``ScorerPress`` instance or a registered name (built with its defaults).
        alpha_safeguard: fraction of each head's average budget it keeps whatever the other heads score.
    """

    press: ScorerPress | str = "expected_attention"
    alpha_safeguard: float = 0.2

    def validate(self) -> None:
        if isinstance(self.press, str):
            self.press = build_press(self.press)
        if not isinstance(self.press, ScorerPress) or isinstance(self.press, AdaKVPress):
            raise ValueError(f"adakv wraps a scorer press (name or ScorerPress), got {self.press!r}")
        inner = self.press
        if self.compression_ratio == 0.0 and self.budget is None:  # kvpress style: the budget is on the inner press
            self.compression_ratio, self.budget = inner.compression_ratio, inner.budget
        elif (inner.compression_ratio, inner.budget) not in ((0.0, None), (self.compression_ratio, self.budget)):
            raise ValueError("give the budget on the adakv wrapper or on its inner press, not different ones on both")
        super().validate()
        a = self.alpha_safeguard
        if not isinstance(a, (int, float)) or isinstance(a, bool) or math.isnan(a) or not 0.0 <= a <= 1.0:
            raise ValueError(f"alpha_safeguard must be in [0, 1], got {a!r}")

    @property
    def needs_attentions(self) -> bool:  # type: ignore[override]
        return self.press.needs_attentions

    def on_enter(self, model: nn.Module) -> None:
        self.press.share_state(self.layer_state)  # the inner press sees the wrapper's per-layer bookkeeping
        self.press.on_enter(model)

    def score(self, module, hidden_states, keys, values, attentions, kwargs) -> torch.Tensor:
        return self.press.score(module, hidden_states, keys, values, attentions, kwargs)

    def select(self, scores: torch.Tensor, n_kept: int, module: nn.Module, kwargs: dict) -> list[torch.Tensor]:
        """Per-head sorted kept indices; their counts sum to ``Hkv * n_kept`` (fewer only if a head runs out)."""
        b, hkv, s = scores.shape
        if b != 1:
            raise ValueError("adakv stores per-head budgets for batch size 1")
        keep = adaptive_keep(scores[0], n_kept, self.alpha_safeguard)
        return [keep[h].nonzero().flatten() for h in range(hkv)]


def adaptive_keep(scores: torch.Tensor, n_kept: int, alpha_safeguard: float) -> torch.Tensor:
    """AdaKV's head-wise allocation of one layer: the kept mask ``(Hkv, S)`` for scores ``(Hkv, S)``.

    Every head keeps its top ``max(1, int(alpha_safeguard * n_kept))``; then the ``Hkv * (S - n_kept)`` globally
    lowest scores of the layer are evicted, so ``Hkv * n_kept`` are kept in all (fewer only where scores are
    ``-inf``: a ragged cache's padding counts as pruned). ``+inf`` (protected) positions stay. The bottom-k is
    kvpress's (``masked_key_indices``), so ties resolve identically. Shared by :class:`AdaKVPress` and CORE's
    ``head_budgets="adaptive"``.
    """
    hkv, s = scores.shape
    scores = scores.clone()
    n_safe = min(s, max(1, int(n_kept * alpha_safeguard)))
    top = scores.topk(n_safe, dim=-1).indices
    scores.scatter_(-1, top, torch.finfo(scores.dtype).max)  # safeguard (protected stay +inf)
    n_pruned = max(0, hkv * (s - n_kept))
    keep = scores.reshape(-1) != float("-inf")
    if n_pruned:
        keep[torch.topk(-scores.reshape(-1), n_pruned).indices] = False
    return keep.view(hkv, s)


def keep_top_per_head(scores: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The kept mask ``(Hkv, S)`` that keeps each head's top ``counts[h]`` by ``scores`` (``+inf`` first): given
    head budgets, the head's own ranking picks its set (CORE's ``head_pool="split"``)."""
    rank = scores.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)
    return rank < counts.to(rank.device)[:, None]
