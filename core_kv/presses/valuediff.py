"""ValueDiff: keep the tokens whose value vectors deviate most from the cache's mean value.

Park, Choi and Lee, "ValueDiff: Value-Geometric KV Cache Eviction for Sink-Suppressed LLMs"
(``../shared/papers/004_e4fd5de70ac2a9d7.txt``: abstract, Tables 1–3 and 9). The score of position i in a KV head
is ``||v_i - v̄||_2`` with ``v̄`` the mean value of the current cache; the highest scores are kept. The paper's
tables also report two value-geometry variants, selected here with ``variant``:

- ``"diff"`` (ValueDiff): ``||v_i - v̄||_2``;
- ``"vnorm"`` (V-Norm): ``||v_i||_2``;
- ``"vdir"`` (V-Dir): directional deviation from the mean value, ``1 - cos(v_i, v̄)``.

The paper's regime is a fixed token budget with eviction at every block boundary of a chunked prefill and at every
decoding step; here that is ``budget=2048, decoding=True, decoding_slack=0`` with
``core_kv.pipeline.prefill(..., chunk_size=block)``. The one-shot ``compression_ratio`` mode of the other presses
works unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from core_kv.presses.base import ScorerPress

VARIANTS = ("diff", "vnorm", "vdir")


def value_scores(values: torch.Tensor, variant: str = "diff", valid: torch.Tensor | None = None) -> torch.Tensor:
    """Scores ``(B, H, S)`` from values ``(B, H, S, D)``; ``valid`` ``(H, S)`` restricts the mean to real entries."""
    v = values.float()
    if variant == "vnorm":
        return v.norm(dim=-1)
    if valid is None:
        mean = v.mean(dim=2, keepdim=True)  # (B, H, 1, D)
    else:
        w = valid[None, :, :, None].to(v.dtype)  # (1, H, S, 1)
        mean = (v * w).sum(dim=2, keepdim=True) / w.sum(dim=2, keepdim=True).clamp_min(1.0)
    if variant == "diff":
        return (v - mean).norm(dim=-1)
    if variant == "vdir":
        return 1.0 - F.cosine_similarity(v, mean.expand_as(v), dim=-1)
    raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")


@dataclass
class ValueDiffPress(ScorerPress, name="valuediff"):
    """ValueDiff and its V-Norm / V-Dir variants (``../shared/papers/004_e4fd5de70ac2a9d7.txt``).

    One registered name with a ``variant`` option ("diff" | "vnorm" | "vdir") rather than three names, so the
    variants share budget and eviction-schedule options and cannot drift apart.

    Deviations: the available paper text gives neither the exact V-Dir formula nor the protected sink/recent
    positions or prefill block size; V-Dir is ``1 - cos(v_i, v̄)`` and protection defaults to none (set
    ``protected_sinks``/``protected_recent`` as for any press). The mean is over the whole current cache (after
    earlier evictions), per KV head, ignoring padding of a ragged cache.

    Args:
        variant: "diff" (ValueDiff), "vnorm" (V-Norm) or "vdir" (V-Dir).
    """

    variant: str = "diff"

    def validate(self) -> None:
        super().validate()
        if self.variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {self.variant!r}")

    def score(self, module, hidden_states, keys, values, attentions, kwargs) -> torch.Tensor:
        lengths = kwargs.get("kv_lengths")
        valid = None
        if lengths is not None and bool((lengths != values.shape[2]).any()):  # ragged cache, right-padded
            valid = torch.arange(values.shape[2], device=values.device)[None, :] < lengths[:, None]  # (Hkv, S)
        return value_scores(values, self.variant, valid)
