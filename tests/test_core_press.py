"""The ``core`` press (CORE.md "Inference", "Certificate", "Ablations") on a tiny config-built Llama (4 q / 2 kv heads).

Artifacts are built in the test (untrained indexer and memory on a geometry fitted to the tiny model's keys): the
press's mechanics do not depend on training, and the tests must run without the shipped checkpoint.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import DynamicCache

from core_kv.core_model import CoreConfig, CoreModel
from core_kv.distill.replay import ReplaySpec, capture, replay_layer
from core_kv.models.cache import RaggedLayer, cache_kwarg, kv_bytes, layer_lengths
from core_kv.models.fingerprint import FingerprintMismatch
from core_kv.pipeline import greedy_answer, prefill
from core_kv.presses import base as press_base
from core_kv.presses import build_press
from core_kv.presses.adakv import AdaKVPress
from core_kv.presses.core import CorePress
from core_kv.presses.core_scorer import CoreEvent
from core_kv.presses.knorm import KnormPress
from core_kv.presses.latent_memory import MemoryLayer
from tests.helpers import N, ids, logits_after, record_core_kept, tiny_model


def press_for(path, **options) -> CorePress:
    return CorePress.from_pretrained(path, **options)


# ------------------------------------------------------------------------------------------------------------------
# Artifact


def test_artifact_round_trip_and_registry(tiny_artifact):
    core, path = tiny_artifact
    press = press_for(path, compression_ratio=0.5)
    for k, v in core.state_dict().items():
        torch.testing.assert_close(press.core.state_dict()[k], v, rtol=0, atol=0)
    same = build_press("core", checkpoint=str(path), compression_ratio=0.5)
    assert same.core.config.fingerprint == core.config.fingerprint
    json.dumps(press.config_dict())  # results folders record the options
    assert build_press("core_ea", checkpoint=str(path), compression_ratio=0.5).scorer.allocation == "expected_attention"
    assert build_press("core_keydiff", checkpoint=str(path), compression_ratio=0.5).scorer.allocation == "keydiff"


def test_artifact_loaded_once_and_handed_to_the_pieces(tiny_artifact, monkeypatch):
    """The ``core`` press loads its artifact once and hands it to the pieces (the scorer the artifact, the memory its
    trained memory); the budget and the protection are held by the scorer alone."""
    _, path = tiny_artifact
    loads = []
    load = CoreModel.from_pretrained.__func__
    monkeypatch.setattr(
        CoreModel, "from_pretrained", classmethod(lambda cls, *a, **k: loads.append(a) or load(cls, *a, **k))
    )
    press = press_for(path, compression_ratio=0.5, policy="paper", head_budgets="adaptive", repair=True)
    assert len(loads) == 1
    stack = press.press
    assert repr(press).endswith("; LatentMemoryPress(TwinRepairPress(AdaKVPress(CoreScorerPress))))")
    assert press.scorer is stack.press.press.press and press.scorer.core is press.core
    assert press.memory_press is stack and stack.memory is press.core.memory
    assert stack.write_rule == press.core.config.write_rule
    for p in (press, stack, stack.press, stack.press.press):  # delegated, not copied
        assert "compression_ratio" not in vars(p) and p.compression_ratio == 0.5
    press.compression_ratio = 0.75
    assert press.scorer.compression_ratio == 0.75
    assert press.protected_recent == press.scorer.protected_recent == press.core.config.protected_recent
    assert "core" not in press.scorer.config_dict() and press.scorer.config_dict()["checkpoint"] == str(path)
    with pytest.raises(ValueError, match="latent_memory needs the artifact's trained memory"):
        build_press("latent_memory", press=press.scorer)


class PublishingKnorm(KnormPress):
    """A non-CORE scorer that publishes an event (uniform ``p``, its cached keys as the pre-RoPE keys) in the stack's
    per-layer state, as CORE's scorer does, and withdraws it after the ``evicted`` phase."""

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        hkv, n = keys.shape[1:3]
        pos = torch.arange(n)[None].expand(hkv, -1)
        self.layer_state[module.layer_idx]["event"] = CoreEvent(
            p=torch.full((hkv, n), 1 / n), k_pre=keys[0].float(), positions=pos, lengths=kwargs["kv_lengths"]
        )
        return super().score(module, hidden_states, keys, values, attentions, kwargs)

    def evicted(self, module, keys, values, kept, lengths=None) -> None:
        self.layer_state[module.layer_idx].pop("event")


def test_the_memory_writes_the_event_it_is_handed(tiny_artifact, llama):
    """The scorer's event reaches the memory as data (the per-layer state during the ``evicted`` phase): the memory
    needs no CORE scorer below it, and writes the event's mass of the finally evicted entries (``Z = Σ_E p``)."""
    core, _ = tiny_artifact
    press = build_press("latent_memory", press=PublishingKnorm(compression_ratio=0.75), memory=core.memory)
    prefill(llama, ids(), press)
    for layer in (0, 1):
        mem = press.memory_state(layer)
        assert mem.events == 1
        torch.testing.assert_close(mem.Z, torch.full((2,), (N - N // 4) / N))  # 150 of 200 evicted, p = 1/200 each
    assert all("event" not in st for st in press.layer_state.values())  # withdrawn after the phase


def test_one_query_capture_per_forward_serves_every_piece(tiny_artifact, llama, monkeypatch):
    """The scorer (observation window) and the memory (readout) read one capture of ``q_proj`` per forward: one hook
    per layer, the projection converted at most once per (layer, forward)."""
    _, path = tiny_artifact
    press = press_for(path, compression_ratio=0.75, policy="paper")  # scorer + memory
    converted, forwards = [], []
    convert = press_base.prerope_queries_from_projection
    monkeypatch.setattr(
        press_base, "prerope_queries_from_projection", lambda m, out: converted.append(m.layer_idx) or convert(m, out)
    )
    attn = llama.model.layers[0].self_attn
    with press(llama):
        assert len(attn.q_proj._forward_hooks) == 1
    handles = [layer.self_attn.register_forward_hook(lambda m, a, o: forwards.append(m.layer_idx))
               for layer in llama.model.layers]  # fmt: skip
    try:
        cache = prefill(llama, ids(), press, chunk_size=64)
        greedy_answer(llama, cache, N, ids(4, seed=2), 3, press, eos_token_ids=[])
    finally:
        for h in handles:
            h.remove()
    assert not attn.q_proj._forward_hooks
    assert sorted(converted) == sorted(forwards)  # every forward read (window or readout), converted once


def test_refuses_artifact_for_another_model_and_missing_checkpoint(tiny_artifact, tmp_path):
    _, path = tiny_artifact
    press = press_for(path, compression_ratio=0.5)
    with pytest.raises(FingerprintMismatch):
        prefill(tiny_model("llama", seed=5), ids(), press)
    with pytest.raises(ValueError, match="checkpoint"):
        build_press("core", compression_ratio=0.5)
    with pytest.raises(ValueError, match="no CORE artifact"):
        build_press("core", checkpoint=str(tmp_path), compression_ratio=0.5)
    with pytest.raises(ValueError, match="allocation"):
        build_press("core", checkpoint=str(path), compression_ratio=0.5, allocation="h2o")


# ------------------------------------------------------------------------------------------------------------------
# Budgets and the memory path


@pytest.mark.parametrize("chunk", [None, 64])
def test_exact_budgets_with_memory_on(tiny_artifact, llama, chunk):
    _, path = tiny_artifact
    press = press_for(path, compression_ratio=0.5)
    cache = prefill(llama, ids(), press, chunk_size=chunk)
    assert kv_bytes(cache)["tokens_per_head"] == [[100, 100]] * 2
    for layer in range(2):
        assert press.memory_state(layer).Z.gt(0).all()
    assert press.aux_breakdown()["memory_state"] == press.core.memory.state_bytes()
    answer = greedy_answer(llama, cache, N, ids(6, seed=2), 4, press, eos_token_ids=[])
    assert len(answer) == 4
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in llama.modules())  # q_proj hooks came off too
    assert kv_bytes(cache)["tokens_per_head"] == [[100, 100]] * 2  # question trimmed, tracking re-synced


def test_budget_matched_reduces_b_by_the_memory_token_equivalent(tiny_artifact, llama):
    _, path = tiny_artifact
    press = press_for(path, budget=400, budget_matched=True)
    eq = press.memory_press.token_equivalent(4)  # fp32 cache: (512·16 + 512 + 1 + 16 + 1) · 4 B / (2 · 16 · 4 B)
    assert eq == -(-(512 * 16 + 512 + 18) * 4 // (2 * 16 * 4))
    cache = prefill(llama, ids(), press)
    assert kv_bytes(cache)["tokens_per_head"] == [[max(1, N - eq)] * 2] * 2  # the memory outweighs 200 tokens here
    with pytest.raises(ValueError, match="budget_matched"):  # no memory: nothing to match
        press_for(path, budget=400, budget_matched=True, memory=False)


def test_ratio_zero_equals_uncompressed(tiny_artifact, llama):
    _, path = tiny_artifact
    ctx, q = ids(120), ids(6, seed=2)
    ref = logits_after(llama, None, ctx, q)
    torch.testing.assert_close(logits_after(llama, press_for(path), ctx, q), ref, rtol=0, atol=0)
    cache = prefill(llama, ctx, None)
    want = greedy_answer(llama, cache, 120, q, 5, None, eos_token_ids=[])
    press = press_for(path)
    assert greedy_answer(llama, prefill(llama, ctx, press), 120, q, 5, press, eos_token_ids=[]) == want


def test_empty_memory_and_closed_gate_leave_outputs_unchanged(tiny_artifact, llama):
    _, path = tiny_artifact
    ctx, q = ids(), ids(6, seed=2)
    # one-shot prefill: the memory is empty during the only forward, so its logits are the full model's
    press = press_for(path, compression_ratio=0.75)
    cache = DynamicCache()
    with torch.inference_mode(), press(llama):
        out = llama(input_ids=ctx, use_cache=True, **{cache_kwarg(llama): cache})
    with torch.inference_mode():
        ref = llama(input_ids=ctx).logits
    torch.testing.assert_close(out.logits, ref)
    # gate 0 (bias -1e4): the compensated path equals retention only, on the same retained sets
    closed = press_for(path, compression_ratio=0.75)
    closed.core.memory.gate_b.data.fill_(-1e4)
    none = press_for(path, compression_ratio=0.75, memory=False)
    reference = logits_after(llama, none, ctx, q, 64)  # chunked: chunk queries and the question read the memory
    torch.testing.assert_close(logits_after(llama, closed, ctx, q, 64), reference)
    # and an open gate does change them
    opened = press_for(path, compression_ratio=0.75)
    opened.core.memory.gate_b.data.fill_(3.0)
    assert not torch.allclose(logits_after(llama, opened, ctx, q, 64), reference)


@pytest.mark.parametrize("rule", ["mass", "equal_event", "uniform_token"])
def test_write_rule_bookkeeping(tiny_artifact, llama, rule):
    _, path = tiny_artifact
    press = press_for(path, compression_ratio=0.5, write_rule=rule)
    prefill(llama, ids(), press)  # one event per layer
    assert [e["layer"] for e in press.events] == [0, 1]
    for e in press.events:
        z = press.memory_state(e["layer"]).Z
        want = {
            "mass": torch.tensor(e["eps_hat"]),
            "equal_event": torch.ones(2),
            "uniform_token": torch.full((2,), 100.0),
        }
        torch.testing.assert_close(z, want[rule], rtol=1e-5, atol=1e-6)


def test_repeated_eviction_never_exceeds_budget_plus_slack(tiny_artifact, llama):
    _, path = tiny_artifact
    budget, slack, steps = 40, 8, 18
    press = press_for(path, budget=budget, decoding=True, decoding_slack=slack)
    cache = DynamicCache()
    key = cache_kwarg(llama)
    with torch.inference_mode(), press(llama):
        llama(input_ids=ids(100), use_cache=True, **{key: cache})
        assert all(layer_lengths(layer).tolist() == [budget] * 2 for layer in cache.layers)
        token = ids(1, seed=4)
        for step in range(steps):
            out = llama(input_ids=token, position_ids=torch.tensor([[100 + step]]), use_cache=True, **{key: cache})
            token = out.logits[:, -1:].argmax(-1)
            for layer in cache.layers:
                assert int(layer_lengths(layer).max()) <= budget + slack, step
    assert press.memory_state(0).events == 1 + steps // (slack + 1)  # prefill + one per 9 decode steps


# ------------------------------------------------------------------------------------------------------------------
# Same computation as training's replay


def test_layer0_retained_sets_match_replay(tiny_artifact, llama):
    core, path = tiny_artifact
    press = press_for(path, compression_ratio=0.5)
    kept = record_core_kept(press, (0, 1))
    ctx = ids()
    prefill(llama, ctx, press, chunk_size=64)
    spec = ReplaySpec(chunk_size=64, ratio=0.5, protected_sinks=4, protected_recent=32, policy="student",
                      targets=False, utility=False)  # fmt: skip
    acts = capture(llama, ctx)
    events = replay_layer(acts[0], 0, [64, 128, 192], None, core.geometry(), spec, core.indexer.scores)
    assert len(events) == 3 and len(kept[0]) == 4  # the press also evicts after the last (8-token) chunk
    for ev, mine in zip(events, kept[0][:3], strict=True):
        theirs = ev.cand[ev.kept].view(2, -1)
        assert torch.equal(theirs, mine), (ev.t_e, theirs, mine)


# ------------------------------------------------------------------------------------------------------------------
# Ablations and the certificate


@pytest.mark.parametrize(
    "options",
    [
        {"allocation": "expected_attention"},
        {"allocation": "keydiff"},
        {"memory": False},
        {"calibrated": False},
        {"write_rule": "equal_event"},
        {"write_rule": "uniform_token"},
    ],  # fmt: skip
    ids=["ea", "keydiff", "no_memory", "no_calibration", "equal_event", "uniform_token"],
)
def test_ablations_keep_the_budget(tiny_artifact, llama, options):
    _, path = tiny_artifact
    press = press_for(path, compression_ratio=0.75, **options)
    cache = prefill(llama, ids(), press, chunk_size=64)
    assert kv_bytes(cache)["tokens_per_head"] == [[50, 50]] * 2
    assert (press.memory_state(0) is None) == (options == {"memory": False})
    assert len(greedy_answer(llama, cache, N, ids(4, seed=3), 2, press, eos_token_ids=[])) == 2


def test_calibration_changes_mass_not_retention(tiny_artifact, llama):
    _, path = tiny_artifact
    runs = {}
    for calibrated in (True, False):
        press = press_for(path, compression_ratio=0.5, calibrated=calibrated)
        cache = prefill(llama, ids(), press, chunk_size=64)
        runs[calibrated] = (kv_bytes(cache), [e["eps_hat"] for e in press.events])
    assert runs[True][0] == runs[False][0]
    assert runs[True][1] != runs[False][1]


# ------------------------------------------------------------------------------------------------------------------
# Issue 16: the artifact's settings win unless overridden; bad artifacts and inputs are named


def _artifact_with(tiny_artifact, tmp_path, **config) -> object:
    core, _ = tiny_artifact
    c = CoreConfig(**{**core.config.to_dict(), **config})
    other = CoreModel(c)
    other.load_state_dict(core.state_dict())
    path = tmp_path / "final"
    other.save_pretrained(path)
    return path


def test_protected_positions_come_from_the_artifact(tiny_artifact, tmp_path, llama):
    """An artifact trained with protected_recent=8 / sinks=2 runs with them; an explicit other value wins with a
    warning; invalid stored values are refused at load, naming the file."""
    import warnings

    path = _artifact_with(tiny_artifact, tmp_path, protected_sinks=2, protected_recent=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        press = press_for(path, compression_ratio=0.5)
        assert (press.protected_sinks, press.protected_recent) == (2, 8)
        assert press_for(path, compression_ratio=0.5, protected_recent=8).protected_recent == 8  # same: no warning
    with pytest.warns(UserWarning, match="protected_recent=16.*trained with 8"):
        assert press_for(path, compression_ratio=0.5, protected_recent=16).protected_recent == 16
    assert press.config_dict()["protected_recent"] == 8  # results folders record the value used
    bad = _artifact_with(tiny_artifact, tmp_path / "bad", protected_recent=-1)
    with pytest.raises(ValueError, match=r"protected_recent.*config\.json|config\.json.*protected_recent"):
        press_for(bad, compression_ratio=0.5)


def test_corrupt_artifact_tensors_are_refused_at_load(tiny_artifact, tmp_path):
    """NaN/Inf in an artifact's tensors, or a tensor whose shape does not match config.json, is refused when the
    artifact loads, naming the file and the tensor."""
    from safetensors.torch import load_file, save_file

    core, _ = tiny_artifact

    def damaged(name: str, edit):
        """The artifact saved to ``tmp_path / name`` with ``edit(tensors)`` applied to its weights file."""
        path = tmp_path / name
        core.save_pretrained(path)
        tensors = load_file(str(path / "model.safetensors"))
        edit(tensors)
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        return path

    for name, value in [("nan", float("nan")), ("inf", float("inf"))]:
        path = damaged(name, lambda t, v=value: t["memory.w_phi"].fill_(v))
        with pytest.raises(ValueError, match=r"model\.safetensors.*memory\.w_phi.*(NaN|Inf)"):
            CoreModel.from_pretrained(path)
    with pytest.raises(ValueError, match=r"model\.safetensors.*indexer\.temperature"):
        CoreModel.from_pretrained(damaged("shape", lambda t: t.__setitem__("indexer.temperature", torch.ones(5))))
    with pytest.raises(ValueError, match=r"model\.safetensors.*geo_proj"):
        CoreModel.from_pretrained(damaged("missing", lambda t: t.pop("geo_proj")))


def test_artifacts_with_other_feature_constants_are_refused_at_load(tiny_artifact, tmp_path):
    """An artifact whose recorded feature spec differs from the code's in any constant (not only the version or the
    names) is refused at load, naming the constant: the press would otherwise feed it features computed another way.
    The unedited artifact loads."""
    core, src = tiny_artifact
    assert CoreModel.from_pretrained(src).config.feature_spec == core.config.feature_spec
    edits = [
        ("obs_window", 128, r"obs_window=128 \(code: 32\)"),
        ("psi_temperature", 0.2, r"psi_temperature=0\.2 \(code: 0\.1\)"),
        ("version", 7, r"feature spec v7 is not one"),
        ("names", ["x"] * 14, r"names \['x', 'x', 'x'\]"),
    ]
    for key, value, message in edits:
        path = tmp_path / key
        core.save_pretrained(path)
        cfg = json.loads((path / "config.json").read_text())
        cfg["feature_spec"][key] = value
        (path / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ValueError, match=message):
            CoreModel.from_pretrained(path)
        with pytest.raises(ValueError, match=message):
            build_press("core", checkpoint=str(path), compression_ratio=0.5)


def test_nan_inputs_are_named_at_the_press_boundary(tiny_artifact, llama):
    """NaN hidden states reach the core press as a clear error naming the layer, not a Cholesky failure."""
    _, path = tiny_artifact
    press = press_for(path, compression_ratio=0.5)
    emb = llama.get_input_embeddings()
    saved = emb.weight.detach().clone()
    try:
        with torch.no_grad():
            emb.weight.fill_(float("nan"))
        with pytest.raises(ValueError, match=r"CorePress.*NaN.*\(layer 0\)"):
            prefill(llama, ids(), press)
    finally:
        with torch.no_grad():
            emb.weight.copy_(saved)


def test_replay_targets_follow_per_layer_lambda(tiny_artifact, llama):
    """The distillation's on-policy targets use ``lam_layers``: layer 1 with ``{"1": 4.0}`` over λ = 1 equals a
    plain λ = 4 replay there; layer 0 equals the plain λ = 1 replay."""
    core, _ = tiny_artifact
    acts = capture(llama, ids())
    base = dict(chunk_size=64, ratio=0.5, protected_sinks=4, protected_recent=32, policy="full")
    mixed = ReplaySpec(**base, lam=1.0, lam_layers={"1": 4.0})
    for layer, lam in ((0, 1.0), (1, 4.0)):
        a = replay_layer(acts[layer], layer, [64, 128], None, core.geometry(), mixed, core.indexer.scores)
        b = replay_layer(acts[layer], layer, [64, 128], None, core.geometry(), ReplaySpec(**base, lam=lam),
                         core.indexer.scores)  # fmt: skip
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x.p_star, y.p_star)
    c = replay_layer(acts[1], 1, [64, 128], None, core.geometry(), ReplaySpec(**base, lam=1.0), core.indexer.scores)
    assert not torch.equal(c[0].p_star, a[0].p_star)


# ------------------------------------------------------------------------------------------------------------------
# Head-wise (AdaKV) budgets


def adaptive_reference(p: torch.Tensor, prot: torch.Tensor, b: int, alpha: float) -> set:
    """AdaKV's rule written out: each head keeps its protected positions and its top max(1, int(alpha·b)) by p,
    then the layer's largest remaining p until Hkv·b entries are kept."""
    hkv, n = p.shape
    safe = max(1, int(alpha * b))
    keep = set()
    for h in range(hkv):
        ranked = sorted(range(n), key=lambda j: (not bool(prot[j]), -float(p[h, j])))
        keep |= {(h, j) for j in ranked[:safe]} | {(h, j) for j in range(n) if prot[j]}
    rest = sorted(((float(p[h, j]), h, j) for h in range(hkv) for j in range(n) if (h, j) not in keep), reverse=True)
    return keep | {(h, j) for _, h, j in rest[: hkv * b - len(keep)]}


def run_recording(press, model, ctx, chunk_size=None):
    """Prefill; returns the cache, each layer's final kept index lists (per head) and the distribution p of its last
    event (the scorer's, as the memory writes with it)."""
    kept, dists = {}, {}
    scorer, evicted = press.scorer, press.scorer.evicted

    def recording(module, keys, values, k, lengths=None):
        kept[module.layer_idx] = list(k[0]) if isinstance(k, torch.Tensor) else list(k)
        dists[module.layer_idx] = scorer.layer_state[module.layer_idx]["event"].p.clone()
        evicted(module, keys, values, k, lengths)

    scorer.evicted = recording
    return prefill(model, ctx, press, chunk_size), kept, dists


def test_adaptive_head_budgets_follow_adakv_over_the_calibrated_distribution(tiny_artifact, llama):
    """``head_budgets="adaptive"``: every layer keeps exactly Hkv·B entries, split across its KV heads by AdaKV's
    rule over p (checked against the rule written out); each head's evicted entries, and only those, are written;
    the answer reads the ragged cache and the memory."""
    from core_kv.budget import protected_mask

    _, path = tiny_artifact
    b = N // 4
    for rule in ("mass", "uniform_token"):
        press = press_for(path, compression_ratio=0.75, head_budgets="adaptive", write_rule=rule)
        cache, kept, dists = run_recording(press, llama, ids())
        prot = protected_mask(N, 4, 32)
        per_head = kv_bytes(cache)["tokens_per_head"]
        assert [sum(h) for h in per_head] == [2 * b, 2 * b]
        assert any(h[0] != h[1] for h in per_head)  # the budgets did move between heads
        for layer in range(2):
            got = {(h, int(j)) for h in range(2) for j in kept[layer][h]}
            assert got == adaptive_reference(dists[layer], prot, b, 0.2)
            mem = press.memory_state(layer)
            evicted = torch.tensor([N - len(kept[layer][h]) for h in range(2)], dtype=torch.float32)
            want = evicted if rule == "uniform_token" else torch.tensor(press.events[layer]["eps_hat"])
            torch.testing.assert_close(mem.Z, want, rtol=1e-5, atol=1e-6)
            assert press.events[layer]["kept_per_head"] == [len(k) for k in kept[layer]]
        answer = greedy_answer(llama, cache, N, ids(6, seed=2), 4, press, eos_token_ids=[])
        assert len(answer) == 4
        assert kv_bytes(cache)["tokens_per_head"] == per_head  # question and answer trimmed off the ragged layers


def test_adaptive_with_full_safeguard_is_the_uniform_press(tiny_artifact, llama):
    """``alpha_safeguard=1`` gives every head its own Top-B: the uniform press's cache and logits, bit for bit."""
    _, path = tiny_artifact
    ctx, q = ids(), ids(6, seed=2)
    uniform = logits_after(llama, press_for(path, compression_ratio=0.75), ctx, q)
    safe = press_for(path, compression_ratio=0.75, head_budgets="adaptive")
    safe.inner(AdaKVPress).alpha_safeguard = 1.0
    safe = logits_after(llama, safe, ctx, q)
    torch.testing.assert_close(safe, uniform, rtol=0, atol=0)


def identity_rope(attn, t: int):
    """cos = 1, sin = 0: RoPE that leaves the query as it is (the test gives post-RoPE queries)."""
    d = attn.head_dim
    return torch.ones(1, t, d), torch.zeros(1, t, d)


def test_ragged_readout_log_partition_matches_each_head(tiny_artifact, llama):
    """The readout's lse_R over a ragged layer equals each query head's log-sum-exp over its own KV head's keys."""
    _, path = tiny_artifact
    press = press_for(path, compression_ratio=0.75, head_budgets="adaptive")
    cache = prefill(llama, ids(), press)
    layer = next(i for i, lay in enumerate(cache.layers) if isinstance(lay, RaggedLayer))
    attn = llama.model.layers[layer].self_attn
    keys, _, valid = cache.layers[layer].padded()
    q = torch.randn(4, 1, keys.shape[-1], generator=torch.Generator().manual_seed(0))
    st = MemoryLayer(survive=torch.ones(2), fwd={"cache": cache, "position_embeddings": identity_rope(attn, 1)})
    got = press.memory_press.retained_lse(attn, st, q)
    for h in range(4):
        k = keys[0, h // 2][valid[h // 2]]
        torch.testing.assert_close(got[h], ((q[h] @ k.mT) * attn.scaling).logsumexp(-1), rtol=1e-5, atol=1e-5)


def test_adaptive_allocation_press_is_adakv_over_that_press(tiny_artifact, llama):
    """With ``head_budgets="adaptive"`` the heads compete on the allocation press's raw scores: ExpectedAttention with
    ε = 1e-2, no protected positions and no memory is kvpress's leaderboard AdaKV(ExpectedAttention), logits bit for
    bit."""
    _, path = tiny_artifact
    ctx, q = ids(), ids(6, seed=2)
    with pytest.warns(UserWarning, match="overrides the artifact"):
        core_ea = press_for(path, compression_ratio=0.75, allocation="expected_attention", head_budgets="adaptive",
                            protected_sinks=0, protected_recent=0, memory=False)  # fmt: skip
    core_ea.scorer._inner.epsilon = 1e-2  # kvpress's leaderboard entry runs ExpectedAttention with ε = 1e-2
    adakv = build_press("adakv_expected_attention", compression_ratio=0.75)
    torch.testing.assert_close(logits_after(llama, core_ea, ctx, q), logits_after(llama, adakv, ctx, q), rtol=0, atol=0)


def test_output_head_pool_ranks_by_expected_attentions_formula_over_p(tiny_artifact, llama):
    """``head_pool="output"``: the heads of a layer compete on ``(p + ε) · ‖v‖`` (AdaKV's rule written out over
    that quantity, p the calibrated distribution, v the layer's values). Each layer still keeps Hkv·B entries."""
    from core_kv.budget import protected_mask

    _, path = tiny_artifact
    b, eps = N // 4, 0.05
    acts = capture(llama, ids())
    prot = protected_mask(N, 4, 32)
    press = press_for(path, compression_ratio=0.75, head_budgets="adaptive", head_pool="output")
    press.inner(AdaKVPress).pool_epsilon = eps
    cache, kept, dists = run_recording(press, llama, ids())
    assert [sum(h) for h in kv_bytes(cache)["tokens_per_head"]] == [2 * b, 2 * b]
    for layer in range(2):
        pooled = (dists[layer] + eps) * acts[layer].v.norm(dim=-1)
        got = {(h, int(j)) for h in range(2) for j in kept[layer][h]}
        assert got == adaptive_reference(pooled, prot, b, 0.2)
        assert got != adaptive_reference(dists[layer], prot, b, 0.2), layer  # the value norms moved the split
    for options, what in (({"head_pool": "value"}, "head_pool"), ({"head_pool": "output"}, "head_budgets")):
        with pytest.raises(ValueError, match=what):
            press_for(path, compression_ratio=0.5, **options)


def repair_reference(keys: torch.Tensor, kept: set, prot: torch.Tensor, tau: float, w: int = 32) -> set:
    """TwinKV's repair pass (paper 001 §3.4) written out over one head's kept positions: b_i = the best cosine to a
    kept key more than w positions away (-1 if none); orphans = evicted with b < τ (ascending b), donors = kept,
    unprotected, b ≥ τ (descending b); the min(#orphans, #donors) first pairs swap."""
    from core_kv.presses.twin_repair import naive_best_twin

    b = naive_best_twin(keys, torch.tensor(sorted(kept)), w)
    n = keys.shape[0]
    orphans = sorted((j for j in range(n) if j not in kept and b[j] < tau), key=lambda j: (float(b[j]), j))
    donors = sorted((j for j in kept if not prot[j] and b[j] >= tau), key=lambda j: (-float(b[j]), j))
    m = min(len(orphans), len(donors))
    return (kept - set(donors[:m])) | set(orphans[:m])


@pytest.mark.parametrize("head_budgets", ["uniform", "adaptive"])
def test_repair_runs_twinkvs_pass_on_cores_sets(tiny_artifact, llama, head_budgets):
    """``repair=True`` (TwinRepairPress around the scorer, or around AdaKV around it): every head's retained set is
    CORE's set after TwinKV's repair pass (post-RoPE keys, CORE's protected positions never donate, donors most
    redundant first), so each head keeps the same number of entries; the evicted mass ε̂ is that of the repaired set."""
    from core_kv.budget import protected_mask
    from core_kv.presses.twin_repair import TwinRepairPress

    _, path = tiny_artifact
    tau, b = 0.3, N // 4
    prot = protected_mask(N, 4, 32)
    opts = dict(compression_ratio=0.75, head_budgets=head_budgets, memory=False)
    _, before, _ = run_recording(press_for(path, **opts), llama, ids())
    press = press_for(path, repair=True, **opts)
    press.inner(TwinRepairPress).threshold = tau
    assert (press.inner(TwinRepairPress).protected_sinks, press.inner(TwinRepairPress).protected_recent) == (4, 32)
    cache, after, dists = run_recording(press, llama, ids())
    full = prefill(llama, ids(), None)
    swapped = 0
    for layer in range(2):
        keys = full.layers[layer].keys[0]  # (Hkv, N, D) post-RoPE
        for h in range(2):
            s0 = {int(j) for j in before[layer][h]}
            s1 = {int(j) for j in after[layer][h]}
            assert s1 == repair_reference(keys[h], s0, prot, tau)
            assert len(s1) == len(s0) and all(int(j) in s1 for j in prot.nonzero().flatten())
            swapped += len(s1 - s0)
        evicted = torch.ones(2, N, dtype=torch.bool)
        for h in range(2):
            evicted[h, after[layer][h]] = False
        ev = press.events[layer]["eps_hat"]
        torch.testing.assert_close(torch.tensor(ev), (dists[layer] * evicted).sum(-1).float(), rtol=1e-5, atol=1e-6)
    assert swapped > 0  # the pass moved something (else the test checks nothing)
    if head_budgets == "uniform":
        assert all(len(x) == b for layer in after.values() for x in layer)


def test_a_composition_serving_another_selection_says_so(tiny_artifact, tmp_path):
    """The artifact records the selection its indexer and memory were trained under (``train.py``'s ``selection``);
    a composition that serves the other one says so in its repr and records both in its results config."""
    core, path = tiny_artifact
    shared = press_for(path, compression_ratio=0.75, policy="paper", head_budgets="shared", memory=False)
    assert core.config.trained_selection == "per_head"
    assert "(trained per_head, served shared)" in repr(shared)
    assert shared.config_dict()["trained_selection"] == "per_head"
    assert "trained" not in repr(press_for(path, compression_ratio=0.75, policy="paper"))
    core.config.trained_selection = "shared"
    try:
        core.save_pretrained(tmp_path / "shared")
    finally:
        core.config.trained_selection = "per_head"
    assert "trained" not in repr(press_for(tmp_path / "shared", compression_ratio=0.75, policy="paper",
                                           head_budgets="shared", memory=False))  # fmt: skip
    assert "(trained shared, served per_head)" in repr(press_for(tmp_path / "shared", compression_ratio=0.75,
                                                                 policy="paper"))  # fmt: skip
