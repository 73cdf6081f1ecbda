"""Sliding-window and QK-norm families (Gemma 3, Gemma 2) on tiny config-built models (``core_kv.models.tiny``).

What is Gemma-specific is data in ``core_kv.models.attention.FAMILIES`` plus the module's own ``scaling``
(``query_pre_attn_scalar``), ``attn_logit_softcapping`` and ``sliding_window``; these tests check each against the
model itself: the captured Q/K/V and the per-layer-type RoPE reproduce the keys the model caches, the logit helper
reproduces the layer's attention output (scale and softcap), the pipeline's cache is the model's own (window layers
hold W - 1 positions) and answers exactly as ``generate``, questions sharing one compression restore the slid window,
a compressed global layer answers like the full model with the evicted keys masked out, and CORE runs on it with
retained sets equal to its replay's (the global layer's RoPE base undone and redone by the press).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import transformers
from transformers import DynamicCache
from transformers.cache_utils import DynamicSlidingWindowLayer

from core_kv.core_model import CoreConfig, CoreModel
from core_kv.distill.replay import ReplaySpec, capture, replay_layer
from core_kv.models.attention import (
    FAMILIES,
    apply_rope,
    attention_inputs,
    attention_logits,
    attention_modules,
    attention_scale,
    layer_rotary,
    logit_softcap,
    new_cache,
    prerope_keys,
    prerope_values,
    press_layers,
    queries_with_rope,
    ragged_sdpa,
    window_layers,
)
from core_kv.models.cache import RaggedLayer, cache_kwarg, cache_marks, crop_cache, kv_bytes, layer_lengths
from core_kv.models.fingerprint import model_fingerprint
from core_kv.models.tiny import tiny_lm
from core_kv.pipeline import greedy_answer, prefill
from core_kv.presses import build_press
from core_kv.presses.core import CorePress
from core_kv.teacher.geometry import fit_geometry
from tests.helpers import masked_full_cache_logits, record_core_kept

N = 200
W = 48  # the tiny Gemmas' sliding window (core_kv.models.tiny.FAMILIES)
SHAPE = dict(vocab_size=128, num_hidden_layers=4, max_position_embeddings=2048)
_MODELS: dict = {}


def gemma(family: str = "gemma3") -> torch.nn.Module:
    """4 layers (sliding, global, sliding, global), 4 query / 2 KV heads, head dim 16, query_pre_attn_scalar 24."""
    if family not in _MODELS:
        _MODELS[family] = tiny_lm(family, 0, "eager" if family == "gemma2" else "sdpa", **SHAPE)
    return _MODELS[family]


def ids(n: int = N, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(seed))


def test_table_entries_and_window_layers():
    assert FAMILIES["Gemma3Attention"].qk_norm and FAMILIES["Gemma3Attention"].rope_layer_type
    assert not FAMILIES["Gemma2Attention"].qk_norm and not FAMILIES["Gemma2Attention"].rope_layer_type
    for family in ("gemma3", "gemma2"):
        model = gemma(family)
        assert window_layers(model) == {0: W, 2: W}
        assert [layer.self_attn.layer_idx for layer in press_layers(model)] == [1, 3]
        attn = attention_modules(model)[1]
        assert attention_scale(attn) == 24**-0.5  # query_pre_attn_scalar, not head_dim 16
        assert logit_softcap(attn) == (5.0 if family == "gemma2" else None)
        assert [type(layer).__name__ for layer in new_cache(model).layers] == [
            "DynamicSlidingWindowLayer", "DynamicLayer", "DynamicSlidingWindowLayer", "DynamicLayer",
        ]  # fmt: skip
    # no window layer: every layer is compressed, the cache is plain
    assert window_layers(tiny_lm("llama", 0, **SHAPE)) == {} and not new_cache(tiny_lm("llama", 0, **SHAPE)).layers
    # every layer windowed (Mistral-7B-v0.1-like): treated as global attention, as before window layers existed
    all_window = tiny_lm("gemma3", 0, **SHAPE, layer_types=["sliding_attention"] * 4)
    assert window_layers(all_window) == {} and len(press_layers(all_window)) == 4


@pytest.mark.parametrize("family", ["gemma3", "gemma2"])
@torch.inference_mode()
def test_capture_and_layer_rope_reproduce_the_models_cached_keys_and_values(family):
    model = gemma(family)
    seen = {}
    cache = new_cache(model)
    with torch.inference_mode(), attention_inputs(model, lambda i, m, h, kw: seen.setdefault(i, (m, h, kw))):
        model.model(input_ids=ids(), use_cache=True, **{cache_kwarg(model): cache})
    rope = layer_rotary(model)
    pos = torch.arange(N)[None]
    cos_by_layer = []
    for i, (module, h, kwargs) in seen.items():
        cos, sin = rope(module, h, pos)
        torch.testing.assert_close(cos, kwargs["position_embeddings"][0], rtol=0, atol=0)
        torch.testing.assert_close(sin, kwargs["position_embeddings"][1], rtol=0, atol=0)
        cos_by_layer.append(cos)
        keys = apply_rope(module, prerope_keys(module, h), (cos, sin))
        stored = N if i % 2 else W - 1  # a window layer keeps its last W - 1 positions
        assert cache.layers[i].keys.shape[2] == stored
        torch.testing.assert_close(keys[:, :, -stored:], cache.layers[i].keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(prerope_values(module, h)[:, :, -stored:], cache.layers[i].values, rtol=1e-5,
                                   atol=1e-5)  # fmt: skip
    # Gemma 3: sliding layers rotate with base 10k, global ones with 1M; Gemma 2 has one RoPE
    assert torch.equal(cos_by_layer[0], cos_by_layer[2]) and torch.equal(cos_by_layer[1], cos_by_layer[3])
    assert torch.equal(cos_by_layer[0], cos_by_layer[1]) == (family == "gemma2")


@pytest.mark.parametrize("family", ["gemma3", "gemma2"])
@pytest.mark.parametrize("layer", [0, 1])
@torch.inference_mode()
def test_attention_logits_reproduce_the_layer_output(family, layer):
    """softmax(attention_logits(q, k)) v, causal (and windowed on a sliding layer), is the layer's pre-W_O output:
    the scale is query_pre_attn_scalar's and Gemma 2's softcap is applied."""
    model = gemma(family)
    module = attention_modules(model)[layer]
    got = {}
    handle = module.o_proj.register_forward_pre_hook(lambda m, a: got.setdefault("out", a[0]))
    try:
        with torch.inference_mode(), attention_inputs(model, lambda i, m, h, kw: got.setdefault(i, (h, kw))):
            model.model(input_ids=ids(), use_cache=False)
    finally:
        handle.remove()
    h, kwargs = got[layer]
    q = queries_with_rope(module, h, kwargs["position_embeddings"])  # (1, H, N, D)
    k = apply_rope(module, prerope_keys(module, h), kwargs["position_embeddings"]).repeat_interleave(2, 1)
    v = prerope_values(module, h).repeat_interleave(2, 1)
    i, j = torch.arange(N)[:, None], torch.arange(N)[None]
    visible = (j <= i) & ((i - j < W) if layer in window_layers(model) else True)
    attn = attention_logits(module, q, k).masked_fill(~visible, float("-inf")).softmax(-1)
    want = (attn @ v).transpose(1, 2).reshape(1, N, -1)
    torch.testing.assert_close(got["out"], want, rtol=1e-4, atol=1e-5)


@torch.inference_mode()
def test_ragged_attention_applies_the_softcap():
    torch.manual_seed(0)
    module = attention_modules(gemma("gemma2"))[1]
    q = torch.randn(1, 4, 3, 16) * 3
    full_k, full_v = torch.randn(1, 2, 6, 16) * 3, torch.randn(1, 2, 6, 16)
    kept = [torch.arange(6), torch.tensor([1, 4])]  # 6 and 2 kept, then 3 new tokens each: 9 and 5 keys
    new_k, new_v = torch.randn(1, 2, 3, 16) * 3, torch.randn(1, 2, 3, 16)
    kv, _ = RaggedLayer.from_kept(full_k, full_v, kept).update(new_k, new_v)
    keys = [torch.cat([full_k[0, h, kept[h]], new_k[0, h]]) for h in range(2)]
    values = [torch.cat([full_v[0, h, kept[h]], new_v[0, h]]) for h in range(2)]
    out, lse = ragged_sdpa(module, q, kv, scaling=24**-0.5, softcap=5.0, return_lse=True)  # (1, T, H, D), (H, T)
    for head in range(4):
        k, v = keys[head // 2], values[head // 2]
        logits = torch.tanh(q[0, head] @ k.T * 24**-0.5 / 5.0) * 5.0
        s = k.shape[0]
        visible = torch.arange(s)[None] <= (s - 3 + torch.arange(3))[:, None]
        logits = logits.masked_fill(~visible, float("-inf"))
        want = logits.softmax(-1) @ v
        torch.testing.assert_close(lse[head], logits.logsumexp(-1), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out[0, :, head], want, rtol=1e-5, atol=1e-5)


def test_pipeline_cache_answers_as_generate_and_questions_restore_the_window():
    """Full cache: the pipeline's cache is the model's own (window layers hold W - 1), greedy answers equal
    ``generate``'s, and two questions on one prefill answer alike (the window the first one slid is restored)."""
    model = gemma("gemma3")
    ctx, question = ids(), ids(7, seed=2)
    cache = prefill(model, ctx, None)
    assert kv_bytes(cache)["tokens_per_head"] == [[W - 1] * 2, [N] * 2, [W - 1] * 2, [N] * 2]
    first = greedy_answer(model, cache, N, question, 20, None, eos_token_ids=[])  # any new token slides the window
    second = greedy_answer(model, cache, N, question, 20, None, eos_token_ids=[])
    want = model.generate(torch.cat([ctx, question], 1), max_new_tokens=20, do_sample=False, min_new_tokens=20,
                          eos_token_id=None, pad_token_id=0)[0, N + 7 :].tolist()  # fmt: skip
    assert first == second == want
    assert kv_bytes(cache)["tokens_per_head"] == [[W - 1] * 2, [N] * 2, [W - 1] * 2, [N] * 2]
    # a plain length cannot trim a slid window: the error says what to take instead
    before = [layer_lengths(layer) for layer in cache.layers]
    with torch.inference_mode():
        model(input_ids=question, position_ids=torch.arange(N, N + 7)[None], **{cache_kwarg(model): cache})
    with pytest.raises(ValueError, match="cache_marks"):
        crop_cache(cache, before)


def test_compressed_global_layers_answer_like_the_masked_full_model():
    """Question logits on a cache whose global layers were compressed (window layers untouched) equal the full
    model's with the evicted keys masked out of the global layers' attention (eager reference)."""
    model = gemma("gemma3")
    press = build_press("knorm", compression_ratio=0.6)
    kept = {}
    compress = press.compress

    def recording(module, *args, **kwargs):
        out = compress(module, *args, **kwargs)
        kept[module.layer_idx] = out[0]  # (Hkv, k)
        return out

    press.compress = recording
    cache = prefill(model, ids(), press)
    assert sorted(kept) == [1, 3] and isinstance(cache.layers[0], DynamicSlidingWindowLayer)
    question = ids(5, seed=3)
    pos = torch.arange(N, N + 5)[None]
    with torch.inference_mode(), press(model):
        got = model(input_ids=question, position_ids=pos, **{cache_kwarg(model): cache}).logits

    keep = {}
    for layer, rows in kept.items():  # the kept context positions of each KV head, and the question's
        keep[layer] = torch.zeros(2, N + 5, dtype=torch.bool).scatter_(1, rows, True)
        keep[layer][:, N:] = True
    full = prefill(model, ids(), None)
    want = masked_full_cache_logits(model, transformers.models.gemma3.modeling_gemma3, full, keep, question, pos)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_cache_marks_restore_a_compressed_cache_after_a_question():
    model = gemma("gemma3")
    press = build_press("snapkv", compression_ratio=0.5)
    cache = prefill(model, ids(), press)
    marks = cache_marks(cache)
    lengths = kv_bytes(cache)["tokens_per_head"]
    assert lengths == [[W - 1] * 2, [N // 2] * 2, [W - 1] * 2, [N // 2] * 2]
    with torch.inference_mode(), press(model):
        model(input_ids=ids(60, seed=4), position_ids=torch.arange(N, N + 60)[None], **{cache_kwarg(model): cache})
    keys = [layer.keys.clone() for layer in cache.layers]
    crop_cache(cache, marks)
    assert kv_bytes(cache)["tokens_per_head"] == lengths
    assert cache.layers[0].cumulative_length == N
    assert not torch.equal(keys[0][:, :, -1], cache.layers[0].keys[:, :, -1])  # the slid window was put back


# ------------------------------------------------------------------------------------------------------------------
# CORE on Gemma 3


@pytest.fixture(scope="module")
def core_artifact(tmp_path_factory):
    model = gemma("gemma3")
    geo = fit_geometry([a.k_pre for a in capture(model, ids(300, seed=9))], model_fingerprint(model), d_z=8,
                       num_prototypes=8)  # fmt: skip
    core = CoreModel(CoreConfig.for_model(model, geo))
    core.set_geometry(geo)
    core.indexer.temperature.fill_(1.5)
    path = tmp_path_factory.mktemp("core_gemma3") / "final"
    core.save_pretrained(path)
    return core, path


def test_core_runs_on_gemma3_global_layers_only(core_artifact):
    _, path = core_artifact
    model = gemma("gemma3")
    press = CorePress.from_pretrained(path, compression_ratio=0.5)
    cache = prefill(model, ids(), press)
    assert kv_bytes(cache)["tokens_per_head"] == [[W - 1] * 2, [N // 2] * 2, [W - 1] * 2, [N // 2] * 2]
    assert press.memory_state(1) is not None and press.memory_state(3) is not None
    assert press.memory_state(0) is None and press.memory_state(2) is None  # window layers: no event, no memory
    answer = greedy_answer(model, cache, N, ids(6, seed=2), 4, press, eos_token_ids=[])
    assert len(answer) == 4
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_core_retained_sets_on_a_global_layer_match_replay(core_artifact):
    """Layer 1 (global, RoPE base 1M): the press's chunked-prefill retained sets equal replay's on the captured
    activations, so the press undoes and redoes that layer's own RoPE (not the sliding layers')."""
    core, path = core_artifact
    model = gemma("gemma3")
    press = CorePress.from_pretrained(path, compression_ratio=0.5)
    kept = record_core_kept(press, (1, 3))
    ctx = ids()
    prefill(model, ctx, press, chunk_size=64)
    spec = ReplaySpec(chunk_size=64, ratio=0.5, protected_sinks=4, protected_recent=32, policy="student",
                      targets=False, utility=False)  # fmt: skip
    acts = capture(model, ctx)
    events = replay_layer(acts[1], 1, [64, 128, 192], None, core.geometry(), spec, core.indexer.scores)
    assert len(events) == 3 and len(kept[1]) == 4
    for ev, mine in zip(events, kept[1][:3], strict=True):
        assert torch.equal(ev.cand[ev.kept].view(2, -1), mine)


def test_user_cache_without_config_still_leaves_window_layers_alone():
    """A plain DynamicCache (the caller's) stores every position in the window layers; presses still compress only
    the global ones, and the bytes report what is stored."""
    model = gemma("gemma3")
    press = build_press("keydiff", compression_ratio=0.75)
    cache = DynamicCache()
    with torch.inference_mode(), press(model):
        model.model(input_ids=ids(), use_cache=True, **{cache_kwarg(model): cache})
    assert kv_bytes(cache)["tokens_per_head"] == [[N] * 2, [N // 4] * 2, [N] * 2, [N // 4] * 2]


# ------------------------------------------------------------------------------------------------------------------
# Training on a hybrid model: window layers are never compressed, so the teacher and the replay skip them


def test_capture_marks_window_layers_and_replay_gives_them_no_event(core_artifact):
    core, _ = core_artifact
    model = gemma("gemma3")
    ctx = ids()
    acts = capture(model, ctx)
    assert [a.window for a in acts] == [W, None, W, None]
    spec = ReplaySpec(chunk_size=64, ratio=0.5, protected_sinks=4, protected_recent=32, policy="student",
                      targets=False, utility=False)  # fmt: skip
    assert replay_layer(acts[0], 0, [64, 128, 192], None, core.geometry(), spec, core.indexer.scores) == []
    assert len(replay_layer(acts[1], 1, [64, 128, 192], None, core.geometry(), spec, core.indexer.scores)) == 3
    # the compressed cascade keeps a window layer's own (windowed) output: layer 1 sees what the model gives it
    from core_kv.distill.replay import cascade_capture

    def replay(layer, a):
        return replay_layer(a, layer, [64, 128, 192], None, core.geometry(), spec, core.indexer.scores)

    with torch.no_grad():
        cascade = cascade_capture(model, ctx, replay)
    torch.testing.assert_close(cascade[1].q_pre, acts[1].q_pre, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(cascade[2].q_pre, acts[2].q_pre, atol=1e-3)  # after a compressed global layer


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_train_py_on_a_hybrid_model_trains_global_layers_only(tmp_path):
    """train.py end to end on a config-built Gemma 3 saved as a folder: the teacher writes records for the global
    layers only, and the artifact compresses the model's global layers with its memory on."""
    import train
    from core_kv.models.loading import tiny_tokenizer
    from core_kv.teacher.dataset import TeacherDataset

    tok = tiny_tokenizer()
    model = tiny_lm("gemma3", 0, "sdpa", **{**SHAPE, "vocab_size": len(tok)})
    folder = tmp_path / "gemma3-tiny"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    out, teacher = tmp_path / "run", tmp_path / "teacher"
    train.main([
        f"out_dir={out}", f"teacher.out_dir={teacher}", f"teacher.model.path={folder}", "teacher.chunk_size=64",
        "teacher.protected_recent=8", "teacher.progress=false", "teacher.data.source=random", "teacher.data.num_docs=3",
        "teacher.data.calib_docs=2", "teacher.data.min_len=160", "teacher.data.max_len=200", "train_docs=3",
        "calib_docs=2", "eval_docs=1", "eval_ratios=[0.75]", "indexer.warmup_steps=2", "indexer.records_per_micro=4",
        "indexer.steps=2", "memory.steps=2", "save_every=1", "progress=false",
    ])  # fmt: skip
    assert {r.layer for r in TeacherDataset(teacher).records()} == {1, 3}
    calib = json.loads((out / "stages" / "calibration.json").read_text())
    assert calib["temperature"][0] == calib["temperature"][2] == 1.0  # window layers: no event, the default T
    assert math.isfinite(calib["before"]) and math.isfinite(calib["after"])  # averaged over the global layers
    # the policy stage ran on the hybrid model and recorded a composition per band; with it (head-wise budgets
    # possibly) each global layer keeps exactly Hkv * N/4 in all, the window layers their window
    press = CorePress.from_pretrained(out / "final", compression_ratio=0.75)
    assert press.core.config.inference_policy["lengths"][0]["bands"]
    tokens = kv_bytes(prefill(model, ids(), press))["tokens_per_head"]
    assert tokens[0] == tokens[2] == [W - 1] * 2
    assert sum(tokens[1]) == sum(tokens[3]) == 2 * (N // 4)
    # the paper's press (uniform budgets, memory in every compressed layer): memory events on global layers only
    press = CorePress.from_pretrained(out / "final", compression_ratio=0.75, policy="paper")
    assert kv_bytes(prefill(model, ids(), press))["tokens_per_head"] == [[W - 1] * 2, [N // 4] * 2] * 2
    assert press.memory_state(1).events == 1 and press.memory_state(0) is None
