"""KV-cache access across transformers versions, and a cache layer that stores per-head budgets without padding.

transformers 5.24 renamed the attention forward argument ``past_key_values`` -> ``cache`` (and the model output
field likewise); 5.2 silently ignores ``cache=``. Everything in core_kv reaches the cache through
:func:`cache_from_kwargs` / :func:`cache_from_output` and passes it to models as ``past_key_values=`` (accepted by
both), so one code path serves the whole 5.x line.

:class:`RaggedLayer` stores per-head budgets (AdaKV, TwinKV, CORE) with each KV head's tokens contiguous in one pool:
nothing is padded to the longest head, so the memory saving is real, and appends are written in place. The attention
function in :mod:`core_kv.models.attention` reads each head's rows in place.
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


RESERVE_TOKENS = 16
"""Smallest free room per head a :class:`RaggedLayer` adds when an append does not fit (it then doubles, up to
:data:`RESERVE_MAX`), so decode steps write in place and the layer is re-laid out only every so many tokens."""
RESERVE_MAX = 256


@dataclass
class HeadGroup:
    """KV heads that keep the same number of tokens, as one rectangular copy (:attr:`RaggedLayer.groups`)."""

    heads: torch.Tensor  # (h_g,) KV-head indices, ascending
    keys: torch.Tensor  # (B, h_g, S_g, D)
    values: torch.Tensor  # (B, h_g, S_g, D)


class RaggedKV:
    """What :meth:`RaggedLayer.update` hands to the attention function instead of rectangular K/V tensors: the layer
    and how many tokens (the forward's queries) were just appended to every head."""

    def __init__(self, layer: RaggedLayer, new_tokens: int):
        self.layer = layer
        self.new_tokens = new_tokens

    @property
    def num_heads(self) -> int:
        return self.layer.num_heads

    @property
    def shape(self) -> tuple[int, int, int, int]:  # rectangular view of the longest head, for shape-only readers
        return (1, self.layer.num_heads, self.layer.get_seq_length(), self.layer.head_dim)


class RaggedLayer(DynamicLayer):
    """A dynamic cache layer whose KV heads keep different numbers of tokens, each head's tokens contiguous.

    Storage: keys and values are two pools ``(capacity, D)``; KV head ``h`` owns the rows
    ``[start_h, start_h + capacity_h)`` and fills the first ``L_h`` of them in token order. Nothing is padded to the
    longest head. Right after an eviction every capacity equals its head's count (the pools hold exactly the kept
    entries); an append that does not fit re-lays the pools out once with free room per head (:data:`RESERVE_TOKENS`,
    doubling up to :data:`RESERVE_MAX`), so question and decode tokens are then written in place, never by
    concatenation. :meth:`nbytes` counts the pools as allocated (free room included); :meth:`payload_bytes` the kept
    entries alone.

    :func:`core_kv.models.attention.ragged_sdpa` reads each head's rows in place (a view, no copy) with the query
    heads of that KV head. :meth:`lengths` gives tokens per KV head; :meth:`padded` a right-padded rectangular copy
    (for re-scoring at a later eviction event).
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, lengths: list[int], capacities: list[int]):
        super().__init__()
        self.num_heads, self.head_dim = len(lengths), keys.shape[-1]
        self.device, self.dtype = keys.device, keys.dtype
        self.is_initialized = True
        self.keys = self.values = None  # rectangular views do not exist for a ragged layer
        self._k, self._v = keys, values  # (capacity, D) pools
        self._lengths = list(lengths)
        self._set_capacities(capacities)
        self._reserve = 0  # free room per head added at the last re-layout

    def _set_capacities(self, capacities: list[int]) -> None:
        self._capacities = list(capacities)
        self._starts = [sum(capacities[:h]) for h in range(len(capacities))]

    # ------------------------------------------------------------------------------------------------------------
    # Building and growing

    @classmethod
    def from_kept(
        cls, keys: torch.Tensor, values: torch.Tensor, kept: list[torch.Tensor]
    ) -> RaggedLayer | tuple[torch.Tensor, torch.Tensor]:
        """Build from full ``keys``/``values`` ``(1, Hkv, S, D)`` and per-head kept indices (sorted, 1-D each).

        Returns plain rectangular ``(keys, values)`` when every head keeps the same count.
        """
        counts = [int(k.numel()) for k in kept]
        if len(set(counts)) == 1:
            idx = torch.stack(kept).to(keys.device)  # (Hkv, k)
            idx = idx[None, :, :, None].expand(keys.shape[0], -1, -1, keys.shape[-1])
            return keys.gather(2, idx).contiguous(), values.gather(2, idx).contiguous()
        if keys.shape[0] != 1:
            raise ValueError("per-head budgets are stored for batch size 1")
        if min(counts) < 1:
            raise ValueError(f"every KV head must keep at least one token, got per-head counts {counts}")
        hkv, s, d = keys.shape[1:]
        rows = torch.cat([kept[h].to(keys.device) + h * s for h in range(hkv)])  # head-major, as the pools
        return cls(
            keys[0].reshape(hkv * s, d).index_select(0, rows), values[0].reshape(hkv * s, d).index_select(0, rows),
            counts, counts,
        )  # fmt: skip

    def _writable(self) -> None:
        """Pools made under ``torch.inference_mode`` cannot be written in place outside it: copy them once."""
        if self._k.is_inference() and not torch.is_inference_mode_enabled():
            self._k, self._v = self._k.clone(), self._v.clone()

    def _relayout(self, room: int) -> None:
        """Copy every head into new pools with ``room`` free rows per head beyond its tokens."""
        old_k, old_v, old_starts = self._k, self._v, self._starts
        self._set_capacities([n + room for n in self._lengths])
        total = sum(self._capacities)
        self._k = old_k.new_zeros(total, self.head_dim)
        self._v = old_v.new_zeros(total, self.head_dim)
        for h, n in enumerate(self._lengths):
            a, b = old_starts[h], self._starts[h]
            self._k[b : b + n] = old_k[a : a + n]
            self._v[b : b + n] = old_v[a : a + n]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append the ``T`` new tokens ``(1, Hkv, T, D)`` to every head, in place; returns :class:`RaggedKV` twice."""
        b, hkv, t, d = key_states.shape
        if b != 1:
            raise ValueError("per-head (ragged) caches support batch size 1")
        if any(n + t > c for n, c in zip(self._lengths, self._capacities, strict=True)):
            self._reserve = min(RESERVE_MAX, max(RESERVE_TOKENS, 2 * self._reserve))
            self._relayout(t + self._reserve)
        self._writable()
        if t == 1:
            rows = torch.tensor([s + n for s, n in zip(self._starts, self._lengths, strict=True)])
        else:
            base = torch.tensor([s + n for s, n in zip(self._starts, self._lengths, strict=True)])
            rows = (base[:, None] + torch.arange(t)).flatten()  # head-major, as key_states[0] below
        rows = rows.to(self.device)
        self._k.index_copy_(0, rows, key_states[0].reshape(hkv * t, d).to(self.dtype))
        self._v.index_copy_(0, rows, value_states[0].reshape(hkv * t, d).to(self.dtype))
        self._lengths = [n + t for n in self._lengths]
        view = RaggedKV(self, t)
        return view, view

    # ------------------------------------------------------------------------------------------------------------
    # Reading

    def head(self, h: int) -> tuple[torch.Tensor, torch.Tensor]:
        """KV head ``h``'s keys and values ``(L_h, D)`` (views into the pools, no copy)."""
        a, n = self._starts[h], self._lengths[h]
        return self._k[a : a + n], self._v[a : a + n]

    def lengths(self) -> torch.Tensor:
        """Tokens kept per KV head, ``(Hkv,)``."""
        return torch.tensor(self._lengths, dtype=torch.long)

    def get_seq_length(self) -> int:
        return max(self._lengths)

    def padded(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Right-padded copies ``(1, Hkv, S_max, D)`` (zeros past each head's end) and a validity mask ``(Hkv, S_max)``."""
        s_max = self.get_seq_length()
        keys = self._k.new_zeros(1, self.num_heads, s_max, self.head_dim)
        values = keys.clone()
        valid = torch.zeros(self.num_heads, s_max, dtype=torch.bool, device=self.device)
        for h, n in enumerate(self._lengths):
            keys[0, h, :n], values[0, h, :n] = self.head(h)
            valid[h, :n] = True
        return keys, values, valid

    @property
    def groups(self) -> list[HeadGroup]:
        """Heads with equal counts as rectangular copies ``(1, h_g, S_g, D)`` (for readers that want one tensor per
        quota; the attention reads the pools in place)."""
        keys, values, _ = self.padded()
        out = []
        for count in sorted(set(self._lengths)):
            heads = torch.tensor([h for h, c in enumerate(self._lengths) if c == count], device=self.device)
            out.append(HeadGroup(heads, keys[:, heads, :count], values[:, heads, :count]))
        return out

    def nbytes(self) -> int:
        """Bytes allocated: both pools, free room included."""
        return self._k.numel() * self._k.element_size() + self._v.numel() * self._v.element_size()

    def payload_bytes(self) -> int:
        """Bytes of the kept entries alone: ``2 · D · bytes(dtype) · Σ_heads tokens``."""
        return 2 * self.head_dim * self._k.element_size() * sum(self._lengths)

    # ------------------------------------------------------------------------------------------------------------
    # Trimming and what a ragged layer cannot do

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens of every head (the pipeline trims question and answer tokens);
        their rows stay allocated, free for the next append."""
        if tokens_to_remove > 0:
            raise ValueError("RaggedLayer.crop takes a negative count (tokens to remove from the end)")
        n = -tokens_to_remove
        if n and n >= min(self._lengths):
            raise ValueError(f"RaggedLayer.crop: cannot remove {n} tokens from heads holding {self._lengths}")
        self._lengths = [c - n for c in self._lengths]

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
    """Bytes a cache layer holds (a ragged layer: its pools, free room included)."""
    if isinstance(layer, RaggedLayer):
        return layer.nbytes()
    if not layer.is_initialized or layer.keys is None:
        return 0
    return layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()


def layer_payload_bytes(layer) -> int:
    """Bytes of the entries a cache layer keeps (``2 · D · bytes(dtype)`` per kept token per head)."""
    if isinstance(layer, RaggedLayer):
        return layer.payload_bytes()
    return layer_nbytes(layer)


def kv_bytes(cache: Cache) -> dict:
    """KV bytes stored: ``{"per_layer", "total", "payload_per_layer", "payload", "tokens_per_head"}``.

    ``per_layer``/``total`` are what the cache holds (for a ragged layer: its pools as allocated, free room for
    appends included); ``payload_per_layer``/``payload`` the kept entries alone (the same for rectangular layers)."""
    per_layer = [layer_nbytes(layer) for layer in cache.layers]
    payload = [layer_payload_bytes(layer) for layer in cache.layers]
    return {
        "per_layer": per_layer,
        "total": int(sum(per_layer)),
        "payload_per_layer": payload,
        "payload": int(sum(payload)),
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
