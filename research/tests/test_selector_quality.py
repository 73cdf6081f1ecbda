"""``research/selector_quality.py`` on a tiny training run (the run of ``tests/test_train_entry.py``'s reference)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import run, tiny_args


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ref")
    run(tiny_args(out, tmp_path_factory.mktemp("teacher")))
    return out


def test_selector_quality_reproduces_the_report_and_scores_presses(reference):
    """``research/selector_quality.py`` replays the run's held-out events: its utility / teacher / student J_B are
    the report's Table 7 (same events, same sets), and each press gets a row on the same problems."""
    import json

    from research import selector_quality

    out = selector_quality.main(["--run", str(reference)])
    t7 = json.loads((reference / "summary.json").read_text())["eval"]["r75"]["table7"]
    rows = out["r75"]
    for name in ("utility", "teacher", "student"):
        for k in ("U_B", "C_B", "J_B"):
            assert rows[name][k] == pytest.approx(t7[name][k], abs=1e-6), (name, k)
    assert {"snapkv", "keydiff", "expected_attention"} <= rows.keys()
    assert len({r["n"] for r in rows.values()}) == 1
    assert all(0 < r["U_B"] <= 1 + 1e-9 for r in rows.values())
