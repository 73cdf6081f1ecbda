"""Model loading: the tiny config-built model, the local-folder path, default-model choice and clear errors."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from core_kv.models import loading
from core_kv.models.loading import (
    TINY,
    TINY_LABEL,
    ContextWindowError,
    check_context_window,
    context_window,
    load_model,
    model_label,
)


@pytest.fixture(scope="module")
def tiny():
    return load_model(TINY)


def test_tiny_is_deterministic_and_round_trips_text(tiny):
    model, tok = tiny
    text = "The special magic number for quiet-river is: 1234567. Ünïcode too."
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert model.config.vocab_size == len(tok)
    assert model.config.bos_token_id == tok.bos_token_id and model.config.eos_token_id == tok.eos_token_id
    again, _ = load_model(TINY)
    for a, b in zip(model.state_dict().values(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert not model.training
    assert model_label(TINY) == TINY_LABEL


def test_local_folder_loads_offline_with_dtype(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, tok = tiny
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded, tok2 = load_model(str(tmp_path), dtype="float32")
    ids = torch.tensor([tok.encode("hello there", add_special_tokens=False)])
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, loaded(ids).logits, atol=1e-5)
    assert tok2.encode("hello there") == tok.encode("hello there")
    bf16, _ = load_model(str(tmp_path), dtype="bfloat16")
    assert next(bf16.parameters()).dtype == torch.bfloat16
    assert model_label(str(tmp_path)) == str(tmp_path)


def test_missing_model_offline_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(OSError, match="offline"):
        load_model("no-such-org/no-such-model-xyz")
    (tmp_path / "empty").mkdir()
    with pytest.raises(OSError, match="not a complete Hugging Face model folder"):
        load_model(str(tmp_path / "empty"))


def test_bad_options_raise():
    with pytest.raises(ValueError, match="unknown dtype"):
        load_model(TINY, dtype="float8")
    if importlib.util.find_spec("flash_attn") is None:
        with pytest.raises(ImportError, match="flash_attn"):
            load_model("some/model", attn_implementation="flash_attention_2")


def test_context_window_check(tiny):
    model, _ = tiny
    window = context_window(model)
    assert window == model.config.max_position_embeddings
    check_context_window(model, window)
    with pytest.raises(ContextWindowError, match=f"context window is {window}"):
        check_context_window(model, window + 1, "ruler L=16384")


def test_default_model_is_smollm2_when_its_wheel_is_installed(monkeypatch):
    monkeypatch.setattr(loading, "_packaged_installed", lambda name: name == "smollm2-135m")
    assert loading.default_model() == "smollm2-135m"


def test_default_model_without_smollm2_prefers_shipped_proxy(tmp_path, monkeypatch):
    monkeypatch.setattr(loading, "_packaged_installed", lambda name: False)
    monkeypatch.setattr(loading, "PROXY_PATH", tmp_path / "proxy-lm")
    assert loading.default_model() == TINY
    (tmp_path / "proxy-lm").mkdir()
    (tmp_path / "proxy-lm" / "config.json").write_text("{}")
    assert loading.default_model() == str(tmp_path / "proxy-lm")
    assert "proxy-lm" in loading.model_label(loading.default_model())


@pytest.mark.parametrize("kind", ["absolute", "dot", "existing_parent"])
def test_missing_local_folder_is_named_not_an_offline_hub_id(kind, tmp_path, monkeypatch):
    """A path that does not exist is reported as "no such folder", not as a hub id missing from the offline cache."""
    from core_kv.models.loading import load_model

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    name = {"absolute": str(tmp_path / "some" / "missing" / "dir"), "dot": "./missing-model",
            "existing_parent": "runs/missing-model"}[kind]  # fmt: skip
    with pytest.raises(OSError, match="no such folder") as e:
        load_model(name)
    assert "offline" not in str(e.value)
