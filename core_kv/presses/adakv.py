"""AdaKV: head-wise budgets by a global top-k across the KV heads of a layer (Feng et al., 2024, "Ada-KV:
Optimizing KV Cache Eviction by Adaptive Budget Allocation for Efficient LLM Inference",
https://arxiv.org/abs/2407.11550; kvpress ``adakv_press.py``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from core_kv.presses.base import ScorerPress, WrapperPress

POOLS = ("score", "output")


@dataclass
class AdaKVPress(WrapperPress, ScorerPress, name="adakv"):
    """AdaKV (https://arxiv.org/abs/2407.11550) around any scorer press, kvpress 0.5.5 defaults.

    The inner ``press`` scores; this press compares the scores across the KV heads of a layer and keeps ``Hkv *
    n_kept`` positions in total (``n_kept`` the inner press's budget): every head first keeps its top ``max(1,
    int(alpha_safeguard * n_kept))`` positions, then the globally lowest scores across all heads of the layer are
    evicted. The inner press's protected positions stay. The per-head index lists are stored physically (a ragged
    cache: each head's tokens contiguous, nothing padded), so the memory saving is real and attention is exact; later
    events (chunked prefill, ``decoding=True``) re-score the ragged cache and keep ``Hkv * n_kept`` again.

    What the heads compete on (``pool``):

    - ``score``: the inner press's :meth:`~core_kv.presses.base.ScorerPress.pooled_scores` (its scores; CORE's
      scorer: its calibrated distribution ``p``, which sums to 1 per head);
    - ``output``: ``(q_i + pool_epsilon) · ‖v_i‖`` with ``q`` those pooled scores — ExpectedAttention's formula
      (https://arxiv.org/abs/2510.00636; kvpress ``(attention + ε) · ‖v‖``), the output an entry carries, so heads
      whose values are larger keep more. Meant for a scorer whose pooled scores are an attention distribution (CORE's
      ``p``): "value-aware head pooling", a deviation from both papers measured on SmolLM2 (docs/method.md).

    Deviations from kvpress: kvpress keeps the full cache and hides evicted keys behind "fake keys" inside a
    patched attention function (no memory saved, not eager-compatible); here they are removed, and eager models
    work, so the inner press may be ``h2o``. With ``alpha_safeguard=0`` a head still keeps one token (an empty head
    cannot be attended); kvpress's safeguard is otherwise identical. The budget may also be absolute (``budget``).

    ``build_press("adakv", press="expected_attention", compression_ratio=0.5)`` is kvpress's leaderboard
    ``"expected_attention"``. The budget is the inner press's, held once (kvpress style,
    ``AdaKVPress(ExpectedAttentionPress(0.5))``): ``press.compression_ratio`` reads and writes the inner press's.

    Args:
        press: the scorer, as a ``ScorerPress`` instance or a registered name (built with its defaults).
        alpha_safeguard: fraction of each head's average budget it keeps whatever the other heads score.
        pool: what the heads compete on, ``score`` or ``output`` (above).
        pool_epsilon: ε of ``pool="output"`` (kvpress's leaderboard AdaKV(ExpectedAttention) uses 1e-2).
    """

    press: ScorerPress | str = "expected_attention"
    alpha_safeguard: float = 0.2
    pool: str = "score"
    pool_epsilon: float = 0.01

    compress = ScorerPress.compress  # score (the inner's, pooled) -> protect -> select (head-wise)

    def validate(self) -> None:
        super().validate()
        if not isinstance(self.press, ScorerPress) or isinstance(self.press, AdaKVPress):
            raise ValueError(f"adakv wraps a scorer press (name or ScorerPress), got {self.press!r}")
        a = self.alpha_safeguard
        if not isinstance(a, (int, float)) or isinstance(a, bool) or math.isnan(a) or not 0.0 <= a <= 1.0:
            raise ValueError(f"alpha_safeguard must be in [0, 1], got {a!r}")
        if self.pool not in POOLS:
            raise ValueError(f"adakv: pool must be one of {POOLS}, got {self.pool!r}")
        e = self.pool_epsilon
        if isinstance(e, bool) or not isinstance(e, (int, float)) or not e >= 0:
            raise ValueError(f"adakv: pool_epsilon must be >= 0, got {e!r}")

    def score(self, module, hidden_states, keys, values, attentions, kwargs) -> torch.Tensor:
        scores = self.press.score(module, hidden_states, keys, values, attentions, kwargs)
        pooled = self.press.pooled_scores(module, scores)
        if self.pool == "output":
            pooled = (pooled.float() + self.pool_epsilon) * values.float().norm(dim=-1)
        return pooled

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
    kvpress's (``masked_key_indices``), so ties resolve identically.
    """
    hkv, s = scores.shape
    scores = scores.clone()
    padding = scores == float("-inf")
    n_safe = min(s, max(1, int(n_kept * alpha_safeguard)))
    top = scores.topk(n_safe, dim=-1).indices
    scores.scatter_(-1, top, torch.finfo(scores.dtype).max)  # safeguard (protected stay +inf)
    scores.masked_fill_(padding, float("-inf"))  # a short head's padding is never safeguarded
    n_pruned = max(0, hkv * (s - n_kept))
    keep = scores.reshape(-1) != float("-inf")
    if n_pruned:
        keep[torch.topk(-scores.reshape(-1), n_pruned).indices] = False
    return keep.view(hkv, s)
