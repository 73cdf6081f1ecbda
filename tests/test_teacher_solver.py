"""The teacher allocation solver and coverage term against naive references (CORE.md stage 1; paper Table 5)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from core_kv.budget import budget_split, protected_mask
from core_kv.nystrom import coverage_logdet, kmm_inverse_sqrt, leverage, normalised_beta_b, nystrom_features
from core_kv.teacher.metrics import greedy_select, set_quality
from core_kv.teacher.solver import objective, solve_allocation


def _problem(seed: int, h: int = 2, n: int = 40, m: int = 8, d: int = 6, sharp: float = 2.0):
    g = torch.Generator().manual_seed(seed)
    z = torch.nn.functional.normalize(torch.randn(h, n, d, generator=g, dtype=torch.float64), dim=-1)
    c = torch.nn.functional.normalize(torch.randn(h, m, d, generator=g, dtype=torch.float64), dim=-1)
    gamma = torch.full((h,), 1.0, dtype=torch.float64)
    phi = nystrom_features(z, c, gamma, kmm_inverse_sqrt(c, gamma))
    pi = torch.softmax(sharp * torch.randn(h, n, generator=g, dtype=torch.float64), -1)
    return pi, phi


def _naive_leverage(p, phi, beta_b):
    """Per-head explicit inverse: βB Φ_iᵀ (I + βB Σ p_j Φ_j Φ_jᵀ)^{-1} Φ_i, one candidate at a time."""
    out = torch.empty_like(p)
    for h in range(p.shape[0]):
        a = torch.eye(phi.shape[-1], dtype=torch.float64)
        for j in range(p.shape[1]):
            a = a + beta_b[h] * p[h, j] * torch.outer(phi[h, j], phi[h, j])
        inv = torch.linalg.inv(a)
        for i in range(p.shape[1]):
            out[h, i] = beta_b[h] * phi[h, i] @ inv @ phi[h, i]
    return out


def test_lambda_zero_returns_utility_exactly():
    pi, phi = _problem(0)
    p, hist = solve_allocation(pi, phi, lam=0.0, steps=8, record=(1, 8))
    assert torch.equal(p, pi / pi.sum(-1, keepdim=True))
    assert torch.equal(hist[1], p) and torch.equal(hist[8], p)


def test_coverage_gradient_matches_autograd_and_naive():
    pi, phi = _problem(1)
    beta_b = normalised_beta_b(phi)
    p = pi.clone().requires_grad_(True)
    coverage_logdet(p, phi, beta_b).sum().backward()
    lev = leverage(pi, phi, beta_b)
    torch.testing.assert_close(lev, p.grad, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(lev, _naive_leverage(pi, phi, beta_b), rtol=1e-9, atol=1e-12)


def _reference_optimum(pi, phi, lam, iters=1500, step=0.2):
    """Independent optimiser: exponentiated gradient on the objective, gradient by autograd, from uniform."""
    p = torch.full_like(pi, 1.0 / pi.shape[-1])
    for _ in range(iters):
        q = p.clone().requires_grad_(True)
        (grad,) = torch.autograd.grad(objective(q, pi, phi, lam).sum(), q)
        p = p * torch.exp(step * (grad - grad.amax(-1, keepdim=True)))
        p = p / p.sum(-1, keepdim=True)
    return p


@pytest.mark.parametrize("lam", [0.5, 2.0])
def test_solver_matches_independent_optimum(lam):
    pi, phi = _problem(2, n=12, m=4, d=3)
    p, _ = solve_allocation(pi, phi, lam, steps=64)
    ref = _reference_optimum(pi, phi, lam)
    assert (0.5 * (p - ref).abs().sum(-1)).max() < 1e-3
    assert (objective(p, pi, phi, lam) >= objective(ref, pi, phi, lam) - 1e-9).all()
    # brute force: no random point of the simplex near p scores higher
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        q = (p * torch.exp(0.3 * torch.randn(p.shape, generator=g, dtype=torch.float64))).clamp_min(1e-300)
        q = q / q.sum(-1, keepdim=True)
        assert (objective(q, pi, phi, lam) <= objective(p, pi, phi, lam) + 1e-12).all()
    # stationarity: log p − log π − λ ℓ(p) is constant over candidates
    station = p.log() - pi.log() - lam * leverage(p, phi, normalised_beta_b(phi))
    assert (station.amax(-1) - station.amin(-1)).max() < 1e-8


def test_solver_improves_objective_and_fixed_eta_agrees():
    pi, phi = _problem(3, n=64, m=8)
    p_auto, _ = solve_allocation(pi, phi, 1.0, steps=48)
    p_half, _ = solve_allocation(pi, phi, 1.0, steps=48, eta=0.5)
    assert (0.5 * (p_auto - p_half).abs().sum(-1)).max() < 1e-8
    assert (objective(p_auto, pi, phi, 1.0) > objective(pi, pi, phi, 1.0)).all()


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 10_000), lam=st.sampled_from([0.25, 1.0, 2.0, 4.0]), sharp=st.sampled_from([0.5, 2.0, 4.0]))
def test_damped_solver_converges_on_random_inputs(seed, lam, sharp):
    pi, phi = _problem(seed, h=3, n=80, m=16, d=8, sharp=sharp)
    _, hist = solve_allocation(pi, phi, lam, steps=32, record=(8, 16, 32))
    e8 = 0.5 * (hist[8] - hist[16]).abs().sum(-1)
    e16 = 0.5 * (hist[16] - hist[32]).abs().sum(-1)
    assert e8.max() < 1e-3
    assert (e16 <= e8 + 1e-12).all()
    for p in hist.values():
        torch.testing.assert_close(p.sum(-1), torch.ones(3, dtype=torch.float64))


def test_solver_rejects_bad_arguments():
    pi, phi = _problem(4)
    with pytest.raises(ValueError):
        solve_allocation(pi, phi, -1.0)
    with pytest.raises(ValueError):
        solve_allocation(pi, phi, 1.0, eta=1.5)
    with pytest.raises(ValueError):
        solve_allocation(pi, phi, 1.0, eta="fast")


def test_greedy_beats_or_matches_brute_force_bound():
    """Greedy J_B on a tiny problem: within (1 − 1/e) of the exhaustive optimum, and exact incremental updates."""
    import itertools

    pi, phi = _problem(5, h=1, n=9, m=4, d=3)
    beta_b = normalised_beta_b(phi)
    prot = protected_mask(9, 1, 1)
    mask = greedy_select(pi, phi, beta_b, prot, 2)
    assert int(mask.sum()) == 4 and mask[0, 0] and mask[0, -1]
    j_greedy = sum(set_quality(mask, pi, phi, beta_b))
    best = -1e9
    for combo in itertools.combinations(range(1, 8), 2):
        m = prot.clone()[None]
        m[0, list(combo)] = True
        best = max(best, float(sum(set_quality(m, pi, phi, beta_b))))
    assert float(j_greedy) <= best + 1e-12
    assert float(j_greedy) >= (1 - 1 / 2.718281828) * best
    # the greedy's first free pick is the argmax of the exact marginal gain
    base = set_quality(prot[None], pi, phi, beta_b)
    gains = []
    for i in range(1, 8):
        m = prot.clone()[None]
        m[0, i] = True
        u, _ = set_quality(m, pi, phi, beta_b)
        gains.append((float(u - base[0]), i))
    assert budget_split(100, 0.75, 4, 32) == (25, 4, 21)
