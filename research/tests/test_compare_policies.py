"""research.compare_policies: the policy stage's rule between artifacts, on the scores they recorded."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from research.compare_policies import compare, main

ROOT = Path(__file__).resolve().parents[2]


def _artifact(tmp_path: Path, name: str, scores: dict[str, float], prompts: str | None = None) -> Path:
    """A copy of the proxy artifact's config whose recorded candidates at 0.75 get ``scores`` (label -> accuracy)."""
    art = tmp_path / name
    art.mkdir()
    cfg = json.loads((ROOT / "checkpoints" / "core-proxy" / "final" / "config.json").read_text())
    policy = cfg["inference_policy"]
    for c in policy["candidates"]["0.75"]:
        c["accuracy"], c["logprob"] = scores.get(c["label"], 0.0), -1.0
    if prompts is not None:
        policy["validation"]["key"]["prompts"] = prompts
    (art / "config.json").write_text(json.dumps(cfg))
    return art


def test_each_artifacts_chosen_composition_competes_and_the_rule_picks(tmp_path, capsys):
    a = _artifact(tmp_path, "a", {"uniform, memory": 0.5, "adaptive/score, memory off": 0.625})
    b = _artifact(tmp_path, "b", {"uniform, memory off": 0.75})
    rows = compare([a, b], ratios=[0.75])
    assert [(r["length"], r["ratio"]) for r in rows] == [(512, 0.75)]
    assert [(c["label"], c["accuracy"]) for c in rows[0]["chosen"]] == [("adaptive/score, memory off", 0.625),
                                                                      ("uniform, memory off", 0.75)]  # fmt: skip
    assert rows[0]["winner"] == str(b)
    main([str(a), str(b), "--ratios", "0.75"])
    assert "| 512 | 0.75 | adaptive/score, memory off: 0.625 (-1.000, n=8) | uniform, memory off: 0.750" in (
        capsys.readouterr().out
    )


def test_artifacts_validated_on_other_prompts_do_not_compare(tmp_path):
    a = _artifact(tmp_path, "a", {})
    b = _artifact(tmp_path, "b", {}, prompts="0000000000000000")
    with pytest.raises(SystemExit, match="different prompts"):
        compare([a, b])
    shutil.rmtree(b)
    b.mkdir()
    (b / "config.json").write_text(json.dumps({"model_type": "core_kv"}))
    with pytest.raises(SystemExit, match="no inference_policy"):
        compare([a, b])
