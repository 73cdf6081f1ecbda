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

Shapes: L layers, Hkv KV heads, D head dim, N tokens, d_z projected dim, M prototypes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

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
        k = keys.float()
        k = k / (k.norm(dim=-1, keepdim=True) + EPS)
        k_bar = k.transpose(0, 1).reshape(n, hkv * d)  # (N, Hkv·D), heads in order
        z = k_bar @ p.float().T
        return z / (z.norm(dim=-1, keepdim=True) + EPS)

    def to(self, device) -> KeyGeometry:
        return KeyGeometry(self.projection.to(device), self.prototypes.to(device), self.rotation.to(device))


__all__ = ["D_Z", "GEOMETRY_SEED", "NUM_PROTOTYPES", "KeyGeometry", "hadamard"]
