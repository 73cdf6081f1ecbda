"""The shipped CORE artifact for SmolLM2-135M (``checkpoints/core-smollm2/final``, feature spec v2): it loads, matches
SmolLM2's fingerprint, compresses a real SmolLM2 prefill to the exact budget, is refused on another base model, and is
what ``make train-smollm2`` (``configs/train/smollm2.yaml``) builds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from core_kv.models.cache import layer_lengths
from core_kv.models.fingerprint import FingerprintMismatch, model_fingerprint
from core_kv.models.loading import load_model
from core_kv.presses import build_press

CHECKPOINTS = Path(__file__).resolve().parents[1] / "checkpoints"
ROOT = CHECKPOINTS.parent


@pytest.fixture
def artifact() -> Path:
    return CHECKPOINTS / "core-smollm2" / "final"


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2-135m", dtype="float32")


def test_artifact_matches_smollm2s_fingerprint(smollm2, artifact):
    from core_kv.core_model import CoreModel

    core = CoreModel.from_pretrained(artifact)
    assert core.config.feature_spec["version"] == 2
    stored = core.config.fingerprint
    assert stored == model_fingerprint(smollm2[0])
    assert stored["name"] == "smollm2-135m" and stored["layers"] == 30 and stored["kv_heads"] == 3


@pytest.mark.parametrize("ratio", [0.75, 0.9])
def test_compresses_a_smollm2_prefill_to_the_exact_budget(smollm2, artifact, ratio):
    model, tok = smollm2
    text = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. " * 24
    ids = torch.tensor([tok.encode(text, add_special_tokens=False)[:512]])
    n = ids.shape[1]
    press = build_press("core", checkpoint=str(artifact), compression_ratio=ratio, policy="paper")
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


@pytest.mark.parametrize("config", ["recorded", "make train-smollm2"])
def test_run_key_matches_the_recorded_config(artifact, config):
    """``run.json`` is the key the trainer computes from the artifact's resolved ``config.yaml`` and from
    ``configs/train/smollm2.yaml`` (``make train-smollm2``): a relaunch of that config into the folder resumes it (and
    only runs the policy stage), any other config does not mistake the folder for its own."""
    import json

    from core_kv.config import load_config
    from core_kv.distill.config import TrainConfig
    from core_kv.distill.trainer import Trainer

    folder = artifact.parent
    stored = json.loads((folder / "run.json").read_text())
    path = folder / "config.yaml" if config == "recorded" else ROOT / "configs" / "train" / "smollm2.yaml"
    cfg = load_config(TrainConfig, ["--config", str(path)])
    trainer = Trainer.__new__(Trainer)  # the key needs the config and the base model's fingerprint, no accelerator
    trainer.cfg, trainer.fingerprint = cfg, stored["fingerprint"]
    assert trainer.run_key() == stored
    assert cfg.teacher.features == 2
