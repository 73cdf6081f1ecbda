"""The shipped CORE artifacts for SmolLM2-135M (``checkpoints/core-smollm2/final``, feature spec v1, and
``checkpoints/core-smollm2-v2/final``, spec v2): each loads, matches SmolLM2's fingerprint, compresses a real SmolLM2
prefill to the exact budget, and is refused on another base model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from core_kv.geometry import FingerprintMismatch, model_fingerprint
from core_kv.models.cache import layer_lengths
from core_kv.models.loading import load_model
from core_kv.presses import build_press

CHECKPOINTS = Path(__file__).resolve().parents[1] / "checkpoints"
ARTIFACTS = {1: CHECKPOINTS / "core-smollm2" / "final", 2: CHECKPOINTS / "core-smollm2-v2" / "final"}


@pytest.fixture(params=sorted(ARTIFACTS), ids=lambda v: f"spec-v{v}")
def artifact(request) -> Path:
    return ARTIFACTS[request.param]


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2-135m", dtype="float32")


def test_artifact_matches_smollm2s_fingerprint(smollm2, artifact):
    from core_kv.core_model import CoreModel

    core = CoreModel.from_pretrained(artifact)
    assert core.config.feature_spec["version"] == next(v for v, p in ARTIFACTS.items() if p == artifact)
    stored = core.config.fingerprint
    assert stored == model_fingerprint(smollm2[0])
    assert stored["name"] == "smollm2-135m" and stored["layers"] == 30 and stored["kv_heads"] == 3


@pytest.mark.parametrize("ratio", [0.75, 0.9])
def test_compresses_a_smollm2_prefill_to_the_exact_budget(smollm2, artifact, ratio):
    model, tok = smollm2
    text = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. " * 24
    ids = torch.tensor([tok.encode(text, add_special_tokens=False)[:512]])
    n = ids.shape[1]
    press = build_press("core", checkpoint=str(artifact), compression_ratio=ratio)
    cache = DynamicCache()
    with torch.inference_mode(), press(model):
        model.model(input_ids=ids, past_key_values=cache)
    budget = int(n * (1 - ratio))
    assert len(cache.layers) == 30
    assert all(layer_lengths(layer).tolist() == [budget] * 3 for layer in cache.layers)
    assert len(press.events) == 30 and all(e["budget"] == budget for e in press.events)


def test_refused_on_another_base_model(artifact):
    proxy, tok = load_model("checkpoints/proxy-lm", dtype="float32")
    press = build_press("core", checkpoint=str(artifact), compression_ratio=0.75)
    ids = torch.tensor([tok.encode("The grass is green. " * 20)])
    with pytest.raises(FingerprintMismatch), torch.inference_mode(), press(proxy):
        proxy.model(input_ids=ids, past_key_values=DynamicCache())


def test_run_key_matches_the_recorded_config(artifact):
    """``run.json`` is the key the trainer computes from the artifact's resolved ``config.yaml``: a relaunch of that
    config into the folder resumes it, and a relaunch of any other config (another feature spec included) does not
    mistake the folder for its own."""
    import json

    from core_kv.config import load_config
    from core_kv.distill.config import TrainConfig
    from core_kv.distill.trainer import Trainer

    folder = artifact.parent
    stored = json.loads((folder / "run.json").read_text())
    cfg = load_config(TrainConfig, ["--config", str(folder / "config.yaml")])
    trainer = Trainer.__new__(Trainer)  # the key needs the config and the base model's fingerprint, no accelerator
    trainer.cfg, trainer.fingerprint = cfg, stored["fingerprint"]
    assert trainer.run_key() == stored
    assert cfg.teacher.features == next(v for v, p in ARTIFACTS.items() if p == artifact)


def test_artifacts_of_different_feature_specs_have_different_run_keys():
    import json

    keys = [json.loads((p.parent / "run.json").read_text()) for p in ARTIFACTS.values()]
    assert keys[0]["config_hash"] != keys[1]["config_hash"]
    assert all(keys[0]["stages"][s] != keys[1]["stages"][s] for s in keys[0]["stages"])
