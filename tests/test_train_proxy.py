"""The proxy-LM training loop (``core_kv.models.train_proxy``): resume equivalence, warm start, export.

A config-sized model (1 layer, hidden 32) and a 512-token tokenizer trained on the fly; 4 steps of 2-3 short
sequences each, so the whole file runs in a few seconds on CPU.
"""

from __future__ import annotations

import json

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from core_kv.models.train_proxy import TrainConfig, export, train


def _cfg(out, **kw) -> TrainConfig:
    base = dict(
        out_dir=str(out),
        export_dir=str(out / "export"),
        base_vocab=512,
        key_word_tokens=False,
        lm_fraction=1.0,
        total_steps=4,
        warmup_steps=40,  # every step is in the warm-up: the lr does not depend on total_steps
        phases=[{"min_len": 48, "max_len": 96, "tokens_per_step": 256, "mix": {"niah_single_1": 0.5, "mk_noise": 0.5}}],
        probe_every=10_000,
        probe_lengths=[256],
        probe_n=1,
        log_every=1,
        threads=1,
        bf16=False,
        ckpt_every_s=1e9,
    )
    base["model"] = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
                     "intermediate_size": 64}  # fmt: skip
    base.update(kw)
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainConfig), base))


def _weights(ckpt) -> dict[str, torch.Tensor]:
    return load_file(str(ckpt / "model.safetensors"))


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    out = tmp_path_factory.mktemp("straight")
    return out, train(_cfg(out))


def test_resume_reaches_the_same_weights(straight, tmp_path):
    _, ckpt = straight
    train(_cfg(tmp_path, total_steps=2))  # "interrupted" after 2 steps (checkpoint written on exit)
    resumed = train(_cfg(tmp_path))  # the rerun resumes from step 2
    assert json.loads((resumed / "state.json").read_text())["step"] == 4
    a, b = _weights(ckpt), _weights(resumed)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)


def test_warm_start_keeps_weights_and_tokenizer_and_chains_the_log(straight, tmp_path):
    out, _ = straight
    parent = export(_cfg(out))
    child_cfg = _cfg(tmp_path / "child", init_from=str(parent), total_steps=2, export_dir=str(tmp_path / "final"))
    from core_kv.models.train_proxy import latest_checkpoint

    # before any step the warm-started model is the parent (zero steps: only the start-up checkpoint is written)
    start = train(_cfg(tmp_path / "zero", init_from=str(parent), total_steps=0))
    for k, v in _weights(parent).items():
        torch.testing.assert_close(_weights(start)[k], v, rtol=0, atol=0, msg=k)
    assert (tmp_path / "zero" / "tokenizer" / "tokenizer.json").read_text() == (parent / "tokenizer.json").read_text()

    train(child_cfg)
    assert latest_checkpoint(tmp_path / "child") is not None
    final = export(child_cfg)
    rows = [json.loads(line) for line in (final / "training_log.jsonl").read_text().splitlines()]
    assert [(r["stage"], r["step"]) for r in rows] == [(0, 1), (0, 2), (0, 3), (0, 4), (1, 5), (1, 6)]
    assert (final / "loss_curve.png").stat().st_size > 0


def test_warm_start_refuses_a_folder_without_tokenizer(tmp_path):
    with pytest.raises(FileNotFoundError, match="not an exported proxy folder"):
        train(_cfg(tmp_path / "run", init_from=str(tmp_path)))
