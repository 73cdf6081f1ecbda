"""The released teacher (research/released/teacher.py): utility and the DRIVE fixed point against direct loops."""

from __future__ import annotations

import pytest
import torch

from research.released.features import qk_statistics
from research.released.teacher import DriveConfig, drive_teacher, drive_weights, teacher_distribution


def direct_drive(z, u, beta, alpha, tau, steps):
    """The fixed point written one token at a time with an explicit inverse."""
    z, u = z.double(), u.double()
    n, d = z.shape
    x = z - z.mean(0)
    w = [1.0 / n] * n
    for _ in range(steps):
        sigma = torch.eye(d, dtype=torch.float64)
        for i in range(n):
            sigma = sigma + alpha * w[i] * torch.outer(x[i], x[i])
        inv = torch.linalg.inv(sigma)
        logits = [(float(u[i]) + beta * alpha * float(x[i] @ inv @ x[i])) / tau for i in range(n)]
        top = max(logits)
        e = [pow(2.718281828459045, v - top) for v in logits]
        w = [v / sum(e) for v in e]
    return torch.tensor(w, dtype=torch.float64)


@pytest.mark.parametrize("beta,alpha,tau,steps", [(128.0, 1.0, 8.0, 8), (0.0, 1.0, 8.0, 3), (10.0, 0.5, 2.0, 1)])
def test_drive_fixed_point_equals_the_direct_loop(beta, alpha, tau, steps):
    gen = torch.Generator().manual_seed(0)
    z = torch.nn.functional.normalize(torch.randn(40, 6, generator=gen), dim=-1)
    u = torch.randn(40, generator=gen) * 3
    got = drive_weights(z, u, DriveConfig(beta=beta, alpha=alpha, tau=tau, steps=steps))
    torch.testing.assert_close(got, direct_drive(z, u, beta, alpha, tau, steps), atol=1e-10, rtol=1e-8)
    assert abs(float(got.sum()) - 1) < 1e-12


def test_without_coverage_the_teacher_is_a_tempered_softmax_of_utility():
    u = torch.tensor([1.0, 2.0, 3.0, -1.0])
    z = torch.randn(4, 3)
    w = drive_weights(z, u, DriveConfig(beta=0.0, tau=2.0))
    torch.testing.assert_close(w, torch.softmax(u.double() / 2.0, -1))


def test_coverage_raises_isolated_keys():
    """Equal utilities: a key far from a tight cluster of near-duplicates gets the largest weight."""
    cluster = torch.nn.functional.normalize(torch.tensor([1.0, 0.0, 0.0]) + 0.01 * torch.randn(20, 3), dim=-1)
    z = torch.cat([cluster, torch.tensor([[0.0, 1.0, 0.0]])])
    w = drive_weights(z, torch.zeros(21))
    assert int(w.argmax()) == 20


def test_teacher_temperature_and_zero_weights():
    w = torch.tensor([0.5, 0.25, 0.25, 0.0], dtype=torch.float64)
    torch.testing.assert_close(teacher_distribution(w), w)
    sharp = teacher_distribution(w, 0.5)
    torch.testing.assert_close(sharp, torch.tensor([4 / 6, 1 / 6, 1 / 6, 0.0], dtype=torch.float64))
    with pytest.raises(ValueError, match="tau"):
        DriveConfig(tau=0)
    with pytest.raises(ValueError, match="steps"):
        DriveConfig(steps=0)
    pi = drive_teacher(torch.randn(10, 4), torch.randn(10))
    assert abs(float(pi.sum()) - 1) < 1e-12


def test_streamed_utility_equals_a_naive_max():
    gen = torch.Generator().manual_seed(1)
    h, hkv, t, d = 6, 2, 30, 8
    q, k = torch.randn(h, t, d, generator=gen), torch.randn(hkv, t, d, generator=gen)
    pos = torch.arange(t)
    u = qk_statistics(q, k, pos, pos, 0.3, block=7, with_utility=True)[1]
    logits = torch.einsum("mgtd,mnd->tmgn", q.view(hkv, 3, t, d), k) * 0.3  # (T, Hkv, G, N), G = 3 <= 4: mean
    pooled = logits.mean(2)
    naive = torch.stack([pooled[i:, :, i].max() for i in range(t)])  # query t sees candidate i iff t >= i
    torch.testing.assert_close(u, naive)
    torch.testing.assert_close(qk_statistics(q, k, pos, pos, 0.3, with_utility=True)[1], naive)  # one block
    # G > 4: TopMean of the 4 largest heads
    q8 = torch.randn(16, t, d, generator=gen)
    u8 = qk_statistics(q8, k, pos, pos, 0.3, with_utility=True)[1]
    lg = torch.einsum("mgtd,mnd->tmgn", q8.view(hkv, 8, t, d), k) * 0.3
    top = lg.topk(4, dim=2).values.mean(2)
    torch.testing.assert_close(u8, torch.stack([top[i:, :, i].max() for i in range(t)]))
