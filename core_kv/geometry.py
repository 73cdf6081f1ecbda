"""The frozen key geometry of a CORE artifact at run time, and the base-model fingerprint.

Per (layer, KV head): a projection ``z = normalize(W_z (k̃ − μ))`` of pre-RoPE keys to ``d_z`` dims, ``M = 64``
fixed coverage prototypes [paper Table 9: d_z = 64, M_p = 64], an RBF bandwidth ``γ`` and ``K_mm^{-1/2}`` for the
Nyström features (``CORE.md`` stage 0). :mod:`core_kv.teacher.geometry` fits it once on calibration text; the
teacher, the trainer and the press read it through :class:`Geometry` (saved as ``geometry.safetensors`` or inside an
artifact, with a fingerprint of the base model: loading against a different model raises
:class:`FingerprintMismatch`). It sits below the teacher so inference never imports the offline stage.

Shapes: L layers, Hkv KV heads, D head dim, d_z projected dim, M prototypes, N keys.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from core_kv.files import atomic_write
from core_kv.models.attention import attention_modules, model_dims
from core_kv.nystrom import nystrom_features

GEOMETRY_VERSION = 1


class FingerprintMismatch(ValueError):
    """A stored artifact was made for a different base model."""


def model_fingerprint(model: nn.Module) -> dict:
    """Name, revision, layer/head shapes and a digest of the first layer's key projection.

    The digest separates two checkpoints that share a name (e.g. two random inits of a config-built model). A
    packaged model's converted folder is named by its short name (``smollm2-135m``), wherever the cache lives.
    """
    from core_kv.models.packaged import canonical_name

    cfg = model.config
    attn = attention_modules(model)[0]
    w = attn.qkv_proj.weight if hasattr(attn, "qkv_proj") else attn.k_proj.weight
    digest = hashlib.sha256(w.detach().float().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]
    return {
        "name": canonical_name(str(getattr(cfg, "_name_or_path", "") or type(model).__name__)),
        "revision": getattr(cfg, "_commit_hash", None),
        "model_type": cfg.model_type,
        **model_dims(model),
        "k_proj_digest": digest,
    }


def check_fingerprint(stored: dict, expected: dict, what: str) -> None:
    """Raise :class:`FingerprintMismatch` naming the differing fields."""
    diff = {
        k: (stored.get(k), expected.get(k)) for k in set(stored) | set(expected) if stored.get(k) != expected.get(k)
    }
    if diff:
        lines = ", ".join(f"{k}: stored {a!r} vs model {b!r}" for k, (a, b) in sorted(diff.items()))
        raise FingerprintMismatch(f"{what} was made for a different base model ({lines}); refit it for this model")


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
