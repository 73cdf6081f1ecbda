"""Random eviction: the sanity baseline every informed press must beat (kvpress ``random_press.py``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from core_kv.presses.base import ScorerPress


@dataclass
class RandomPress(ScorerPress, name="random"):
    """Uniform random scores, as kvpress 0.5.5 (a fresh generator seeded with ``seed`` at every eviction event).

    Deviation from kvpress: ``seed`` defaults to 0 (kvpress: ``None``), so results are reproducible by default;
    pass ``seed=None`` for the global RNG.

    Args:
        seed: generator seed; ``None`` draws from torch's global RNG.
    """

    seed: int | None = 0

    def score(self, module, hidden_states, keys, values, attentions, kwargs) -> torch.Tensor:
        generator = None
        if self.seed is not None:
            generator = torch.Generator(device=keys.device)
            generator.manual_seed(self.seed)
        return torch.rand(*keys.shape[:-1], generator=generator, device=keys.device, dtype=keys.dtype)
