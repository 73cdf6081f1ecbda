"""The certificate observer (:mod:`research.certificate`) on a tiny config-built Llama with an untrained artifact:
the exact bound always holds, rows are logged per (layer, query head), head-wise budgets pad each head's evicted
entries, and logging changes nothing the press computes."""

from __future__ import annotations

import pytest
import torch

from core_kv.pipeline import greedy_answer, prefill
from core_kv.presses import build_press
from research.certificate import CertifiedCorePress, certificate_terms
from tests.helpers import N, fit_tiny_artifact, ids, logits_after, tiny_model


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def path(tmp_path_factory, llama):
    core = fit_tiny_artifact(llama, seed=0)
    core.indexer.temperature.fill_(1.5)
    out = tmp_path_factory.mktemp("core") / "final"
    core.save_pretrained(out)
    return out


def certified(path, **options) -> CertifiedCorePress:
    return build_press("core_certified", checkpoint=str(path), policy="paper", **options)


def test_certificate_bound_holds_on_random_tensors():
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        n, d = 40, 8
        q, k, v = torch.randn(d, generator=g), torch.randn(n, d, generator=g) * 2, torch.randn(n, d, generator=g)
        evicted = torch.rand(n, generator=g) < 0.6
        a = (k @ q).softmax(0)
        alpha = a[evicted].sum()
        o_star, o_r = a @ v, (a * ~evicted / a[~evicted].sum()) @ v
        o_e = (a * evicted / alpha) @ v
        torch.testing.assert_close(o_star - o_r, alpha * (o_e - o_r))  # the exact identity
        w = torch.rand(n, generator=g) * evicted
        c_e = (w @ v) / w.sum()
        r_e = (v[evicted] - c_e).norm(dim=-1).max()
        eps_hat = torch.rand((), generator=g)
        bound = certificate_terms(eps_hat, (alpha - eps_hat).abs(), c_e, r_e, o_r).sum(-1)
        assert (o_star - o_r).norm() <= bound + 1e-6


def test_certificate_logged_per_head_and_exact_bound_holds(path, llama):
    press = certified(path, compression_ratio=0.75)
    cache = prefill(llama, ids(), press, chunk_size=64)
    greedy_answer(llama, cache, N, ids(6, seed=2), 3, press, eos_token_ids=[])
    rows = press.certificates
    assert rows and {r["layer"] for r in rows} == {0, 1}
    for r in rows:
        assert len(r["ret_err"]) == 4 and len(r["terms"]) == 4 and len(r["terms"][0]) == 4
        assert min(r["holds_exact"]) == 1.0
        assert all(0 <= a <= 1 for a in r["alpha"])
    assert press.aux_breakdown()["memory_state"] == press.core.memory.state_bytes()  # the shadow is not counted


def test_logging_changes_nothing_the_press_computes(path, llama):
    """The certified press keeps the same sets and gives the same logits as the plain ``core`` press."""
    from core_kv.models.cache import kv_bytes

    ctx, q = ids(), ids(6, seed=2)
    plain = build_press("core", checkpoint=str(path), policy="paper", compression_ratio=0.75)
    audited = certified(path, compression_ratio=0.75)
    for p in (plain, audited):
        p.core.memory.gate_b.data.fill_(1.0)
    torch.testing.assert_close(logits_after(llama, audited, ctx, q, 64), logits_after(llama, plain, ctx, q, 64))
    assert kv_bytes(prefill(llama, ctx, audited, 64)) == kv_bytes(prefill(llama, ctx, plain, 64))


def test_adaptive_certificate_matches_the_uniform_one_and_masks_each_heads_padding(path, llama):
    """Under head-wise budgets (a ragged cache; each head's evicted entries right-padded to the longest head's):
    with ``alpha_safeguard=1`` (the uniform press exactly) the rows equal the uniform press's; with AdaKV's floor the
    heads evict different counts, the shadow's valid mask counts each head's evictions, and every row is finite with
    the exact bound holding."""
    from core_kv.presses.adakv import AdaKVPress

    question = ids(6, seed=2)
    rows = {}
    for name, options in (("uniform", {}), ("adaptive1", {"head_budgets": "adaptive"})):
        press = certified(path, compression_ratio=0.75, **options)
        if options:
            press.inner(AdaKVPress).alpha_safeguard = 1.0
        cache = prefill(llama, ids(), press)
        greedy_answer(llama, cache, N, question, 3, press, eos_token_ids=[])
        rows[name] = press.certificates
    assert len(rows["uniform"]) == len(rows["adaptive1"]) > 0
    for a, b in zip(rows["uniform"], rows["adaptive1"], strict=True):
        for key in ("alpha", "gate", "ret_err", "comp_err", "bound_exact"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
    press = certified(path, compression_ratio=0.75, head_budgets="adaptive")
    cache = prefill(llama, ids(), press)
    kept = {e["layer"]: e["kept_per_head"] for e in press.events}
    assert any(len(set(k)) > 1 for k in kept.values())  # heads evict different counts: padding is exercised
    for idx, (_, _, valid) in press.memory_press._shadow.items():
        assert valid.sum(-1).tolist() == [N - k for k in kept[idx]]
    greedy_answer(llama, cache, N, question, 3, press, eos_token_ids=[])
    for r in press.certificates:
        for key in ("alpha", "gate", "ret_err", "comp_err"):
            assert all(x == x and abs(x) < float("inf") for x in r[key]), key
        assert all(0 <= a <= 1 for a in r["alpha"]) and min(r["holds_exact"]) == 1.0


def test_a_certificate_without_memory_is_refused(path):
    with pytest.raises(ValueError, match="audits the memory"):
        certified(path, compression_ratio=0.5, memory=False)


def test_certified_stack_is_the_core_stack_with_its_memory_rebuilt(path):
    """The certified press composes its own stack: the ``core`` stack's pieces, the latent memory rebuilt as the
    certified one with the same options and the artifact's memory (no class hook in the product press)."""
    press = certified(path, compression_ratio=0.5, head_budgets="adaptive", write_rule="equal_event")
    plain = build_press("core", checkpoint=str(path), policy="paper", compression_ratio=0.5, head_budgets="adaptive",
                        write_rule="equal_event")  # fmt: skip
    assert repr(press).endswith("; CertifiedMemoryPress(AdaKVPress(CoreScorerPress)))")
    assert press.memory_press is press.press and press.memory_press.memory is press.core.memory
    mine, theirs = press.memory_press.config_dict(), plain.memory_press.config_dict()
    assert {k: v for k, v in mine.items() if k not in ("name", "certificate_delta", "write_noise")} == {
        k: v for k, v in theirs.items() if k != "name"
    }
