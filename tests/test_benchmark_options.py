"""Options of the diagnostic scripts: ``core_cost.py --press-option`` and ``distill_gap.py``'s information tests
(the key-content indexer and the ``--obs-window`` guard)."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
COST = runpy.run_path(str(ROOT / "benchmarks" / "core_cost.py"))
GAP = runpy.run_path(str(ROOT / "benchmarks" / "distill_gap.py"))


def test_core_cost_press_options_are_typed_per_variant_name():
    variants = COST["parse_press_options"]([
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


def test_content_indexer_standardises_the_14_features_and_scales_phi_to_unit_rms():
    from core_kv.features import NUM_FEATURES, FeatureStats
    from core_kv.indexer import CoreIndexer

    torch.manual_seed(0)
    layers, heads, n, m = 2, 3, 7, 5
    stats = FeatureStats(torch.randn(layers, heads, NUM_FEATURES), torch.rand(layers, heads, NUM_FEATURES) + 0.5)
    idx = GAP["ContentIndexer"](layers, heads, m)
    idx.set_feature_stats(stats)
    feats, phi = torch.randn(heads, n, NUM_FEATURES), torch.rand(heads, n, m) * 3
    x = idx.standardize(1, torch.cat([feats, phi], -1))
    ref = CoreIndexer(layers, heads)
    ref.set_feature_stats(stats)
    torch.testing.assert_close(x[..., :NUM_FEATURES], ref.standardize(1, feats))
    torch.testing.assert_close(x[..., NUM_FEATURES:].pow(2).mean(-1), torch.ones(heads, n), rtol=1e-4, atol=1e-4)
    assert idx.scores(1, torch.cat([feats, phi], -1)).shape == (heads, n)
    widths = [mod.out_features for mod in idx.layers[0] if isinstance(mod, torch.nn.Linear)]
    assert idx.layers[0][0].in_features == NUM_FEATURES + m and widths == [128, 128, 1]
    assert [mod.out_features for mod in GAP["mlp"](4, 16, 3) if isinstance(mod, torch.nn.Linear)] == [16, 16, 16, 1]


def test_obs_window_teacher_refuses_the_default_records_folder(capsys):
    with pytest.raises(SystemExit) as e:
        GAP["main"](["teacher", "--obs-window", "128"])
    assert e.value.code == 2 and "--teacher-dir" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        GAP["main"](["eval", "x.safetensors", "--obs-window", "128"])
    assert "--obs-window" in capsys.readouterr().err
    import core_kv.features
    import core_kv.teacher.run

    assert core_kv.features.OBS_WINDOW == core_kv.teacher.run.OBS_WINDOW == 32  # a refused call overrides nothing


def test_core_cost_column_names_must_not_repeat(capsys):
    with pytest.raises(SystemExit) as e:
        COST["main"](["--press-option", "float16.repair=true", "--memory-dtypes", "float16"])
    assert e.value.code == 2 and "column names repeat" in capsys.readouterr().err


def test_core_profile_wraps_every_target_and_refuses_a_missing_one(tmp_path):
    """Every component core_profile.py times exists in the code (it raises naming a missing one) and comes off."""
    import core_kv.features as features
    from core_kv.models.tiny import tiny_lm
    from core_kv.presses import build_press
    from core_kv.presses.core import CorePress

    prof_mod = runpy.run_path(str(ROOT / "benchmarks" / "core_profile.py"))
    model = tiny_lm(seed=0)
    ckpt = COST["build_artifact"](model, tmp_path / "core")
    press = build_press("core", checkpoint=str(ckpt), compression_ratio=0.5)
    before = (features.twin_rarity, CorePress._post_hook, press.core.indexer.scores)
    prof = prof_mod["Profiler"]()
    prof.instrument(press)
    assert features.twin_rarity is not before[0] and "_post_hook" in vars(CorePress)
    prof.unwrap()
    assert (features.twin_rarity, CorePress._post_hook, press.core.indexer.scores) == before
    assert "_post_hook" not in vars(CorePress)  # the inherited hook is BasePress's again
    for target in (("core_kv.features", "no_such_feature", "x"), ("press", "_scores", "indexer")):
        with pytest.raises(SystemExit, match=f"{target[0]}.{target[1]} does not exist"):
            prof_mod["Profiler"]().wrap(
                prof_mod["resolve"](target[0], press), target[1], target[2], ".".join(target[:2])
            )
