"""Log-determinant coverage on Nyström prototype features (CORE.md stage 1, step 2; indexmem_core.md §3.2(b)).

With the 64 fixed prototypes ``c_1..c_M`` as landmarks of an RBF kernel ``κ(x, y) = exp(-γ‖x − y‖²)`` on the
projected keys, a candidate's coverage feature is ``Φ_i = K_mm^{-1/2} κ(z_i, c_·) ∈ R^M`` and

    F_cov(p) = logdet(I_M + βB Σ_i p_i Φ_i Φ_iᵀ),        βB = 1 / mean_i ‖Φ_i‖²   (the normalised β)

is concave in ``p``; its gradient is the ridge leverage score ``ℓ_i(p) = βB Φ_iᵀ A(p)^{-1} Φ_i`` with
``A(p) = I + βB Σ_j p_j Φ_j Φ_jᵀ``: one M×M Cholesky factorisation plus an N×M product.

[choice] With the design's ``β = 1/(B · mean‖Φ‖²)`` the product ``βB`` does not depend on ``B``, so the
allocation is budget-free and one teacher solve serves every compression ratio (only Top-B depends on B). Every
function here takes the product ``beta_b`` directly.

Shapes: ``...`` leading batch dims (e.g. KV heads), N candidates, M prototypes (64), d_z projected-key dim.
"""

from __future__ import annotations

import torch


def rbf(z: torch.Tensor, prototypes: torch.Tensor, gamma: torch.Tensor | float) -> torch.Tensor:
    """``κ(z_i, c_j) = exp(-γ‖z_i − c_j‖²)``: ``z`` (..., N, d_z), ``prototypes`` (..., M, d_z) -> (..., N, M)."""
    d2 = (z.pow(2).sum(-1, keepdim=True) + prototypes.pow(2).sum(-1).unsqueeze(-2)) - 2 * z @ prototypes.mT
    gamma = torch.as_tensor(gamma, dtype=z.dtype, device=z.device)
    return torch.exp(-gamma[..., None, None] * d2.clamp_min(0.0))


def kmm_inverse_sqrt(prototypes: torch.Tensor, gamma: torch.Tensor | float, jitter: float = 1e-4) -> torch.Tensor:
    """``(K_mm + jitter·I)^{-1/2}`` (..., M, M), symmetric, computed in float64 by eigendecomposition."""
    k = rbf(prototypes.double(), prototypes.double(), torch.as_tensor(gamma).double())
    eye = torch.eye(k.shape[-1], dtype=k.dtype, device=k.device)
    evals, evecs = torch.linalg.eigh(k + jitter * eye)
    inv_sqrt = (evecs * evals.clamp_min(jitter).rsqrt().unsqueeze(-2)) @ evecs.mT
    return inv_sqrt.to(prototypes.dtype)


def nystrom_features(
    z: torch.Tensor, prototypes: torch.Tensor, gamma: torch.Tensor | float, kmm_inv_sqrt: torch.Tensor
) -> torch.Tensor:
    """``Φ = κ(z, c) K_mm^{-1/2}``: (..., N, d_z) -> (..., N, M)."""
    return rbf(z, prototypes, gamma) @ kmm_inv_sqrt


def normalised_beta_b(phi: torch.Tensor) -> torch.Tensor:
    """``βB = 1 / mean_i ‖Φ_i‖²`` per leading index: (..., N, M) -> (...)."""
    return 1.0 / phi.pow(2).sum(-1).mean(-1).clamp_min(1e-12)


def _gram(p: torch.Tensor, phi: torch.Tensor, beta_b: torch.Tensor) -> torch.Tensor:
    """``A(p) = I + βB Φᵀ diag(p) Φ`` (..., M, M)."""
    eye = torch.eye(phi.shape[-1], dtype=phi.dtype, device=phi.device)
    return eye + beta_b[..., None, None] * (phi.mT * p.unsqueeze(-2)) @ phi


def coverage_logdet(p: torch.Tensor, phi: torch.Tensor, beta_b: torch.Tensor) -> torch.Tensor:
    """``F_cov(p) = logdet A(p)``: ``p`` (..., N), ``phi`` (..., N, M), ``beta_b`` (...) -> (...)."""
    return torch.linalg.slogdet(_gram(p, phi, beta_b))[1]


def _inverse_gram(p: torch.Tensor, phi: torch.Tensor, beta_b: torch.Tensor) -> torch.Tensor:
    """``A(p)^{-1}`` (..., M, M) through a Cholesky factorisation (A is SPD)."""
    return torch.cholesky_inverse(torch.linalg.cholesky(_gram(p, phi, beta_b)))


def leverage(p: torch.Tensor, phi: torch.Tensor, beta_b: torch.Tensor) -> torch.Tensor:
    """``∇_p F_cov = βB Φ_iᵀ A(p)^{-1} Φ_i`` (ridge leverage scores): -> (..., N)."""
    proj = phi @ _inverse_gram(p, phi, beta_b)  # (..., N, M) rows Φ_iᵀ A⁻¹
    return beta_b[..., None] * (proj * phi).sum(-1)


def leverage_and_curvature(
    p: torch.Tensor, phi: torch.Tensor, beta_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Leverage ``ℓ_i`` and the row sums ``g_i = Σ_j p_j K_ij²`` of the leverage Jacobian (K = βB Φ A⁻¹ Φᵀ).

    ``g_i = βB Φ_iᵀ A⁻¹ (A − I) A⁻¹ Φ_i = ℓ_i − βB ‖A⁻¹ Φ_i‖²`` bounds the spectral radius of ``(K∘K) diag(p)``
    by ``max_i g_i``; the solver uses it to pick a step that contracts (see :mod:`core_kv.teacher.solver`).
    """
    proj = phi @ _inverse_gram(p, phi, beta_b)  # (..., N, M)
    lev = beta_b[..., None] * (proj * phi).sum(-1)
    return lev, lev - beta_b[..., None] * proj.pow(2).sum(-1)
