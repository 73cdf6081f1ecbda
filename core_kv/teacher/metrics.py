"""The paper's teacher diagnostics: Table 5 (solver residuals, Top-B agreement) and Table 7 (set quality).

Budgets follow the press convention (:mod:`core_kv.presses.base`): ``B = floor(N (1 − ratio))`` tokens per head,
the first ``sinks`` and last ``recent`` candidates protected inside B. Every selector keeps the protected tokens and
chooses the other ``B' = B − protected`` among the rest; Top-B agreement is measured on those ``B'`` free picks,
where selectors can actually differ [choice].

Set quality [choice; the paper does not define its U_B, C_B]: for a retained set S with |S| = B,

    U_B(S) = Σ_{i∈S} π_U,i                 utility captured (future attention mass kept)
    C_B(S) = F_cov(1_S / B) = logdet(I + βB/B Σ_{i∈S} Φ_i Φ_iᵀ)   coverage of the uniform allocation on S
    J_B = U_B + C_B

with the teacher's normalised ``βB``. ``J_B`` is monotone submodular, so the greedy maximiser (:func:`greedy_select`)
is within ``1 − 1/e`` of the best set and is the reference upper line of Table 7.

Shapes: H heads (batch), N candidates, M prototypes.
"""

from __future__ import annotations

import torch

from core_kv.budget import top_free
from core_kv.nystrom import coverage_logdet


def residual(p: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """``e = ½‖p − ref‖₁`` (H,)."""
    return 0.5 * (p.double() - ref.double()).abs().sum(-1)


def free_overlap(p: torch.Tensor, ref: torch.Tensor, protected: torch.Tensor, b_free: int) -> torch.Tensor:
    """Share of the ``b_free`` free picks of ``p`` that ``ref`` also picks (H,)."""
    a, b = top_free(p, protected, b_free), top_free(ref, protected, b_free)
    return ((a & b & ~protected).sum(-1).double()) / max(b_free, 1)


def set_quality(mask: torch.Tensor, pi_u: torch.Tensor, phi: torch.Tensor, beta_b: torch.Tensor):
    """``(U_B, C_B)`` (H,) of retained masks (H, N)."""
    m = mask.double()
    u = (pi_u.double() * m).sum(-1)
    c = coverage_logdet(m / m.sum(-1, keepdim=True), phi.double(), beta_b.double())
    return u, c


def greedy_select(
    pi_u: torch.Tensor, phi: torch.Tensor, beta_b: torch.Tensor, protected: torch.Tensor, b_free: int
) -> torch.Tensor:
    """Greedy maximiser of ``J_B = U_B + C_B`` over sets of size ``B = protected + b_free`` -> mask (H, N).

    Gains of adding i: ``π_i + log(1 + β Φ_iᵀ A_S⁻¹ Φ_i)``, with ``β = βB / B``; ``A_S⁻¹`` and the quadratic forms
    are kept up to date by Sherman–Morrison, O(N·M) per pick.
    """
    pi, phi = pi_u.double(), phi.double()
    h, n, m_dim = phi.shape
    budget = int(protected.sum()) + b_free
    beta = (beta_b.double() / budget)[:, None]  # (H, 1)
    mask = protected.expand(h, n).clone()
    a = torch.eye(m_dim, dtype=torch.float64).expand(h, m_dim, m_dim).clone()
    a = a + beta[..., None] * (phi.mT * mask.double()[:, None]) @ phi
    c_inv = torch.linalg.inv(a)  # (H, M, M)
    quad = (phi * (phi @ c_inv)).sum(-1)  # (H, N) Φ_iᵀ A⁻¹ Φ_i
    rows = torch.arange(h)
    for _ in range(b_free):
        gain = (pi + torch.log1p(beta * quad)).masked_fill(mask, float("-inf"))
        j = gain.argmax(-1)  # (H,)
        mask[rows, j] = True
        w = (c_inv @ phi[rows, j][..., None]).squeeze(-1)  # (H, M) A⁻¹ Φ_j
        denom = 1.0 + beta * quad[rows, j][:, None]  # (H, 1)
        r = phi @ w[..., None]  # (H, N, 1)
        quad = quad - beta * r.squeeze(-1).pow(2) / denom
        c_inv = c_inv - (beta / denom)[..., None] * w[:, :, None] * w[:, None, :]
    return mask
