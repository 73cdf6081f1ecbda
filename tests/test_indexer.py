"""Indexer and artifact: paper shape, two channels of one distribution, save/load and base-model checks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from core_kv.budget import protected_mask, top_free
from core_kv.core_model import CoreConfig, CoreModel
from core_kv.features import FeatureStats
from core_kv.indexer import CoreIndexer, indexer_mlp
from core_kv.models.fingerprint import FingerprintMismatch, model_fingerprint
from core_kv.teacher.geometry import fit_geometry


def test_mlp_is_the_paper_shape():
    mlp = indexer_mlp()
    assert [m.__class__.__name__ for m in mlp] == ["Linear", "GELU", "Linear", "GELU", "Linear"]
    assert (mlp[0].in_features, mlp[0].out_features, mlp[2].out_features, mlp[4].out_features) == (14, 128, 128, 1)
    assert sum(p.numel() for p in mlp.parameters()) == 18_561  # paper Table 9 / indexmem_core.md §3.3


def test_scores_standardise_and_per_head_bias():
    idx = CoreIndexer(num_layers=2, num_kv_heads=3)
    stats = FeatureStats(torch.randn(2, 3, 14), torch.rand(2, 3, 14) + 0.5)
    idx.set_feature_stats(stats)
    with torch.no_grad():
        idx.head_bias[1] = torch.tensor([0.0, 1.0, -2.0])
    x = torch.randn(3, 7, 14)
    s = idx.scores(1, x)
    ref = idx.layers[1]((x - stats.mean[1][:, None]) / stats.std[1][:, None]).squeeze(-1) + idx.head_bias[1][:, None]
    torch.testing.assert_close(s, ref)
    # the MLP is shared by the KV heads: same standardised input -> logits differ only by the head bias
    same = stats.mean[1][:, None] + stats.std[1][:, None] * torch.randn(1, 7, 14)
    d = idx.scores(1, same) - idx.head_bias[1][:, None]
    torch.testing.assert_close(d[0], d[2])


def test_topb_invariant_to_temperature_and_mass_monotone():
    """One distribution, two channels: retention ignores T, the excluded mass grows with T (CORE.md stage 3)."""
    idx = CoreIndexer(1, 2)
    s = idx.scores(0, torch.randn(2, 40, 14)).detach()
    prot = protected_mask(40, 4, 8)
    masses = []
    for t in (0.5, 1.0, 2.0, 4.0):
        idx.temperature.fill_(t)
        p = idx.distribution(0, s)
        kept = top_free(p, prot, 10)
        if t == 0.5:
            first = kept
        assert torch.equal(kept, first)
        masses.append((p * ~kept).sum(-1))
    for a, b in zip(masses, masses[1:], strict=False):
        assert (b > a).all()


@pytest.fixture(scope="module")
def artifact(tmp_path_factory, llama):
    keys = [torch.randn(2, 300, 16, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    geo = fit_geometry(keys, model_fingerprint(llama), d_z=16, num_prototypes=64)
    core = CoreModel(CoreConfig.for_model(llama, geo, write_rule="equal_event"))
    core.set_geometry(geo)
    core.indexer.temperature.fill_(1.7)
    path = tmp_path_factory.mktemp("core") / "final"
    core.save_pretrained(path)
    return core, path


def test_save_and_load_roundtrip(artifact, llama):
    core, path = artifact
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors"]
    loaded = CoreModel.from_pretrained(path, base_model=llama)
    assert loaded.config.write_rule == "equal_event" and not loaded.training
    for (k, a), (k2, b) in zip(core.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert k == k2 and torch.equal(a, b), k
    geo = loaded.geometry()
    assert geo.prototypes.shape == (2, 2, 64, 16) and geo.fingerprint == core.config.fingerprint


def test_other_base_model_is_refused(artifact):
    from tests.helpers import tiny_model

    _, path = artifact
    with pytest.raises(FingerprintMismatch, match="k_proj_digest"):
        CoreModel.from_pretrained(path, base_model=tiny_model("llama", seed=5))
    with pytest.raises(FingerprintMismatch, match="head_dim|model_type"):
        CoreModel.from_pretrained(path, base_model=tiny_model("qwen3"))


def test_an_artifact_of_an_unimported_plugin_names_its_model_type_and_module(artifact, tmp_path, monkeypatch):
    """Artifact kinds are chosen by ``model_type`` (``load_artifact``); a kind whose plugin is not imported is refused
    naming the model_type and the module its config.json records; a CORE artifact loads through the registry."""
    import json
    import shutil

    import core_kv.core_model as cm

    _, path = artifact
    assert isinstance(cm.load_artifact(path), CoreModel)
    other = tmp_path / "released"
    shutil.copytree(path, other)
    stored = json.loads((other / "config.json").read_text())
    stored.update(model_type="core_kv_released", plugin="research.released")
    (other / "config.json").write_text(json.dumps(stored))
    monkeypatch.setattr(cm, "ARTIFACTS", {"core_kv": CoreModel})  # as in a process that imported no plugin
    for load in (cm.load_artifact, CoreModel.from_pretrained):
        with pytest.raises(ValueError, match=r"model_type 'core_kv_released' is defined by the plugin module "
                                             r"'research.released'.*`import research.released`"):  # fmt: skip
            load(other)


def test_config_rejects_unknown_write_rule():
    with pytest.raises(ValueError, match="write_rule"):
        CoreConfig(write_rule="average")


@pytest.mark.parametrize(
    "folder", sorted(Path(__file__).resolve().parents[1].glob("checkpoints/core-*/final")), ids=str
)
def test_shipped_artifacts_load(folder):
    """Every shipped artifact folder passes the artifact check and loads."""
    import core_kv.core_model

    core_kv.core_model.check_artifact(folder)
    core = CoreModel.from_pretrained(folder)
    assert core.config.num_layers == len(core.indexer.layers)
