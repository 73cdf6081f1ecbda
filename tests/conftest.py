"""Shared fixtures: tiny models built from config (no downloads), offline environment."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(min(2, torch.get_num_threads()))

TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
)


def tiny_model(family: str = "llama", attn: str = "sdpa", seed: int = 0):
    """A 2-layer GQA model (4 query heads, 2 KV heads) of the given family, random weights, eval mode."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Phi3Config,
        Phi3ForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    builders = {
        "llama": lambda: LlamaForCausalLM(LlamaConfig(**TINY, attn_implementation=attn)),
        "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**TINY, head_dim=16, attn_implementation=attn)),
        "mistral": lambda: MistralForCausalLM(MistralConfig(**TINY, attn_implementation=attn)),
        "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**TINY, attn_implementation=attn)),
        "phi3": lambda: Phi3ForCausalLM(Phi3Config(**TINY, pad_token_id=0, attn_implementation=attn)),
    }
    torch.manual_seed(seed)
    return builders[family]().eval()


@pytest.fixture(scope="session")
def llama():
    return tiny_model("llama")


@pytest.fixture(scope="session")
def qwen3():
    return tiny_model("qwen3")
