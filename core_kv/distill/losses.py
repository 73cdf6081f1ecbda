"""Losses, calibration and metrics of CORE stages 2–4 (CORE.md; indexmem_core.md §3.4, §3.5, §3.7).

- :func:`kl_to_teacher`: ``KL(p* ‖ softmax(s))`` per (head), the distillation loss [CORE.md stage 2].
- :func:`topb_boundary_bce`: the optional Top-B boundary term ``BCE(σ(s − τ_B), 1[i ∈ TopB(p*)])``, ``τ_B`` midway
  between the B-th and (B+1)-th largest free logits (stop-gradient) [choice, indexmem_core.md §3.4].
- :func:`memory_loss`: ``‖ô − o*‖² / ‖o*‖²`` + ``μ_g BCE(g, α_E)`` [CORE.md stage 4].
- :func:`excluded_mass`, :func:`fit_temperature`, :func:`calibration_error`: stage 3, one temperature per layer
  so the excluded mass ``ε̂`` matches the true evicted attention mass ``α`` (CORE.md stage 3).
- :func:`topb_overlap`: share of the free Top-B picks the student shares with the teacher.
- :func:`shared_view`: the head-shared targets and scores (``selection: shared``): the teacher allocation pooled
  over a layer's KV heads and the student's pooled distribution, the quantity ``head_shared`` ranks at inference;
  every loss above then applies to the pooled row [choice: issue 56; the release trains head-shared scores, anchors
  §5].

Shapes: Hkv heads (or any batch of rows), N candidates, H query heads, T queries, D head dim.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from core_kv.budget import top_free

LOGIT_CLIP = 1e-4  # ε̂ and α are clipped to [1e-4, 1 − 1e-4] before the logit


def kl_to_teacher(p_star: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """``KL(p* ‖ softmax(s)) = Σ_i p*_i (log p*_i − log_softmax(s)_i)`` per row: (.., N) -> (..)."""
    p = p_star.float()
    logq = F.log_softmax(scores.float(), -1)
    return (torch.xlogy(p, p) - torch.where(p > 0, p * logq, torch.zeros_like(logq))).sum(-1)


def topb_boundary_bce(p_star: torch.Tensor, scores: torch.Tensor, protected: torch.Tensor, b_free: int) -> torch.Tensor:
    """Mean BCE over free candidates of ``σ(s − τ_B)`` against membership in the teacher's free Top-B (..)."""
    free = ~protected
    if b_free <= 0 or b_free >= int(free.sum()):
        return scores.new_zeros(scores.shape[:-1])
    target = top_free(p_star.float(), protected, b_free) & free  # (.., N)
    s = scores.float()
    tau = s.masked_fill(protected, float("-inf")).topk(b_free + 1, dim=-1).values[..., -2:].mean(-1).detach()
    bce = F.binary_cross_entropy_with_logits(s - tau[..., None], target.float(), reduction="none")
    return (bce * free).sum(-1) / free.sum()


def shared_view(p_star: torch.Tensor, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Head-shared targets and scores over one layer's KV heads (dim −2): ``(p̄*, log q̄)``, each (.., 1, N).

    ``p̄* = (1/Hkv) Σ_h p*_h`` is the teacher allocation pooled over the heads, and ``log q̄ = log (1/Hkv) Σ_h
    softmax(s_h)`` the student's pooled distribution: what :class:`~core_kv.presses.head_shared.HeadSharedPress`
    ranks (the mean of the per-head distributions; before calibration the temperature is 1). ``log q̄`` is already
    normalised, so ``kl_to_teacher(p̄*, log q̄) = KL(p̄* ‖ q̄)`` and the boundary BCE ranks the served score.
    """
    hkv = scores.shape[-2]
    log_q = torch.logsumexp(F.log_softmax(scores.float(), -1), dim=-2, keepdim=True) - math.log(hkv)
    return p_star.float().mean(-2, keepdim=True), log_q


def excluded_mass(scores: torch.Tensor, evicted: torch.Tensor, temperature: float | torch.Tensor = 1.0):
    """``ε̂ = Σ_{i∈E} softmax(s / T)_i`` per row (..)."""
    p = (scores.float() / temperature).softmax(-1)
    return (p * evicted).sum(-1)


def _logit(x: torch.Tensor) -> torch.Tensor:
    x = x.double().clamp(LOGIT_CLIP, 1 - LOGIT_CLIP)
    return (x / (1 - x)).log()


def calibration_error(eps_hat: torch.Tensor, alpha: torch.Tensor) -> float:
    """Mean ``|α − ε̂|`` over events (the mass-calibration error CORE.md stage 3 reports)."""
    return float((alpha.double() - eps_hat.double()).abs().mean()) if alpha.numel() else float("nan")


def fit_temperature(
    scores: list[torch.Tensor],
    evicted: list[torch.Tensor],
    alpha: list[torch.Tensor],
    log_t_range: tuple[float, float] = (-4.0, 4.0),
    grid: int = 161,
    refine: int = 40,
) -> tuple[float, dict]:
    """Temperature ``T`` minimising ``Σ_e (logit ε̂_e(T) − logit α_e)²`` over the events of one layer.

    A grid over ``log T`` brackets the minimum, then golden-section search refines it (ε̂ is monotone in T for a
    fixed ranking, and the loss is unimodal in practice) [choice: CORE.md stage 3, "1-D search on log T"].

    Args:
        scores: Per event, logits (Hkv, N_e).
        evicted: Per event, evicted masks (Hkv, N_e).
        alpha: Per event, true evicted masses (Hkv,).

    Returns:
        ``(T, {"before": err at T = 1, "after": err at T, "n": events·heads})`` with mean ``|α − ε̂|`` errors.
    """
    if not scores:
        return 1.0, {"before": float("nan"), "after": float("nan"), "n": 0}
    target = _logit(torch.cat([a.reshape(-1) for a in alpha]))
    n_max = max(s.shape[-1] for s in scores)
    pad = lambda x, v: F.pad(x.reshape(-1, x.shape[-1]), (0, n_max - x.shape[-1]), value=v)  # noqa: E731
    s_all = torch.cat([pad(s.float(), float("-inf")) for s in scores])  # (rows, N_max), padding never wins
    e_all = torch.cat([pad(e.float(), 0.0) for e in evicted])

    def eps_at(log_t: float) -> torch.Tensor:
        return ((s_all / math.exp(log_t)).softmax(-1) * e_all).sum(-1)

    def loss(log_t: float) -> float:
        return float((_logit(eps_at(log_t)) - target).pow(2).sum())

    xs = torch.linspace(*log_t_range, grid).tolist()
    vals = [loss(x) for x in xs]
    i = min(range(grid), key=vals.__getitem__)
    lo, hi = xs[max(i - 1, 0)], xs[min(i + 1, grid - 1)]
    r = (math.sqrt(5) - 1) / 2
    a, b = hi - r * (hi - lo), lo + r * (hi - lo)
    fa, fb = loss(a), loss(b)
    for _ in range(refine):
        if fa < fb:
            hi, b, fb = b, a, fa
            a = hi - r * (hi - lo)
            fa = loss(a)
        else:
            lo, a, fa = a, b, fb
            b = lo + r * (hi - lo)
            fb = loss(b)
    best = min([(vals[i], xs[i]), (fa, a), (fb, b)])[1]
    alphas = torch.cat([x.reshape(-1) for x in alpha])
    stats = {
        "before": calibration_error(eps_at(0.0), alphas),
        "after": calibration_error(eps_at(best), alphas),
        "n": int(alphas.numel()),
    }
    return math.exp(best), stats


def topb_overlap(scores: torch.Tensor, p_star: torch.Tensor, protected: torch.Tensor, b_free: int) -> torch.Tensor:
    """Share of the ``b_free`` free picks of the student that the teacher also picks, per row (..)."""
    a = top_free(scores.float(), protected, b_free)
    b = top_free(p_star.float(), protected, b_free)
    return (a & b & ~protected).sum(-1).double() / max(b_free, 1)


def memory_loss(
    o_hat: torch.Tensor, o_full: torch.Tensor, gate: torch.Tensor, alpha: torch.Tensor, gate_weight: float = 0.1
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, relative error)``: mean over queries of ``‖ô − o*‖² / (‖o*‖² + 1e-6)`` plus ``μ_g BCE(g, α)``.

    Args:
        o_hat: Compensated outputs (H, T, D).
        o_full: Full-cache outputs (H, T, D).
        gate: Gate values in (0, 1) (H, T).
        alpha: True evicted attention mass (H, T).
        gate_weight: μ_g.
    """
    rel = (o_hat - o_full.float()).pow(2).sum(-1) / (o_full.float().pow(2).sum(-1) + 1e-6)  # (H, T)
    bce = F.binary_cross_entropy(gate.clamp(1e-6, 1 - 1e-6), alpha.float().clamp(0, 1), reduction="none")
    return rel.mean() + gate_weight * bce.mean(), rel.mean().detach()


def relative_error(o: torch.Tensor, o_full: torch.Tensor) -> torch.Tensor:
    """Mean over queries of ``‖o − o*‖² / (‖o*‖² + 1e-6)``."""
    return ((o.float() - o_full.float()).pow(2).sum(-1) / (o_full.float().pow(2).sum(-1) + 1e-6)).mean()
