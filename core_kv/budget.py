"""The one budget rule shared by every press, the teacher and replay (``../shared/design/CORE.md``; paper §3).

Out of ``n`` tokens a head keeps ``B = floor(n (1 − ratio))`` (at least 1, at most ``n``); inside ``B`` the first
``s = min(sinks, B)`` and the last ``w = min(recent, B − s)`` positions are protected (always kept), and the other
``B − s − w`` are the top of a score (:func:`top_free`): the Top-B rule of the teacher, the replay and CORE's press.
"""

from __future__ import annotations

import math

import torch


def kept_tokens(n: int, ratio: float) -> int:
    """``B = floor(n (1 − ratio))`` clipped to ``[1, n]`` (the ``1e-9`` absorbs float error at exact products)."""
    return max(1, min(n, math.floor(n * (1.0 - ratio) + 1e-9)))


def protected_split(b: int, sinks: int, recent: int) -> tuple[int, int]:
    """``(s, w)``: protected sinks and recent positions inside a budget of ``b``."""
    s = min(sinks, b)
    return s, min(recent, b - s)


def budget_split(n: int, ratio: float, sinks: int, recent: int) -> tuple[int, int, int]:
    """``(B, s, w)``: tokens kept per head, protected sinks and protected recent tokens, for ``n`` candidates."""
    b = kept_tokens(n, ratio)
    return (b, *protected_split(b, sinks, recent))


def protected_mask(n: int, s: int, w: int, device=None) -> torch.Tensor:
    """The protected positions ``(N,)`` of ``n`` candidates: the first ``s`` and the last ``w``."""
    m = torch.zeros(n, dtype=torch.bool, device=device)
    m[:s] = True
    if w:
        m[n - w :] = True
    return m


def top_free(scores: torch.Tensor, protected: torch.Tensor, b_free: int) -> torch.Tensor:
    """Retained mask (H, N): the protected tokens plus the top ``b_free`` others by ``scores`` (H, N)."""
    masked = scores.masked_fill(protected, float("-inf"))
    mask = protected.expand_as(scores).clone()
    if b_free > 0:
        mask.scatter_(-1, masked.topk(b_free, dim=-1).indices, True)
    return mask
