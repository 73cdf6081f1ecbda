"""``research/policy_candidates.py``: what it refuses, naming the cause (issue 60): an artifact of another base model
(the model, not a prompt-hash mismatch), a ``--candidate`` that is not JSON, a policy record missing a field."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from research import policy_candidates

ROOT = Path(__file__).resolve().parents[2]
PROXY = ROOT / "checkpoints" / "core-proxy" / "final"


@pytest.mark.parametrize("text", ["memory=false", "{'memory': false}", '{"memory": false'])
def test_a_candidate_that_is_not_json_names_itself_and_the_form_expected(text):
    with pytest.raises(SystemExit, match=rf"^--candidate {text!r}: not JSON .*e\.g\. --candidate '\{{\"head_budgets\""):
        policy_candidates.parse_candidates([text])


def test_a_candidate_of_bad_options_names_the_option():
    assert [c.describe() for c in policy_candidates.parse_candidates(['{"memory": false}'])] == ["uniform, memory off"]
    with pytest.raises(SystemExit, match=r"""^--candidate '\[1\]': policy options must be a mapping"""):
        policy_candidates.parse_candidates(["[1]"])
    with pytest.raises(
        SystemExit, match=r"""^--candidate '\{"colour": 1\}': unknown policy option\(s\) \['colour'\]"""
    ):
        policy_candidates.parse_candidates(['{"colour": 1}'])


@pytest.mark.parametrize("field", ["key", "tasks", "context_tokens", "per_task", "seed", "key.prompts", "key.weights"])
def test_a_record_missing_a_validation_field_names_it(tmp_path, field):
    """A record missing ``validation.key`` gave ``KeyError: 'key'``."""
    art = tmp_path / "final"
    shutil.copytree(PROXY, art)
    config = json.loads((art / "config.json").read_text())
    record = config["inference_policy"]["validation"]
    *head, last = field.split(".")
    for part in head:
        record = record[part]
    del record[last]
    (art / "config.json").write_text(json.dumps(config))
    with pytest.raises(SystemExit, match=rf"^{art / 'config.json'}: inference_policy lacks validation\.{field}"):
        policy_candidates.recorded_policy(art)


def test_a_damaged_record_is_named_with_its_file(tmp_path):
    art = tmp_path / "final"
    shutil.copytree(PROXY, art)
    config = json.loads((art / "config.json").read_text())
    config["inference_policy"]["bands"][0]["upto"] = "abc"
    (art / "config.json").write_text(json.dumps(config))
    with pytest.raises(SystemExit, match=rf"^{art / 'config.json'}: inference_policy: bands\[0\]\.upto"):
        policy_candidates.recorded_policy(art)


def test_an_artifact_of_another_base_model_names_the_model_not_the_prompts_hash():
    """The SmolLM2 artifact with the proxy LM reported a prompt-hash mismatch."""
    art = ROOT / "checkpoints" / "core-smollm2" / "final"
    argv = ["--artifact", str(art), "--model", "checkpoints/proxy-lm", "--candidate", '{"memory": false}',
            "--ratios", "0.5"]  # fmt: skip
    with pytest.raises(SystemExit, match=r"^--model checkpoints/proxy-lm is not the base model of .*core-smollm2/final "
                                         r"\(trained on 'smollm2-135m'\): .*layers: stored 30 vs model 4"):  # fmt: skip
        policy_candidates.main(argv)
