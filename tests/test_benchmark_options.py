"""Options of the cost benchmark: ``python -m benchmarks.core_cost --press-option`` (the labelled-press syntax of
:mod:`core_kv.eval.press_labels`)."""

from __future__ import annotations

import pytest

from benchmarks import core_cost
from core_kv.eval.press_labels import parse_press_options

COST = vars(core_cost)


def test_core_cost_press_options_are_typed_per_variant_name():
    variants = parse_press_options([
        "repair.head_budgets=adaptive", "repair.memory=false", "repair.repair=true", "repair.repair_threshold=0.9",
        "other.k=3",
    ])  # fmt: skip
    assert variants == {
        "repair": {"head_budgets": "adaptive", "memory": False, "repair": True, "repair_threshold": 0.9},
        "other": {"k": 3},
    }
    assert type(variants["other"]["k"]) is int and type(variants["repair"]["repair_threshold"]) is float


@pytest.mark.parametrize("bad", ["repair", "repair=true", "repair:memory=false", ".memory=false", "repair.=1"])
def test_core_cost_refuses_malformed_press_options_naming_the_option(bad):
    with pytest.raises(SystemExit, match="--press-option"):
        COST["main"](["--press-option", bad])


def test_core_cost_column_names_must_not_repeat(capsys):
    with pytest.raises(SystemExit) as e:
        COST["main"](["--press-option", "float16.repair=true", "--memory-dtypes", "float16"])
    assert e.value.code == 2 and "column names repeat" in capsys.readouterr().err


def test_core_profile_wraps_every_target_and_refuses_a_missing_one(tmp_path):
    """Every component core_profile.py times exists in the code (it raises naming a missing one) and comes off."""
    import core_kv.features as features
    from benchmarks import core_profile
    from core_kv.models.tiny import tiny_lm
    from core_kv.presses import build_press
    from core_kv.presses.base import BasePress
    from core_kv.presses.latent_memory import LatentMemoryPress

    model = tiny_lm(seed=0)
    ckpt = COST["build_artifact"](model, tmp_path / "core")
    press = build_press("core", checkpoint=str(ckpt), compression_ratio=0.5)
    before = (features.twin_rarity, BasePress._post_hook, LatentMemoryPress.readout, press.core.indexer.scores)
    prof = core_profile.Profiler()
    prof.instrument(press)
    assert features.twin_rarity is not before[0] and BasePress._post_hook is not before[1]
    prof.unwrap()
    assert (features.twin_rarity, BasePress._post_hook, LatentMemoryPress.readout, press.core.indexer.scores) == before
    for target in (("core_kv.features", "no_such_feature", "x"), (core_profile.SCORER, "_scores", "indexer")):
        with pytest.raises(SystemExit, match=f"{target[0]}.{target[1]} does not exist"):
            core_profile.Profiler().wrap(
                core_profile.resolve(target[0], press), target[1], target[2], ".".join(target[:2])
            )
