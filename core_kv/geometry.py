"""The frozen key geometry of a CORE artifact at run time.

Per (layer, KV head): a projection ``z = normalize(W_z (k̃ − μ))`` of pre-RoPE keys to ``d_z`` dims, ``M = 64``
fixed coverage prototypes [paper Table 9: d_z = 64, M_p = 64], an RBF bandwidth ``γ`` and ``K_mm^{-1/2}`` for the
Nyström features (``CORE.md`` stage 0). :mod:`core_kv.teacher.geometry` fits it once on calibration text; the
teacher, the trainer and the press read it through :class:`Geometry` (saved as ``geometry.safetensors`` or inside an
artifact, with the base model's :mod:`~core_kv.models.fingerprint`: loading against a different model raises
:class:`~core_kv.models.fingerprint.FingerprintMismatch`). It sits below the teacher so inference never imports the
offline stage.

Shapes: L layers, Hkv KV heads, D head dim, d_z projected dim, M prototypes, N keys.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from core_kv.files import atomic_write
from core_kv.models.fingerprint import check_fingerprint
from core_kv.nystrom import nystrom_features

GEOMETRY_VERSION = 1


@dataclass
class Geometry:
    """Frozen projection, prototypes and Nyström factors for every (layer, KV head)."""

    mean: torch.Tensor  # (L, Hkv, D)
    proj: torch.Tensor  # (L, Hkv, d_z, D)
    prototypes: torch.Tensor  # (L, Hkv, M, d_z)
    gamma: torch.Tensor  # (L, Hkv)
    kmm_inv_sqrt: torch.Tensor  # (L, Hkv, M, M)
    fingerprint: dict
    calibration: dict = field(default_factory=dict)  # how it was fitted (data, sizes); a change means refit

    @property
    def num_prototypes(self) -> int:
        return self.prototypes.shape[-2]

    def project(self, layer: int, keys: torch.Tensor) -> torch.Tensor:
        """``z = normalize(W_z (k̃ − μ))``: pre-RoPE keys (Hkv, N, D) -> (Hkv, N, d_z)."""
        mu, w = self.mean[layer].to(keys), self.proj[layer].to(keys)
        return F.normalize((keys - mu[:, None]) @ w.mT, dim=-1)

    def nystrom(self, layer: int, z: torch.Tensor) -> torch.Tensor:
        """Coverage features ``Φ`` (Hkv, N, M) of projected keys ``z`` (Hkv, N, d_z)."""
        c, k = self.prototypes[layer].to(z), self.kmm_inv_sqrt[layer].to(z)
        return nystrom_features(z, c, self.gamma[layer].to(z), k)

    def save(self, path: str | Path) -> Path:
        tensors = {k: getattr(self, k).contiguous() for k in ("mean", "proj", "prototypes", "gamma", "kmm_inv_sqrt")}
        meta = {
            "fingerprint": json.dumps(self.fingerprint, sort_keys=True),
            "calibration": json.dumps(self.calibration, sort_keys=True),
            "version": str(GEOMETRY_VERSION),
        }
        return atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=meta))

    @classmethod
    def load(cls, path: str | Path, expect_fingerprint: dict | None = None) -> Geometry:
        from safetensors import safe_open

        try:
            with safe_open(str(path), "pt") as f:
                meta = f.metadata() or {}
            t = load_file(str(path))
        except Exception as e:  # safetensors' errors (a truncated file) name no path
            raise ValueError(f"{path}: unreadable geometry file ({type(e).__name__}: {e})") from e
        if meta.get("version") != str(GEOMETRY_VERSION):
            raise ValueError(f"{path}: geometry version {meta.get('version')!r}, this code reads {GEOMETRY_VERSION}")
        fp = json.loads(meta["fingerprint"])
        if expect_fingerprint is not None:
            check_fingerprint(fp, expect_fingerprint, f"geometry {path}")
        calib = json.loads(meta.get("calibration", "{}"))
        return cls(t["mean"], t["proj"], t["prototypes"], t["gamma"], t["kmm_inv_sqrt"], fp, calib)
