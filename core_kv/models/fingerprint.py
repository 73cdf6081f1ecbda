"""The base-model fingerprint every stored artifact carries (teacher datasets, geometries, CORE artifacts), and the
check that refuses one made for another model."""

from __future__ import annotations

import hashlib

from torch import nn

from core_kv.models.attention import attention_modules, model_dims
from core_kv.models.packaged import canonical_name


class FingerprintMismatch(ValueError):
    """A stored artifact was made for a different base model."""


def model_fingerprint(model: nn.Module) -> dict:
    """Name, revision, layer/head shapes and a digest of the first layer's key projection.

    The digest separates two checkpoints that share a name (e.g. two random inits of a config-built model). A
    packaged model's converted folder is named by its short name (``smollm2-135m``), wherever the cache lives.
    """
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
