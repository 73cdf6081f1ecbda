"""Per-family attention access and the attention function that reads per-head (ragged) caches exactly.

Supported families are the entries of :data:`FAMILIES` (one :class:`Family` per attention class): Llama, Mistral,
Qwen2, Qwen3 (q/k RMSNorm before RoPE), Phi3 (fused ``qkv_proj``, partial rotary), Gemma 2 (``query_pre_attn_scalar``,
logit softcapping, sliding-window layers) and Gemma 3 (q/k norms, a RoPE base per layer type, sliding-window layers).
What differs between families is data, not code: the helpers below read the entry, the module's own ``scaling``
(``query_pre_attn_scalar ** -0.5`` for Gemma), its ``attn_logit_softcapping`` when set, and its sliding window.
Anything else raises :class:`UnsupportedModelError` rather than computing a wrong result.

**Window layers** (:func:`window_layers`): a layer whose attention the model restricts to a sliding window of W
positions (Gemma 2/3's ``sliding_attention`` layers, Qwen2/3's lower layers with ``use_sliding_window``, Mistral's
every layer when ``config.sliding_window`` is set). The model's own cache (:func:`~core_kv.models.cache.new_cache`)
keeps at most W - 1 positions there, whatever the context length. Presses compress the other (global) layers only
(:func:`press_layers`; the rule and its measurements: ``docs/presses.md`` "Sliding-window layers").

The ragged attention path (``core_kv+<base>``, e.g. ``core_kv+sdpa``) is registered with transformers'
``AttentionInterface``: for an ordinary rectangular cache it calls the base implementation unchanged; for a
:class:`~core_kv.models.cache.RaggedLayer` it reads each KV head's rows in place with that head's query heads
(:func:`ragged_sdpa`). It is exact: no fake keys, no padding to the longest head (see ``../shared/design/PRESSES.md``).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface, DynamicCache
from transformers.cache_utils import DynamicSlidingWindowLayer
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from core_kv.models.cache import RaggedKV


@dataclass(frozen=True)
class Family:
    """How core_kv reads one attention class; a new family with the same mechanics is one more :data:`FAMILIES` entry.

    What every family shares is read from the module itself: ``scaling`` (the factor on ``q · k``),
    ``attn_logit_softcapping`` (when set) and ``sliding_window`` (``None`` on a global layer).

    Args:
        fused_qkv: Q, K and V come from one ``qkv_proj`` (Phi3), else ``q_proj``/``k_proj``/``v_proj``.
        qk_norm: the model applies ``q_norm``/``k_norm`` (per head, over D) to Q and K before RoPE (Qwen3, Gemma 3).
        rope_layer_type: the model's ``rotary_emb(x, position_ids, layer_type)`` has a RoPE per layer type (Gemma 3:
            base 10k in sliding layers, 1M in global ones); the type is ``config.layer_types[layer_idx]``.
    """

    fused_qkv: bool = False
    qk_norm: bool = False
    rope_layer_type: bool = False


FAMILIES: dict[str, Family] = {
    "LlamaAttention": Family(),
    "MistralAttention": Family(),
    "Qwen2Attention": Family(),
    "Qwen3Attention": Family(qk_norm=True),
    "Phi3Attention": Family(fused_qkv=True),
    "Gemma2Attention": Family(),
    "Gemma3Attention": Family(qk_norm=True, rope_layer_type=True),
}
SUPPORTED_ATTENTION = tuple(FAMILIES)
PREFIX = "core_kv+"


class UnsupportedModelError(ValueError):
    """The model's architecture or attention implementation is not one core_kv can compress exactly."""


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of a causal LM (``model.model.layers``), checked for a supported attention class."""
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise UnsupportedModelError(f"{type(model).__name__}: no `model.layers`; core_kv supports decoder-only LMs")
    for layer in layers:
        name = type(layer.self_attn).__name__
        if name not in SUPPORTED_ATTENTION:
            raise UnsupportedModelError(
                f"attention class {name} is not supported (supported: {', '.join(SUPPORTED_ATTENTION)})"
            )
    return list(layers)


def attention_modules(model: nn.Module) -> list[nn.Module]:
    return [layer.self_attn for layer in decoder_layers(model)]


def family(module: nn.Module) -> Family:
    """The :data:`FAMILIES` entry of an attention module (``UnsupportedModelError`` for any other class)."""
    name = type(module).__name__
    if name not in FAMILIES:
        raise UnsupportedModelError(f"attention class {name} is not supported (supported: {', '.join(FAMILIES)})")
    return FAMILIES[name]


def sliding_window(module: nn.Module) -> int | None:
    """The sliding window W the model restricts this attention module to (its ``sliding_window`` attribute), ``None``
    for a global (full-attention) layer."""
    family(module)
    window = getattr(module, "sliding_window", None)
    return int(window) if window else None


def window_layers(model: nn.Module) -> dict[int, int]:
    """``{layer index: W}`` of a hybrid model's sliding-window layers (Gemma 2/3: five of every six).

    Empty for a model with global attention only, and for one whose every layer has the window (Mistral-7B-v0.1's
    and Phi-3-mini-4k's ``config.sliding_window`` apply to every layer, and their classes carry no per-layer
    window): such a model is compressed in every layer with a plain ``DynamicCache``, as before window layers
    were supported.
    """
    windows = {i: w for i, attn in enumerate(attention_modules(model)) if (w := sliding_window(attn)) is not None}
    return {} if len(windows) == len(attention_modules(model)) else windows


def press_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers a press compresses: the global ones. Window layers keep their window (at most W - 1
    positions in the model's own cache; ``docs/presses.md`` "Sliding-window layers")."""
    windows = window_layers(model)
    return [layer for i, layer in enumerate(decoder_layers(model)) if i not in windows]


def new_cache(model: nn.Module) -> DynamicCache:
    """The empty cache the model itself would build: for a hybrid model (:func:`window_layers`) a ``DynamicCache``
    from its config, whose window layers are ``DynamicSlidingWindowLayer`` s storing at most W - 1 positions; else a
    plain ``DynamicCache`` of ``DynamicLayer`` s (what presses compress).

    Raises:
        UnsupportedModelError: the config's cache layout disagrees with the attention modules' windows.
    """
    windows = window_layers(model)
    if not windows:
        return DynamicCache()
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    cache = DynamicCache(config=config)
    got = {
        i: layer.sliding_window for i, layer in enumerate(cache.layers) if isinstance(layer, DynamicSlidingWindowLayer)
    }
    if got != windows:
        raise UnsupportedModelError(
            f"{type(model).__name__}: the cache built from its config has window layers {got}, its attention modules "
            f"{windows}; core_kv cannot tell which layers keep a window"
        )
    return cache


def attention_scale(module: nn.Module) -> float:
    """The factor on ``q · k`` in the model's attention: ``module.scaling`` (``head_dim ** -0.5``, or
    ``query_pre_attn_scalar ** -0.5`` for Gemma)."""
    return float(getattr(module, "scaling", module.head_dim**-0.5))


def logit_softcap(module: nn.Module) -> float | None:
    """``attn_logit_softcapping`` of the module when its config sets one (Gemma 2: 50), else ``None``."""
    cap = getattr(module, "attn_logit_softcapping", None)
    return float(cap) if cap else None


def softcapped(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``cap · tanh(logits / cap)`` (Gemma 2's attention-logit softcapping), or ``logits`` when ``cap`` is unset."""
    return logits if not cap else torch.tanh(logits / cap) * cap


def attention_logits(module: nn.Module, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The model's attention logits ``q @ k^T``, scaled and softcapped as the module does, ``(..., T, S)``.

    ``q`` ``(..., T, D)``, ``k`` ``(..., S, D)`` (post-RoPE). With the default scale it divides by ``sqrt(D)``, the
    form kvpress's presses use (bit-identical scores to before this helper for Llama-like families)."""
    logits = q @ k.transpose(-1, -2)
    d = q.shape[-1]
    scale = attention_scale(module)
    logits = logits / math.sqrt(d) if scale == d**-0.5 else logits * scale
    return softcapped(logits, logit_softcap(module))


def layer_rotary(model: nn.Module) -> Callable[[nn.Module, torch.Tensor, torch.Tensor], tuple]:
    """``rope(module, x, position_ids) -> (cos, sin)``: the RoPE the model applies in ``module``'s layer at
    ``position_ids`` ``(1, N)`` (per layer type where the family has one: Gemma 3's sliding vs global bases)."""
    rotary = getattr(model, "model", model).rotary_emb

    def rope(module: nn.Module, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if family(module).rope_layer_type:
            return rotary(x, position_ids, module.config.layer_types[module.layer_idx])
        return rotary(x, position_ids)

    return rope


def model_dims(model: nn.Module) -> dict:
    """Layer/head geometry: ``{"layers", "heads", "kv_heads", "head_dim", "groups"}``."""
    attn = attention_modules(model)[0]
    cfg = model.config
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    return {
        "layers": cfg.num_hidden_layers,
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": attn.head_dim,
        "groups": heads // kv_heads,
    }


def _family(module: nn.Module):
    return sys.modules[type(module).__module__]


def _split_qkv(module: nn.Module, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw Q, K, V projections ``(B, T, H*D)``, ``(B, T, Hkv*D)``, ``(B, T, Hkv*D)``."""
    if family(module).fused_qkv:  # Phi3
        qkv = module.qkv_proj(hidden_states)
        q_end = module.config.num_attention_heads * module.head_dim
        kv = module.num_key_value_heads * module.head_dim
        return qkv[..., :q_end], qkv[..., q_end : q_end + kv], qkv[..., q_end + kv :]
    return module.q_proj(hidden_states), module.k_proj(hidden_states), module.v_proj(hidden_states)


def _heads(module: nn.Module, x: torch.Tensor, norm: str | None = None) -> torch.Tensor:
    """``(B, T, n·D)`` -> ``(B, n, T, D)``, the family's ``norm`` (``q_norm`` / ``k_norm``) applied where it has one."""
    b, t, _ = x.shape
    x = x.view(b, t, -1, module.head_dim)
    if norm is not None and family(module).qk_norm:
        x = getattr(module, norm)(x)
    return x.transpose(1, 2)


def prerope_queries(module: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """Queries before RoPE (after q_norm for Qwen3 and Gemma 3), ``(B, H, T, D)``."""
    return _heads(module, _split_qkv(module, hidden_states)[0], "q_norm")


def prerope_queries_from_projection(module: nn.Module, projected: torch.Tensor) -> torch.Tensor:
    """Queries before RoPE ``(B, H, T, D)`` from the output of ``module``'s query projection (``q_proj``, or the fused
    ``qkv_proj`` whose first ``H·D`` columns are the queries), q_norm applied where the model applies it: what a
    forward hook on the projection sees, without a second projection."""
    return _heads(module, projected[..., : module.config.num_attention_heads * module.head_dim], "q_norm")


def prerope_keys(module: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """Keys before RoPE (after k_norm for Qwen3 and Gemma 3), ``(B, Hkv, T, D)``."""
    return _heads(module, _split_qkv(module, hidden_states)[1], "k_norm")


def prerope_values(module: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """Values, ``(B, Hkv, T, D)``."""
    return _heads(module, _split_qkv(module, hidden_states)[2])


def apply_rope(
    module: nn.Module, x: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """Rotate ``x`` ``(B, H, T, D)`` with the family's own RoPE (partial rotary included) at the given (cos, sin)."""
    cos, sin = position_embeddings
    rotated, _ = _family(module).apply_rotary_pos_emb(x, x[:, :1], cos, sin)
    return rotated


def queries_with_rope(module: nn.Module, hidden_states: torch.Tensor, position_embeddings) -> torch.Tensor:
    """Post-RoPE queries of the current forward, ``(B, H, T, D)``."""
    return apply_rope(module, prerope_queries(module, hidden_states), position_embeddings)


# ----------------------------------------------------------------------------------------------------------------
# Capture: one layer's Q/K/V of a forward, for the teacher's collection and distillation's replay


@dataclass
class LayerQKV:
    """One layer's queries, keys and values of one sequence (float32, batch dim dropped)."""

    q_pre: torch.Tensor  # (H, T, D)
    k_pre: torch.Tensor  # (Hkv, T, D)
    v: torch.Tensor  # (Hkv, T, D)
    q_post: torch.Tensor  # (H, T, D)
    k_post: torch.Tensor  # (Hkv, T, D)
    scaling: float
    window: int | None = None  # a hybrid model's sliding-window layer (never compressed; training skips it)

    @property
    def groups(self) -> int:
        return self.q_pre.shape[0] // self.k_pre.shape[0]


def layer_qkv(module: nn.Module, hidden_states: torch.Tensor, position_embeddings) -> LayerQKV:
    """Q/K/V of an attention module's input ``hidden_states`` ``(1, T, hidden)``, before and after the family's RoPE
    (rotated in the model's dtype, then cast to float32)."""
    q_pre = prerope_queries(module, hidden_states)  # (1, H, T, D)
    k_pre = prerope_keys(module, hidden_states)  # (1, Hkv, T, D)
    v = prerope_values(module, hidden_states)  # (1, Hkv, T, D)
    return LayerQKV(
        q_pre[0].float(), k_pre[0].float(), v[0].float(),
        apply_rope(module, q_pre, position_embeddings)[0].float(), apply_rope(module, k_pre, position_embeddings)[0].float(),
        attention_scale(module),
    )  # fmt: skip


@contextmanager
def attention_inputs(model: nn.Module, fn: Callable[[int, nn.Module, torch.Tensor, dict], None]) -> Iterator[None]:
    """Inside the block, ``fn(layer, module, hidden_states, kwargs)`` runs before every attention module's forward
    (``kwargs`` holds ``position_embeddings``); the hooks always come off."""

    def hook(layer: int):
        def pre(module, args, kwargs):
            fn(layer, module, kwargs.get("hidden_states", args[0] if args else None), kwargs)

        return pre

    handles = [m.register_forward_pre_hook(hook(i), with_kwargs=True) for i, m in enumerate(attention_modules(model))]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


# ----------------------------------------------------------------------------------------------------------------
# Ragged attention


def ragged_sdpa(
    module: nn.Module | None,
    query: torch.Tensor,
    kv: RaggedKV,
    scaling: float | None = None,
    softcap: float | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact causal attention of ``query`` ``(1, H, T, D)`` over a ragged cache; returns ``(1, T, H, D)`` and, with
    ``return_lse``, each query's log-partition ``(H, T)`` over its KV head's keys.

    Each KV head's keys and values are read in place (a view of the layer's pools, no copy, no padding) by the
    ``G`` query heads that share it; the T new tokens are the last T of every head (just appended), so query t sees
    the first ``L_h − T + t + 1`` of them. A decode step (T = 1) passes the G queries as the rows of one attention
    call per KV head (no mask, no repeated keys).

    One call per KV head rather than one call per layer: see docs/presses.md ("Exact per-head budgets") for the
    one-call layouts measured against it (pages merged by log-sum-exp; heads padded to the longest). ``softcap``
    (Gemma 2's ``attn_logit_softcapping``) caps the logits as the model's eager attention does,
    ``cap · tanh(logits / cap)``, which SDPA cannot, so a softcapped model's heads run unfused.
    """
    layer = kv.layer
    b, h, t, d = query.shape
    hkv = layer.num_heads
    g = h // hkv
    if b != 1:
        raise ValueError("per-head (ragged) caches support batch size 1")
    if t != kv.new_tokens:
        raise ValueError(f"ragged attention: {t} queries for {kv.new_tokens} new cache tokens")
    scale = scaling if scaling is not None else d**-0.5
    if t == 1:  # per KV head, its G queries as the rows of one sequence: (1, 1, G, D) over (1, 1, L_h, D)
        q = query.reshape(hkv, 1, 1, g, d)  # query head h·G + j reads KV head h
        outs, lses = [], []
        for kv_head in range(hkv):
            keys, values = layer.head(kv_head)  # (L_h, D) views
            o, s = _attention(q[kv_head], keys[None, None], values[None, None], None, scale, return_lse, softcap)
            outs.append(o)
            lses.append(s)
        out = torch.cat(outs, 2)  # (1, 1, H, D): the heads in order, the (1, T, H, D) layout
        return (out, torch.cat(lses, 2).view(h, 1).float()) if return_lse else out
    out = query.new_empty(hkv, g, t, d)
    lse = query.new_empty(hkv, g, t, dtype=torch.float32) if return_lse else None
    q = query.reshape(hkv, g, t, d)
    for kv_head in range(hkv):
        keys, values = layer.head(kv_head)
        n = keys.shape[0]
        visible = torch.arange(n, device=query.device)[None] <= (n - t + torch.arange(t, device=query.device))[:, None]
        mask = torch.zeros(t, n, dtype=query.dtype, device=query.device).masked_fill_(
            ~visible, torch.finfo(query.dtype).min
        )
        o, s = _attention(  # the G query heads over one KV head: keys broadcast (a stride-0 view)
            q[kv_head][None], keys.expand(1, g, n, d), values.expand(1, g, n, d), mask[None, None], scale, return_lse,
            softcap,
        )  # fmt: skip
        out[kv_head] = o.view(g, t, d)
        if return_lse:
            lse[kv_head] = s.view(g, t)
    out = out.view(1, h, t, d).transpose(1, 2).contiguous()
    return (out, lse.view(h, t)) if return_lse else out


_CPU_KERNEL = True  # tests switch it off to check the device-independent path on CPU


def _attention(
    q, k, v, mask, scale: float, with_lse: bool, softcap: float | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(softmax(q kᵀ · scale + mask) v, log-partition or None)`` for ``(1, n, R, D)`` rows over ``(1, n, L, D)``;
    with ``softcap`` the logits are ``cap · tanh(logits / cap)`` before the mask (unfused, as eager attention)."""
    if softcap:
        logits = softcapped((q.float() @ k.float().mT) * scale, softcap)
        if mask is not None:
            logits = logits + mask.float()
        out = (torch.softmax(logits, dim=-1) @ v.float()).to(q.dtype)
        return out, (logits.logsumexp(-1) if with_lse else None)
    if q.device.type == "cpu" and _CPU_KERNEL:  # the CPU flash kernel returns the log-partition with the output
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, attn_mask=mask, scale=scale
        )
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    if not with_lse:
        return out, None
    logits = (q.float() @ k.float().mT) * scale
    return out, (logits if mask is None else logits + mask.float()).logsumexp(-1)


def causal_mask(t: int, s: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Additive mask ``(1, 1, T, S)``: the T queries are the last T of S cached positions (no padding)."""
    allowed = torch.arange(s, device=device)[None, :] <= (s - t + torch.arange(t, device=device))[:, None]
    return torch.zeros(t, s, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)[None, None]


def _make_wrapper(base: str):
    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        if isinstance(key, RaggedKV):
            sink = module.__dict__.get(LSE_SINK)
            softcap = kwargs.get("softcap")
            if sink is None:
                return ragged_sdpa(module, query, key, scaling, softcap), None
            out, sink["lse"] = ragged_sdpa(module, query, key, scaling, softcap, return_lse=True)  # CORE's readout
            return out, None
        if attention_mask is not None and attention_mask.shape[-1] != key.shape[-2]:
            # transformers builds one mask from layer 0's cache length; layers compressed to other lengths
            # (per-layer budgets, e.g. PyramidKV) need their own causal mask, aligned to the end of the cache.
            attention_mask = causal_mask(query.shape[-2], key.shape[-2], query.dtype, query.device)
        sink = module.__dict__.get(LSE_SINK)
        if (
            sink is not None
            and base == "sdpa"
            and query.shape[0] == 1
            and query.shape[2] == 1
            and not dropout
            and attention_mask is None  # no padding, no sliding window: the one query sees every cached key
            and kwargs.get("sliding_window") is None
            and not kwargs.get("softcap")
        ):
            # one new query per head (a decode step) for a press that wants its log-partition (CORE's readout):
            # the CPU/GPU flash kernel returns it with the output, so the press does not recompute q·K; the G query
            # heads of a KV head ride as G rows of one (no causal mask for a single query, no repeated KV)
            out, lse = _attention_with_lse(query, key, value, scaling)
            if out is not None:
                sink["lse"] = lse
                return out, None
        fn = ALL_ATTENTION_FUNCTIONS[base] if base != "eager" else _family(module).eager_attention_forward
        return fn(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)

    return attention


LSE_SINK = "_core_kv_lse_sink"  # attention-module attribute: a dict that receives "lse" (H, T): a decode step's
# (T = 1), or any forward's on a ragged layer


def _attention_with_lse(query, key, value, scaling):
    """``(output (1, 1, H, D), lse (H, 1))`` of one query per head over ``key``/``value`` (1, Hkv, S, D)."""
    b, h, _, d = query.shape
    hkv = key.shape[1]
    if query.device.type != "cpu" or h % hkv or key.shape[0] != 1:
        return None, None
    q = query.reshape(1, hkv, h // hkv, d)  # rows of a KV head's query heads
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, key, value, 0.0, False, scale=scaling)
    return out.reshape(1, h, 1, d).transpose(1, 2).contiguous(), lse.reshape(h, 1)


def register_attention(base: str) -> str:
    """Register ``core_kv+<base>`` (attention function and mask function) and return its name."""
    name = PREFIX + base
    if name not in ALL_ATTENTION_FUNCTIONS.valid_keys():
        AttentionInterface.register(name, _make_wrapper(base))
        mask_fn = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get(base)
        if mask_fn is not None:
            ALL_MASK_ATTENTION_FUNCTIONS.register(name, mask_fn)
    return name


@contextmanager
def ragged_attention(model: nn.Module):
    """Route the model's attention through ``core_kv+<its implementation>`` for the duration of the block."""
    config = model.config
    original = config._attn_implementation or "eager"
    if original.startswith(PREFIX):  # nested (press inside a pipeline that already switched)
        yield
        return
    name = register_attention(original)
    configs = {id(config): config}
    for module in model.modules():
        cfg = getattr(module, "config", None)
        if cfg is not None and getattr(cfg, "_attn_implementation", None) == original:
            configs[id(cfg)] = cfg
    for cfg in configs.values():
        cfg._attn_implementation = name
    try:
        yield
    finally:
        for cfg in configs.values():
            cfg._attn_implementation = original
