"""The released memory (core_kv/fast_memory.py) against the expanded (unfolded) formulas written out."""

from __future__ import annotations

import torch

from core_kv.fast_memory import (
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


def test_state_bytes_and_empty_write_mass():
    mem = FastMemory(30, 9, 3, 64)
    assert mem.state_bytes() == 30 * (512 * 192 + 512 + 1) * 4
    s = FastState.empty(4, 3)
    w, mass = conditional_weights(torch.tensor([0.5, 0.5]), torch.tensor([False, False]))
    assert float(mass) == 0 and w.eq(0).all()
    s2 = write(s, torch.randn(4, 3), torch.zeros(0, 3), torch.zeros(0, 3), torch.zeros(0), mass)
    assert s2.M.abs().sum() == 0 and float(s2.Z) == 0
