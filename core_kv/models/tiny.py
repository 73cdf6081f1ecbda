"""One builder for the random-weight models built from config alone: tests, benchmarks, ``load_model("tiny")``, the
teacher's ``model.random_init``.

``tiny_lm(**overrides)`` is a Llama of shape :data:`TINY` (2 layers, hidden 64, 4 query / 2 KV heads, head dim 16)
with any config field overridden, its weights a pure function of ``seed``; ``tiny_lm("qwen3")`` is the same shape in
another supported family (:data:`FAMILIES`, what the contract tests run every press on). A benchmark at a real model's
shape passes every size field (``tiny_lm(**SHAPES["llama-3.1-8b"])``): "tiny" names the use, not a size limit.
"""

from __future__ import annotations

import torch
from torch import nn

# The test shape (GQA 4:2, head dim 16).
TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
)

# family -> (config class, model class, what the family needs on top of TINY) in ``transformers``.
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0}),
    # Gemma 3 (Gemma-3-270M's mechanics): q/k norms, a RoPE base per layer type, query_pre_attn_scalar != head_dim
    # (so a 1/sqrt(D) shortcut shows), and sliding-window layers (window 48 < the tests' contexts) alternating with
    # global ones (Gemma-3-270M: 5 sliding per global, window 512).
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {"head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 48, "sliding_window_pattern": 2},
    ),
    # Gemma 2: the same without q/k norms, one RoPE, and attention-logit softcapping (run it with eager attention:
    # transformers' SDPA path ignores the softcap).
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {"head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 48, "attn_logit_softcapping": 5.0},
    ),
}


def tiny_lm(
    family: str = "llama", seed: int | None = 0, attn_implementation: str | None = "sdpa", **overrides
) -> nn.Module:
    """A causal LM of ``family`` with random weights, in eval mode, built from ``TINY | FAMILIES[family] | overrides``.

    Args:
        family: a key of :data:`FAMILIES`.
        seed: ``torch.manual_seed(seed)`` right before the weights are drawn (the global RNG is left there, as the
            callers always did); ``None`` draws from the RNG as it stands.
        attn_implementation: the attention path (``None``: the config's default).
        **overrides: config fields replacing or adding to :data:`TINY`.
    """
    import transformers

    config_name, model_name, extra = FAMILIES[family]
    config = getattr(transformers, config_name)(**{**TINY, **extra, **overrides})
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    if seed is not None:
        torch.manual_seed(seed)
    return getattr(transformers, model_name)(config).eval()
