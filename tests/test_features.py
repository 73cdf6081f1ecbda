"""The 14 indexer features on hand-built inputs (core_kv/features.py; CORE.md stage 2 feature list)."""

from __future__ import annotations

import math

import pytest
import torch

from core_kv.features import (
    FEATURE_NAMES,
    FEATURE_SPECS,
    NUM_FEATURES,
    TWIN_LOCAL,
    TWIN_THRESHOLD,
    FeatureStats,
    compute_features,
    moments,
    observation_attention,
    update_persistence,
)
from core_kv.nystrom import leverage, normalised_beta_b

F = {n: i for i, n in enumerate(FEATURE_NAMES)}


def _inputs(n=100, hkv=2, g=2, w=4, d=4, m=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    attn = torch.softmax(torch.randn(hkv, g * w, n, generator=gen), -1)
    q = torch.randn(hkv, g * w, d, generator=gen)
    k = torch.randn(hkv, n, d, generator=gen)
    v = torch.randn(hkv, n, d, generator=gen)
    z = torch.nn.functional.normalize(torch.randn(hkv, n, 3, generator=gen), dim=-1)
    protos = torch.eye(3).expand(hkv, m, 3).clone()
    phi = torch.rand(hkv, n, m, generator=gen)
    return attn, q, k, v, z, phi, protos


def test_names_and_shapes():
    assert NUM_FEATURES == 14 and len(set(FEATURE_NAMES)) == 14
    attn, q, k, v, z, phi, protos = _inputs()
    feats, ema = compute_features(attn, q, k, v, torch.arange(100), 99, z, phi, protos)
    assert feats.shape == (2, 100, 14) and ema.shape == (2, 100)
    assert torch.isfinite(feats).all()


def test_values_on_hand_built_inputs():
    attn, q, k, v, z, phi, protos = _inputs()
    pos = torch.arange(100)
    feats, _ = compute_features(attn, q, k, v, pos, 99, z, phi, protos)
    torch.testing.assert_close(feats[..., F["obs_mean_log"]], (attn.mean(1) + 1e-6).log())
    torch.testing.assert_close(feats[..., F["obs_max_log"]], (attn.amax(1) + 1e-6).log())
    torch.testing.assert_close(feats[..., F["persistence_log"]], feats[..., F["obs_mean_log"]])  # first event
    torch.testing.assert_close(feats[..., F["key_norm"]], k.norm(dim=-1))
    torch.testing.assert_close(feats[..., F["value_norm"]], v.norm(dim=-1))
    assert feats[0, 99, F["age_log"]] == 0 and math.isclose(
        float(feats[0, 0, F["age_log"]]), math.log(100), rel_tol=1e-6
    )
    assert feats[0, 99, F["rel_pos"]] == 1 and feats[0, 0, F["rel_pos"]] == 0
    assert feats[0, :4, F["sink"]].eq(1).all() and feats[0, 4:, F["sink"]].eq(0).all()
    assert feats[0, 36:, F["local"]].eq(1).all() and feats[0, :36, F["local"]].eq(0).all()
    # prototypes = the axes: fit = largest coordinate of z
    torch.testing.assert_close(feats[..., F["proto_fit"]], z.amax(-1))
    psi = (z / 0.1).softmax(-1)
    torch.testing.assert_close(feats[..., F["proto_entropy"]], -(psi * psi.log()).sum(-1))
    torch.testing.assert_close(feats[..., F["redundancy"]], -((psi * psi.mean(1, keepdim=True)).sum(-1)).log())
    p_uni = torch.full((2, 100), 0.01, dtype=torch.float64)
    lev = leverage(p_uni, phi.double(), normalised_beta_b(phi.double())).float()
    torch.testing.assert_close(feats[..., F["novelty"]], lev)
    cos = torch.nn.functional.cosine_similarity(k, q.mean(1, keepdim=True), dim=-1)
    torch.testing.assert_close(feats[..., F["query_cos"]], cos)


def test_redundancy_separates_crowded_from_lonely_tokens():
    n = 10
    z = torch.zeros(1, n, 3)
    z[0, :9, 0] = 1.0  # nine tokens in the first prototype's cell
    z[0, 9, 1] = 1.0  # one alone
    attn = torch.full((1, 1, n), 1 / n)
    protos = torch.eye(3)[None]
    feats, _ = compute_features(
        attn, torch.ones(1, 1, 2), torch.ones(1, n, 2), torch.ones(1, n, 2), torch.arange(n), n - 1, z,
        torch.rand(1, n, 3), protos,
    )  # fmt: skip
    red = feats[0, :, F["redundancy"]]
    assert red[9] > red[0] + 1.0


def test_persistence_ema():
    prev = torch.tensor([[0.2, float("nan")]])
    new = update_persistence(prev, torch.tensor([[0.4, 0.3]]))
    torch.testing.assert_close(new, torch.tensor([[0.3, 0.3]]))
    assert torch.equal(update_persistence(None, torch.tensor([[0.5]])), torch.tensor([[0.5]]))


def test_observation_attention_is_causal_by_position():
    q = torch.randn(1, 2, 3, 4)
    k = torch.randn(1, 5, 4)
    probs = observation_attention(q, k, torch.tensor([2, 3, 4]), torch.arange(5), 0.5)
    assert probs.shape == (1, 6, 5)
    torch.testing.assert_close(probs.sum(-1), torch.ones(1, 6))
    assert probs[0, 0, 3:].eq(0).all() and probs[0, 3, 3:].eq(0).all()  # query at 2 sees 0..2 (both heads)
    ref = torch.softmax(q[0, 0, 0] @ k[0, :3].T * 0.5, -1)
    torch.testing.assert_close(probs[0, 0, :3], ref)


def test_feature_stats_round_trip(tmp_path):
    x = torch.randn(2, 50, 14) * 3 + 1
    x[..., 7] = 1.0  # a constant flag keeps std 1
    c, s, s2 = moments(x)
    stats = FeatureStats.from_moments(c[None], s[None], s2[None])
    std = stats.standardize(x, 0)
    torch.testing.assert_close(std[..., :7].mean(1), torch.zeros(2, 7), atol=1e-5, rtol=0)
    assert stats.std[0, :, 7].eq(1).all()
    stats.save(tmp_path / "s.safetensors")
    back = FeatureStats.load(tmp_path / "s.safetensors")
    torch.testing.assert_close(back.mean, stats.mean)


def test_feature_stats_refuse_other_version(tmp_path, monkeypatch):
    import core_kv.features as features

    stats = FeatureStats(torch.zeros(1, 1, 14), torch.ones(1, 1, 14))
    stats.save(tmp_path / "s.safetensors")
    monkeypatch.setattr(features, "FEATURE_SPECS", {2: features.FEATURE_SPECS[2]})  # a code that no longer has v1
    with pytest.raises(ValueError, match="feature spec v1"):
        features.FeatureStats.load(tmp_path / "s.safetensors")


def test_feature_stats_keep_their_version(tmp_path):
    FeatureStats(torch.zeros(1, 1, 14), torch.ones(1, 1, 14), version=2).save(tmp_path / "s.safetensors")
    assert FeatureStats.load(tmp_path / "s.safetensors").version == 2
    with pytest.raises(ValueError, match="feature spec v99"):
        FeatureStats(torch.zeros(1, 1, 14), torch.ones(1, 1, 14), version=99).save(tmp_path / "t.safetensors")


def test_v2_replaces_the_flags_with_keydiff_and_twin_scores():
    """Spec v2: columns 7 / 8 are KeyDiffPress's score and TwinKV's rarity term on the post-RoPE keys (each checked
    against the press's own function); every other column equals v1's."""
    from core_kv.presses.keydiff import KeyDiffPress
    from core_kv.presses.twinkv import naive_nonlocal_counts

    attn, q, k, v, z, phi, protos = _inputs(n=120)
    k_post = torch.randn(2, 120, 4, generator=torch.Generator().manual_seed(5))
    k_post[:, 50:70] = k_post[:, 10:11]  # twins: 10 and 50..69 (50..69 are also each other's local neighbours)
    pos = torch.arange(120)
    v1, _ = compute_features(attn, q, k, v, pos, 119, z, phi, protos)
    v2, _ = compute_features(attn, q, k, v, pos, 119, z, phi, protos, keys_post=k_post, version=2)
    names = FEATURE_SPECS[2]
    assert names[7:9] == ("key_distinct", "twin_rarity") and NUM_FEATURES == len(names)
    keep = [i for i in range(14) if i not in (7, 8)]
    torch.testing.assert_close(v2[..., keep], v1[..., keep])
    keydiff = KeyDiffPress(compression_ratio=0.5).score(None, None, k_post[None], None, None, {})[0]
    torch.testing.assert_close(v2[..., 7], keydiff)
    counts = naive_nonlocal_counts(k_post[None], TWIN_LOCAL, TWIN_THRESHOLD)[0].float()
    torch.testing.assert_close(v2[..., 8], torch.log((120 + 1) / (counts + 1)))
    assert counts[0, 10] >= 20 and counts[0, 60] >= 1  # 10's twins 50..69 are far; 60's are near except 10
    with pytest.raises(ValueError, match="keys_post"):
        compute_features(attn, q, k, v, pos, 119, z, phi, protos, version=2)
    with pytest.raises(ValueError, match="feature spec v7"):
        compute_features(attn, q, k, v, pos, 119, z, phi, protos, keys_post=k_post, version=7)


def test_twin_rarity_band_form_equals_the_masked_count():
    """The band form (all twins minus those within 32 positions, read from the same similarity block) gives exactly
    the counts of masking the band over every pair, for positions with gaps (after evictions), per-head positions,
    and positions out of order (which take the masked form)."""
    from core_kv.features import twin_rarity

    gen = torch.Generator().manual_seed(0)
    n, d = 300, 8
    keys = torch.randn(2, n, d, generator=gen) + 3 * torch.randn(1, 1, d, generator=gen)  # many near-duplicates
    keys[:, 200:210] = keys[:, 5:6]  # a run of exact twins: local among themselves, far from 5

    def masked(keys, pos):
        khat = torch.nn.functional.normalize(keys, dim=-1)
        far = (pos[..., :, None] - pos[..., None, :]).abs() > TWIN_LOCAL
        counts = ((khat @ khat.mT > TWIN_THRESHOLD) & far).sum(-1).float()
        return torch.log((n + 1) / (counts + 1))

    gaps = torch.sort(torch.randperm(4 * n, generator=gen)[:n]).values
    per_head = torch.stack([gaps, torch.sort(torch.randperm(2 * n, generator=gen)[:n]).values])
    shuffled = gaps[torch.randperm(n, generator=gen)]
    for pos in (torch.arange(n), gaps, per_head, shuffled, gaps.float()):
        got = twin_rarity(keys, pos, block=64)
        assert torch.equal(got, masked(keys, pos.float())), pos[:5]
    assert twin_rarity(keys, torch.arange(n))[0, 5] < math.log(n + 1) - 2  # 5 has ten far twins


def test_novelty_in_float32_matches_float64():
    """Column 12 (ridge leverage under uniform p) is computed in float32: A's eigenvalues lie in [1, 2], so it agrees
    with a float64 solve to a few ulps."""
    attn, q, k, v, z, phi, protos = _inputs()
    phi = phi * 50  # scale does not matter: βB normalises it away
    feats, _ = compute_features(attn, q, k, v, torch.arange(100), 99, z, phi, protos)
    p_uni = torch.full((2, 100), 0.01, dtype=torch.float64)
    lev = leverage(p_uni, phi.double(), normalised_beta_b(phi.double()))
    torch.testing.assert_close(feats[..., F["novelty"]].double(), lev, rtol=1e-5, atol=0)
