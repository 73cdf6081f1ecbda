"""CORE's press on a feature spec v3 artifact (the released design): core_released_scorer + fast_memory."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from core_kv.budget import kept_tokens
from core_kv.distill.replay import capture
from core_kv.models.attention import attention_modules
from core_kv.models.fingerprint import model_fingerprint
from core_kv.models.tiny import tiny_lm
from core_kv.pipeline import greedy_answer, prefill
from core_kv.presses import build_press
from research.released.geometry import KeyGeometry
from research.released.memory import concat_heads, conditional_weights
from research.released.model import ReleasedConfig, ReleasedModel
from research.released.presses import FastMemoryPress, ReleasedScorerPress

N = 150
SPECIAL = 7


@pytest.fixture(scope="module")
def model():
    return tiny_lm("llama", 0, "sdpa", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)  # fmt: skip


@pytest.fixture(scope="module")
def artifact(model, tmp_path_factory) -> str:
    """A v3 artifact for the tiny model: random indexer and memory, the fixed geometry, one special token."""
    fp = model_fingerprint(model)
    cfg = ReleasedConfig(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=fp["head_dim"], d_z=64, num_prototypes=64,
                     memory_dim=32, protected_sinks=4, protected_recent=0, fingerprint=fp,
                         special_token_ids=[SPECIAL])  # fmt: skip
    torch.manual_seed(0)
    core = ReleasedModel(cfg)
    core.set_key_geometry(KeyGeometry.draw(2, 2, fp["head_dim"]))
    core.memory.reset_parameters(3)
    path = tmp_path_factory.mktemp("v3") / "final"
    core.save_pretrained(path)
    return str(path)


def ids(n=N, seed=1):
    x = torch.randint(8, 128, (1, n), generator=torch.Generator().manual_seed(seed))
    x[0, 40] = SPECIAL
    return x


def test_one_shot_prefill_keeps_the_top_scored_set_in_every_head(model, artifact):
    press = build_press("core_released", checkpoint=artifact, compression_ratio=0.75)
    assert isinstance(press.scorer, ReleasedScorerPress) and isinstance(press.press, FastMemoryPress)
    x = ids()
    cache = prefill(model, x, press)
    b = kept_tokens(N, 0.75)
    acts = capture(model, x)
    core = ReleasedModel.from_pretrained(artifact)
    a = acts[0]  # layer 0's inputs do not depend on the compression
    pos = torch.arange(N)
    s = core.scores(0, a.q_post, a.k_post, a.v, pos, pos, N, a.scaling, 0, token_ids=x[0])
    ranked = s.clone()
    ranked[:4] = float("inf")
    kept = ranked.topk(b).indices.sort().values
    for layer in cache.layers:
        assert layer.keys.shape[2] == b
    torch.testing.assert_close(cache.layers[0].keys[0], a.k_post[:, kept], atol=1e-5, rtol=1e-5)
    # the memory wrote the evicted entries with the conditional weights and the artifact's decay
    evicted = torch.ones(N, dtype=torch.bool)
    evicted[kept] = False
    w, mass = conditional_weights(torch.softmax(s, -1), evicted)
    ref = core.memory.write(core.memory.empty_state(), 0, concat_heads(a.k_post)[evicted], concat_heads(a.v)[evicted],
                            w[evicted], mass, 0.9)  # fmt: skip
    got = press.memory_state(0)
    torch.testing.assert_close(got.M, ref.M, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got.Z, ref.Z)
    assert press.events[0]["budget"] == b and len(press.events) == 2


def test_special_tokens_change_the_sink_feature(model, artifact):
    core = ReleasedModel.from_pretrained(artifact)
    a = capture(model, ids())[0]
    pos = torch.arange(N)
    with_ids = core.scores(0, a.q_post, a.k_post, a.v, pos, pos, N, a.scaling, 0, token_ids=ids()[0])
    without = core.scores(0, a.q_post, a.k_post, a.v, pos, pos, N, a.scaling, 0)
    assert with_ids[40] != without[40]
    torch.testing.assert_close(with_ids[:40], without[:40])


def test_memory_reads_after_the_event_and_a_closed_gate_equals_no_memory(model, artifact):
    x, q = ids(), torch.randint(8, 128, (1, 6), generator=torch.Generator().manual_seed(5))
    answers = {}
    for name, opts in (("memory", {}), ("off", {"memory": False})):
        press = build_press("core_released", checkpoint=artifact, compression_ratio=0.75, **opts)
        cache = prefill(model, x, press)
        answers[name] = greedy_answer(model, cache, N, q, 8, press, eos_token_ids=[])
        with press(model), torch.no_grad():
            logits = model(input_ids=q, position_ids=torch.arange(N, N + 6)[None], past_key_values=cache).logits
        answers[name + "_logits"] = logits
    closed = build_press("fast_memory", press=build_press("core_released_scorer", checkpoint=artifact,
                                                          compression_ratio=0.75), gate=0.0)  # fmt: skip
    cache = prefill(model, x, closed)
    with closed(model), torch.no_grad():
        logits = model(input_ids=q, position_ids=torch.arange(N, N + 6)[None], past_key_values=cache).logits
    torch.testing.assert_close(logits, answers["off_logits"])
    assert not torch.allclose(answers["memory_logits"], answers["off_logits"])


def test_interpolate_artifact_moves_the_output_toward_the_memory(model, artifact, tmp_path):
    """The same weights saved with ``memory_readout="interpolate"``: at the first layer's ``o_proj`` input during the
    question's forward (gate fixed at 0.5), ``o_R + 0.5 (m − o_R)`` = the residual artifact's ``o_R + 0.5 m`` minus
    ``0.5 o_R``, with ``o_R`` the memory-off output."""
    core = ReleasedModel.from_pretrained(artifact)
    core.config.memory_readout = "interpolate"
    core.save_pretrained(tmp_path / "ip")
    assert ReleasedModel.from_pretrained(tmp_path / "ip").memory.readout_form == "interpolate"
    x, q = ids(), torch.randint(8, 128, (1, 6), generator=torch.Generator().manual_seed(5))
    seen = {}
    for name, path, gate in (("res", artifact, 0.5), ("ip", str(tmp_path / "ip"), 0.5), ("off", artifact, 0.0)):
        press = build_press("fast_memory", press=build_press("core_released_scorer", checkpoint=path,
                                                             compression_ratio=0.75), gate=gate)  # fmt: skip
        cache = prefill(model, x, press)
        with press(model), torch.no_grad():  # this hook runs after the press's own o_proj pre-hook
            hook = model.model.layers[0].self_attn.o_proj.register_forward_pre_hook(
                lambda m, args, name=name: seen.__setitem__(name, args[0].detach().clone())
            )
            model(input_ids=q, position_ids=torch.arange(N, N + 6)[None], past_key_values=cache)
            hook.remove()
    torch.testing.assert_close(seen["ip"], seen["res"] - 0.5 * seen["off"], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(seen["ip"], seen["off"])


def test_decode_time_events_use_the_interval_queries_and_keep_heads_aligned(model, artifact):
    press = build_press("core_released", checkpoint=artifact, compression_ratio=0.75, decoding=True, decoding_slack=8)
    x = ids()
    cache = prefill(model, x, press)
    greedy_answer(model, cache, N, torch.tensor([[9, 10, 11]]), 30, press, eos_token_ids=[], trim=False)
    decode_events = [e for e in press.events if e["t_e"] > N]
    assert decode_events, "the cache grew past B + slack: a decode-time event must have happened"
    for layer in cache.layers:
        assert layer.keys.shape[2] <= kept_tokens(N + 33, 0.75) + 8
    assert all(e["kept_per_head"][0] == e["kept_per_head"][1] for e in press.events)


def test_chunked_prefill_keeps_the_budget(model, artifact):
    press = build_press("core_released", checkpoint=artifact, compression_ratio=0.5)
    cache = prefill(model, ids(), press, chunk_size=64)
    assert all(layer.keys.shape[2] == kept_tokens(N, 0.5) for layer in cache.layers)


def test_v3_refuses_head_wise_budgets_and_the_latent_memory_options(artifact):
    from core_kv.policy import PolicyOptions
    from research.released.presses import compose

    scorer = build_press("core_released_scorer", checkpoint=artifact, compression_ratio=0.75)
    for options in (PolicyOptions(head_budgets="adaptive"), PolicyOptions(repair=True)):
        with pytest.raises(ValueError, match="released artifact.*head_budgets must be 'uniform' and repair false"):
            compose(scorer, options)
    for option in ({"head_budgets": "adaptive"}, {"write_rule": "uniform_token"}):
        with pytest.raises((TypeError, ValueError), match=next(iter(option))):
            build_press("core_released", checkpoint=artifact, compression_ratio=0.75, **option)
    with pytest.raises(ValueError, match="core_kv_released.*research.released"):
        build_press("core", checkpoint=artifact, compression_ratio=0.75)
    with pytest.raises(ValueError, match="decay"):
        build_press("fast_memory", press=build_press("core_released_scorer", checkpoint=artifact,
                                                     compression_ratio=0.5), decay=2.0)  # fmt: skip


def test_hooks_come_off(model, artifact):
    press = build_press("core_released", checkpoint=artifact, compression_ratio=0.75)
    with pytest.raises(RuntimeError, match="boom"), press(model):
        raise RuntimeError("boom")
    body = model.model
    assert not body.embed_tokens._forward_pre_hooks
    for m in attention_modules(model):
        assert not m._forward_hooks and not m._forward_pre_hooks and not m.q_proj._forward_hooks


def test_the_trained_tiny_artifact_runs_end_to_end(tmp_path):
    """The released recipe's own artifact (train.py, tiny model) compresses and answers through the core press."""
    from core_kv.models.loading import ModelSpec, load_from_spec
    from research.released.tests.helpers import run, tiny_args

    out = tmp_path / "run"
    run(tiny_args(out, "released.schedule.total_steps=2", "released.schedule.indexer_steps=1", "policy.enabled=false"))
    model, _ = load_from_spec(ModelSpec(random_init=True, path="", hidden_size=64, num_layers=2, intermediate_size=128),
                          "cpu")  # fmt: skip
    press = build_press("core_released", checkpoint=str(out / "final"), compression_ratio=0.5)
    cache = prefill(model, torch.randint(3, 200, (1, 120)), press)
    assert all(layer.keys.shape[2] == 60 for layer in cache.layers)
    assert len(greedy_answer(model, cache, 120, torch.tensor([[5, 6]]), 4, press, eos_token_ids=[])) == 4
    assert isinstance(cache, DynamicCache)


def test_policy_stage_compares_only_the_v3_compositions(tmp_path):
    """On a v3 artifact the default grid narrows to uniform budgets without repair (memory on / off); the recorded
    policy applies through the core press; explicit head-wise candidates are refused."""
    import json
    from pathlib import Path

    from transformers import AutoModelForCausalLM, AutoTokenizer

    import core_kv.eval.policy_stage as stage
    from core_kv.policy import PolicyStageConfig
    from research.released.presses import policy_candidate

    root = Path(__file__).resolve().parents[3] / "checkpoints" / "proxy-lm"
    tok = AutoTokenizer.from_pretrained(root)
    lm = AutoModelForCausalLM.from_pretrained(root).eval()
    fp = model_fingerprint(lm)
    cfg = ReleasedConfig(num_layers=fp["layers"], num_heads=fp["heads"], num_kv_heads=fp["kv_heads"],
                     head_dim=fp["head_dim"], d_z=64, num_prototypes=64, memory_dim=32, protected_recent=0,
                     fingerprint=fp)  # fmt: skip
    torch.manual_seed(0)
    core = ReleasedModel(cfg)
    core.set_key_geometry(KeyGeometry.draw(fp["layers"], fp["kv_heads"], fp["head_dim"]))
    art = tmp_path / "final"
    core.save_pretrained(art)
    small = PolicyStageConfig(ratios=[0.75], lengths=[160], per_task=1)
    policy = stage.run_policy_stage(small, art, lm, tok, tmp_path / "work", progress=False, candidate=policy_candidate)
    rows = json.loads((art / "config.json").read_text())["inference_policy"]["lengths"][0]["candidates"]["0.75"]
    assert sorted(r["label"] for r in rows) == ["uniform, memory", "uniform, memory off"]
    press = build_press("core_released", checkpoint=str(art), compression_ratio=0.75)
    assert press.options == policy.for_ratio(0.75)
    with pytest.raises(ValueError, match="do not apply"):
        stage.run_policy_stage(PolicyStageConfig(ratios=[0.75], lengths=[160], per_task=1,
                                                 candidates=[{"head_budgets": "adaptive"}]), art, lm, tok,
                               tmp_path / "work2", progress=False, candidate=policy_candidate)  # fmt: skip
    # an artifact whose memory was never trained (released.memory.train=false) is validated without the memory
    core.config.memory_trained = False
    core.config.inference_policy = None
    untrained = tmp_path / "untrained"
    core.save_pretrained(untrained)
    stage.run_policy_stage(small, untrained, lm, tok, tmp_path / "work3", progress=False, candidate=policy_candidate)
    rows = json.loads((untrained / "config.json").read_text())["inference_policy"]["lengths"][0]["candidates"]["0.75"]
    assert [r["label"] for r in rows] == ["uniform, memory off"]
