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


def test_cost_curve_merges_runs_of_length_keyed_compositions_and_fits_the_exponent(tmp_path, capsys):
    """``cost_targets --out`` records each CORE band's composition per length (the policy is keyed by length); two
    runs of one model merge, and a time that grows as n² has exponent 2."""
    import json

    from benchmarks import cost_curve

    def run(lengths, composition):
        results = {str(n): {"none": {"prefill": n**2 * 1e-6, "decode": 0.01},
                            "snapkv@0.75": {"prefill": n**2 * 1e-6, "decode": 0.01},
                            "core@0.75": {"prefill": 1.1 * n**2 * 1e-6, "decode": 0.0102}} for n in lengths}  # fmt: skip
        return {"model": "m", "args": {"model": None}, "results": results,
                "compositions": {"core@0.75": {str(n): composition(n) for n in lengths}}}  # fmt: skip

    paths = []
    for i, (lengths, comp) in enumerate([((4096, 8192), lambda n: "shared, memory off"),
                                         ((16384,), lambda n: "uniform, memory")]):  # fmt: skip
        paths.append(tmp_path / f"{i}.json")
        paths[-1].write_text(json.dumps(run(lengths, comp)))
    cost_curve.main([str(p) for p in paths])
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line == ("| m | 75% | shared, memory off / uniform, memory | 4k, 8k, 16k | 1.10 / 1.10 / 1.10 | "
                    "1.02 / 1.02 / 1.02 | 2.00 / 2.00 / 2.00 | 0.00 |")  # fmt: skip
    # a later run re-measures only the 50% band at 8k, on a slower host (every time x 2): the 75% band's 8k point
    # keeps its own run's baselines (1.10, not its core time over the later run's none)
    slow = {"model": "m", "args": {"model": None}, "compositions": {"core@0.5": {"8192": "adaptive/output, memory off"}},
            "results": {"8192": {"none": {"prefill": 2 * 8192**2 * 1e-6, "decode": 0.02},
                                 "snapkv@0.5": {"prefill": 2 * 8192**2 * 1e-6, "decode": 0.02},
                                 "core@0.5": {"prefill": 2.6 * 8192**2 * 1e-6, "decode": 0.0208}}}}  # fmt: skip
    paths.append(tmp_path / "slow.json")
    paths[-1].write_text(json.dumps(slow))
    cost_curve.main([str(p) for p in paths])
    lines = capsys.readouterr().out.strip().splitlines()
    assert "| 4k, 8k, 16k | 1.10 / 1.10 / 1.10 | 1.02 / 1.02 / 1.02 |" in lines[-2]
    assert lines[-1].startswith("| m | 50% | adaptive/output, memory off | 8k | 1.30 | 1.04 |")
