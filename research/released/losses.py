"""The released recipe's boundary term and KL (GitHub ``zhutizi23-coder/CORE`` ``core/indexer.py``
``boundary_margin_loss``, ``core/train.py``): at every budget, the ``δ`` teacher ranks just inside the cut must
out-score the ``δ`` just outside by a margin; the KL leaves the protected sinks out.

Shapes: N candidates.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from core_kv.budget import kept_tokens
from core_kv.distill.losses import kl_to_teacher


def boundary_windows(
    p_teacher: torch.Tensor, budget: int, delta: int, eligible: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(P, N)`` index windows around the teacher's Top-``budget`` cut among the ``eligible`` candidates.

    The eligible candidates are ranked by ``p_teacher`` (N,) descending (stable: ties keep position order);
    ``P`` = ranks ``[budget − δ, budget)``, ``N`` = ranks ``[budget, budget + δ)`` (0-based). Both are empty when the
    budget keeps none or all of them."""
    idx = torch.arange(p_teacher.shape[-1], device=p_teacher.device)
    if eligible is not None:
        idx = idx[eligible.to(p_teacher.device).bool()]
    order = idx[p_teacher[idx].argsort(descending=True, stable=True)]
    if budget <= 0 or budget >= len(order):
        return order[:0], order[:0]
    return order[max(0, budget - delta) : budget], order[budget : budget + delta]


def pairwise_hinge(
    scores: torch.Tensor, pos: torch.Tensor, neg: torch.Tensor, margin: float = 0.5, temperature: float = 1.0
) -> torch.Tensor:
    """``mean_{p∈P, n∈N} relu(margin − (s_p − s_n)/τ)`` (0 when a window is empty)."""
    if len(pos) == 0 or len(neg) == 0:
        return scores.sum() * 0.0
    z = scores.float() / temperature
    return F.relu(margin - (z[pos][:, None] - z[neg][None, :])).mean()


def multi_budget_hinge(
    scores: torch.Tensor,
    p_teacher: torch.Tensor,
    ratios: list[float] | tuple[float, ...],
    sinks: int = 4,
    delta: int = 32,
    margin: float = 0.5,
    temperature: float = 1.0,
) -> torch.Tensor:
    """The boundary hinge averaged over every compression ratio at once (the release's all-budget supervision).

    For ratio ``r`` over ``n`` candidates the cache keeps ``B = floor(n (1 − r))`` (:func:`core_kv.budget.kept_tokens`,
    at least the ``sinks``); the first ``sinks`` positions are kept by rule, so the cut is at ``B − sinks`` among the
    others. Budgets whose windows are empty do not count in the mean.

    Args:
        scores: Student logits (N,) (with gradient).
        p_teacher: Teacher distribution (N,).
        ratios: Compression ratios (the release's {0.25, 0.5, 0.75, 0.9}).
        sinks, delta, margin, temperature: Protected prefix, window half-width δ, margin, student temperature τ_m.
    """
    n = scores.shape[-1]
    s = min(sinks, n)
    eligible = torch.ones(n, dtype=torch.bool, device=scores.device)
    eligible[:s] = False
    terms = []
    for r in ratios:
        b = max(s, kept_tokens(n, r)) - s
        pos, neg = boundary_windows(p_teacher, b, delta, eligible)
        if len(pos) and len(neg):
            terms.append(pairwise_hinge(scores, pos, neg, margin, temperature))
    return torch.stack(terms).mean() if terms else scores.sum() * 0.0


def masked_kl(p_teacher: torch.Tensor, scores: torch.Tensor, eligible: torch.Tensor, temperature: float = 1.0):
    """``KL(π_T ‖ softmax(s/τ))`` on the eligible candidates only (the release excludes the protected sinks), both
    distributions renormalised there."""
    p = p_teacher[eligible].float()
    return kl_to_teacher(p / p.sum().clamp_min(1e-30), scores[eligible] / temperature)


__all__ = ["boundary_windows", "masked_kl", "multi_budget_hinge", "pairwise_hinge"]
