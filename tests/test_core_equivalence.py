"""The optimised CORE press (issue 19) against the naive reference it replaced.

:class:`ReferenceScorer` and :class:`ReferenceMemory` keep the earlier per-head computation: features KV head by KV head (as
``distill/replay.py`` calls them), RoPE inverted with per-head cos/sin, the memory written by
:func:`core_kv.memory.write` and read by :func:`core_kv.memory.compensate` (the trainer's differentiable functions).
The optimised press must keep the same retained sets event by event and give the same outputs within float
tolerance, in one-shot and chunked prefill and with decode-time eviction.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.utils.rnn import pad_sequence

import core_kv.presses.latent_memory
from core_kv.features import compute_features, observation_attention
from core_kv.memory import MemoryState, compensate, compensate_fused, gate_terms, write, write_fused
from core_kv.models.attention import apply_rope
from core_kv.models.cache import RaggedLayer, cache_kwarg
from core_kv.pipeline import greedy_answer, prefill
from core_kv.presses.core import CorePress
from core_kv.presses.core_scorer import CoreScorerPress
from core_kv.presses.latent_memory import LatentMemoryPress
from tests.helpers import ids, logits_after


class ReferenceScorer(CoreScorerPress):
    """The scorer as it was before issue 19: per-head features (as ``distill/replay.py`` calls them), RoPE inverted
    with per-head cos/sin; for equivalence only."""

    def unrope(self, module, keys, positions):
        x = keys.float()[:, None]
        cos, sin = self._rotary(module, x, positions)
        return apply_rope(module, x, (cos.float(), -sin.float()))[:, 0]

    def _features(self, module, st, keys, values, k_pre):
        idx = module.layer_idx
        geo = self.core.geometry()
        hkv, n, d = keys.shape
        g = st.wq_pre.shape[0] // hkv
        cos, sin = self._rotary(module, st.wq_pre, st.wpos[None])
        wq_post = apply_rope(module, st.wq_pre[None], (cos.float(), sin.float()))[0]
        z = geo.project(idx, k_pre)
        phi = geo.nystrom(idx, z)
        protos = geo.prototypes[idx].to(z)
        scaling = float(getattr(module, "scaling", d**-0.5))
        feats = []
        for h in range(hkv):
            c = st.pos[h]
            qs = slice(h * g, (h + 1) * g)
            obs = observation_attention(wq_post[qs][None], keys[h][None], st.wpos, c, scaling)
            f, ema = compute_features(
                obs, st.wq_pre[qs].reshape(1, -1, d), k_pre[h][None], values[h][None], c, st.next - 1,
                z[h][None], phi[h][None], protos[h][None], st.persist[h][None],
            )  # fmt: skip
            st.persist[h] = ema[0]
            feats.append(f[0])
        return torch.stack(feats)


class ReferenceMemory(LatentMemoryPress):
    """The memory written by :func:`core_kv.memory.write` and read by :func:`core_kv.memory.compensate` (the
    trainer's differentiable functions) instead of the fused kernels."""

    def write(self, module, st, keys, values, kept):
        fused = core_kv.presses.latent_memory.write_fused
        pad = lambda heads: pad_sequence(list(heads), batch_first=True)  # noqa: E731 (zero weights write nothing)
        core_kv.presses.latent_memory.write_fused = lambda mem, w_phi, k, v, w, dtype=None: write(
            mem, w_phi, pad(k), pad(v), pad(w)
        )
        try:
            super().write(module, st, keys, values, kept)
        finally:
            core_kv.presses.latent_memory.write_fused = fused

    def compensate(self, layer, mem, q_pre, o_r, lse):
        return self.memory.compensate(mem, layer, q_pre, o_r, lse)


def stacks(path, **options):
    """The shipped composition (the paper's press: memory around the scorer) and the reference one."""
    fast = CorePress.from_pretrained(path, policy="paper", **options)
    scorer = ReferenceScorer(checkpoint=str(path), **options)
    ref = ReferenceMemory(press=scorer, memory=scorer.core.memory, write_rule=scorer.core.config.write_rule)
    return fast, ref


def recorded(press):
    """Spy on the scorer's ``evicted`` phase: (layer, retained positions, ε̂) of every event."""
    scorer = press.inner(CoreScorerPress)
    log, evicted = [], scorer.evicted

    def wrapper(module, *args):
        evicted(module, *args)
        log.append((module.layer_idx, scorer._layers[module.layer_idx].pos.clone(), scorer.events[-1]["eps_hat"]))

    scorer.evicted = wrapper
    return log


def assert_same_events(fast, ref):
    assert len(fast) == len(ref) > 0
    for (la, pa, ea), (lb, pb, eb) in zip(fast, ref, strict=True):
        assert la == lb
        assert torch.equal(pa, pb), la  # the retained sets are identical
        torch.testing.assert_close(torch.tensor(ea), torch.tensor(eb), rtol=1e-5, atol=1e-7)


def open_gate(press):
    press.inner(CoreScorerPress).core.memory.gate_b.data.fill_(1.0)  # the memory's contribution shows in the logits


@pytest.mark.parametrize("chunk", [None, 64])
def test_optimised_press_equals_reference(tiny_artifact, llama, chunk):
    _, path = tiny_artifact
    ctx, q = ids(), ids(6, seed=2)
    fast, ref = stacks(path, compression_ratio=0.75)
    for p in (fast, ref):
        open_gate(p)
    log_f, log_r = recorded(fast), recorded(ref)
    out_f, out_r = logits_after(llama, fast, ctx, q, chunk), logits_after(llama, ref, ctx, q, chunk)
    assert_same_events(log_f, log_r)
    torch.testing.assert_close(out_f, out_r, rtol=1e-4, atol=1e-4)
    for layer in range(2):
        mf, mr = fast.memory_state(layer), ref.memory_state(layer)
        torch.testing.assert_close(mf.M, mr.M, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(mf.b, mr.b, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(mf.Z, mr.Z)
    # the question tokens were trimmed by the pipeline: the lazily tracked entries re-synced to the cache
    cache_f, cache_r = prefill(llama, ctx, fast, chunk), prefill(llama, ctx, ref, chunk)
    ans_f = greedy_answer(llama, cache_f, ctx.shape[1], q, 6, fast, eos_token_ids=[])
    ans_r = greedy_answer(llama, cache_r, ctx.shape[1], q, 6, ref, eos_token_ids=[])
    assert ans_f == ans_r
    assert fast.aux_breakdown()["obs_window"] == 0  # the observation window is dropped once no event can follow
    assert fast.aux_breakdown()["memory_state"] == ref.aux_breakdown()["memory_state"]


def test_decode_time_eviction_equals_reference(tiny_artifact, llama):
    _, path = tiny_artifact
    budget, slack, steps = 40, 8, 20
    logs, outs = [], []
    for press in stacks(path, budget=budget, decoding=True, decoding_slack=slack):
        open_gate(press)
        logs.append(recorded(press))
        from transformers import DynamicCache

        cache, key, steps_out = DynamicCache(), cache_kwarg(llama), []
        with torch.inference_mode(), press(llama):
            llama(input_ids=ids(100), use_cache=True, **{key: cache})
            token = ids(1, seed=4)
            for step in range(steps):
                out = llama(input_ids=token, position_ids=torch.tensor([[100 + step]]), use_cache=True, **{key: cache})
                steps_out.append(out.logits[:, -1])
                token = out.logits[:, -1:].argmax(-1)
        outs.append(torch.cat(steps_out))
    assert_same_events(*logs)
    assert len(logs[0]) == 2 * (1 + steps // (slack + 1))  # 2 layers: prefill + one event per 9 steps
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-4)


def test_fused_write_and_readout_equal_the_trainer_functions():
    g = torch.Generator().manual_seed(0)
    hkv, gq, p, d, n, t = 2, 3, 64, 8, 30, 5
    w_phi = torch.randn(hkv, p, d, generator=g) / d**0.5
    state = MemoryState.empty(hkv, d, p)
    fused = MemoryState.empty(hkv, d, p)
    for _ in range(3):  # several events accumulate
        k, v = torch.randn(hkv, n, d, generator=g), torch.randn(hkv, n, d, generator=g)
        w = torch.rand(hkv, n, generator=g) * (torch.rand(hkv, n, generator=g) < 0.7)
        state, fused = write(state, w_phi, k, v, w), write_fused(fused, w_phi, k, v, w)
    for name in ("M", "b", "Z", "s_v", "radius"):
        torch.testing.assert_close(getattr(fused, name), getattr(state, name), rtol=1e-5, atol=1e-6)
    assert fused.Mb.shape == (hkv, p, d + 1) and fused.nbytes() == state.nbytes()
    q, o, lse = torch.randn(hkv * gq, t, d, generator=g), torch.randn(hkv * gq, t, d, generator=g), torch.randn(6, t)
    gate_w, gate_b = torch.randn(4, generator=g), torch.randn(hkv * gq, generator=g)
    want = compensate(state, w_phi, gate_w, gate_b, q, o, lse)
    got = compensate_fused(fused, w_phi.mT, gate_terms(fused, gate_w, gate_b), q, o, lse)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # an empty head keeps its gate shut, as compensate
    half = write_fused(MemoryState.empty(hkv, d, p), w_phi, k, v, w * torch.tensor([[1.0], [0.0]]))
    _, gates = compensate_fused(half, w_phi.mT, gate_terms(half, gate_w, gate_b), q, o, lse)
    assert gates[gq:].eq(0).all() and gates[:gq].gt(0).all()


def test_fused_write_takes_each_heads_own_count():
    """Head-wise budgets evict different numbers per KV head: written from each head's own entries (no padding; one
    head writes nothing), the state equals the trainer's write of the zero-padded event, and the empty head's gate
    stays shut."""
    g = torch.Generator().manual_seed(1)
    hkv, p, d, counts = 3, 64, 8, (17, 5, 0)
    w_phi = torch.randn(hkv, p, d, generator=g) / d**0.5
    k, v = torch.randn(hkv, 17, d, generator=g), torch.randn(hkv, 17, d, generator=g)
    w = torch.rand(hkv, 17, generator=g) * (torch.arange(17)[None] < torch.tensor(counts)[:, None])  # padding: 0
    want = write(MemoryState.empty(hkv, d, p), w_phi, k, v, w)
    got = write_fused(MemoryState.empty(hkv, d, p), w_phi, [k[h, :c] for h, c in enumerate(counts)],
                      [v[h, :c] for h, c in enumerate(counts)], [w[h, :c] for h, c in enumerate(counts)])  # fmt: skip
    for name in ("M", "b", "Z", "s_v", "radius"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=1e-5, atol=1e-6)
    assert got.Z[2] == 0 and got.Mb[2].eq(0).all()
    q, o = torch.randn(hkv * 2, 1, d, generator=g), torch.randn(hkv * 2, 1, d, generator=g)
    gate_w, gate_b = torch.randn(4, generator=g), torch.randn(hkv * 2, generator=g)
    out, gates = compensate_fused(got, w_phi.mT, gate_terms(got, gate_w, gate_b), q, o, torch.randn(hkv * 2, 1))
    assert gates[4:].eq(0).all() and gates[:4].gt(0).all() and torch.equal(out[4:], o[4:])


def test_batched_features_equal_per_head(tiny_artifact, llama):
    """The features of every KV head at once equal the per-head calls bit for bit (same kernels per head)."""
    _, path = tiny_artifact
    feats = {}
    for cls in (CoreScorerPress, ReferenceScorer):
        press = cls(checkpoint=str(path), compression_ratio=0.5)
        got = []
        features = press._features

        def wrapper(module, st, *args, features=features, got=got):
            out = features(module, st, *args)
            got.append((out.clone(), st.persist.clone()))
            return out

        press._features = wrapper
        prefill(llama, ids(), press, chunk_size=64)
        feats[cls] = got
    for (fa, pa), (fb, pb) in zip(feats[CoreScorerPress], feats[ReferenceScorer], strict=True):
        torch.testing.assert_close(fa, fb, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(pa, pb, rtol=1e-6, atol=1e-7, equal_nan=True)


def test_decode_steps_take_the_log_partition_from_the_attention(tiny_artifact, llama):
    """On a decode step the readout's lse_R comes from the attention kernel and equals the recomputed one."""
    _, path = tiny_artifact
    press = CorePress.from_pretrained(path, compression_ratio=0.75, policy="paper")
    memory = press.memory_press
    seen = []
    compensate_fn = memory.compensate

    def compensate_spy(layer, mem, q_pre, o_r, lse):
        st = memory._memory[layer]
        if q_pre.shape[1] == 1:
            assert "lse" in st.fwd  # the kernel's, not recomputed
            seen.append((lse, memory.retained_lse(llama.model.layers[layer].self_attn, st, q_pre)))
        return compensate_fn(layer, mem, q_pre, o_r, lse)

    memory.compensate = compensate_spy
    cache = prefill(llama, ids(), press)
    greedy_answer(llama, cache, ids().shape[1], ids(3, seed=2), 4, press, eos_token_ids=[])
    assert len(seen) == 2 * 3  # 2 layers × the 3 one-token steps after the 3-token question
    for got, want in seen:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not any("_core_kv_lse_sink" in m.__dict__ for m in llama.modules())  # cleared on exit


def test_ragged_layers_take_the_log_partition_from_the_attention_for_every_forward(tiny_artifact, llama):
    """Head-wise budgets (ragged layers): the question's multi-token forward and the decode steps alike take lse_R
    from the per-head attention kernel; it equals the recomputed one."""
    _, path = tiny_artifact
    press = CorePress.from_pretrained(path, compression_ratio=0.75, policy="paper", head_budgets="adaptive")
    memory = press.memory_press
    seen = []
    compensate_fn = memory.compensate

    def compensate_spy(layer, mem, q_pre, o_r, lse):
        st = memory._memory[layer]
        if isinstance(st.fwd["cache"].layers[layer], RaggedLayer):  # (a layer whose heads keep equal counts is not)
            assert "lse" in st.fwd  # the kernel's, not recomputed
            seen.append((q_pre.shape[1], lse, memory.retained_lse(llama.model.layers[layer].self_attn, st, q_pre)))
        return compensate_fn(layer, mem, q_pre, o_r, lse)

    memory.compensate = compensate_spy
    cache = prefill(llama, ids(), press)
    greedy_answer(llama, cache, ids().shape[1], ids(3, seed=2), 4, press, eos_token_ids=[])
    lengths = [t for t, *_ in seen]
    assert lengths.count(3) >= 1 and lengths.count(1) == 3 * lengths.count(3)  # per ragged layer: question, 3 steps
    for _, got, want in seen:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_two_byte_memory_state_stays_within_tolerance(tiny_artifact, llama, dtype):
    """``memory_dtype``: half the state bytes, the same retained sets, logits within the stated tolerance."""
    _, path = tiny_artifact
    ctx, q = ids(), ids(6, seed=2)
    runs = {}
    for dt in (None, dtype):
        press = CorePress.from_pretrained(path, compression_ratio=0.75, memory_dtype=dt, policy="paper")
        open_gate(press)
        log = recorded(press)
        runs[dt] = (press, log, logits_after(llama, press, ctx, q, 64))
    (p32, log32, out32), (p16, log16, out16) = runs[None], runs[dtype]
    assert_same_events(log16, log32)
    tol = {"float16": 1e-4, "bfloat16": 2e-3}[dtype]
    torch.testing.assert_close(out16, out32, rtol=0, atol=tol)
    full = p32.aux_breakdown()["memory_state"]
    assert p16.aux_breakdown()["memory_state"] < 0.51 * full
    assert p16.memory_state(0).Mb.dtype == getattr(torch, dtype)
