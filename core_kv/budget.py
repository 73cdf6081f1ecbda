"""The one budget rule shared by every press, the teacher and replay (``../shared/design/CORE.md``; paper §3).

Out of ``n`` tokens a head keeps ``B = floor(n (1 − ratio))`` (at least 1, at most ``n``); inside ``B`` the first
``s = min(sinks, B)`` and the last ``w = min(recent, B − s)`` positions are protected (always kept).
"""

from __future__ import annotations

import math


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
