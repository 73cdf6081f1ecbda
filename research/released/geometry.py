"""The released CORE key geometry (feature spec v3): fixed random maps, nothing fitted to data.

The CORE authors' release (GitHub ``zhutizi23-coder/CORE``, ``core/features.py`` ``LayerwiseKeyGeometryProjector``,
``PrototypeBank``, ``HadamardProjector``; config ``key_geometry_mode="head_concat_layer_gaussian"``) replaces a
fitted per-head geometry by three fixed random objects drawn from one ``geometry_seed``:

- **projection** per layer ``P_l ∈ R^{d_z × Hkv·D}`` with i.i.d. ``N(0, 1/d_z)`` entries: a token's key is the
  concatenation over KV heads of its per-head L2-normalised post-RoPE keys, ``k̄ = [k_1/‖k_1‖, …, k_Hkv/‖k_Hkv‖]``,
  and ``z = normalize(P_l k̄)`` (``d_z = 64``). One ``z`` per token per layer: the geometry is shared by the KV heads.
- **prototypes** ``c_1..c_M`` (``M = 64``): i.i.d. Gaussian vectors normalised to unit length, shared by every layer.
- **rotation** ``R = H_{d_z} S / √d_z``: the Walsh–Hadamard matrix (Sylvester order, truncated when ``d_z`` is not a
  power of two) times a random sign diagonal ``S``; orthogonal when ``d_z`` is a power of two.

The draws are ours (``torch.Generator`` streams seeded by ``geometry_seed``), not the release's numpy streams: the
maps have the same distribution, not the same numbers. They are stored in every artifact, so an artifact never
depends on redrawing them.

**Fitted** (:meth:`KeyGeometry.fit`; not in the release: the one-choice ablation of issue 44, ``released.geometry.kind=fitted``).
The same three maps, the first two fitted to keys of the base model, as core_kv's v2 geometry is (per-head PCA and
spherical k-means, :mod:`core_kv.teacher.geometry`), in the release's head-shared form so that every feature and the
artifact format stay as they are: ``P_l`` = the top ``d_z`` principal directions of ``k̄`` (eigenvectors of its
covariance over the calibration tokens, as rows); the prototypes = a spherical k-means codebook of the centred
directions ``ẑ`` (centred per document, as the features centre per event), pooled over the layers because the
release's prototypes are shared by every layer; the rotation = the drawn one.

Shapes: L layers, Hkv KV heads, D head dim, N tokens, d_z projected dim, M prototypes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from core_kv.teacher.geometry import spherical_kmeans

D_Z = 64  # [release: proto_dim]
NUM_PROTOTYPES = 64  # [release: n_prototypes]
GEOMETRY_SEED = 42  # [release: geometry_seed, fixed across training seeds]
EPS = 1e-8  # [release: key_geometry_eps]


def hadamard(n: int) -> torch.Tensor:
    """The Sylvester Walsh–Hadamard matrix of order ``n`` (a power of two), entries ±1, float64."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"hadamard order must be a power of two, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


@dataclass
class KeyGeometry:
    """The fixed maps of one base model: ``projection`` (L, d_z, Hkv·D), ``prototypes`` (M, d_z), ``rotation``
    (d_z, d_z)."""

    projection: torch.Tensor
    prototypes: torch.Tensor
    rotation: torch.Tensor

    @classmethod
    def draw(
        cls,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        d_z: int = D_Z,
        num_prototypes: int = NUM_PROTOTYPES,
        seed: int = GEOMETRY_SEED,
    ) -> KeyGeometry:
        """Draw the three maps from ``seed`` (the same seed gives the same maps on any machine: CPU generator)."""
        if min(num_layers, num_kv_heads, head_dim, d_z, num_prototypes) < 1:
            raise ValueError("key geometry dimensions must all be >= 1")
        g = torch.Generator().manual_seed(int(seed))
        projection = torch.randn(num_layers, d_z, num_kv_heads * head_dim, generator=g) / math.sqrt(d_z)
        prototypes = torch.nn.functional.normalize(torch.randn(num_prototypes, d_z, generator=g), dim=-1, eps=EPS)
        signs = torch.randint(0, 2, (d_z,), generator=g).double() * 2 - 1
        size = 1 << max(d_z - 1, 0).bit_length()
        rotation = (hadamard(size)[:d_z, :d_z] * signs[None, :] / math.sqrt(d_z)).float()
        return cls(projection, prototypes, rotation)

    @classmethod
    def fit(
        cls,
        keys: list[list[torch.Tensor]],
        d_z: int = D_Z,
        num_prototypes: int = NUM_PROTOTYPES,
        seed: int = GEOMETRY_SEED,
        iters: int = 25,
        max_points: int = 16384,
    ) -> KeyGeometry:
        """Fit the projection and the prototypes to ``keys[layer]`` (one post-RoPE ``(Hkv, N, D)`` tensor per
        calibration document); the rotation is :meth:`draw`'s for ``seed``. Deterministic (CPU generator).

        Args:
            keys: Per layer, the calibration documents' keys.
            d_z, num_prototypes, seed: As :meth:`draw`.
            iters: Spherical k-means iterations (:func:`core_kv.teacher.geometry.spherical_kmeans`, the v2 geometry's:
                k-means++ seeding from ``seed + 1``, cosine Lloyd steps).
            max_points: At most this many centred directions enter the k-means (a seeded draw when there are more).
        """
        if not keys or any(not docs for docs in keys):
            raise ValueError("KeyGeometry.fit needs at least one calibration document in every layer")
        hkv, _, d = keys[0][0].shape
        if d_z > hkv * d:
            raise ValueError(f"KeyGeometry.fit: d_z = {d_z} exceeds the key width Hkv·D = {hkv}·{d}")
        drawn = cls.draw(len(keys), hkv, d, d_z, num_prototypes, seed)
        projection = torch.empty_like(drawn.projection)
        for layer, docs in enumerate(keys):
            k_bar = torch.cat([_concat_normalised(k) for k in docs]).double()
            cov = torch.cov(k_bar.T)
            _, vecs = torch.linalg.eigh(cov)  # ascending eigenvalues
            projection[layer] = vecs[:, -d_z:].flip(-1).T.float()
        fitted = cls(projection, drawn.prototypes, drawn.rotation)
        directions = []
        for layer, docs in enumerate(keys):
            for k in docs:
                z = fitted.project(layer, k)
                c = z - z.mean(0, keepdim=True)
                norm = c.norm(dim=-1, keepdim=True)
                directions.append(c[norm[:, 0] > 1e-6] / norm[norm[:, 0] > 1e-6])
        points = torch.cat(directions)
        g = torch.Generator().manual_seed(int(seed) + 1)
        if points.shape[0] > max_points:
            points = points[torch.randperm(points.shape[0], generator=g)[:max_points]]
        if points.shape[0] < num_prototypes:
            raise ValueError(f"KeyGeometry.fit: {points.shape[0]} calibration directions for {num_prototypes} "
                             "prototypes; give more calibration tokens")  # fmt: skip
        return cls(projection, spherical_kmeans(points, num_prototypes, iters, int(seed) + 1), drawn.rotation)

    @property
    def d_z(self) -> int:
        return self.projection.shape[1]

    @property
    def num_layers(self) -> int:
        return self.projection.shape[0]

    def project(self, layer: int, keys: torch.Tensor) -> torch.Tensor:
        """``z = normalize(P_l [k_h / ‖k_h‖]_h)``: post-RoPE keys (Hkv, N, D) -> (N, d_z), float32."""
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"key geometry: layer {layer} outside [0, {self.num_layers})")
        hkv, n, d = keys.shape
        p = self.projection[layer].to(keys.device)
        if p.shape[1] != hkv * d:
            raise ValueError(f"key geometry expects Hkv·D = {p.shape[1]} key columns, got {hkv}·{d}")
        z = _concat_normalised(keys) @ p.float().T
        return z / (z.norm(dim=-1, keepdim=True) + EPS)

    def to(self, device) -> KeyGeometry:
        return KeyGeometry(self.projection.to(device), self.prototypes.to(device), self.rotation.to(device))


def _concat_normalised(keys: torch.Tensor) -> torch.Tensor:
    """``k̄``: per-head L2-normalised keys ``(Hkv, N, D)`` concatenated over the heads, in order -> ``(N, Hkv·D)``."""
    hkv, n, d = keys.shape
    k = keys.float()
    k = k / (k.norm(dim=-1, keepdim=True) + EPS)
    return k.transpose(0, 1).reshape(n, hkv * d)


__all__ = ["D_Z", "GEOMETRY_SEED", "NUM_PROTOTYPES", "KeyGeometry", "hadamard"]
