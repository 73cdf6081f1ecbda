"""Stage 0: the frozen key geometry of one base model (CORE.md stage 0; indexmem_core.md §3.1).

Per (layer, KV head): a projection ``z = normalize(W_z (k̃ − μ))`` of pre-RoPE keys to ``d_z`` dims (top PCA
directions), ``M = 64`` fixed coverage prototypes (spherical k-means on z) [paper Table 9: d_z = 64, M_p = 64], an
RBF bandwidth ``γ = 1 / median pairwise ‖z − z'‖²`` and ``K_mm^{-1/2}`` for the Nyström features. Fitted once on
calibration text, saved as ``geometry.safetensors`` with a fingerprint of the base model; loading against a
different model raises.

[choice] ``d_z = min(64, head_dim)``: the proxy LM's head dim is 24, so its projection is a full PCA rotation.
[choice] Prototypes are unit vectors (spherical k-means, k-means++ seeding, fixed seed), so ``⟨z, c⟩`` is a cosine.

Shapes: L layers, Hkv KV heads, D head dim, d_z projected dim, M prototypes, N keys.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from core_kv.geometry import Geometry
from core_kv.nystrom import kmm_inverse_sqrt


def spherical_kmeans(x: torch.Tensor, k: int, iters: int = 25, seed: int = 0) -> torch.Tensor:
    """Unit-norm centres of ``x`` (N, d) (rows unit norm) by k-means++ seeding and cosine Lloyd steps -> (k, d)."""
    g = torch.Generator().manual_seed(seed)
    n = x.shape[0]
    if n < k:  # too few calibration keys: pad with random unit vectors so M stays fixed
        extra = F.normalize(torch.randn(k - n, x.shape[1], generator=g, dtype=x.dtype), dim=-1)
        return torch.cat([x, extra])
    centres = [x[torch.randint(n, (1,), generator=g)].squeeze(0)]
    d = (1 - x @ centres[0]).clamp_min(0)
    for _ in range(1, k):
        probs = d / d.sum() if d.sum() > 0 else torch.full_like(d, 1 / n)
        c = x[torch.multinomial(probs, 1, generator=g)].squeeze(0)
        centres.append(c)
        d = torch.minimum(d, (1 - x @ c).clamp_min(0))
    c = torch.stack(centres)
    for _ in range(iters):
        assign = (x @ c.T).argmax(-1)
        sums = torch.zeros_like(c).index_add_(0, assign, x)
        empty = sums.norm(dim=-1) < 1e-8
        c = torch.where(empty[:, None], c, F.normalize(sums, dim=-1))
    return c


def fit_head_geometry(
    keys: torch.Tensor, d_z: int = 64, num_prototypes: int = 64, seed: int = 0, jitter: float = 1e-4
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fit one head from pre-RoPE keys (N, D): ``(μ (D,), W_z (d_z, D), prototypes (M, d_z), γ (), K_mm^{-1/2})``."""
    keys = keys.double()
    d_z = min(d_z, keys.shape[1])
    mu = keys.mean(0)
    centred = keys - mu
    _, _, vh = torch.linalg.svd(centred, full_matrices=False)  # rows of vh: principal directions, descending
    w = vh[:d_z]
    z = F.normalize(centred @ w.T, dim=-1)
    g = torch.Generator().manual_seed(seed)
    sample = z[torch.randperm(z.shape[0], generator=g)[:2048]]
    d2 = torch.cdist(sample, sample).pow(2)
    off = d2[~torch.eye(sample.shape[0], dtype=torch.bool)]
    gamma = 1.0 / off.median().clamp_min(1e-6) if off.numel() else torch.tensor(1.0, dtype=torch.float64)
    protos = spherical_kmeans(z, num_prototypes, seed=seed)
    kinv = kmm_inverse_sqrt(protos, gamma, jitter)
    return mu.float(), w.float(), protos.float(), gamma.float(), kinv.float()


def fit_geometry(
    keys_per_layer: list[torch.Tensor],
    fingerprint: dict,
    d_z: int = 64,
    num_prototypes: int = 64,
    seed: int = 0,
    calibration: dict | None = None,
) -> Geometry:
    """Fit every (layer, head) from calibration keys: ``keys_per_layer[l]`` is (Hkv, N, D) pre-RoPE keys."""
    parts = [[fit_head_geometry(k[h], d_z, num_prototypes, seed) for h in range(k.shape[0])] for k in keys_per_layer]
    stack = [torch.stack([torch.stack([head[i] for head in layer]) for layer in parts]) for i in range(5)]
    return Geometry(*stack, fingerprint=fingerprint, calibration=dict(calibration or {}))
