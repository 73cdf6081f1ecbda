"""Shared fixtures: tiny models built from config (no downloads), offline environment."""

from __future__ import annotations

import os

import pytest
import torch

from core_kv.models.tiny import tiny_lm

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(min(2, torch.get_num_threads()))


def tiny_model(family: str = "llama", attn: str = "sdpa", seed: int = 0):
    """A 2-layer GQA model (4 query heads, 2 KV heads) of the given family, random weights, eval mode."""
    return tiny_lm(family, seed, attn)


@pytest.fixture(scope="session")
def llama():
    return tiny_model("llama")


@pytest.fixture(scope="session")
def qwen3():
    return tiny_model("qwen3")
