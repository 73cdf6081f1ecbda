"""Learning-rate schedules: the learning rate after ``step`` optimizer steps, one function per shape.

- :func:`warmup_cosine`: the distillation stages' (:mod:`core_kv.distill.loop`);
- :func:`wsd_linear`: the proxy LM's (:mod:`core_kv.proxy.train`); ``total`` can be raised on resume while the run is
  still in the stable part without changing the steps already taken;
- :func:`wsd_cosine`: the released recipe's online distillation (``OnlineConfig``).
"""

from __future__ import annotations

import math


def warmup_cosine(step: int, total: int, base: float, warmup: int) -> float:
    """Linear warm-up over ``warmup`` steps (from ``base / warmup`` at step 0), multiplied by a cosine from ``base``
    to 10% of ``base`` at step ``total`` (held there after) [choice]; ``total <= 0``: ``base``."""
    if total <= 0:
        return base
    warm = min(1.0, (step + 1) / max(warmup, 1))
    return base * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(step / total, 1.0))))


def wsd_linear(step: int, total: int, peak: float, warmup: int, decay_fraction: float, final_ratio: float) -> float:
    """Warmup-stable-decay: linear warm-up (from ``peak / warmup`` at step 0), constant ``peak``, then linear decay to
    ``final_ratio * peak`` over the last ``decay_fraction`` of ``total`` steps (held there after)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    decay_start = total * (1 - decay_fraction)
    if step < decay_start:
        return peak
    p = min(1.0, (step - decay_start) / max(1.0, total - decay_start))
    return peak * (1 - (1 - final_ratio) * p)


def wsd_cosine(step: int, peak: float, final: float, warmup: int, stable: int, decay: int) -> float:
    """Warmup-stable-decay: linear warm-up from 0 over ``warmup`` steps, ``stable`` steps at ``peak``, cosine decay to
    ``final`` over ``decay`` steps (held there after the schedule's end)."""
    if step < warmup:
        return peak * step / max(1, warmup)
    if step < warmup + stable:
        return peak
    d = min(1.0, max(0.0, (step - warmup - stable) / max(1, decay)))
    ratio = final / peak
    return peak * (ratio + (1 - ratio) * 0.5 * (1 + math.cos(math.pi * d)))
