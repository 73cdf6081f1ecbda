"""The released recipe end to end (research/released/trainer.py through train.py) on a tiny config-built Llama."""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from core_kv.config import load_config
from core_kv.distill.config import TrainConfig
from core_kv.distill.trainer import train_schema
from research.released.config import ReleasedOptions, ReleasedTrainConfig
from research.released.tests.helpers import CONFIGS, ROOT, run, tiny_args


def load(argv: list[str]):
    """A train config as train.py reads it (plugins imported, the recipe's schema)."""
    return load_config(TrainConfig, argv, resolve=train_schema)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("released") / "run"
    run(tiny_args(out))
    return out


def test_folder_listing_and_v3_artifact(reference):
    from core_kv.models.loading import ModelSpec, load_from_spec
    from research.released.model import ReleasedModel

    assert {p.name for p in reference.iterdir()} >= {"final", "stages", "state", "run.json", "summary.json",
                                                     "config.yaml", "report.md"}  # fmt: skip
    assert {p.name for p in (reference / "stages").iterdir()} == {"online_indexer.safetensors",
                                                                  "online_joint.safetensors"}  # fmt: skip
    model, _ = load_from_spec(
        ModelSpec(random_init=True, path="", hidden_size=64, num_layers=2, intermediate_size=128), "cpu"
    )
    core = ReleasedModel.from_pretrained(reference / "final", base_model=model)
    c = core.config
    assert c.feature_spec["version"] == 3 and c.model_type == "core_kv_released" and c.plugin == "research.released"
    assert c.protected_sinks == 4 and c.protected_recent == 0
    assert core.indexer.head_bias.shape == (2, 1) and core.memory.theta.shape == (2, 32, 64)
    assert c.teacher["drive"] == {"beta": 128.0, "alpha": 1.0, "tau": 8.0, "steps": 8, "temperature": 1.0}
    torch.testing.assert_close(core.key_geometry().projection.norm(), core.key_projection.norm())
    assert "r75" in (reference / "report.md").read_text() or "75%" in (reference / "report.md").read_text()


def test_resume_after_interruption_matches(tmp_path, reference):
    """Stopped inside stage 1, then inside stage 2, then finished: the same artifact as one uninterrupted run."""
    from core_kv.distill.loop import Interrupted

    out = tmp_path / "run"
    for stop in ("stop_after=2", "stop_after=2"):
        with pytest.raises(Interrupted):
            run(tiny_args(out, stop))
    run(tiny_args(out))
    a, b = (
        load_file(str(reference / "final" / "model.safetensors")),
        load_file(str(out / "final" / "model.safetensors")),
    )
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], msg=k)


@pytest.mark.slow
def test_resume_after_sigkill_matches(tmp_path, reference):
    """The process is killed (SIGKILL) once a resumable state exists; the relaunch finishes with the same artifact."""
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    code = "import sys, train; train.main(sys.argv[1:])"
    proc = subprocess.Popen([sys.executable, "-c", code, *tiny_args(out)], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.time() + 300
    while time.time() < deadline and not list((out / "state").glob("online_joint/step_*")):
        if proc.poll() is not None:
            pytest.skip("the run finished before it could be killed")
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / "final").exists()
    subprocess.run([sys.executable, "-c", code, *tiny_args(out)], cwd=ROOT, env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    a, b = (
        load_file(str(reference / "final" / "model.safetensors")),
        load_file(str(out / "final" / "model.safetensors")),
    )
    for k in a:
        torch.testing.assert_close(a[k], b[k], msg=k)


def test_memory_off_trains_the_indexer_for_every_step(tmp_path, reference):
    out = tmp_path / "run"
    s = run(
        tiny_args(
            out, "released.memory.train=false", "released.schedule.total_steps=2", "released.schedule.indexer_steps=2"
        )
    )
    assert {p.name for p in (out / "stages").iterdir()} == {"online_indexer.safetensors"}
    assert "memory_relative" not in s["eval"]["r75"]
    # the artifact says its memory is untrained: no memory by default, and a press that asks for it is refused
    from core_kv.presses import build_press
    from research.released.model import ReleasedModel
    from research.released.presses import FastMemoryPress

    core = ReleasedModel.from_pretrained(out / "final")
    assert core.config.memory_trained is False and core.policy().for_ratio(0.75).memory is False
    press = build_press("core_released", checkpoint=str(out / "final"), compression_ratio=0.75)
    assert press.memory_press is None
    for kwargs in ({"policy": "paper"}, {"memory": True}):
        with pytest.raises(ValueError, match="no trained memory.*memory=false"):
            build_press("core_released", checkpoint=str(out / "final"), compression_ratio=0.75, **kwargs)
    trained = build_press("core_released", checkpoint=str(reference / "final"), compression_ratio=0.75)
    assert isinstance(trained.memory_press, FastMemoryPress)


def test_wsd_schedule_by_hand():
    r = ReleasedOptions()
    o = r.schedule
    assert o.lr_at(0) == 0.0 and math.isclose(o.lr_at(50), 2.5e-4)
    assert o.lr_at(100) == o.lr_at(3199) == 5e-4
    mid = 3200 + 1100  # half the decay: the cosine is at its middle
    assert math.isclose(o.lr_at(mid), 7.5e-6 + (5e-4 - 7.5e-6) * 0.5, rel_tol=1e-9)
    assert math.isclose(o.lr_at(5400), 7.5e-6) and math.isclose(o.lr_at(9999), 7.5e-6)
    assert [o.seq_len(s) for s in (1, 7, 8, 16)] == [2048, 2048, 4096, 4096]
    assert [o.decode_at(s) for s in (1, 4, 6, 8)] == [False, True, False, True]
    ratios = [r.ratio_at(0, s) for s in range(1, 200)]
    assert set(ratios) == {0.25, 0.5, 0.75, 0.9} and ratios == [r.ratio_at(0, s) for s in range(1, 200)]


def test_released_options_are_validated_at_config_load():
    plugin = "plugins=[research.released]"
    with pytest.raises(ValueError, match="released.schedule.indexer_steps"):
        load([plugin, "recipe=released", "released.schedule.total_steps=5", "released.schedule.indexer_steps=6"])
    with pytest.raises(ValueError, match="released.losses.budgets"):
        load([plugin, "recipe=released", "released.losses.budgets=[0.5,1.0]"])
    with pytest.raises(ValueError, match="recipe: 'offline' is not registered"):
        load([plugin, "recipe=offline"])
    with pytest.raises(ValueError, match="released.teacher.tau"):
        load([plugin, "recipe=released", "released.teacher.tau=0"])
    with pytest.raises(ValueError, match="plugins: cannot import 'research.nope'"):
        load(["plugins=[research.nope]"])
    assert type(load([plugin])) is TrainConfig  # the plugin imported, the replay recipe kept
    with pytest.raises(ValueError, match="recipe: 'released' is not the recipe of this config schema .*plugins"):
        TrainConfig(recipe="released")


def test_attention_rows_equal_the_models_own_attention_output():
    """The memory's targets o* are the attention module's input to o_proj (computed from the captured Q/K/V)."""
    from core_kv.distill.replay import capture
    from core_kv.models.tiny import tiny_lm
    from research.released.trainer import attention_rows

    model = tiny_lm(seed=0, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    intermediate_size=128, vocab_size=256, attn_implementation="eager")  # fmt: skip
    ids = torch.randint(3, 250, (1, 40))
    seen = {}
    hook = model.model.layers[1].self_attn.o_proj.register_forward_pre_hook(
        lambda m, args: seen.setdefault("x", args[0].detach())
    )
    acts = capture(model, ids)
    hook.remove()
    qpos = torch.arange(30, 40)
    causal = torch.arange(40)[None, :] <= qpos[:, None]
    torch.testing.assert_close(attention_rows(acts[1], qpos, causal), seen["x"][0, 30:], atol=1e-5, rtol=1e-4)


def test_evicted_share_and_gate_term_by_hand():
    """α_E is the evicted share of each query's full-cache attention (mean over query heads), and the gate term adds
    exactly ``memory_gate_weight · BCE(g, α_E)`` to the layer's memory loss (0: the release's loss)."""
    import torch.nn.functional as F

    from core_kv.models.attention import LayerQKV
    from research.released.memory import FastMemory
    from research.released.trainer import _memory_term, attention_rows, keep_mask

    gen = torch.Generator().manual_seed(3)
    hkv, g, t, d, n, tail = 2, 2, 24, 8, 20, 4
    q, k = torch.randn(hkv * g, t, d, generator=gen), torch.randn(hkv, t, d, generator=gen)
    a = LayerQKV(q_pre=q, k_pre=k, v=torch.randn(hkv, t, d, generator=gen), q_post=q, k_post=k, scaling=d**-0.5)
    qpos = torch.arange(t - tail, t)
    causal = torch.arange(t)[None, :] <= qpos[:, None]
    share = torch.zeros(t, dtype=torch.bool)
    share[[5, 7, 11]] = True
    _, alpha = attention_rows(a, qpos, causal, share=share)
    naive = torch.zeros(tail)
    for h in range(hkv * g):
        logits = (a.q_post[h, qpos] @ a.k_post[h // g].T) * a.scaling
        p = logits.masked_fill(~causal, float("-inf")).softmax(-1)
        naive += p[:, share].sum(-1) / (hkv * g)
    torch.testing.assert_close(alpha, naive)

    memory = FastMemory(1, hkv * g, hkv, d, dim=16, gate_hidden=4)
    memory.reset_parameters(0)
    scores = torch.randn(n, generator=gen)
    base = ReleasedOptions()
    base.losses.sinks = 2
    plain, mse, gap, gate, alpha_e = _memory_term(a, memory, 0, scores, n, tail, 0.5, base)
    assert float(plain) == pytest.approx(mse)
    gated, gated_mse, *_ = _memory_term(a, memory, 0, scores, n, tail, 0.5, _gated(base, 0.5))
    evicted = torch.cat([~keep_mask(scores, 0.5, 2), torch.zeros(t - n, dtype=torch.bool)])
    _, alpha = attention_rows(a, qpos, causal, share=evicted)
    state = memory.write_event(memory.empty_state(), 0, scores, ~keep_mask(scores, 0.5, 2), a.k_post[:, :n],
                               a.v[:, :n])  # fmt: skip
    _, g_q = memory.readout_heads(state, 0, a.q_post[:, qpos])
    torch.testing.assert_close(gated - plain, 0.5 * F.binary_cross_entropy(g_q, alpha))
    assert alpha_e == pytest.approx(float(alpha.mean())) and 0 < alpha_e < 1 and gap > 0 and gated_mse == mse


def _gated(options: ReleasedOptions, weight: float) -> ReleasedOptions:
    from dataclasses import replace

    return replace(options, memory=replace(options.memory, gate_weight=weight))


def test_shipped_released_yamls_load():
    paths = sorted(CONFIGS.glob("*.yaml"))
    assert [p.name for p in paths] == ["proxy.yaml", "smollm2.yaml"]
    for path in paths:
        cfg = load([str(path)])
        assert isinstance(cfg, ReleasedTrainConfig) and cfg.recipe == "released", path


def test_released_scores_equal_the_indexer_on_the_v3_features(reference):
    from research.released.features import compute_features_v3, special_mask
    from research.released.model import ReleasedModel

    core = ReleasedModel.from_pretrained(reference / "final")
    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(4, 20, 16, generator=gen), torch.randn(2, 20, 16, generator=gen), torch.randn(2, 20, 16)
    pos = torch.arange(20)
    ids = torch.randint(0, 300, (20,), generator=gen)
    got = core.scores(1, q, k, v, pos, pos, 20, 0.25, token_ids=ids)
    feats, _, _ = compute_features_v3(q, k, v, pos, pos, 20, core.key_geometry(), 1, 0.25, 0,
                                      special_mask(ids, core.config.special_token_ids))  # fmt: skip
    torch.testing.assert_close(got, core.indexer.scores(1, feats[None])[0])
    assert got.shape == (20,)


def test_ablated_features_are_invisible_to_the_indexer_in_training_and_after_loading(tmp_path):
    """``released.ablate_features=[coverage]``: the artifact records the 4 coverage names, the loaded indexer zeroes
    them (the scores do not move when only those features change), and the other features still move the scores."""
    from research.released.features import FEATURE_GROUPS_V3, FEATURE_NAMES_V3
    from research.released.model import ReleasedModel

    out = tmp_path / "run"
    run(tiny_args(out, "released.memory.train=false", "released.schedule.total_steps=2", "released.schedule.indexer_steps=2",
                  "released.ablate_features=[coverage]"))  # fmt: skip
    core = ReleasedModel.from_pretrained(out / "final")
    assert core.config.ablated_features == list(FEATURE_GROUPS_V3["coverage"]) == list(FEATURE_NAMES_V3[6:10])
    assert core.indexer.ablated == [6, 7, 8, 9]
    feats = torch.randn(1, 12, 14, generator=torch.Generator().manual_seed(1))
    moved = feats.clone()
    moved[..., 6:10] += 5.0
    torch.testing.assert_close(core.indexer.scores(0, moved), core.indexer.scores(0, feats))
    moved[..., 0] += 5.0
    assert not torch.allclose(core.indexer.scores(0, moved), core.indexer.scores(0, feats))


def test_ablate_features_names_the_unknown_entry():
    with pytest.raises(ValueError, match="released.ablate_features.*covrage"):
        load(["plugins=[research.released]", "recipe=released", "released.ablate_features=[covrage]"])
    from research.released.model import ReleasedConfig

    with pytest.raises(ValueError, match="ablated_features.*'nope'"):
        ReleasedConfig(ablated_features=["nope"])


def _stage_keys(*overrides: str) -> dict:
    from research.released.trainer import ReleasedTrainer

    tr = object.__new__(ReleasedTrainer)  # stage_keys reads only the config and the base model's fingerprint
    tr.cfg = load([str(CONFIGS / "smollm2.yaml"), *overrides])
    tr.fingerprint = {"layers": 30, "heads": 9, "kv_heads": 3, "head_dim": 64, "digest": "x"}
    return tr.stage_keys()


def test_stage_keys_follow_the_options_each_stage_reads():
    """A memory or joint-stage option changes only the joint stage's key (the finished indexer stage is kept); an
    indexer option (the geometry, an ablation, a loss weight) changes both."""
    base = _stage_keys()
    memory = _stage_keys("released.memory.gate_weight=0.5", "released.schedule.joint_memory_lr_scale=0.5")
    assert memory["online_indexer"] == base["online_indexer"] and memory["online_joint"] != base["online_joint"]
    for change in ("released.geometry.kind=fitted", "released.ablate_features=[qk]", "released.losses.lambda_bd=2"):
        other = _stage_keys(change)
        assert other["online_indexer"] != base["online_indexer"] and other["online_joint"] != base["online_joint"]


def test_fitted_geometry_goes_into_the_artifact(tmp_path):
    """``released.geometry.kind=fitted``: the artifact stores a fitted geometry (orthonormal projection rows, fitted
    prototypes, the drawn rotation) and records the choice (the fit itself: test_released_features.py)."""
    from research.released.geometry import KeyGeometry
    from research.released.model import ReleasedModel

    out = tmp_path / "run"
    run(tiny_args(out, "released.memory.train=false", "released.schedule.total_steps=1", "released.schedule.indexer_steps=1",
                  "released.geometry.kind=fitted", "released.geometry.docs=2", "released.geometry.d_z=8", "released.geometry.num_prototypes=8"))  # fmt: skip
    core = ReleasedModel.from_pretrained(out / "final")
    geo = core.key_geometry()
    assert core.config.teacher["geometry"] == "fitted"
    for layer in range(2):
        p = geo.projection[layer]
        torch.testing.assert_close(p @ p.T, torch.eye(8), atol=1e-5, rtol=0)
    drawn = KeyGeometry.draw(2, 2, 16, 8, 8, seed=42)
    assert not torch.allclose(geo.prototypes, drawn.prototypes)
    torch.testing.assert_close(geo.rotation, drawn.rotation)


def test_zero_joint_steps_record_an_untrained_memory(tmp_path):
    """With ``total_steps == indexer_steps`` the artifact recorded ``memory_trained: true`` for a memory that never
    trained (the report showed it worse than retained-only)."""
    from research.released.model import ReleasedModel

    out = tmp_path / "run"
    run(
        tiny_args(
            out,
            "released.schedule.total_steps=2",
            "released.schedule.indexer_steps=2",
            "released.schedule.stable=1",
            "released.schedule.decay=0",
        )
    )
    core = ReleasedModel.from_pretrained(out / "final")
    assert core.config.memory_trained is False and core.policy().for_ratio(0.75).memory is False


@pytest.mark.parametrize(
    "option, name",
    [("indexer.steps=5", "indexer.steps"), ("memory.lr=0.1", "memory.lr"), ("teacher.lam=4", "teacher.lam"),
     ("calibration.grid=11", "calibration.grid"), ("write_rule=equal_event", "write_rule"), ("calib_docs=3", "calib_docs"),
     ("ratios=[0.5]", "ratios"), ("eval_greedy=true", "eval_greedy"), ("teacher.data.max_len=4000", "teacher.data.max_len"),
     ("teacher.chunk_size=256", "teacher.chunk_size"), ("build_teacher=false", "build_teacher")],
)  # fmt: skip
def test_options_the_released_recipe_never_reads_are_refused_by_name(tmp_path, option, name):
    """``indexer.steps`` and ``memory.lr`` under ``recipe: released`` were accepted without a word."""
    from core_kv.config import ConfigError

    with pytest.raises(ConfigError, match=rf"^recipe='released' never reads {re.escape(name)}: remove it"):
        run(tiny_args(tmp_path / "run", option))
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("option", ["released.schedule.long_len=100000", "released.schedule.short_len=9000"])
def test_released_lengths_beyond_the_models_window_are_refused_at_once(tmp_path, option):
    """``released.schedule.long_len=100000`` (then ``online.long_len``) grew to 9.2 GB with no message."""
    from core_kv.models.loading import ContextWindowError

    name, value = option.split("=")
    with pytest.raises(ContextWindowError, match=rf"{re.escape(name)}={int(value):,} exceeds the context window of "
                                                 r"teacher\.model \(random_init\): 8,192 positions"):  # fmt: skip
        run(tiny_args(tmp_path / "run", option))
    assert not (tmp_path / "run" / "stages").exists()
