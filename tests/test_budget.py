"""One budget rule (:mod:`core_kv.budget`): the presses and the teacher/replay split a budget the same way."""

from __future__ import annotations

import math

import pytest

from core_kv.budget import budget_split, kept_tokens, protected_split
from core_kv.presses import build_press


@pytest.mark.parametrize("ratio", [0.0, 0.25, 0.5, 0.75, 0.9, 0.999])
@pytest.mark.parametrize("n", [1, 7, 100, 1000, 4097])
def test_press_budget_is_the_teacher_budget(n, ratio):
    press = build_press("knorm", compression_ratio=ratio, protected_sinks=4, protected_recent=32)
    b, s, w = budget_split(n, ratio, 4, 32)
    assert press.target(n) == b == kept_tokens(n, ratio)
    assert press.protected(b) == (s, w) == protected_split(b, 4, 32)
    assert 1 <= b <= n and b == max(1, math.floor(round(n * (1 - ratio), 9)))
    assert s + w <= b


def test_known_values():
    assert budget_split(100, 0.75, 4, 32) == (25, 4, 21)
    assert budget_split(10, 0.5, 8, 8) == (5, 5, 0)
    assert kept_tokens(3, 0.999) == 1
