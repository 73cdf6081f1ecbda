"""The CORE authors' released recipe, a research line outside the product (``docs/architecture.md``, "The released
recipe"): feature spec v3, the fixed key geometry, the DRIVE teacher, online distillation and the fast memory.

Importing the package registers, in the product's registries:

- its artifact class: ``model_type`` ``core_kv_released`` -> :class:`~research.released.model.ReleasedModel`
  (:data:`core_kv.core_model.ARTIFACTS`; ``load_artifact`` loads it);
- its presses: ``core_released`` (the composition), ``core_released_scorer``, ``fast_memory``
  (:mod:`research.released.presses`);
- its recipe: ``recipe: released`` (:data:`core_kv.distill.trainer.RECIPES`), whose config is
  :class:`~research.released.config.ReleasedTrainConfig`. A train config enables it with ``plugins: [research.released]``
  (``research/released/configs/``).

Modules: ``features`` (spec v3), ``geometry`` (``KeyGeometry``), ``teacher`` (DRIVE), ``memory`` (``FastMemory``),
``model`` (the artifact), ``presses``, ``losses``, ``config``, ``trainer``, ``report``, ``readout`` (a diagnostic).
"""

from __future__ import annotations

from research.released import model, presses, trainer  # noqa: F401  (registration)
from research.released.model import ReleasedConfig, ReleasedModel
from research.released.presses import FastMemoryPress, ReleasedCorePress, ReleasedScorerPress

__all__ = ["FastMemoryPress", "ReleasedConfig", "ReleasedCorePress", "ReleasedModel", "ReleasedScorerPress"]
