"""The learning-rate schedules (``core_kv/schedules.py``) at the points that define them: warm-up, peak, the middle
and the end of the decay, and after the end."""

from __future__ import annotations

import math

import pytest

from core_kv.schedules import warmup_cosine, wsd_cosine, wsd_linear


def test_warmup_cosine():
    base, total, warmup = 1e-3, 100, 10
    assert warmup_cosine(0, total, base, warmup) == pytest.approx(base / warmup)  # (step + 1) / warmup, cosine ~1
    assert warmup_cosine(9, total, base, warmup) == pytest.approx(
        base * (0.1 + 0.9 * 0.5 * (1 + math.cos(0.09 * math.pi)))
    )
    assert warmup_cosine(50, total, base, warmup) == pytest.approx(base * 0.55)  # half-way down to 10%
    assert warmup_cosine(100, total, base, warmup) == pytest.approx(base * 0.1)
    assert warmup_cosine(500, total, base, warmup) == pytest.approx(base * 0.1)  # held at 10% after the end
    assert warmup_cosine(7, 0, base, warmup) == base  # no schedule: the base rate
    assert warmup_cosine(0, total, base, 0) == pytest.approx(base)  # no warm-up


def test_wsd_linear():
    peak, total, warmup = 2e-3, 1000, 40
    assert wsd_linear(0, total, peak, warmup, 0.2, 0.1) == pytest.approx(peak / warmup)
    assert wsd_linear(39, total, peak, warmup, 0.2, 0.1) == pytest.approx(peak)
    assert wsd_linear(40, total, peak, warmup, 0.2, 0.1) == peak
    assert wsd_linear(799, total, peak, warmup, 0.2, 0.1) == peak  # stable until the last 20%
    assert wsd_linear(900, total, peak, warmup, 0.2, 0.1) == pytest.approx(peak * 0.55)  # linear: half-way
    assert wsd_linear(1000, total, peak, warmup, 0.2, 0.1) == pytest.approx(peak * 0.1)
    assert wsd_linear(2000, total, peak, warmup, 0.2, 0.1) == pytest.approx(peak * 0.1)
    # raising total in the stable part leaves the steps taken unchanged
    assert [wsd_linear(s, 2000, peak, warmup, 0.2, 0.1) for s in range(0, 800, 50)] == [
        wsd_linear(s, total, peak, warmup, 0.2, 0.1) for s in range(0, 800, 50)
    ]


def test_wsd_cosine():
    peak, final = 5e-4, 7.5e-6
    assert wsd_cosine(0, peak, final, 100, 3100, 2000) == 0.0  # warm-up from 0
    assert wsd_cosine(50, peak, final, 100, 3100, 2000) == pytest.approx(2.5e-4)
    assert wsd_cosine(100, peak, final, 100, 3100, 2000) == wsd_cosine(3199, peak, final, 100, 3100, 2000) == peak
    assert wsd_cosine(4200, peak, final, 100, 3100, 2000) == pytest.approx(final + (peak - final) * 0.5)
    assert wsd_cosine(5200, peak, final, 100, 3100, 2000) == pytest.approx(final)
    assert wsd_cosine(9999, peak, final, 100, 3100, 2000) == pytest.approx(final)
