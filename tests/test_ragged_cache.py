"""The ragged (per-head budget) cache layer and its attention path, against a naive per-head reference.

Layer level: decode steps and multi-token appends (questions, chunked prefill) across re-layouts, trims followed by
appends, GQA ratios 1-3, fp32 and bf16, the log-partition CORE's readout takes from the kernel, the CPU kernel and
the device-independent path. Model level: a ragged cache built by AdaKV answers a question, a long chunk and decode
steps exactly as the full cache with the evicted keys masked out per head, under eager and SDPA models. Bytes: right
after an eviction a ragged layer holds exactly its kept entries; free room for appends is counted when it exists.
"""

from __future__ import annotations

import pytest
import torch
import transformers

import core_kv.models.attention as attention
from core_kv.models.attention import ragged_sdpa
from core_kv.models.cache import RESERVE_MAX, RESERVE_TOKENS, RaggedLayer, cache_kwarg, kv_bytes
from core_kv.models.tiny import tiny_lm
from core_kv.pipeline import greedy_answer, prefill
from core_kv.presses import build_press


def reference(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], scale: float):
    """Per query head, softmax over its own KV head's keys (causal over the last T), in float64: ``(1, T, H, D)``
    and the log-partition ``(H, T)``."""
    _, h, t, d = q.shape
    g = h // len(keys)
    out, lse = torch.empty(1, t, h, d, dtype=torch.float64), torch.empty(h, t, dtype=torch.float64)
    for head in range(h):
        k, v = keys[head // g].double(), values[head // g].double()
        s = k.shape[0]
        logits = q[0, head].double() @ k.T * scale
        visible = torch.arange(s)[None] <= (s - t + torch.arange(t))[:, None]
        logits = logits.masked_fill(~visible, float("-inf"))
        out[0, :, head] = logits.softmax(-1) @ v
        lse[head] = logits.logsumexp(-1)
    return out, lse


@pytest.fixture(params=[True, False], ids=["cpu-kernel", "device-independent"])
def kernel(request, monkeypatch):
    monkeypatch.setattr(attention, "_CPU_KERNEL", request.param)
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("groups", [1, 2, 3])
def test_appends_trims_and_attention_match_the_per_head_reference(kernel, dtype, groups):
    gen = torch.Generator().manual_seed(groups)
    hkv, d, s = 3, 16, 60
    full_k, full_v = torch.randn(1, hkv, s, d, generator=gen), torch.randn(1, hkv, s, d, generator=gen)
    kept = [torch.arange(0, s, 2), torch.arange(s - 11, s), torch.tensor([0, 5, 9, 30])]
    layer = RaggedLayer.from_kept(full_k.to(dtype), full_v.to(dtype), kept)
    keys = [full_k[0, h, kept[h]].to(dtype).float() for h in range(hkv)]
    values = [full_v[0, h, kept[h]].to(dtype).float() for h in range(hkv)]
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    # decode steps, a question, a chunk longer than any head held, a trim (the pipeline's), then more steps
    for t in [1, 1, 5, 1, 40, -46, 1, 3, 1]:
        if t < 0:
            layer.crop(t)
            keys, values = [k[:t] for k in keys], [v[:t] for v in values]
            continue
        new_k, new_v = torch.randn(1, hkv, t, d, generator=gen), torch.randn(1, hkv, t, d, generator=gen)
        view, _ = layer.update(new_k.to(dtype), new_v.to(dtype))
        keys = [torch.cat([keys[h], new_k[0, h].to(dtype).float()]) for h in range(hkv)]
        values = [torch.cat([values[h], new_v[0, h].to(dtype).float()]) for h in range(hkv)]
        assert layer.lengths().tolist() == [k.shape[0] for k in keys]
        q = torch.randn(1, hkv * groups, t, d, generator=gen).to(dtype)
        got, lse = ragged_sdpa(None, q, view, d**-0.5, return_lse=True)
        want, want_lse = reference(q.float(), keys, values, d**-0.5)
        assert got.dtype == dtype and got.shape == (1, t, hkv * groups, d)
        torch.testing.assert_close(got.double(), want, **tol)
        torch.testing.assert_close(lse.double(), want_lse, **tol)
        assert layer.payload_bytes() == 2 * d * layer._k.element_size() * sum(k.shape[0] for k in keys)
    padded_k, padded_v, valid = layer.padded()
    for h in range(hkv):
        assert torch.equal(padded_k[0, h][valid[h]].float(), keys[h])
        assert torch.equal(padded_v[0, h][valid[h]].float(), values[h])
        assert not padded_k[0, h][~valid[h]].any()
    for grp in layer.groups:
        for j, h in enumerate(grp.heads.tolist()):
            assert torch.equal(grp.keys[0, j].float(), keys[h])


def test_bytes_are_the_kept_entries_until_an_append_needs_room():
    d = 8
    full = torch.randn(1, 2, 50, d)
    layer = RaggedLayer.from_kept(full, full, [torch.arange(20), torch.arange(7)])
    assert layer.nbytes() == layer.payload_bytes() == 2 * 4 * d * 27  # nothing padded to the longest head
    new = torch.randn(1, 2, 1, d)
    layer.update(new, new)  # no room: re-laid out with RESERVE_TOKENS free rows per head after the token
    assert layer.nbytes() == layer.payload_bytes() + 2 * 4 * d * 2 * RESERVE_TOKENS
    pools = layer._k.data_ptr()
    for _ in range(RESERVE_TOKENS):  # in place until the room is used up
        layer.update(new, new)
    assert layer._k.data_ptr() == pools and layer.nbytes() == layer.payload_bytes()
    layer.update(new, new)  # the next room doubles
    assert layer.nbytes() == layer.payload_bytes() + 2 * 4 * d * 2 * min(RESERVE_MAX, 2 * RESERVE_TOKENS)
    with pytest.raises(ValueError, match="cannot remove"):
        layer.crop(-layer.lengths().min().item())


def test_equal_counts_stay_rectangular_and_bad_input_is_refused():
    k = torch.randn(1, 2, 10, 4)
    out = RaggedLayer.from_kept(k, k, [torch.tensor([1, 3]), torch.tensor([0, 9])])
    assert isinstance(out, tuple) and out[0].shape == (1, 2, 2, 4)
    with pytest.raises(ValueError, match="at least one token"):
        RaggedLayer.from_kept(k, k, [torch.tensor([1, 3]), torch.tensor([], dtype=torch.long)])
    with pytest.raises(ValueError, match="batch size 1"):
        RaggedLayer.from_kept(
            k.expand(2, -1, -1, -1), k.expand(2, -1, -1, -1), [torch.tensor([1]), torch.tensor([0, 9])]
        )
    layer = RaggedLayer.from_kept(k, k, [torch.tensor([1]), torch.tensor([0, 9])])
    view, _ = layer.update(torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2, 4))
    with pytest.raises(ValueError, match="3 queries for 2 new cache tokens"):
        ragged_sdpa(None, torch.randn(1, 4, 3, 4), view)


# ------------------------------------------------------------------------------------------------------------------
# Model level


def _masked_reference_logits(model, ids, feeds, keep_by_layer, n_ctx):
    """The full (uncompressed) cache with each layer's evicted positions masked out per KV head (eager attention):
    the logits of every forward in ``feeds`` (token tensors fed one after another)."""
    full = prefill(model, ids, None)
    fam = transformers.models.llama.modeling_llama
    eager = fam.eager_attention_forward

    def masked_eager(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        g = query.shape[1] // key.shape[1]
        logits = query @ key.repeat_interleave(g, 1).transpose(2, 3) * scaling  # (1, H, T, S)
        t, s = logits.shape[-2:]
        keep = torch.ones(key.shape[1], s, dtype=torch.bool)
        keep[:, :n_ctx] = keep_by_layer[module.layer_idx]
        visible = keep.repeat_interleave(g, 0)[None, :, None] & (
            torch.arange(s)[None] <= (s - t + torch.arange(t))[:, None]
        )
        out = logits.masked_fill(~visible, float("-inf")).softmax(-1) @ value.repeat_interleave(g, 1)
        return out.transpose(1, 2).contiguous(), None

    implementation = model.config._attn_implementation
    outs, pos = [], n_ctx
    try:
        fam.eager_attention_forward = masked_eager
        model.config._attn_implementation = "eager"
        with torch.inference_mode():
            for x in feeds:
                p = torch.arange(pos, pos + x.shape[1])[None]
                outs.append(model(input_ids=x, position_ids=p, **{cache_kwarg(model): full}).logits)
                pos += x.shape[1]
    finally:
        fam.eager_attention_forward = eager
        model.config._attn_implementation = implementation
    return outs


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_model_on_a_ragged_cache_matches_the_masked_full_cache(implementation):
    """A question, a 40-token chunk and three decode tokens on AdaKV's ragged cache (GQA 2:1) give the logits of
    the full cache with each head's evicted positions masked out."""
    model = tiny_lm(seed=0, attn_implementation=implementation, vocab_size=128, num_hidden_layers=2)
    n = 120
    ids = torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(1))
    press = build_press("adakv", press="knorm", compression_ratio=0.6)
    kept = {}
    select = press.select

    def record(scores, n_kept, module, kwargs):
        out = select(scores, n_kept, module, kwargs)
        mask = torch.zeros(scores.shape[1], scores.shape[2], dtype=torch.bool)
        for h, rows in enumerate(out):
            mask[h, rows] = True
        kept[module.layer_idx] = mask
        return out

    press.select = record
    cache = prefill(model, ids, press)
    assert all(isinstance(layer, RaggedLayer) for layer in cache.layers), "expected unequal per-head budgets"
    gen = torch.Generator().manual_seed(2)
    feeds = [torch.randint(3, 128, (1, t), generator=gen) for t in (4, 40, 1, 1, 1)]
    got, pos = [], n
    with torch.inference_mode(), press(model):
        for x in feeds:
            p = torch.arange(pos, pos + x.shape[1])[None]
            got.append(model(input_ids=x, position_ids=p, **{cache_kwarg(model): cache}).logits)
            pos += x.shape[1]
    want = _masked_reference_logits(model, ids, feeds, kept, n)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_chunked_prefill_on_a_ragged_cache_keeps_the_budget_and_answers():
    """Chunked prefill with head-wise budgets: every later chunk is appended to and attends over a ragged cache."""
    model = tiny_lm(seed=0, vocab_size=128, num_hidden_layers=2)
    ids = torch.randint(3, 128, (1, 160), generator=torch.Generator().manual_seed(3))
    press = build_press("adakv", press="knorm", budget=24)
    cache = prefill(model, ids, press, chunk_size=48)
    acc = kv_bytes(cache)
    assert [sum(h) for h in acc["tokens_per_head"]] == [2 * 24, 2 * 24]
    assert acc["total"] == acc["payload"]  # each chunk's eviction rebuilds the layer from the kept entries
    tokens = greedy_answer(model, cache, 160, torch.tensor([[5, 6, 7]]), 4, press, eos_token_ids=[])
    assert len(tokens) == 4 and kv_bytes(cache)["tokens_per_head"] == acc["tokens_per_head"]  # trimmed back


def test_core_readout_takes_the_ragged_kernels_log_partition(tmp_path, llama, monkeypatch):
    """CORE with head-wise budgets and its memory: a decode step's readout uses the log-partition the ragged
    attention returns; the logits equal those of the readout computing it itself over the retained cache."""
    import core_kv.presses.latent_memory as memory_mod
    from core_kv.core_model import CoreConfig, CoreModel
    from core_kv.distill.replay import capture
    from core_kv.models.fingerprint import model_fingerprint
    from core_kv.teacher.geometry import fit_geometry

    ctx = torch.randint(3, 128, (1, 200), generator=torch.Generator().manual_seed(1))
    acts = capture(llama, ctx)
    geo = fit_geometry([a.k_pre for a in acts], model_fingerprint(llama), d_z=16, num_prototypes=16)
    core = CoreModel(CoreConfig.for_model(llama, geo))
    core.set_geometry(geo)
    core.save_pretrained(tmp_path / "core")

    def decode_logits():
        press = build_press("core", checkpoint=str(tmp_path / "core"), compression_ratio=0.6, head_budgets="adaptive")
        cache = prefill(llama, ctx, press)
        assert any(isinstance(layer, RaggedLayer) for layer in cache.layers)
        out, pos, token = [], 200, torch.tensor([[5]])
        with torch.inference_mode(), press(llama):
            for _ in range(3):
                logits = llama(
                    input_ids=token, position_ids=torch.tensor([[pos]]), **{cache_kwarg(llama): cache}
                ).logits
                out.append(logits)
                token, pos = logits[:, -1:].argmax(-1), pos + 1
        return torch.cat(out, 1)

    calls = []
    ragged = attention.ragged_sdpa
    monkeypatch.setattr(attention, "ragged_sdpa", lambda *a, **k: calls.append(k.get("return_lse")) or ragged(*a, **k))
    with_kernel = decode_logits()
    assert calls.count(True) == 3 * len(llama.model.layers)  # every decode step of every (ragged) layer
    monkeypatch.setattr(memory_mod, "LSE_SINK", "_no_sink")  # the press no longer asks: its readout computes lse_R
    torch.testing.assert_close(decode_logits(), with_kernel, rtol=1e-5, atol=1e-5)
