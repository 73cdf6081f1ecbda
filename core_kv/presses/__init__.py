"""Presses: one file each, registered by name on import.

``PRESSES`` maps name -> class; ``build_press(name, **options)`` instantiates one with validation.
"""

import importlib
import pkgutil

from core_kv.presses.base import PRESSES, BasePress, ScorerPress, build_press

for _mod in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    if _mod != "base":
        importlib.import_module(f"{__name__}.{_mod}")

__all__ = ["PRESSES", "BasePress", "ScorerPress", "build_press"]
