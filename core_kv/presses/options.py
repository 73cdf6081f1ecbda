"""The one check of every press option, from the press dataclass's annotations (run when a press is constructed).

``build_press("snapkv", window_size="4")`` or ``decoding="no"`` (a YAML string where a bool is meant) raises
``ValueError: press 'snapkv': window_size must be an integer, got '4'`` instead of failing deep inside a forward, or
worse, being taken as true. The rule is :func:`core_kv.config.check_value`'s, the one every config option follows: a
finite number for ``float``, an integer for ``int``, ``True``/``False`` for ``bool``, the classes of a union
(``ScorerPress | str``); ranges and cross-option rules stay in each press's ``validate``.
"""

from __future__ import annotations

import numbers
from dataclasses import fields
from typing import Any

from core_kv.config import ConfigError, check_value, field_types


def check_press_options(press: Any) -> None:
    """Raise ``ValueError`` naming the press and the option when an option's value does not match its annotation
    (a numpy scalar counts as the Python number it holds, and is stored as one)."""
    hints = field_types(type(press))
    for f in fields(press):
        value = getattr(press, f.name)
        if isinstance(value, numbers.Number) and type(value).__module__ == "numpy":  # np.int64(64) is an int
            setattr(press, f.name, value.item())
        if f.init and f.name in hints:
            try:
                check_value(getattr(press, f.name), hints[f.name], f.name)
            except ConfigError as e:
                raise ValueError(f"press {press.name or type(press).__name__!r}: {e}") from None
