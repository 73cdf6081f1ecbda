"""Feature spec v3 (research/released/features.py, geometry.py) against naive, unstreamed references."""

from __future__ import annotations

import math

import pytest
import torch

from research.released.features import (
    FEATURE_NAMES_V3,
    auxiliary_features,
    compute_features_v3,
    coverage_features,
    qk_statistics,
    special_mask,
)
from research.released.geometry import KeyGeometry, hadamard

FLOOR = math.log(1e-8)


def naive_qk(q, k, qpos, kpos, scaling):
    """Every statistic written out from the full (T, Hkv, G, N) advantage tensor, one candidate at a time."""
    h, t, d = q.shape
    hkv, n, _ = k.shape
    g = h // hkv
    out = torch.zeros(n, 6, dtype=torch.float64)
    util = torch.zeros(n, dtype=torch.float64)
    q, k = q.double(), k.double()
    logits = torch.einsum("mgtd,mnd->tmgn", q.view(hkv, g, t, d), k) * scaling  # (T, Hkv, G, N)
    vis = kpos[None, :] <= qpos[:, None]  # (T, N)
    r = torch.full_like(logits, FLOOR)
    for ti in range(t):
        cols = vis[ti]
        lp = torch.log_softmax(logits[ti][..., cols], -1)
        adv = torch.logaddexp(lp + math.log(int(cols.sum())), torch.tensor(FLOOR, dtype=torch.float64))
        r[ti][..., cols] = adv
    kh = min(4, g)
    big = r.topk(kh, dim=2).values.mean(2)  # (T, Hkv, N)
    raw = logits.topk(kh, dim=2).values.mean(2)
    recent = min(16, t)
    for i in range(n):
        v = vis[:, i]
        rows = big[:, :, i]  # (T, Hkv)
        vals = rows[v].reshape(-1)
        out[i, 0] = vals.max() if len(vals) else FLOOR
        kk = max(1, min(int(v.sum()) * hkv, 4, t * hkv))
        out[i, 1] = torch.cat([vals, torch.full((kk,), FLOOR, dtype=torch.float64)]).topk(kk).values.mean()
        pos = rows.reshape(-1)[rows.reshape(-1) > 0]
        out[i, 2] = pos.mean() if len(pos) else 0.0
        rv = v[t - recent :]
        rvals = rows[t - recent :][rv].reshape(-1)
        k4 = max(1, min(int(rv.sum()) * hkv, 4, recent * hkv))
        out[i, 3] = torch.cat([rvals, torch.full((k4,), FLOOR, dtype=torch.float64)]).topk(k4).values.mean()
        out[i, 4] = ((rows.amax(1) > 0) & v).sum() / t
        kf = math.ceil(max(int(v.sum()), 1) / 4)
        groups = [torch.cat([rows[v, m], torch.full((kf,), FLOOR, dtype=torch.float64)]).topk(kf).values.mean() > 0
                  for m in range(hkv)]  # fmt: skip
        out[i, 5] = sum(groups) / hkv
        util[i] = raw[v][:, :, i].max() if v.any() else float("-inf")
    return out, util


def _qk_inputs(h=6, hkv=2, t=40, n=40, d=8, seed=0, decode=False):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(h, t, d, generator=gen) * 1.5
    k = torch.randn(hkv, n, d, generator=gen)
    if decode:  # a compressed cache (gaps in the positions) and the last t positions as queries
        kpos = torch.sort(torch.randperm(3 * n, generator=gen)[:n]).values
        kpos[-t:] = torch.arange(int(kpos[-t - 1]) + 1, int(kpos[-t - 1]) + 1 + t)
        qpos = kpos[-t:].clone()
    else:
        kpos = torch.arange(n)
        qpos = torch.arange(n - t, n)
    return q, k, qpos, kpos


@pytest.mark.parametrize(
    "h,hkv,t,n,block,decode",
    [(6, 2, 40, 40, 128, False), (6, 2, 40, 40, 7, False), (8, 1, 33, 33, 5, False), (4, 4, 20, 20, 3, False),
     (6, 2, 12, 50, 5, True), (10, 2, 24, 60, 9, False)],
)  # fmt: skip
def test_streamed_qk_features_equal_the_unstreamed_reference(h, hkv, t, n, block, decode):
    q, k, qpos, kpos = _qk_inputs(h, hkv, t, n, decode=decode)
    feats, util = qk_statistics(q, k, qpos, kpos, 0.35, block=block, with_utility=True)
    ref, ref_util = naive_qk(q, k, qpos, kpos, 0.35)
    torch.testing.assert_close(feats.double(), ref, atol=2e-5, rtol=1e-5)
    finite = torch.isfinite(ref_util)
    torch.testing.assert_close(util.double()[finite], ref_util[finite], atol=1e-5, rtol=1e-5)


def test_block_size_does_not_change_the_features():
    q, k, qpos, kpos = _qk_inputs(6, 2, 300, 300, seed=3)
    a, ua = qk_statistics(q, k, qpos, kpos, 0.3, block=300, with_utility=True)
    b, ub = qk_statistics(q, k, qpos, kpos, 0.3, block=128, with_utility=True)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ua, ub)


def test_uniform_attention_has_zero_advantage():
    """Identical keys give every visible candidate p = 1/|C_t|, so r = 0 (up to rounding) for every query."""
    q = torch.randn(4, 10, 8)
    k = torch.ones(2, 10, 8)
    feats, _ = qk_statistics(q, k, torch.arange(10), torch.arange(10), 0.3)
    for col in (0, 1, 2, 3):  # max, top-mean, mean of positives, recent top-mean
        torch.testing.assert_close(feats[:, col], torch.zeros(10), atol=1e-5, rtol=0)


def _naive_coverage(z, protos, rot):
    n = z.shape[0]
    zc = z - z.mean(0)
    out = torch.zeros(n, 4)
    direc = [zc[i] / zc[i].norm() if zc[i].norm() > 1e-6 else None for i in range(n)]
    nearest = [int((d @ protos.T).argmax()) if d is not None else -1 for d in direc]
    for i in range(n):
        if direc[i] is None:
            out[i, :3] = torch.tensor([0.0, 1.0, 0.0])
            continue
        c = (direc[i] @ protos.T).sort(descending=True).values
        out[i, 0] = math.log1p(sum(1 for m in nearest if m == nearest[i]))
        out[i, 1] = 1 - c[0]
        out[i, 2] = c[0] - c[1]
    zr = z @ rot.T
    mu, var = zr.mean(0), zr.var(0, unbiased=False)
    eff = 0.9 * var + 0.1 * var.mean() + 1e-8
    out[:, 3] = torch.log1p(((zr - mu) ** 2 / eff).mean(-1))
    return out


def test_coverage_features_equal_the_reference():
    geo = KeyGeometry.draw(3, 2, 8, d_z=16, num_prototypes=10, seed=1)
    k = torch.randn(2, 50, 8)
    z = geo.project(1, k)
    got = coverage_features(z, geo.prototypes, geo.rotation)
    torch.testing.assert_close(got, _naive_coverage(z, geo.prototypes, geo.rotation), atol=1e-4, rtol=1e-4)
    z2 = torch.cat([z, z.mean(0, keepdim=True)])  # the last token sits at the candidates' centroid: no direction
    got2 = coverage_features(z2, geo.prototypes, geo.rotation)
    assert got2[-1, :3].tolist() == [0.0, 1.0, 0.0]
    torch.testing.assert_close(got2, _naive_coverage(z2, geo.prototypes, geo.rotation), atol=1e-4, rtol=1e-4)


def test_key_geometry_is_fixed_by_its_seed_and_normalises_per_head():
    a = KeyGeometry.draw(2, 3, 4, seed=7)
    b = KeyGeometry.draw(2, 3, 4, seed=7)
    c = KeyGeometry.draw(2, 3, 4, seed=8)
    assert torch.equal(a.projection, b.projection) and not torch.equal(a.projection, c.projection)
    assert a.projection.shape == (2, 64, 12) and a.prototypes.shape == (64, 64)
    torch.testing.assert_close(a.prototypes.norm(dim=-1), torch.ones(64))
    torch.testing.assert_close(a.rotation @ a.rotation.T, torch.eye(64), atol=1e-5, rtol=0)
    k = torch.randn(3, 5, 4)
    scaled = k * torch.tensor([2.0, 0.5, 7.0])[:, None, None]  # per-head scale is normalised away
    torch.testing.assert_close(a.project(0, k), a.project(0, scaled))
    manual = torch.nn.functional.normalize(
        torch.nn.functional.normalize(k, dim=-1).transpose(0, 1).reshape(5, 12) @ a.projection[0].T, dim=-1
    )
    torch.testing.assert_close(a.project(0, k), manual)
    assert torch.equal(
        hadamard(4), torch.tensor([[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1.0]]).double()
    )
    with pytest.raises(IndexError, match="layer 2"):
        a.project(2, k)


def test_fitted_key_geometry_against_a_naive_pca_and_kmeans():
    """``KeyGeometry.fit``: the projection spans the top principal subspace of k̄ (a naive covariance eigenbasis), its
    rows are orthonormal; the codebook is a fixed point of the spherical k-means update and fits the centred directions
    better than the drawn prototypes; the rotation is the drawn one; the same seed gives the same maps."""
    g = torch.Generator().manual_seed(3)
    mix = torch.randn(2, 3 * 4, 3 * 4, generator=g)  # correlated key columns, one mix per layer
    keys = [[(torch.randn(70, 12, generator=g) @ mix[layer]).reshape(70, 3, 4).transpose(0, 1) for _ in range(3)]
            for layer in range(2)]  # fmt: skip
    geo = KeyGeometry.fit(keys, d_z=5, num_prototypes=6, seed=4)
    again = KeyGeometry.fit(keys, d_z=5, num_prototypes=6, seed=4)
    assert torch.equal(geo.projection, again.projection) and torch.equal(geo.prototypes, again.prototypes)
    assert geo.projection.shape == (2, 5, 12) and geo.prototypes.shape == (6, 5)
    assert torch.equal(geo.rotation, KeyGeometry.draw(2, 3, 4, 5, 6, seed=4).rotation)
    centred_dirs = []
    for layer in range(2):
        p = geo.projection[layer].double()
        torch.testing.assert_close(p @ p.T, torch.eye(5, dtype=torch.float64), atol=1e-5, rtol=0)
        k_bar = torch.cat(
            [torch.nn.functional.normalize(k, dim=-1).transpose(0, 1).reshape(70, 12) for k in keys[layer]]
        )
        k_bar = k_bar.double() - k_bar.double().mean(0)
        vals, vecs = torch.linalg.eigh(k_bar.T @ k_bar)
        top = vecs[:, -5:]  # the same subspace: every singular value of P·top is 1
        torch.testing.assert_close(torch.linalg.svdvals(p @ top), torch.ones(5, dtype=torch.float64), atol=1e-4, rtol=0)
        for k in keys[layer]:
            z = geo.project(layer, k)
            centred_dirs.append(torch.nn.functional.normalize(z - z.mean(0), dim=-1))
    pts = torch.cat(centred_dirs)
    torch.testing.assert_close(geo.prototypes.norm(dim=-1), torch.ones(6))
    assign = (pts @ geo.prototypes.T).argmax(-1)
    update = torch.nn.functional.normalize(torch.zeros(6, 5).index_add_(0, assign, pts), dim=-1)
    torch.testing.assert_close(update, geo.prototypes, atol=1e-4, rtol=0)  # converged (25 Lloyd rounds)
    drawn = KeyGeometry.draw(2, 3, 4, 5, 6, seed=4).prototypes
    assert (pts @ geo.prototypes.T).max(-1).values.mean() > (pts @ drawn.T).max(-1).values.mean() + 0.05
    with pytest.raises(ValueError, match="d_z = 13 exceeds the key width"):
        KeyGeometry.fit(keys, d_z=13)
    with pytest.raises(ValueError, match="420 calibration directions for 500 prototypes"):
        KeyGeometry.fit(keys, d_z=5, num_prototypes=500)


def test_auxiliary_features():
    v = torch.randn(2, 6, 4)
    pos = torch.tensor([0, 3, 4, 10, 18, 19])
    special = torch.tensor([False, False, False, True, False, False])
    aux = auxiliary_features(v, pos, 20, phase=1, special=special)
    torch.testing.assert_close(aux[:, 0], torch.log1p(19 - pos.float()) / math.log1p(19))
    assert aux[:, 1].tolist() == [1, 1, 0, 1, 0, 0]
    torch.testing.assert_close(aux[:, 2], torch.log1p((v**2).sum(-1).mean(0) / 4))
    assert aux[:, 3].eq(1).all()
    with pytest.raises(ValueError, match=r"\[0, 20\)"):
        auxiliary_features(v, pos + 5, 20)
    assert special_mask(torch.tensor([5, 1, 7]), [1, 7]).tolist() == [False, True, True]
    assert special_mask(None, [1]) is None and special_mask(torch.tensor([1]), []) is None


def test_compute_features_v3_assembles_the_three_groups():
    geo = KeyGeometry.draw(2, 2, 8, d_z=16, num_prototypes=8, seed=0)
    q, k, qpos, kpos = _qk_inputs(4, 2, 30, 30, d=8)
    v = torch.randn(2, 30, 8)
    feats, z, util = compute_features_v3(q, k, v, qpos, kpos, 30, geo, 1, 0.35, with_utility=True)
    assert feats.shape == (30, len(FEATURE_NAMES_V3)) == (30, 14) and z.shape == (30, 16)
    torch.testing.assert_close(feats[:, :6], qk_statistics(q, k, qpos, kpos, 0.35)[0])
    torch.testing.assert_close(feats[:, 6:10], coverage_features(geo.project(1, k), geo.prototypes, geo.rotation))
    torch.testing.assert_close(feats[:, 10:], auxiliary_features(v, kpos, 30))
    assert util is not None and util.shape == (30,)


def test_f6_merges_staged_rows_exactly(monkeypatch):
    """f6's Top-K is merged in several rounds when few rows are staged at a time: the same features."""
    import research.released.features as fv3

    q, k, qpos, kpos = _qk_inputs(6, 2, 64, 64, seed=5)
    whole, _ = qk_statistics(q, k, qpos, kpos, 0.35, block=8)
    monkeypatch.setattr(fv3, "F6_MERGE_ROWS", 8)
    rounds, _ = qk_statistics(q, k, qpos, kpos, 0.35, block=8)
    torch.testing.assert_close(rounds, whole)
    ref, _ = naive_qk(q, k, qpos, kpos, 0.35)
    torch.testing.assert_close(rounds.double(), ref, atol=2e-5, rtol=1e-5)
