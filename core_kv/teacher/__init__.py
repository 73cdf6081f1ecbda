"""CORE stage 0-1: the offline teacher (``../shared/design/CORE.md``; paper Tables 5, 7, 9).

- :mod:`~core_kv.teacher.geometry`: per (layer, KV head) key projection and 64 fixed coverage prototypes.
- :mod:`~core_kv.teacher.utility`: future-query utility ``π_U`` from full-cache attention.
- :mod:`~core_kv.nystrom` (on the floor, shared with :mod:`core_kv.features`): Nyström features and the log-det
  coverage term with its leverage gradient.
- :mod:`~core_kv.teacher.solver`: ``p* = argmax −KL(p‖π_U) + λ F_cov(p)`` by damped mirror ascent (R0 = 8).
- :mod:`~core_kv.teacher.metrics`: Table 5 residuals/agreement and Table 7 set quality.
- :mod:`~core_kv.teacher.dataset`: safetensors shards + manifest, and the reader that refuses mismatches.
- :mod:`~core_kv.teacher.config` (the typed config and the event times; its model loads with
  :func:`core_kv.models.loading.load_from_spec`, its documents are :mod:`core_kv.documents`'s),
  :mod:`~core_kv.teacher.run` (the collection; ``python -m core_kv.teacher --config ...``),
  :mod:`~core_kv.teacher.report` (summary and text report).

Shape legend: L layers, H query heads, Hkv KV heads, G = H / Hkv, D head dim, T tokens, N candidates at an
event, M prototypes (64), d_z projected key dim (min(64, D)), F features (14).

Imports (``docs/architecture.md``): the teacher sits above :mod:`core_kv.features` (the collection computes the
features) and the kernel math on the floor; the namespace re-exports the base stage only.
"""

from core_kv.geometry import Geometry
from core_kv.models.fingerprint import model_fingerprint
from core_kv.nystrom import coverage_logdet, leverage, nystrom_features
from core_kv.teacher.geometry import fit_geometry
from core_kv.teacher.solver import solve_allocation
from core_kv.teacher.utility import future_utility

__all__ = [
    "Geometry",
    "coverage_logdet",
    "fit_geometry",
    "future_utility",
    "leverage",
    "model_fingerprint",
    "nystrom_features",
    "solve_allocation",
]
