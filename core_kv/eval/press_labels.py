"""Presses under labels: ``--press-option label.option=value`` on the command line of the benchmarks and research
scripts, and labels whose options name their press with ``kind`` (as in the evaluation configs)."""

from __future__ import annotations

import json


def parse_press_options(items: list[str]) -> dict[str, dict]:
    """``["label.option=value", ...]`` -> ``{label: {option: value}}`` (values parsed as JSON where they are)."""
    opts: dict[str, dict] = {}
    for item in items:
        if "=" not in item or "." not in item.split("=", 1)[0]:
            raise ValueError(f"--press-option expects method.option=value, got {item!r}")
        lhs, value = item.split("=", 1)
        method, key = lhs.split(".", 1)
        if not method or not key:
            raise ValueError(f"--press-option expects method.option=value, got {item!r}")
        try:
            value = json.loads(value)
        except ValueError:
            pass
        opts.setdefault(method, {})[key] = value
    return opts


def build_labelled_presses(methods: list[str], options: dict[str, dict], ratio: float) -> dict:
    """One press per label at ``ratio``: a press name, ``full`` (None: no press), or a label whose options name its
    press with ``kind`` (as in the evaluation configs), so variants of one press sit side by side."""
    from core_kv.presses import build_press

    unknown = set(options) - set(methods)
    if unknown:
        raise ValueError(f"--press-option for methods not in --methods: {sorted(unknown)}")
    presses = {}
    for m in methods:
        opts = dict(options.get(m, {}))
        try:
            presses[m] = None if m == "full" else build_press(opts.pop("kind", m), compression_ratio=ratio, **opts)
        except ValueError as e:
            raise ValueError(f"{m}: {e}") from None
    return presses
