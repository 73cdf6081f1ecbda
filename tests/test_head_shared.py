"""``head_shared``: one score per token per layer over a per-head scorer (the release's head-shared scores, issue 44)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from core_kv.core_model import CoreConfig, CoreModel
from core_kv.distill.replay import capture
from core_kv.models.fingerprint import model_fingerprint
from core_kv.pipeline import prefill
from core_kv.presses import build_press
from core_kv.teacher.geometry import fit_geometry

N = 200


def ids(n: int = N, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def artifact(tmp_path_factory, llama):
    geo = fit_geometry([a.k_pre for a in capture(llama, ids(300, seed=9))], model_fingerprint(llama), d_z=16,
                       num_prototypes=16)  # fmt: skip
    core = CoreModel(CoreConfig.for_model(llama, geo))
    core.set_geometry(geo)
    path = tmp_path_factory.mktemp("core_hs") / "final"
    core.save_pretrained(path)
    return path


def record(press):
    """Record, per event, the inner scorer's pooled scores and the wrapper's kept indices."""
    inner, rows = press.press, []
    pooled, select = inner.pooled_scores, press.select

    def pooled_rec(module, scores):
        out = pooled(module, scores)
        rows.append({"pooled": out.detach().float().clone()})
        return out

    def select_rec(scores, n_kept, module, kwargs):
        kept = select(scores, n_kept, module, kwargs)
        rows[-1].update(kept=kept.clone(), n_kept=n_kept, sinks_recent=press.protected(n_kept))
        return kept

    inner.pooled_scores, press.select = pooled_rec, select_rec
    return rows


def naive_kept(pooled: torch.Tensor, n_kept: int, sinks: int, recent: int) -> torch.Tensor:
    """Top-``n_kept`` of the head mean, the first ``sinks`` and last ``recent`` positions forced in (sorted)."""
    shared = pooled[0].mean(0).clone()
    n = shared.shape[0]
    shared[:sinks] = float("inf")
    shared[n - recent :] = float("inf")
    return shared.topk(n_kept).indices.sort().values


@pytest.mark.parametrize("inner", ["knorm", "core_scorer"])
def test_every_head_keeps_the_top_b_of_the_mean_over_heads(inner, artifact, llama):
    opts = {"checkpoint": str(artifact)} if inner == "core_scorer" else {}
    press = build_press("head_shared", press=inner, press_options=opts, compression_ratio=0.6)
    rows = record(press)
    prefill(llama, ids(), press)
    assert len(rows) == llama.config.num_hidden_layers
    for row in rows:
        kept, pooled = row["kept"][0], row["pooled"]
        if inner == "core_scorer":  # CORE's pooled scores: the calibrated distribution, 1 per head
            torch.testing.assert_close(pooled[0].sum(-1), torch.ones(pooled.shape[1]))
        assert kept.shape[0] == pooled.shape[1] and kept.shape[1] == row["n_kept"] == N - int(N * 0.6)
        for h in range(1, kept.shape[0]):
            assert torch.equal(kept[h], kept[0])
        assert torch.equal(kept[0], naive_kept(pooled, row["n_kept"], *row["sinks_recent"]))
        per_head = [set(pooled[0, h].topk(row["n_kept"]).indices.tolist()) for h in range(pooled.shape[1])]
        assert len({frozenset(s) for s in per_head}) > 1, "the inner scorer's heads agree: the test shows nothing"


def test_refuses_headwise_budgets_and_a_ragged_cache():
    with pytest.raises(ValueError, match="head_shared wraps a per-head scorer"):
        build_press("head_shared", press=build_press("adakv", compression_ratio=0.5))
    press = build_press("head_shared", press="knorm", compression_ratio=0.5)
    keys = torch.randn(1, 2, 6, 8)
    with pytest.raises(ValueError, match=r"layer 3 holds a ragged cache \(\[5, 6\]"):
        press.score(SimpleNamespace(layer_idx=3), None, keys, keys, None, {"kv_lengths": torch.tensor([5, 6])})


def test_core_press_with_shared_budgets_is_head_shared_around_its_scorer(artifact, llama):
    """``core`` with ``head_budgets="shared"`` (a policy composition) keeps exactly what ``head_shared(core_scorer)``
    keeps, and the memory wraps it (outermost) when on."""
    from core_kv.presses.head_shared import HeadSharedPress
    from core_kv.presses.latent_memory import LatentMemoryPress

    ctx = ids()
    core = build_press("core", checkpoint=str(artifact), compression_ratio=0.6, head_budgets="shared", memory=False)
    assert isinstance(core.press, HeadSharedPress) and core.options.describe() == "shared, memory off"
    ref = build_press("head_shared", press="core_scorer", press_options={"checkpoint": str(artifact)},
                      compression_ratio=0.6)  # fmt: skip
    a, b = prefill(llama, ctx, core), prefill(llama, ctx, ref)
    for layer in range(llama.config.num_hidden_layers):
        torch.testing.assert_close(a.layers[layer].keys, b.layers[layer].keys, rtol=0, atol=0)
    with_memory = build_press("core", checkpoint=str(artifact), compression_ratio=0.6, head_budgets="shared",
                              memory=True)  # fmt: skip
    assert isinstance(with_memory.press, LatentMemoryPress) and isinstance(with_memory.press.press, HeadSharedPress)
