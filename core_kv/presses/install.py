"""The install lock: :func:`claim` / :func:`release` keep two presses from being installed on one model at once, and
one press from serving two models (its per-layer state serves one model at a time)."""

from __future__ import annotations

from typing import Any

_INSTALLED = "_core_kv_press"  # attribute of an attention module: the press whose hooks are on it
_ACTIVE: set[int] = set()  # ids of the presses installed now (a press's per-layer state serves one model at a time)


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
