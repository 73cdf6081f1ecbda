"""The released recipe's losses (core_kv/distill/losses.py: boundary windows, pairwise hinge, all-budget hinge,
KL without the sinks) against hand computations."""

from __future__ import annotations

import math

import torch

from research.released.losses import boundary_windows, masked_kl, multi_budget_hinge, pairwise_hinge


def test_boundary_windows_by_hand():
    p = torch.tensor([0.05, 0.30, 0.10, 0.20, 0.15, 0.10, 0.10])
    # ranking (stable, ties by position): 1 (.30), 3 (.20), 4 (.15), 2 (.10), 5 (.10), 6 (.10), 0 (.05)
    pos, neg = boundary_windows(p, 3, 2)
    assert pos.tolist() == [3, 4] and neg.tolist() == [2, 5]
    eligible = torch.tensor([False, False, True, True, True, True, True])  # position 1 is not a candidate
    pos, neg = boundary_windows(p, 2, 5, eligible)
    assert pos.tolist() == [3, 4] and neg.tolist() == [2, 5, 6]
    assert boundary_windows(p, 0, 2)[0].numel() == 0 and boundary_windows(p, 7, 2)[1].numel() == 0


def test_pairwise_hinge_by_hand():
    s = torch.tensor([2.0, 1.0, 0.8, 0.0], requires_grad=True)
    loss = pairwise_hinge(s, torch.tensor([0, 1]), torch.tensor([2, 3]), margin=0.5)
    # gaps: 0-2: 1.2, 0-3: 2.0, 1-2: 0.2 -> 0.3, 1-3: 1.0 -> mean(0, 0, 0.3, 0) = 0.075
    assert math.isclose(float(loss.detach()), 0.075, rel_tol=1e-6)
    loss.backward()
    torch.testing.assert_close(s.grad, torch.tensor([0.0, -0.25, 0.25, 0.0]))
    half = pairwise_hinge(s, torch.tensor([1]), torch.tensor([2]), margin=0.5, temperature=2.0)
    assert math.isclose(float(half.detach()), 0.5 - 0.1, rel_tol=1e-6)
    assert float(pairwise_hinge(s, torch.tensor([], dtype=torch.long), torch.tensor([2])).detach()) == 0.0


def test_multi_budget_hinge_by_hand():
    n = 12
    p = torch.linspace(1.0, 0.1, n)  # teacher ranks positions in order
    p[:2] = 5.0  # the sinks rank first but are not candidates of the cut
    s = torch.zeros(n)
    s[2:] = torch.tensor([9.0, 8.0, 7.0, 6.0, 5.0, 1.0, 4.0, 3.0, 2.0, 0.0])  # position 7 is out of order
    got = multi_budget_hinge(s, p, [0.5, 0.75], sinks=2, delta=2, margin=0.5)
    # r = 0.5: B = 6, cut at 4 among positions 2..11: P = {4, 5}, N = {6, 7}
    #   s: 7, 6 | 5, 1 -> gaps 2, 6, 1, 5: all >= 0.5 -> 0
    # r = 0.75: B = 3, cut at 1: P = {2}, N = {3, 4}: s 9 | 8, 7 -> gaps 1, 2 -> 0
    assert float(got) == 0.0
    s2 = s.clone()
    s2[5] = 5.2  # P {4, 5} vs N {6, 7} at r = 0.5: gap 5.2 - 5 = 0.2 -> 0.3 hinge; mean over 4 pairs = 0.075
    got2 = multi_budget_hinge(s2, p, [0.5, 0.75], sinks=2, delta=2, margin=0.5)
    assert math.isclose(float(got2), (0.075 + 0.0) / 2, rel_tol=1e-6)
    # a ratio whose budget keeps only the sinks has no window and does not count in the mean
    got3 = multi_budget_hinge(s2, p, [0.5, 0.999], sinks=2, delta=2, margin=0.5)
    assert math.isclose(float(got3), 0.075, rel_tol=1e-6)


def test_masked_kl_excludes_the_sinks():
    p = torch.tensor([0.5, 0.2, 0.2, 0.1])
    s = torch.tensor([3.0, 0.0, 1.0, -1.0])
    eligible = torch.tensor([False, True, True, True])
    q = torch.softmax(s[1:], -1)
    pt = p[1:] / p[1:].sum()
    ref = (pt * (pt.log() - q.log())).sum()
    torch.testing.assert_close(masked_kl(p, s, eligible), ref)
