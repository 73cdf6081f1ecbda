"""The teacher allocation ``p* = argmax_p −KL(p‖π_U) + λ F_cov(p)`` by damped mirror ascent (CORE.md stage 1, step 3).

The objective is strictly concave on the simplex, so ``p*`` is unique; its stationarity condition is the fixed point
``log p = log π_U + λ ℓ(p) − const`` (ℓ the ridge leverage, :func:`core_kv.nystrom.leverage`). The solver
iterates, from ``p⁽⁰⁾ = π_U``,

    log p⁽ʳ⁺¹⁾ = (1 − η) log p⁽ʳ⁾ + η (log π_U + λ ℓ(p⁽ʳ⁾)) − log-normaliser,

for ``R0 = 8`` steps [paper Table 5]. The undamped map (η = 1) oscillates (indexmem_core.md §3.2(d)).

Step size. The Jacobian of the map ``x ↦ log π_U + λ ℓ(softmax x)`` is ``−λ (K∘K)(diag p − ppᵀ)`` with
``K = βB Φ A⁻¹ Φᵀ``: a product of two PSD matrices, so its eigenvalues are real and lie in ``[−a, 0]`` with
``a ≤ λ max_i Σ_j p_j K_ij²``. A damped step contracts by ``max(|1 − η|, |1 − η(1 + a)|)``, which
``η = 2 / (2 + a)`` minimises (rate ``a / (2 + a)``). ``eta="auto"`` [choice] takes that step with ``a`` bounded
at the current iterate; a fixed ``eta=0.5`` is the design's default and diverges once ``a > 2``.
The evidence for the default is in ``docs/method.md`` (Teacher section).

Everything is computed in float64 (one M×M Cholesky per step; the residuals of Table 5 reach 1e-12).

Shapes: ``...`` leading batch dims (KV heads), N candidates, M prototypes.
"""

from __future__ import annotations

import torch

from core_kv.nystrom import leverage, leverage_and_curvature, normalised_beta_b

TINY = 1e-30


def solve_allocation(
    pi_u: torch.Tensor,
    phi: torch.Tensor,
    lam: float,
    steps: int = 8,
    eta: float | str = "auto",
    beta_b: torch.Tensor | None = None,
    record: tuple[int, ...] = (),
) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Teacher allocation after ``steps`` damped mirror-ascent steps.

    Args:
        pi_u: Query utility ``π_U`` (..., N), non-negative; normalised here.
        phi: Nyström coverage features ``Φ`` (..., N, M).
        lam: Coverage weight λ ≥ 0. ``λ = 0`` returns ``π_U`` exactly (the utility-only teacher).
        steps: Iterations R (R0 = 8 in the paper).
        eta: Damping η in (0, 1], or ``"auto"`` for the contraction-optimal step (module docstring).
        beta_b: ``βB`` (...); defaults to the normalised ``1 / mean‖Φ‖²``.
        record: Iteration counts r ≤ ``steps`` whose iterates ``p⁽ʳ⁾`` are returned too (r = 0 is ``π_U``).

    Returns:
        ``(p, {r: p⁽ʳ⁾})``, float64, each summing to 1 over the last dim.
    """
    if lam < 0:
        raise ValueError(f"lam must be >= 0, got {lam}")
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    if isinstance(eta, str) and eta != "auto" or not isinstance(eta, str) and not 0.0 < eta <= 1.0:
        raise ValueError(f"eta must be in (0, 1] or 'auto', got {eta!r}")
    pi = pi_u.double().clamp_min(0.0)
    pi = pi / pi.sum(-1, keepdim=True).clamp_min(TINY)
    history: dict[int, torch.Tensor] = {}
    if 0 in record:
        history[0] = pi
    if lam == 0.0:  # the fixed point is π_U itself: return it bit for bit
        for r in record:
            history[r] = pi
        return pi, history
    phi = phi.double()
    beta_b = normalised_beta_b(phi) if beta_b is None else beta_b.double()
    log_pi = pi.clamp_min(TINY).log()
    log_p = log_pi
    for r in range(1, steps + 1):
        p = log_p.exp()
        if eta == "auto":
            lev, curv = leverage_and_curvature(p, phi, beta_b)
            a = lam * curv.amax(-1, keepdim=True)
            step = 2.0 / (2.0 + a)
        else:
            lev, step = leverage(p, phi, beta_b), eta
        log_p = (1 - step) * log_p + step * (log_pi + lam * lev)
        log_p = log_p - log_p.logsumexp(-1, keepdim=True)
        if r in record:
            history[r] = log_p.exp()
    return log_p.exp(), history


def objective(p: torch.Tensor, pi_u: torch.Tensor, phi: torch.Tensor, lam: float, beta_b=None) -> torch.Tensor:
    """``−KL(p‖π_U) + λ F_cov(p)`` (...), for tests and diagnostics."""
    from core_kv.nystrom import coverage_logdet

    p, pi, phi = p.double(), pi_u.double(), phi.double()
    beta_b = normalised_beta_b(phi) if beta_b is None else beta_b.double()
    kl = (p * (p.clamp_min(TINY).log() - pi.clamp_min(TINY).log())).sum(-1)
    return -kl + lam * coverage_logdet(p, phi, beta_b)
