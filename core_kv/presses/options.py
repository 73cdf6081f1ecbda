"""The one check of every press option, from the press dataclass's annotations (run when a press is constructed).

``build_press("snapkv", window_size="4")`` or ``decoding="no"`` (a YAML string where a bool is meant) raises
``ValueError: press 'snapkv': window_size must be an integer, got '4'`` instead of failing deep inside a forward, or
worse, being taken as true. The rule is :func:`core_kv.config.check_value`'s, the one every config option follows: a
finite number for ``float``, an integer for ``int``, ``True``/``False`` for ``bool``, the classes of a union
(``ScorerPress | str``); ranges and cross-option rules stay in each press's ``validate``.

Also here: :func:`claim` / :func:`release`, which keep two presses from being installed on one model at once.
"""

from __future__ import annotations

import numbers
from dataclasses import fields
from typing import Any

from core_kv.config import ConfigError, check_value, field_types

_INSTALLED = "_core_kv_press"  # attribute of an attention module: the press whose hooks are on it
_ACTIVE: set[int] = set()  # ids of the presses installed now (a press's per-layer state serves one model at a time)


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


def claim(press: Any, attention_modules: list) -> None:
    """Mark ``attention_modules`` as hooked by ``press``; raise if another press (or this one, entered twice) already
    is. A wrapper press that runs an inner press on its own hooks (AdaKV, TwinRepair) installs one press."""
    for attn in attention_modules:
        other = attn.__dict__.get(_INSTALLED)
        if other is not None:
            which = "this press, entered twice" if other is press else type(other).__name__
            raise ValueError(
                f"{type(press).__name__}: the model already has a press installed ({which}); one press per model at "
                "a time: exit the other `with press(model):` block first, or compose presses by wrapping them "
                "(e.g. build_press('twin_repair', press=...), build_press('adakv', press=...))"
            )
    if id(press) in _ACTIVE:
        raise ValueError(
            f"{type(press).__name__}: this press is already installed on another model (its per-layer state serves one "
            "model at a time): build one press per model"
        )
    for attn in attention_modules:
        attn.__dict__[_INSTALLED] = press
    _ACTIVE.add(id(press))


def release(press: Any, attention_modules: list) -> None:
    """Undo :func:`claim` (only the marks ``press`` holds)."""
    _ACTIVE.discard(id(press))
    for attn in attention_modules:
        if attn.__dict__.get(_INSTALLED) is press:
            del attn.__dict__[_INSTALLED]
