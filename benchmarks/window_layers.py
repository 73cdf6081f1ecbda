"""Sliding-window layers: what compressing them as well would cost (the measurement behind ``docs/presses.md``'s rule).

core_kv's presses compress a hybrid model's global layers only; its window layers keep their window (at most W - 1
positions, the model's own cache). This script runs the other rule on the same cells, for comparison: every press
of the eval config is replaced by ``<method>+window``, the same press hooked on *every* layer, where a window layer
keeps ``floor((1 - r) · stored)`` of the positions it stores (so ``compression_ratio`` removes that fraction of every
layer's stored KV, window layers included). Everything else (contexts, seed, protocol, generation) is the config's,
so the rule-G cells of the same config (the grid) are the comparison; results folders and the report land in
``output_dir`` as for ``eval.py``. Diagnostic only: it patches ``core_kv.presses.base``'s layer rule for this process.

Usage::

    python benchmarks/window_layers.py configs/eval/gemma3_ruler.yaml "methods=[snapkv,keydiff,twinkv]" \\
        "ratios=[0.75,0.9]" output_dir=results/gemma3_window
"""

from __future__ import annotations

import dataclasses
import sys

from core_kv.config import load_config
from core_kv.eval.runner import REFERENCE, EvalConfig, run_eval
from core_kv.models import cache as cache_mod
from core_kv.models.attention import decoder_layers, sliding_window
from core_kv.presses import base
from core_kv.presses.base import PRESSES, build_press

SUFFIX = "+window"


def window_too(cls: type) -> type:
    """``cls`` with window layers compressed too: a window layer keeps ``(1 - r)`` of what it stores."""
    if cls.name + SUFFIX in PRESSES:
        return PRESSES[cls.name + SUFFIX]

    @dataclasses.dataclass
    class WindowToo(cls, name=cls.name + SUFFIX):
        def eviction_target(self, module, seen, prefill):
            w = sliding_window(module)
            if w is not None and prefill:
                return self.target(min(seen, w - 1))  # of the window it stores, not of the context it saw
            return super().eviction_target(module, seen, prefill)

    WindowToo.__name__ = WindowToo.__qualname__ = f"{cls.__name__}WindowToo"
    return WindowToo


def check_any_dynamic(cache, layer=None) -> None:
    """The cache check with sliding-window layers allowed to be compressed (this diagnostic only)."""
    cache_mod.check_cache_supported(cache, None)


def main(argv: list[str] | None = None) -> None:
    cfg = load_config(EvalConfig, sys.argv[1:] if argv is None else argv, usage=__doc__)
    methods, options = [], {}
    for m in cfg.methods:
        if m == REFERENCE:
            continue
        opts = dict(cfg.press_options.get(m) or {})
        kind = opts.pop("kind", m)
        cls = type(build_press(kind, compression_ratio=0.5, **opts))
        variant = window_too(cls)
        methods.append(m + SUFFIX)
        options[m + SUFFIX] = {"kind": variant.name, **opts}
    base.press_layers = decoder_layers  # every layer gets the hooks
    base.check_cache_supported = check_any_dynamic
    cfg = dataclasses.replace(cfg, methods=methods, press_options=options, reference=False)
    results = run_eval(cfg)
    if results.markdown:
        print(results.markdown)


if __name__ == "__main__":
    main()
