"""``research/value_heads.py``: per-head retention of a needle's value (issue 20's essay diagnostic). The head
statistics against hand-computed values, and a run on the proxy LM."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from research import value_heads

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = vars(value_heads)


def test_head_stats_match_a_hand_computation():
    mass = torch.tensor([0.4, 0.1, 0.2, 0.3])  # value = positions 1, 2 (full-cache share 0.3)
    whole, vmass, infl = SCRIPT["head_stats"](mass, {0, 1, 2}, [1, 2])
    assert whole is True and vmass == pytest.approx(1.0)
    assert infl == pytest.approx((0.3 / 0.7) / 0.3)  # the value's share of the kept mass grows when 3 is evicted
    whole, vmass, infl = SCRIPT["head_stats"](mass, {0, 2, 3}, [1, 2])
    assert whole is False and vmass == pytest.approx(0.2 / 0.3)
    assert infl == pytest.approx((0.2 / 0.9) / 0.3)
    whole, vmass, infl = SCRIPT["head_stats"](mass, {0, 3}, [1, 2])
    assert (whole, vmass, infl) == (False, 0.0, 0.0)


@pytest.mark.skipif(not (ROOT / "checkpoints" / "proxy-lm").is_dir(), reason="the shipped proxy LM is not checked out")
def test_a_run_on_the_proxy_reports_shares_and_keydiff_at_90_percent_loses_part_of_the_value():
    # a 256-token noise haystack at 90%: KeyDiff keeps a tenth of it per head and loses some of the value's digits
    out = SCRIPT["main"]([
        "--model", str(ROOT / "checkpoints" / "proxy-lm"), "--methods", "keydiff", "--ratio", "0.9",
        "--haystack", "noise", "--n", "1", "--length", "256", "--top", "3",
    ])  # fmt: skip
    s = out["keydiff"]
    assert 0.0 <= s["whole"] <= 1.0 and 0.0 <= s["value_mass"] <= 1.0 + 1e-6
    assert 0.0 <= s["repeated_kept"] <= 1.0 and s["first_kept"] < 1.0
