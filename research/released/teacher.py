"""The released CORE teacher: raw-logit utility and the DRIVE fixed point (feature spec v3's teacher).

Source: GitHub ``zhutizi23-coder/CORE`` ``core/teacher.py`` (``DiversityAwareTeacher``) and ``core/config.py``
defaults; our own implementation of that specification.

**Utility.** Over every query ``t`` of the event (all prefill queries, or the last decode interval), the raw attention
logit ``a(t, h, i) = q_t^h · k_i · scaling`` is pooled over the query heads of each KV group ``m`` by TopMean (the mean
of the ``min(4, G)`` largest), and ``u_i = max_{t visible, m} TopMean_h a(t, h, i)``: a candidate is worth the strongest
logit any query of the event gives it. It is computed from the logits the features already stream
(:func:`research.released.features.qk_statistics` with ``with_utility=True``).

**DRIVE fixed point.** With the projected keys ``z_i`` of :class:`~research.released.geometry.KeyGeometry` centred once,
``x̄_i = z_i − mean_j z_j``, starting from uniform ``w``::

    Σ(w) = I + α Σ_i w_i x̄_i x̄_iᵀ,    h_i = α x̄_iᵀ Σ(w)⁻¹ x̄_i,    w ← softmax((u + β h) / τ)

for ``steps`` iterations (β = 128, α = 1, τ = 8, 8 iterations in the release), an approximate maximiser of
``Σ w_i u_i + β logdet Σ(w) − τ Σ w_i log w_i`` on the simplex. The distillation target is
``π_T ∝ w^{1/T}`` (``T = 1``: ``π_T = w``).

Shapes: H query heads, Hkv KV heads, G = H/Hkv, T queries, N candidates, D head dim, d_z projected dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from core_kv.config import check_on_init, option


@dataclass
class DriveConfig:
    """The DRIVE teacher's constants (release defaults); the ``teacher`` section of the recipe's options.

    Args:
        beta: Coverage weight β (``beta_coverage``).
        alpha: Covariance scale α (``alpha_coverage``).
        tau: Fixed-point temperature τ (``drive_temp``).
        steps: Fixed-point iterations (``teacher_n_iter``).
        temperature: Distillation temperature ``T`` applied after the fixed point (``teacher_temp``).
    """

    beta: float = option(128.0, ge=0)
    alpha: float = option(1.0, gt=0)
    tau: float = option(8.0, gt=0)
    steps: int = option(8, ge=1)
    temperature: float = option(1.0, gt=0)

    def __post_init__(self) -> None:
        check_on_init(self)


@torch.no_grad()
def drive_weights(z: torch.Tensor, utility: torch.Tensor, cfg: DriveConfig | None = None) -> torch.Tensor:
    """The DRIVE fixed point ``w`` (N,) from projected keys ``z`` (N, d_z) and utilities (N,), in float64.

    Candidates with ``u = −inf`` (seen by no query) get weight 0."""
    cfg = cfg or DriveConfig()
    x = z.double()
    x = x - x.mean(0, keepdim=True)  # fixed, unweighted centring
    u = utility.double()
    n, d = x.shape
    eye = torch.eye(d, dtype=torch.float64, device=x.device)
    w = torch.full((n,), 1.0 / n, dtype=torch.float64, device=x.device)
    for _ in range(cfg.steps):
        sigma = eye + cfg.alpha * (x.T * w) @ x  # (d_z, d_z)
        chol = torch.linalg.cholesky(sigma)
        sol = torch.cholesky_solve(x.T, chol)  # Σ⁻¹ x̄ᵀ (d_z, N)
        lev = cfg.alpha * (x * sol.T).sum(-1)
        w = torch.softmax((u + cfg.beta * lev) / cfg.tau, -1)
    return w


def teacher_distribution(weights: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``π_T ∝ w^{1/T}`` (zero weights stay zero), normalised."""
    w = weights.double()
    if temperature != 1.0:
        w = torch.softmax(w.clamp_min(1e-300).log() / temperature, -1) * (w > 0)
    return w / w.sum().clamp_min(1e-300)


@torch.no_grad()
def drive_teacher(z: torch.Tensor, utility: torch.Tensor, cfg: DriveConfig | None = None) -> torch.Tensor:
    """``π_T`` (N,) float64: the fixed point then the distillation temperature."""
    cfg = cfg or DriveConfig()
    return teacher_distribution(drive_weights(z, utility, cfg), cfg.temperature)


__all__ = ["DriveConfig", "drive_teacher", "drive_weights", "teacher_distribution"]
