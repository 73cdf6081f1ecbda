"""KV-cache access across transformers versions, and a cache layer that stores per-head budgets without padding.

transformers 5.24 renamed the attention forward argument ``past_key_values`` -> ``cache`` (and the model output
field likewise); 5.2 silently ignores ``cache=``. Everything in core_kv reaches the cache through
:func:`cache_from_kwargs` / :func:`cache_from_output` and passes it to models as ``past_key_values=`` (accepted by
both), so one code path serves the whole 5.x line.

:class:`RaggedLayer` keeps heads grouped by quota: heads that keep the same number of tokens share one tensor
``(B, h_g, S_g, D)`` and nothing is padded, so a per-head budget (AdaKV, TwinKV, CORE) saves real memory. The
attention function in :mod:`core_kv.models.attention` reads it group by group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer


def cache_from_kwargs(kwargs: dict) -> Cache | None:
    """The cache object an attention module received (``cache`` from 5.24 on, ``past_key_values`` before)."""
    cache = kwargs.get("cache")
    if cache is None:
        cache = kwargs.get("past_key_values")
    return cache


def cache_from_output(output) -> Cache | None:
    """The cache a model forward returned (``output.cache`` from 5.24 on, ``output.past_key_values`` before)."""
    keys = output.keys()
    if "cache" in keys:
        return output["cache"]
    return output["past_key_values"] if "past_key_values" in keys else None


def cache_kwarg(model) -> str:
    """Name of the cache argument the model's forward takes: ``cache`` (transformers >= 5.24) or ``past_key_values``."""
    import inspect

    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def check_cache_supported(cache: Cache, layer: int | None = None) -> None:
    """Raise for cache types whose layers we cannot rewrite exactly (quantized, static, offloaded).

    Sliding-window layers (``DynamicSlidingWindowLayer``) are accepted where presses leave them alone (every layer
    but ``layer``, the one about to be compressed): they keep their window."""
    if type(cache) is not DynamicCache and not isinstance(cache, DynamicCache):
        raise TypeError(
            f"core_kv presses need a transformers DynamicCache, got {type(cache).__name__}: static, quantized and "
            "offloaded caches cannot be resized per head"
        )
    for i, lay in enumerate(cache.layers):
        allowed = (DynamicLayer, RaggedLayer) if i == layer else (DynamicLayer, RaggedLayer, DynamicSlidingWindowLayer)
        if type(lay) not in allowed:
            raise TypeError(
                f"cache layer {i} is a {type(lay).__name__}; core_kv presses compress DynamicLayer only "
                "(quantized layers would silently drop or corrupt kept tokens; a sliding-window layer keeps its "
                "window and is not compressed)"
            )


@dataclass
class HeadGroup:
    """KV heads that keep the same number of tokens, stored together."""

    heads: torch.Tensor  # (h_g,) KV-head indices, ascending
    keys: torch.Tensor  # (B, h_g, S_g, D)
    values: torch.Tensor  # (B, h_g, S_g, D)


class RaggedKV:
    """What :meth:`RaggedLayer.update` hands to the attention function instead of rectangular K/V tensors."""

    def __init__(self, groups: list[HeadGroup], num_heads: int):
        self.groups = groups
        self.num_heads = num_heads

    @property
    def shape(self) -> tuple[int, int, int, int]:  # rectangular view of the largest group, for shape-only readers
        g = max(self.groups, key=lambda g: g.keys.shape[2])
        return (g.keys.shape[0], self.num_heads, g.keys.shape[2], g.keys.shape[3])


class RaggedLayer(DynamicLayer):
    """A dynamic cache layer whose KV heads keep different numbers of tokens, grouped by equal count.

    Appends (question and decode tokens) go to every group. :meth:`lengths` gives tokens per KV head;
    :meth:`padded` gives a right-padded rectangular copy (for re-scoring at a later eviction event only; the
    stored payload is never padded).
    """

    def __init__(self, groups: list[HeadGroup], num_heads: int):
        super().__init__()
        self.groups = groups
        self.num_heads = num_heads
        first = groups[0].keys
        self.device, self.dtype = first.device, first.dtype
        self.is_initialized = True
        self.keys = self.values = None  # rectangular views do not exist for a ragged layer

    @classmethod
    def from_kept(
        cls, keys: torch.Tensor, values: torch.Tensor, kept: list[torch.Tensor]
    ) -> RaggedLayer | tuple[torch.Tensor, torch.Tensor]:
        """Build from full ``keys``/``values`` ``(B, Hkv, S, D)`` and per-head kept indices (sorted, 1-D each).

        Returns plain rectangular ``(keys, values)`` when every head keeps the same count.
        """
        counts = [int(k.numel()) for k in kept]
        if len(set(counts)) == 1:
            idx = torch.stack(kept).to(keys.device)  # (Hkv, k)
            idx = idx[None, :, :, None].expand(keys.shape[0], -1, -1, keys.shape[-1])
            return keys.gather(2, idx).contiguous(), values.gather(2, idx).contiguous()
        groups = []
        for count in sorted(set(counts)):
            heads = [h for h, c in enumerate(counts) if c == count]
            idx = torch.stack([kept[h] for h in heads]).to(keys.device)  # (h_g, count)
            h_t = torch.tensor(heads, device=keys.device)
            idx4 = idx[None, :, :, None].expand(keys.shape[0], -1, -1, keys.shape[-1])
            groups.append(
                HeadGroup(h_t, keys[:, h_t].gather(2, idx4).contiguous(), values[:, h_t].gather(2, idx4).contiguous())
            )
        return cls(groups, num_heads=len(kept))

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        for g in self.groups:
            g.keys = torch.cat([g.keys, key_states[:, g.heads]], dim=-2)
            g.values = torch.cat([g.values, value_states[:, g.heads]], dim=-2)
        view = RaggedKV(self.groups, self.num_heads)
        return view, view

    def lengths(self) -> torch.Tensor:
        """Tokens kept per KV head, ``(Hkv,)``."""
        out = torch.zeros(self.num_heads, dtype=torch.long)
        for g in self.groups:
            out[g.heads.cpu()] = g.keys.shape[2]
        return out

    def get_seq_length(self) -> int:
        return max(g.keys.shape[2] for g in self.groups)

    def padded(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Right-padded copies ``(B, Hkv, S_max, D)`` and a validity mask ``(Hkv, S_max)``."""
        s_max = self.get_seq_length()
        b, _, _, d = self.groups[0].keys.shape
        keys = self.groups[0].keys.new_zeros(b, self.num_heads, s_max, d)
        values = keys.clone()
        valid = torch.zeros(self.num_heads, s_max, dtype=torch.bool, device=keys.device)
        for g in self.groups:
            s = g.keys.shape[2]
            keys[:, g.heads, :s] = g.keys
            values[:, g.heads, :s] = g.values
            valid[g.heads, :s] = True
        return keys, values, valid

    def nbytes(self) -> int:
        return sum(
            g.keys.numel() * g.keys.element_size() + g.values.numel() * g.values.element_size() for g in self.groups
        )

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("RaggedLayer.crop takes a negative count (tokens to remove from the end)")
        if tokens_to_remove == 0:
            return
        for g in self.groups:
            g.keys = g.keys[..., :tokens_to_remove, :]
            g.values = g.values[..., :tokens_to_remove, :]

    def reset(self) -> None:
        raise RuntimeError("a RaggedLayer cannot be reset in place; build a new cache")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise ValueError("per-head budgets are stored for batch size 1; batch expansion (beam search) is unsupported")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise ValueError("per-head budgets are stored for batch size 1; batch selection is unsupported")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise ValueError("per-head budgets are stored for batch size 1; beam search is unsupported")


def layer_lengths(layer) -> torch.Tensor:
    """Tokens per KV head of a cache layer, ``(Hkv,)`` (equal for a rectangular layer)."""
    if isinstance(layer, RaggedLayer):
        return layer.lengths()
    return torch.full((layer.keys.shape[1],), layer.keys.shape[2], dtype=torch.long)


def layer_nbytes(layer) -> int:
    if isinstance(layer, RaggedLayer):
        return layer.nbytes()
    if not layer.is_initialized or layer.keys is None:
        return 0
    return layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()


def kv_bytes(cache: Cache) -> dict:
    """KV payload actually stored: ``{"per_layer": [...], "total": int, "tokens_per_head": [[...], ...]}``."""
    per_layer = [layer_nbytes(layer) for layer in cache.layers]
    return {
        "per_layer": per_layer,
        "total": int(sum(per_layer)),
        "tokens_per_head": [layer_lengths(layer).tolist() for layer in cache.layers],
    }


@dataclass
class WindowMark:
    """A sliding-window layer's state at a mark: its window slides as tokens are appended (old positions leave it),
    so trimming back means restoring the stored tensors, not cropping them."""

    keys: torch.Tensor | None
    values: torch.Tensor | None
    cumulative_length: int
    is_initialized: bool


def cache_marks(cache: Cache) -> list:
    """What :func:`crop_cache` needs to trim the cache back to now: tokens per head of every layer, and the stored
    window of every sliding-window layer (references only: appending never modifies the stored tensors in place)."""
    return [
        WindowMark(layer.keys, layer.values, layer.cumulative_length, layer.is_initialized)
        if isinstance(layer, DynamicSlidingWindowLayer)
        else layer_lengths(layer)
        for layer in cache.layers
    ]


def crop_cache(cache: Cache, lengths: list) -> None:
    """Trim every layer back to the per-head ``lengths`` it had (drops question/answer tokens after a question).

    ``lengths``: :func:`cache_marks` (or, for a cache without sliding-window layers, ``layer_lengths`` per layer).

    Raises:
        ValueError: a sliding-window layer given a plain length whose window has moved since (take
            :func:`cache_marks` before appending instead).
    """
    for layer, n in zip(cache.layers, lengths, strict=True):
        if isinstance(n, WindowMark):
            layer.keys, layer.values = n.keys, n.values
            layer.cumulative_length, layer.is_initialized = n.cumulative_length, n.is_initialized
            continue
        if isinstance(layer, DynamicSlidingWindowLayer) and layer.cumulative_length >= layer.sliding_window:
            if layer.cumulative_length != int(n[0]):
                raise ValueError(
                    f"cannot trim a sliding-window cache layer (window {layer.sliding_window}) from a length: its "
                    "window moved; take core_kv.models.cache.cache_marks(cache) before appending"
                )
            continue
        extra = int(layer_lengths(layer)[0] - n[0])
        if extra > 0:
            layer.crop(-extra)
