"""PyramidKV: SnapKV scores with a per-layer budget that shrinks linearly with depth (Cai et al., 2024,
"PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling",
https://arxiv.org/abs/2406.02069; kvpress ``pyramidkv_press.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from core_kv.presses.snapkv import SnapKVPress


@dataclass
class PyramidKVPress(SnapKVPress, name="pyramidkv"):
    """PyramidKV (https://arxiv.org/abs/2406.02069), kvpress 0.5.5 defaults.

    Layer ``l`` of ``L`` keeps ``round(max_num - l (max_num - min_num) / (L - 1))`` tokens per head, where
    ``max_num + min_num = 2 b`` for the average budget ``b`` (so the layers' total matches the ratio) and
    ``min_num = b / beta`` (KVCache-Factory's formula, as kvpress). When the pyramid is infeasible
    (``not n >= max_num >= min_num >= window_size``) every layer falls back to SnapKV's uniform budget
    ``max(1, round(n (1 - ratio)))`` — kvpress's fallback, which rounds where ``target`` floors.

    Deviation from kvpress: an absolute ``budget`` (tokens per head on average) may replace the ratio.

    Args:
        beta: steepness of the pyramid (``min_num = b / beta``).
    """

    beta: int = 20

    def validate(self) -> None:
        super().validate()
        if self.beta < 1:
            raise ValueError(f"beta must be >= 1, got {self.beta}")

    def layer_target(self, module, n: int) -> int:
        avg = self.budget if self.budget is not None else n * (1 - self.compression_ratio)
        if avg >= n:
            return n
        max_capacity = self.window_size + avg
        min_num = (max_capacity - self.window_size) / self.beta
        max_num = (max_capacity - self.window_size) * 2 - min_num
        if max_num >= n - self.window_size:
            max_num = n - self.window_size
            min_num = (max_capacity - self.window_size) * 2 - max_num
        if not (n >= max_num >= min_num >= self.window_size):
            return min(n, max(1, round(avg)))
        layers = module.config.num_hidden_layers
        steps = (max_num - min_num) / (layers - 1) if layers > 1 else 0.0
        return min(n, max(1, round(max_num - module.layer_idx * steps)))
