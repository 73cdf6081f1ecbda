"""The released memory (research/released/memory.py) against the expanded (unfolded) formulas written out."""

from __future__ import annotations

import torch

from research.released.memory import (
    FastMemory,
    FastState,
    concat_heads,
    conditional_weights,
    expand_heads,
    fold_theta,
    memory_mse,
    read,
    write,
)


def _expanded_write(theta, k_exp, v_exp, w, mass, m0, b0, z0, gamma):
    phi = k_exp @ theta.T
    m_bar = sum(w[i] * torch.outer(phi[i], v_exp[i]) for i in range(len(w)))
    b_bar = sum(w[i] * phi[i] ** 2 for i in range(len(w)))
    z = gamma * z0 + mass
    return (gamma * z0 * m0 + mass * m_bar) / (z + 1e-8), (gamma * z0 * b0 + mass * b_bar) / (z + 1e-8), z


def test_folded_write_and_read_equal_the_expanded_formulas():
    torch.manual_seed(0)
    hkv, g, d, p = 2, 3, 4, 16
    mem = FastMemory(2, hkv * g, hkv, d, dim=p, gate_hidden=8)
    keys = torch.randn(hkv, 10, d)
    vals = torch.randn(hkv, 10, d)
    probs = torch.softmax(torch.randn(10), -1)
    evicted = torch.tensor([1, 0, 1, 1, 0, 0, 1, 0, 1, 1], dtype=torch.bool)
    w, mass = conditional_weights(probs, evicted)
    torch.testing.assert_close(w.sum(), torch.tensor(1.0))
    torch.testing.assert_close(mass, probs[evicted].sum())
    theta = mem.theta[1].detach()
    k_exp = expand_heads(keys, g)[evicted]
    assert k_exp.shape == (6, hkv * g * d)
    torch.testing.assert_close(k_exp @ theta.T, concat_heads(keys)[evicted] @ fold_theta(theta, hkv, g).T)
    # two events with decay 0.9: state recurrence
    s = mem.empty_state()
    m_ref, b_ref, z_ref = torch.zeros(p, hkv * g * d), torch.zeros(p), torch.tensor(0.0)
    for mask in (evicted, ~evicted):
        w, mass = conditional_weights(probs, mask)
        s = mem.write(s, 1, concat_heads(keys)[mask], concat_heads(vals)[mask], w[mask], mass)
        m_ref, b_ref, z_ref = _expanded_write(theta, expand_heads(keys, g)[mask], expand_heads(vals, g)[mask],
                                              w[mask], mass, m_ref, b_ref, z_ref, 0.9)  # fmt: skip
    assert s.events == 2
    torch.testing.assert_close(s.Z, z_ref)
    torch.testing.assert_close(s.b, b_ref)
    # compact M holds the expanded M's columns of one query head per KV head
    torch.testing.assert_close(s.M, m_ref.view(p, hkv, g, d)[:, :, 0].reshape(p, hkv * d))
    q = torch.randn(5, hkv * g * d)
    phi = q @ theta.T
    m_exp = (phi @ m_ref) / (phi.pow(2) @ b_ref + 1e-8).sqrt()[:, None]
    torch.testing.assert_close(read(s, theta, q, hkv), m_exp, atol=1e-5, rtol=1e-5)
    res, gate = mem.readout(s, 1, q)
    hidden = torch.nn.functional.gelu(q @ mem.gate_w1[1].T + mem.gate_b1[1])
    g_ref = torch.sigmoid(hidden @ mem.gate_w2[1] + mem.gate_b2[1])
    torch.testing.assert_close(gate, g_ref)
    torch.testing.assert_close(res, g_ref[:, None] * m_exp, atol=1e-5, rtol=1e-5)


def test_first_write_is_the_conditional_summary_and_gradients_reach_theta_and_gate():
    mem = FastMemory(1, 2, 1, 4, dim=8, gate_hidden=4)
    k, v = torch.randn(1, 6, 4), torch.randn(1, 6, 4)
    w = torch.full((6,), 1 / 6)
    s = mem.write(mem.empty_state(), 0, concat_heads(k), concat_heads(v), w, torch.tensor(0.3))
    phi = concat_heads(k) @ fold_theta(mem.theta[0], 1, 2).T
    torch.testing.assert_close(s.M, (0.3 / (0.3 + 1e-8)) * (phi * w[:, None]).T @ concat_heads(v))
    q = torch.randn(3, 8)
    res, _ = mem.readout(s, 0, q)
    target, retained = torch.randn(3, 8), torch.randn(3, 8)
    loss = memory_mse(target, retained, res)
    torch.testing.assert_close(loss, ((target - retained - res) ** 2).sum(-1).mean())
    loss.backward()
    assert mem.theta.grad.abs().sum() > 0 and mem.gate_w1.grad.abs().sum() > 0


def test_interpolate_readout_is_the_gated_move_toward_the_memory():
    """``readout="interpolate"``: the correction is ``g (m − o_R)``, so ``o_R + correction = (1 − g) o_R + g m``."""
    import pytest

    torch.manual_seed(1)
    res_mem, ip_mem = FastMemory(1, 4, 2, 4, dim=8, gate_hidden=4), FastMemory(1, 4, 2, 4, dim=8, gate_hidden=4,
                                                                               readout="interpolate")  # fmt: skip
    ip_mem.load_state_dict(res_mem.state_dict())
    k, v = torch.randn(2, 6, 4), torch.randn(2, 6, 4)
    s = res_mem.write(res_mem.empty_state(), 0, concat_heads(k), concat_heads(v), torch.full((6,), 1 / 6),
                      torch.tensor(0.4))  # fmt: skip
    q, o_r = torch.randn(3, 16), torch.randn(3, 16)
    m = read(s, res_mem.theta[0], q, 2)
    res, g = res_mem.readout(s, 0, q)
    ip, g2 = ip_mem.readout(s, 0, q, o_r)
    torch.testing.assert_close(g, g2)
    torch.testing.assert_close(res, g[:, None] * m)
    torch.testing.assert_close(o_r + ip, (1 - g[:, None]) * o_r + g[:, None] * m)
    with pytest.raises(ValueError, match="retained"):
        ip_mem.readout(s, 0, q)
    with pytest.raises(ValueError, match="readout"):
        FastMemory(1, 4, 2, 4, readout="mix")


def test_positive_kernel_reads_a_convex_combination_of_the_evicted_values():
    """``kernel="positive"``: one event reads ``Σ p̄ κ(q,k) ṽ / Σ p̄ κ(q,k)``, ``κ = (elu(θq)+1)·(elu(θk̃)+1)``; two
    events read the decayed-mass mixture of the numerators and normalisers."""
    import pytest

    torch.manual_seed(2)
    hkv, g, d, p = 2, 2, 4, 8
    mem = FastMemory(1, hkv * g, hkv, d, dim=p, gate_hidden=4, kernel="positive")
    theta = mem.theta[0].detach()
    keys, vals = torch.randn(hkv, 7, d), torch.randn(hkv, 7, d)
    probs = torch.softmax(torch.randn(7), -1)
    q = torch.randn(3, hkv * g * d)
    phi = lambda x: torch.nn.functional.elu(x @ theta.T) + 1  # noqa: E731
    s = mem.empty_state()
    num, den, z = 0, 0, 0.0
    for mask in (torch.tensor([1, 1, 0, 1, 0, 0, 1], dtype=torch.bool), torch.tensor([0, 0, 1, 0, 1, 1, 0]).bool()):
        w, mass = conditional_weights(probs, mask)
        s = mem.write(s, 0, concat_heads(keys)[mask], concat_heads(vals)[mask], w[mask], mass)
        kappa = phi(q) @ phi(expand_heads(keys, g)[mask]).T * w[mask]  # (T, E)
        first = kappa @ expand_heads(vals, g)[mask] / kappa.sum(-1, keepdim=True)
        if z == 0.0:
            torch.testing.assert_close(read(s, theta, q, hkv, "positive"), first, atol=1e-5, rtol=1e-4)
            assert (first.abs() <= expand_heads(vals, g)[mask].abs().max(0).values + 1e-5).all()
        z_new = 0.9 * z + float(mass)
        num = (0.9 * z * num + mass * (kappa @ expand_heads(vals, g)[mask])) / z_new
        den = (0.9 * z * den + mass * kappa.sum(-1, keepdim=True)) / z_new
        z = z_new
    torch.testing.assert_close(read(s, theta, q, hkv, "positive"), num / den, atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="kernel"):
        FastMemory(1, 4, 2, 4, kernel="exp")


def test_state_bytes_and_empty_write_mass():
    mem = FastMemory(30, 9, 3, 64)
    assert mem.state_bytes() == 30 * (512 * 192 + 512 + 1) * 4
    s = FastState.empty(4, 3)
    w, mass = conditional_weights(torch.tensor([0.5, 0.5]), torch.tensor([False, False]))
    assert float(mass) == 0 and w.eq(0).all()
    s2 = write(s, torch.randn(4, 3), torch.zeros(0, 3), torch.zeros(0, 3), torch.zeros(0), mass)
    assert s2.M.abs().sum() == 0 and float(s2.Z) == 0
