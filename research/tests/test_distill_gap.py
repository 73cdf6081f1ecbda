"""``research/distill_gap.py``'s information tests: the key-content indexer and the ``--obs-window`` guard."""

from __future__ import annotations

import pytest
import torch

from research import distill_gap

GAP = vars(distill_gap)


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
