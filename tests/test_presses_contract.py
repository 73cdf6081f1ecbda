"""The press contract, checked for every registered press (``PRESSES``) on tiny models built from config.

CORE's presses (``core``, ``core_ea``, ``core_keydiff``) run from a small artifact fitted here to each tiny model (random
indexer, fitted geometry), so every contract test checks them too; ``full`` never compresses and skips, with that
reason, the tests about what a compression keeps.

Budgets are exact per head (ratio and absolute forms; per-head sums for per-head methods), kept positions are the
top-scored ones, protected positions survive, hooks always come off, ratio 0 and budgets >= the context change
nothing, bad options raise ``ValueError``, unsupported architectures raise. Plus: the ragged attention path against
a hand-written per-head softmax, decode-time eviction bounds, chunked prefill, and Mistral/Qwen2/Phi3/Gemma 2 smoke
runs. On Gemma 3 (sliding-window layers alternating with global ones) the budgets hold on the global layers and every
window layer keeps exactly its window (W - 1 positions), untouched.
"""

from __future__ import annotations

import math
from dataclasses import fields

import pytest
import torch
import transformers
from transformers import DynamicCache

from core_kv.models.attention import PREFIX, UnsupportedModelError, attention_modules, ragged_sdpa, window_layers
from core_kv.models.cache import RaggedLayer, cache_kwarg, kv_bytes, layer_lengths
from core_kv.pipeline import greedy_answer, prefill
from core_kv.presses import PRESSES, BasePress, ScorerPress
from core_kv.presses import build_press as _build_press
from core_kv.presses.base import WrapperPress
from core_kv.presses.latent_memory import LatentMemoryPress
from core_kv.presses.twin_repair import TwinRepairPress
from tests.helpers import (
    COMMON,
    N_CTX,
    build_press,
    can_compress,
    ids,
    masked_full_cache_logits,
    model_for,
    skip_unless_compressing,
    tiny,
)

NAMES = sorted(PRESSES)
pytestmark = pytest.mark.usefixtures("contract_artifacts")  # the folder of core_artifact(arch)


def record_selection(press: BasePress) -> list[tuple[torch.Tensor, object]]:
    """Wrap ``press.select`` to record (masked scores, kept) per eviction event."""
    calls: list = []
    if not isinstance(press, ScorerPress):  # it composes its own selection; its budget is the contract checked
        return calls
    select = press.select

    def wrapped(scores, n_kept, module, kwargs):
        kept = select(scores, n_kept, module, kwargs)
        calls.append((scores.detach().clone(), kept, n_kept, module.layer_idx))
        return kept

    press.select = wrapped
    return calls


def kept_rows(kept) -> list[torch.Tensor]:
    return list(kept[0]) if isinstance(kept, torch.Tensor) else list(kept)


def no_hooks(model: torch.nn.Module) -> bool:
    return all(
        not m._forward_hooks and not m._forward_pre_hooks and "_core_kv_attn" not in m.o_proj.__dict__
        for m in attention_modules(model)
    ) and not model.config._attn_implementation.startswith(PREFIX)


# ------------------------------------------------------------------------------------------------------------------
# Budgets and selection


def check_window_layer(layer: list[int], window: int, n: int) -> None:
    """A sliding-window layer keeps exactly its window: min(n, W - 1) positions per head (presses leave it alone)."""
    assert layer == [min(n, window - 1)] * len(layer), f"window layer holds {layer}, its window is {window}"


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("form", [{"compression_ratio": 0.5}, {"budget": 50}], ids=["ratio", "budget"])
@pytest.mark.parametrize("name", NAMES)
def test_budget_exact_and_top_scored(name, form, arch):
    if not can_compress(name):
        with pytest.raises(ValueError):
            build_press(name, **form)
        pytest.skip(f"{name} never compresses: refusing a budget is its contract")
    press = build_press(name, arch, **form)
    model = model_for(press, arch)
    calls = record_selection(press)
    cache = prefill(model, ids(), press)
    lengths = kv_bytes(cache)["tokens_per_head"]
    hkv = COMMON["num_key_value_heads"]
    windows = window_layers(model)
    assert bool(windows) == (arch == "gemma3")
    for layer, attn in enumerate(attention_modules(model)):
        if layer in windows:
            check_window_layer(lengths[layer], windows[layer], N_CTX)
            continue
        target = press.layer_target(attn, N_CTX)
        assert target <= N_CTX and (form.get("budget") is None or name == "pyramidkv" or target == 50)
        per_head = lengths[layer]
        if len(set(per_head)) == 1:
            assert per_head == [target] * hkv, f"layer {layer}: {per_head} != budget {target}"
        else:  # per-head budgets: the layer total is exact
            assert sum(per_head) == hkv * target and min(per_head) >= 1, f"layer {layer}: {per_head}"
    if type(press).compress is not ScorerPress.compress or type(press)._post_hook is not BasePress._post_hook:
        return  # the press composes its own selection (a repair pass, CORE's event); the budget above is the contract
    assert len(calls) == COMMON["num_hidden_layers"] - len(windows)  # one event per global layer
    for scores, kept, n_kept, _ in calls:
        rows = kept_rows(kept)
        if type(press).select is ScorerPress.select:
            for h, row in enumerate(rows):
                mask = torch.zeros(scores.shape[-1], dtype=torch.bool)
                mask[row] = True
                assert scores[0, h, mask].min() >= scores[0, h, ~mask].max(), f"head {h} did not keep its top-k"
        elif name == "adakv":  # global top-k across heads, after each head's safeguard
            n_safe = max(1, int(n_kept * press.alpha_safeguard))
            safe = torch.zeros_like(scores[0], dtype=torch.bool).scatter_(-1, scores[0].topk(n_safe).indices, True)
            keep = torch.zeros_like(safe)
            for h, row in enumerate(rows):
                keep[h, row] = True
            assert (safe & ~keep).sum() == 0
            assert scores[0][keep & ~safe].min() >= scores[0][~keep].max()


@pytest.mark.filterwarnings("ignore:.*overrides the artifact's setting")  # CORE: protection given over the artifact's
@pytest.mark.parametrize("name", NAMES)
def test_protected_positions_kept(name):
    skip_unless_compressing(name)
    protect = {"protected_sinks": 4, "protected_recent": 8}
    options = {"compression_ratio": 0.75, **protect}
    if issubclass(PRESSES[name], TwinRepairPress):
        # a wrapper whose own protection only guards its repair swaps (twin_repair, documented): protect the inner too
        options["press_options"] = protect
    press = build_press(name, **options)
    cache = prefill(model_for(press), ids(), press)
    full = prefill(model_for(press), ids(), None)
    for layer, full_layer in zip(cache.layers, full.layers, strict=True):
        keys = layer.padded()[0] if isinstance(layer, RaggedLayer) else layer.keys
        lens = layer_lengths(layer)
        for h in range(keys.shape[1]):
            kept = keys[0, h, : lens[h]]
            for pos in [*range(4), *range(N_CTX - 8, N_CTX)]:
                assert (kept == full_layer.keys[0, h, pos]).all(-1).any(), f"protected position {pos} evicted"


# ------------------------------------------------------------------------------------------------------------------
# Hooks, no-ops, validation


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("name", NAMES)
def test_hooks_removed_even_when_forward_raises(name, arch):
    press = build_press(name, arch, compression_ratio=0.5) if can_compress(name) else build_press(name)
    model = model_for(press, arch)
    prefill(model, ids(80), press)
    assert no_hooks(model)
    with pytest.raises(ValueError, match="KV cache"):
        with press(model):
            assert not no_hooks(model)
            model.model(input_ids=ids(80), use_cache=False)  # the press's hook raises inside the forward
    assert no_hooks(model)
    with pytest.raises(KeyError):
        with press(model):
            raise KeyError("user code failing inside the block")
    assert no_hooks(model)


@pytest.mark.parametrize("name", NAMES)
def test_ratio_zero_and_large_budget_are_noops(name):
    model = tiny("qwen3", eager=bool(build_press(name).needs_attentions))
    ctx, question = ids(120), ids(6, seed=2)

    def answer(press):
        cache = prefill(model, ctx, press)
        assert kv_bytes(cache)["tokens_per_head"] == [[120, 120]] * 2
        return greedy_answer(model, cache, 120, question, 5, press, eos_token_ids=[])

    reference = answer(None)
    assert answer(build_press(name)) == reference
    if can_compress(name):
        assert answer(build_press(name, "qwen3", budget=120)) == reference
        assert answer(build_press(name, "qwen3", budget=10_000)) == reference


BAD = {
    "ratio_one": {"compression_ratio": 1.0},
    "ratio_negative": {"compression_ratio": -0.1},
    "ratio_nan": {"compression_ratio": math.nan},
    "budget_zero": {"budget": 0},
    "ratio_and_budget": {"compression_ratio": 0.5, "budget": 10},
    "unknown_option": {"no_such_option": 1},
}


@pytest.mark.parametrize("bad", BAD.values(), ids=BAD.keys())
@pytest.mark.parametrize("name", NAMES)
def test_bad_options_raise(name, bad):
    with pytest.raises(ValueError):
        build_press(name, **bad)


def test_unknown_press_and_eager_requirement():
    with pytest.raises(ValueError, match="unknown press"):
        build_press("no_such_press")
    for name in NAMES:
        press = build_press(name)
        if press.needs_attentions:
            with pytest.raises(ValueError, match="eager"):
                with press(tiny("llama", eager=False)):
                    pass


@pytest.mark.parametrize("name", NAMES)
def test_unsupported_architecture_raises(name):
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=64)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    press = build_press(name, compression_ratio=0.5) if can_compress(name) else build_press(name)
    with pytest.raises(UnsupportedModelError):
        with press(model):
            pass
    assert issubclass(UnsupportedModelError, ValueError)


# ------------------------------------------------------------------------------------------------------------------
# Ragged attention, decode-time eviction, chunked prefill


def naive_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], scale: float):
    """Per query head: softmax(q k^T * scale) v over that head's own KV head, causal over the last T keys."""
    b, h, t, d = q.shape
    groups = h // len(keys)
    out = torch.empty(b, t, h, d)
    for head in range(h):
        k, v = keys[head // groups], values[head // groups]  # (S_h, D)
        s = k.shape[0]
        logits = q[0, head] @ k.T * scale  # (T, S_h)
        visible = torch.arange(s)[None, :] <= (s - t + torch.arange(t))[:, None]
        out[0, :, head] = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1) @ v
    return out


@pytest.mark.parametrize("t", [1, 5])
def test_ragged_attention_matches_naive_reference(t):
    torch.manual_seed(0)
    d, s, lengths = 16, 20, [9, 14, 9]  # unequal per-head quotas
    full_k, full_v = torch.randn(1, 3, s, d), torch.randn(1, 3, s, d)
    kept = [torch.randperm(s)[:n].sort().values for n in lengths]
    layer = RaggedLayer.from_kept(full_k, full_v, kept)
    new_k, new_v = torch.randn(1, 3, t, d), torch.randn(1, 3, t, d)
    view, _ = layer.update(new_k, new_v)
    keys = [torch.cat([full_k[0, h, kept[h]], new_k[0, h]]) for h in range(3)]
    values = [torch.cat([full_v[0, h, kept[h]], new_v[0, h]]) for h in range(3)]
    q = torch.randn(1, 6, t, d)  # 2 query heads per KV head
    got = ragged_sdpa(None, q, view, scaling=d**-0.5)
    torch.testing.assert_close(got, naive_attention(q, keys, values, d**-0.5), rtol=1e-5, atol=1e-5)


def test_ragged_cache_question_matches_masked_dense_model():
    """End to end: a per-head cache answers like the full cache with the evicted keys masked out per head."""
    model = tiny("llama")
    press = build_press("adakv", press="knorm", compression_ratio=0.5)
    calls = record_selection(press)
    cache = prefill(model, ids(), press)
    assert any(isinstance(layer, RaggedLayer) for layer in cache.layers), "expected unequal per-head budgets"
    question = ids(4, seed=3)
    with torch.inference_mode(), press(model):
        pos = torch.arange(N_CTX, N_CTX + 4)[None]
        got = model(input_ids=question, position_ids=pos, **{cache_kwarg(model): cache}).logits

    # reference: full cache, eager per-head masking of the evicted positions via a hook on the attention scores
    full = prefill(model, ids(), None)
    keep = {}
    for _, kept, _, layer in calls:
        mask = torch.zeros(COMMON["num_key_value_heads"], N_CTX + 4, dtype=torch.bool)
        for h, row in enumerate(kept_rows(kept)):
            mask[h, row] = True
        mask[:, N_CTX:] = True
        keep[layer] = mask
    want = masked_full_cache_logits(model, transformers.models.llama.modeling_llama, full, keep, question, pos)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", NAMES)
def test_decode_time_eviction_stays_within_budget_plus_slack(name):
    skip_unless_compressing(name)
    budget, slack = 40, 8
    try:
        # the CORE paper's protocol compresses every `interval` forwards (not at budget + slack): the same bound
        extra = {"interval": slack} if name == "paper_protocol" else {}
        press = build_press(name, "qwen3", budget=budget, decoding=True, decoding_slack=slack, **extra)
    except ValueError as e:  # a press may declare decode-time eviction unsupported, but must say so
        assert "decoding" in str(e)
        pytest.skip(f"{name} declares decode-time eviction unsupported: {e}")
    model = model_for(press, "qwen3")
    cache = DynamicCache()
    key = cache_kwarg(model)
    with torch.inference_mode(), press(model):
        model(input_ids=ids(100), use_cache=True, **{key: cache})
        for layer in cache.layers:
            assert int(layer_lengths(layer).sum()) == 2 * budget
        token = ids(1, seed=4)
        for step in range(24):
            pos = torch.tensor([[100 + step]])
            out = model(input_ids=token, position_ids=pos, use_cache=True, **{key: cache})
            token = out.logits[:, -1:].argmax(-1)
            for layer in cache.layers:
                lens = layer_lengths(layer)
                # per-head presses bound the layer total; uniform ones every head
                assert int(lens.sum()) <= lens.numel() * (budget + slack), f"step {step}: {lens.tolist()}"
                if not isinstance(layer, RaggedLayer):
                    assert int(lens.max()) <= budget + slack, f"step {step}: {lens.tolist()}"


@pytest.mark.parametrize("name", NAMES)
def test_chunked_prefill_keeps_the_budget(name):
    skip_unless_compressing(name)
    press = build_press(name, budget=48)
    model = model_for(press)
    try:
        cache = prefill(model, ids(), press, chunk_size=64)
    except ValueError as e:  # a press may declare chunked prefill unsupported, but must say so
        assert "chunk" in str(e)
        pytest.skip(f"{name} declares chunked prefill unsupported: {e}")
    hkv = COMMON["num_key_value_heads"]
    for layer, attn in zip(cache.layers, attention_modules(model), strict=True):
        lens = layer_lengths(layer)  # the last chunk (8 tokens) left 48 + 8 > 48 tokens: compressed back to 48
        assert int(lens.sum()) == hkv * press.layer_target(attn, 56), lens.tolist()
    answer = greedy_answer(model, cache, N_CTX, ids(4, seed=5), 3, press, eos_token_ids=[])
    assert len(answer) == 3


# ------------------------------------------------------------------------------------------------------------------
# Other families


@pytest.mark.parametrize("arch", ["mistral", "qwen2", "phi3", "gemma2"])
@pytest.mark.parametrize("name", NAMES)
def test_other_families_smoke(name, arch):
    press = build_press(name, arch, compression_ratio=0.5) if can_compress(name) else build_press(name)
    model = tiny(arch, eager=bool(press.needs_attentions))
    cache = prefill(model, ids(96), press)
    per_head = kv_bytes(cache)["tokens_per_head"]
    windows = window_layers(model)
    assert bool(windows) == (arch == "gemma2")
    for i, (layer, attn) in enumerate(zip(per_head, attention_modules(model), strict=True)):
        if i in windows:
            check_window_layer(layer, windows[i], 96)
        elif can_compress(name):
            assert sum(layer) == len(layer) * press.layer_target(attn, 96)
        else:
            assert layer == [96, 96]
    answer = greedy_answer(model, cache, 96, ids(4, seed=6), 2, press, eos_token_ids=[])
    assert len(answer) == 2


@pytest.mark.parametrize("name", NAMES)
def test_nan_inputs_raise_for_every_press(name):
    """NaN hidden states never pass silently through a press, selection-only ones (streaming_llm, twinkv) included:
    the error names the press and the layer (issue 16)."""
    skip_unless_compressing(name)
    press = build_press(name, compression_ratio=0.5)
    model = model_for(press)
    emb = model.get_input_embeddings()
    saved = emb.weight.detach().clone()
    try:
        with torch.no_grad():
            emb.weight.fill_(float("nan"))
        with pytest.raises(ValueError, match=rf"{type(press).__name__}.*NaN.*\(layer 0\)"):
            prefill(model, ids(), press)
    finally:
        with torch.no_grad():
            emb.weight.copy_(saved)


WRAPPERS = sorted(n for n, cls in PRESSES.items() if issubclass(cls, WrapperPress))


@pytest.mark.parametrize("name", WRAPPERS)
def test_wrapper_holds_no_copy_of_the_budget(name):
    """A wrapper's budget, protection and decoding are the innermost press's (kvpress's ``AdaKVPress``): given to
    the wrapper they reach the inner press, set on the wrapper they change it, and contradicting values are refused."""
    cls = PRESSES[name]
    if not next(f for f in fields(cls) if f.name == "press").init:  # a factory: it builds its own stack
        pytest.skip(f"{name} builds its own stack from an artifact (test_core_press.py)")
    if issubclass(cls, LatentMemoryPress) or name == "fast_memory":
        pytest.skip(f"{name} needs a CORE artifact's memory to compress (test_core_press.py)")
    press = build_press(name, press="knorm", compression_ratio=0.5, decoding=True)
    inner = press.press
    assert (inner.compression_ratio, inner.decoding) == (0.5, True) and press.compression_ratio == 0.5
    assert "compression_ratio" not in vars(press) and "decoding" not in vars(press)  # no stored copy
    press.compression_ratio, press.budget = 0.0, 100  # written through
    assert (inner.compression_ratio, inner.budget, press.target(1000)) == (0.0, 100, 100)
    wrapped = _build_press(name, press=build_press("knorm", compression_ratio=0.25))  # the instance's budget
    assert wrapped.compression_ratio == 0.25 and wrapped.press.compression_ratio == 0.25
    with pytest.raises(ValueError, match=r"differs from the wrapped press's \(ratio=0.25"):
        _build_press(name, press=build_press("knorm", compression_ratio=0.25), compression_ratio=0.5)
    with pytest.raises(ValueError, match="decoding_slack=8 differs from the wrapped press's"):
        _build_press(name, press=build_press("knorm", decoding=True, decoding_slack=16), decoding_slack=8)
    if "protected_sinks" in press.held():
        lent = _build_press(name, press=build_press("knorm"), protected_sinks=4)  # the inner holds the default
        assert lent.press.protected_sinks == 4 and lent.protected_sinks == 4
    with pytest.raises(ValueError, match=r"given both to the wrapper and in press_options"):
        _build_press(name, press="knorm", compression_ratio=0.5, press_options={"compression_ratio": 0.25})
