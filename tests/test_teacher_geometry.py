"""Stage-0 geometry: projection, prototypes, Nyström features, fingerprint refusal (CORE.md stage 0)."""

from __future__ import annotations

import pytest
import torch

from core_kv.geometry import Geometry
from core_kv.models.fingerprint import FingerprintMismatch
from core_kv.nystrom import rbf
from core_kv.teacher.geometry import fit_geometry, spherical_kmeans


def _keys(n=600, d=8, clusters=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    centres = 3 * torch.randn(clusters, d, generator=g)
    return centres[torch.randint(clusters, (n,), generator=g)] + 0.3 * torch.randn(n, d, generator=g)


def test_fit_shapes_and_invariants():
    keys = torch.stack([_keys(seed=0), _keys(seed=1)])[None]  # (L=1, Hkv=2, N, D)
    geo = fit_geometry(list(keys), {"name": "x"}, d_z=64, num_prototypes=16)
    assert geo.proj.shape == (1, 2, 8, 8)  # d_z = min(64, D)
    assert geo.prototypes.shape == (1, 2, 16, 8)
    torch.testing.assert_close(geo.prototypes.norm(dim=-1), torch.ones(1, 2, 16))
    z = geo.project(0, keys[0])
    torch.testing.assert_close(z.norm(dim=-1), torch.ones(2, 600))
    # Nyström is exact on the landmarks: Φ(c_j)·Φ(c_l) = κ(c_j, c_l) (up to the jitter)
    c = geo.prototypes[0].double()
    phi = geo.nystrom(0, c)
    torch.testing.assert_close(phi @ phi.mT, rbf(c, c, geo.gamma[0].double()), atol=5e-3, rtol=0)


def test_kmeans_finds_separated_clusters():
    x = torch.nn.functional.normalize(torch.eye(4).repeat_interleave(25, 0) + 0.01 * torch.randn(100, 4), dim=-1)
    c = spherical_kmeans(x, 4, seed=0)
    assert (c @ torch.eye(4)).amax(0).min() > 0.99


def test_save_load_and_refuse_other_model(tmp_path):
    geo = fit_geometry([_keys()[None]], {"name": "a", "layers": 1}, num_prototypes=8, calibration={"docs": 1})
    geo.save(tmp_path / "g.safetensors")
    back = Geometry.load(tmp_path / "g.safetensors", {"name": "a", "layers": 1})
    torch.testing.assert_close(back.prototypes, geo.prototypes)
    assert back.calibration == {"docs": 1}
    with pytest.raises(FingerprintMismatch, match="layers"):
        Geometry.load(tmp_path / "g.safetensors", {"name": "a", "layers": 2})
