"""``scripts/revalidate_policy.py``: the policy stage again on a copy of a finished artifact (other lengths, prompts or
candidates) without retraining; the source is never written, a rerun resumes, another artifact's folder is refused."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "checkpoints" / "core-proxy" / "final"


def _script():
    spec = importlib.util.spec_from_file_location("revalidate_policy", ROOT / "scripts" / "revalidate_policy.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


OPTIONS = ["progress=false", "policy.ratios=[0.75]", "policy.tasks=[single_noise]", "policy.lengths=[128,256]",
           "policy.per_task=[1,1]", 'policy.candidates=[{},{memory: false}]']  # fmt: skip


def test_the_stage_runs_on_a_copy_and_resumes(tmp_path, capsys):
    source = tmp_path / "source"
    shutil.copytree(SOURCE, source)
    before = {p.name: p.read_bytes() for p in source.iterdir()}
    out = tmp_path / "out"
    _script().main([str(source), str(out), *OPTIONS])
    assert {p.name: p.read_bytes() for p in source.iterdir()} == before  # the source is never written
    policy = json.loads((out / "final" / "config.json").read_text())["inference_policy"]
    assert [lb["length"] for lb in policy["lengths"]] == [128, 256]
    assert (out / "final" / "model.safetensors").read_bytes() == before["model.safetensors"]
    assert "## Inference policy" in (out / "report.md").read_text()
    assert json.loads((out / "summary.json").read_text())["policy"] == policy
    printed = capsys.readouterr().out
    assert (
        "[policy] 1 prompts of 128 tokens x (1 full cache + 1 ratios x 2 candidates) = 3 prefills; 3 still" in printed
    )
    _script().main([str(source), str(out), *OPTIONS])  # relaunched: every score is cached
    printed = capsys.readouterr().out
    assert f"reusing {out / 'final'}" in printed and "= 3 prefills; 0 still to run" in printed


def test_another_artifacts_folder_is_refused_and_kept(tmp_path):
    out = tmp_path / "out"
    (out / "final").mkdir(parents=True)
    shutil.copy(SOURCE / "config.json", out / "final" / "config.json")
    (out / "final" / "model.safetensors").write_bytes(b"other weights")
    with pytest.raises(SystemExit, match="holds another artifact's weights"):
        _script().main([str(SOURCE), str(out), *OPTIONS])
    assert (out / "final" / "model.safetensors").read_bytes() == b"other weights"
    with pytest.raises(SystemExit, match="not a CORE artifact"):
        _script().main([str(tmp_path), str(tmp_path / "o2"), *OPTIONS])
