"""Latent memory: write rules, readout and gate against naive loops (CORE.md stage 4; indexmem_core.md §3.11)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from core_kv.memory import MEMORY_DIM, LatentMemory, MemoryState, compensate, read, write, write_weights


def _event(hkv=2, n=12, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(hkv, n, d, generator=g), torch.randn(hkv, n, d, generator=g)
    p = torch.randn(hkv, n, generator=g).softmax(-1)
    evicted = torch.rand(hkv, n, generator=g) < 0.5
    evicted[:, 0] = True
    return k, v, p, evicted


def test_shapes_and_paper_sizes():
    mem = LatentMemory(num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8)
    st = mem.empty_state()
    assert MEMORY_DIM == 512
    assert st.M.shape == (2, 512, 8) and st.b.shape == (2, 512) and st.Z.shape == (2,)
    assert mem.w_phi.shape == (3, 2, 512, 8)  # φ: R^D -> R^512, no bias
    assert mem.state_bytes() == 3 * 2 * (512 * 8 + 512 + 1 + 8 + 1) * 4


@pytest.mark.parametrize("rule", ["mass", "equal_event", "uniform_token"])
def test_write_rules_z_and_weights(rule):
    k, v, p, ev = _event()
    w = write_weights(p, ev, rule)
    assert (w[~ev] == 0).all()
    eps_hat = (p * ev).sum(-1)
    expected_z = {"mass": eps_hat, "equal_event": torch.ones(2), "uniform_token": ev.sum(-1).float()}[rule]
    mem = LatentMemory(1, 4, 2, 8)
    st = mem.write(mem.empty_state(), 0, k, v, w)
    torch.testing.assert_close(st.Z, expected_z)
    st2 = mem.write(st, 0, k, v, w)  # a second event adds the same again
    torch.testing.assert_close(st2.Z, 2 * expected_z)
    assert st2.events == 2


def test_write_and_read_match_naive_loops():
    k, v, p, ev = _event(d=8)
    w = write_weights(p, ev, "mass")
    w_phi = torch.randn(2, 16, 8) / 8**0.5
    st = write(MemoryState.empty(2, 8, dim=16), w_phi, k, v, w)
    for h in range(2):
        m_ref, b_ref = torch.zeros(16, 8), torch.zeros(16)
        for i in range(k.shape[1]):
            f = F.softplus(w_phi[h] @ k[h, i])
            m_ref += w[h, i] * torch.outer(f, v[h, i])
            b_ref += w[h, i] * f
        torch.testing.assert_close(st.M[h], m_ref, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(st.b[h], b_ref, rtol=1e-5, atol=1e-6)
    q = torch.randn(4, 3, 8)  # 4 query heads, G = 2
    m, den = read(st, w_phi, q)
    for hq in range(4):
        h = hq // 2
        for t in range(3):
            f = F.softplus(w_phi[h] @ q[hq, t])
            torch.testing.assert_close(m[hq, t], st.M[h].T @ f / (st.b[h] @ f + 1e-6), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(den[hq, t], st.b[h] @ f, rtol=1e-5, atol=1e-6)


def test_uniform_token_is_plain_linear_attention():
    """With uniform-token writes the readout is the kernel-weighted mean of the written values."""
    k, v, _, ev = _event(hkv=1, n=6, d=4)
    w_phi = torch.randn(1, 32, 4)
    st = write(MemoryState.empty(1, 4, dim=32), w_phi, k, v, write_weights(torch.ones(1, 6) / 6, ev, "uniform_token"))
    q = torch.randn(1, 1, 4)
    kern = F.softplus(k[0] @ w_phi[0].T) @ F.softplus(w_phi[0] @ q[0, 0])  # (n,)
    kern = kern * ev[0]
    expected = (kern[:, None] * v[0]).sum(0) / (kern.sum() + 1e-6)
    torch.testing.assert_close(read(st, w_phi, q)[0][0, 0], expected, rtol=1e-4, atol=1e-5)


def test_certificate_centroid_and_radius():
    k, v, p, ev = _event()
    w = write_weights(p, ev, "mass")
    st = write(MemoryState.empty(2, 8, dim=16), torch.randn(2, 16, 8), k, v, w)
    centre = (w[..., None] * v).sum(1) / w.sum(-1, keepdim=True)
    torch.testing.assert_close(st.centroid, centre)
    radius = torch.stack([(v[h][ev[h]] - centre[h]).norm(dim=-1).max() for h in range(2)])
    torch.testing.assert_close(st.radius, radius)


def test_gate_closed_when_empty_and_gradients_reach_w_phi():
    mem = LatentMemory(1, 4, 2, 8)
    q, o_r, lse = torch.randn(4, 5, 8), torch.randn(4, 5, 8), torch.randn(4, 5)
    out, g = mem.compensate(mem.empty_state(), 0, q, o_r, lse)
    assert (g == 0).all() and torch.equal(out, o_r)
    k, v, p, ev = _event(d=8)
    st = mem.write(mem.empty_state(), 0, k, v, write_weights(p, ev, "mass"))
    out, g = mem.compensate(st, 0, q, o_r, lse)
    assert ((g > 0) & (g < 1)).all()
    out.pow(2).sum().backward()
    assert mem.w_phi.grad is not None and mem.w_phi.grad.abs().sum() > 0
    assert mem.gate_w.grad.abs().sum() > 0 and mem.gate_b.grad.abs().sum() > 0


def test_compensate_is_gated_interpolation():
    k, v, p, ev = _event(d=8)
    w_phi = torch.randn(2, 16, 8)
    st = write(MemoryState.empty(2, 8, dim=16), w_phi, k, v, write_weights(p, ev, "mass"))
    q, o_r, lse = torch.randn(4, 3, 8), torch.randn(4, 3, 8), torch.randn(4, 3)
    out, g = compensate(st, w_phi, torch.zeros(4), torch.full((4,), 2.0), q, o_r, lse)
    m, _ = read(st, w_phi, q)
    gate = torch.sigmoid(torch.tensor(2.0))
    torch.testing.assert_close(out, o_r + gate * (m - o_r))
