"""Which layers' allocation decides retrieval? CORE's indexer in some layers, another press's scores in the others.

A diagnostic for the CORE-on-SmolLM2 question (issue 20): the learned allocation loses needles that KeyDiff keeps,
although both keep the needle's tokens in most layers. This registers ``core_mix``, a ``core`` press whose layers in
``--other-layers`` choose Top-B (and drive the memory writes) with ``--other``'s scores, exactly as ``core_keydiff``
does in every layer, and the rest with the indexer; then it runs :mod:`needle_wording` on it. Swapping layer bands
one at a time says which band's learned allocation breaks retrieval.

    .venv/bin/python benchmarks/allocation_mix.py --checkpoint checkpoints/core-smollm2/final \\
        --other keydiff --other-layers 0-3 --ratios 0.75 --wordings ruler --haystacks noise --n 10

Everything after the mix options is passed to ``needle_wording.py`` (``--methods`` is set to ``core_mix``).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def register_core_mix():
    from core_kv.presses.base import PRESSES
    from core_kv.presses.core import CorePress

    if "core_mix" in PRESSES:
        return PRESSES["core_mix"]

    @dataclass
    class CoreMixPress(CorePress, name="core_mix"):
        """``core`` with ``other``'s scores (``keydiff`` / ``expected_attention``, or ``feature:<name>``: one of the
        indexer's own input features, e.g. ``feature:novelty``) in the layers ``other_layers``."""

        other: str = "keydiff"
        other_layers: list = field(default_factory=list)

        def validate(self) -> None:
            super().validate()
            from core_kv.features import FEATURE_NAMES
            from core_kv.presses.base import build_press

            if self.other.startswith("feature:"):
                if self.other[8:] not in FEATURE_NAMES:
                    raise ValueError(f"core_mix: unknown feature {self.other[8:]!r}; features: {FEATURE_NAMES}")
                self._mix_inner = FEATURE_NAMES.index(self.other[8:])
            elif self.other in ("keydiff", "expected_attention"):
                self._mix_inner = build_press(self.other)
            else:
                raise ValueError(
                    f"core_mix: other must be keydiff, expected_attention or feature:<name>, got {self.other!r}"
                )

        def _event(self, module, st, keys, values, hidden_states, kwargs, b):
            if module.layer_idx not in self.other_layers:
                return super()._event(module, st, keys, values, hidden_states, kwargs, b)
            if isinstance(self._mix_inner, int):  # one raw feature as the score (before standardisation)
                indexer, col = self.core.indexer, self._mix_inner
                original = indexer.scores
                indexer.scores = lambda layer, f: f[..., col].float()
                try:
                    return super()._event(module, st, keys, values, hidden_states, kwargs, b)
                finally:
                    indexer.scores = original
            saved = self.allocation, self._inner
            self.allocation, self._inner = self.other, self._mix_inner
            try:
                return super()._event(module, st, keys, values, hidden_states, kwargs, b)
            finally:
                self.allocation, self._inner = saved

    return CoreMixPress


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], add_help=True)
    ap.add_argument("--checkpoint", required=True, help="CORE artifact folder")
    ap.add_argument("--other", default="keydiff", help="keydiff, expected_attention or feature:<name> (features.py)")
    ap.add_argument("--other-layers", default="", help="layers that use --other's scores, e.g. 0-3,8")
    args, rest = ap.parse_known_args(argv)
    register_core_mix()
    import needle_wording

    from core_kv.config import parse_layers

    try:
        layers = parse_layers(args.other_layers, "--other-layers")
    except ValueError as e:
        raise SystemExit(str(e)) from e
    opts = [f"core_mix.checkpoint={args.checkpoint}", f"core_mix.other={args.other}",
            f"core_mix.other_layers={layers}"]  # fmt: skip
    extra = [a for o in opts for a in ("--press-option", o)]
    return needle_wording.main(["--methods", "core_mix", *extra, *rest])


if __name__ == "__main__":
    main()
