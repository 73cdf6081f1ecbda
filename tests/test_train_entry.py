"""CPU smoke tests of the real entry point (``train.py`` → ``train(cfg)``) on a tiny config-built Llama (GQA 4/2).

One teacher dataset is built per session; every run replays 2–3 steps per stage. Covers: the checkpoint folder
listing, resume after an interruption == uninterrupted, ``from_pretrained`` of ``final/``, gradient-accumulation
invariance (micro-batch × accumulation), 2 gloo processes == 1 process, and every shipped YAML loading.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import locked_by_another, run, tiny_args, tiny_model

ROOT = Path(__file__).resolve().parents[1]


def weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "final" / "model.safetensors"))


def assert_same(a: dict, b: dict, atol: float = 0.0) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if atol:
            torch.testing.assert_close(a[k], b[k], atol=atol, rtol=0, msg=k)
        else:
            assert torch.equal(a[k], b[k]), k


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("teacher")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, teacher_dir) -> Path:
    """The uninterrupted run; it also logs to W&B in offline mode (no login, no network)."""
    out = tmp_path_factory.mktemp("ref")
    wandb_dir = tmp_path_factory.mktemp("wandb")
    old = {k: os.environ.get(k) for k in ("WANDB_MODE", "WANDB_DIR", "WANDB_SILENT")}
    os.environ.update(WANDB_MODE="offline", WANDB_DIR=str(wandb_dir), WANDB_SILENT="true")
    try:
        run(tiny_args(out, teacher_dir, "wandb=true", "wandb_mode=offline"))
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    assert list(wandb_dir.glob("wandb/offline-run-*")), "no offline W&B run written"
    return out


def test_folder_listing_and_artifact(reference):
    from core_kv.core_model import CoreModel
    from core_kv.models.loading import ModelSpec, load_from_spec

    assert sorted(p.name for p in (reference / "final").iterdir()) == ["config.json", "model.safetensors"]
    assert {"state", "stages", "final", "summary.json", "config.yaml"} <= {p.name for p in reference.iterdir()}
    assert sorted(p.name for p in (reference / "stages").iterdir()) == [
        "calibration.json", "indexer.safetensors", "indexer_warmup.safetensors", "memory.safetensors",
    ]  # fmt: skip
    for stage in ("indexer_warmup", "indexer", "memory"):
        steps = sorted(p.name for p in (reference / "state" / stage).iterdir())
        assert steps[-1].startswith("step_") and len(steps) <= 2  # keep_last = 2, no temporary folders left
    base, _ = load_from_spec(
        ModelSpec(random_init=True, path="", hidden_size=64, num_layers=2, intermediate_size=128), "cpu"
    )
    core = CoreModel.from_pretrained(reference / "final", base_model=base)
    assert core.indexer.temperature.shape == (2,) and (core.indexer.temperature > 0).all()
    assert core.memory.w_phi.shape == (2, 2, 512, 16)
    assert core.geo_prototypes.abs().sum() > 0 and core.indexer.feature_std.min() > 0
    assert core.config.fingerprint["kv_heads"] == 2
    summary = __import__("json").loads((reference / "summary.json").read_text())
    t7 = summary["eval"]["r75"]["table7"]
    assert {"utility", "teacher", "student"} <= set(t7) and "greedy" not in t7  # greedy is opt-in (eval_greedy)
    assert 0.5 < summary["eval"]["r75"]["student_J_over_teacher_J"] < 1.5
    assert (reference / "report.md").read_text().count("| 75% |") >= 5


def test_artifact_refuses_other_base_model(reference, llama):
    from core_kv.core_model import CoreModel
    from core_kv.models.fingerprint import FingerprintMismatch

    other = tiny_model("llama", seed=3)
    with pytest.raises(FingerprintMismatch, match="k_proj_digest"):
        CoreModel.from_pretrained(reference / "final", base_model=other)
    from core_kv.models.tiny import tiny_lm

    # the RNG as it stands, LlamaConfig's default attention and max_position_embeddings
    three = tiny_lm(
        seed=None, attn_implementation=None, vocab_size=512, num_hidden_layers=3, max_position_embeddings=2048
    )
    with pytest.raises(FingerprintMismatch, match="layers"):
        CoreModel.from_pretrained(reference / "final", base_model=three)


def test_resume_after_interruption_matches(tmp_path, teacher_dir, reference):
    from core_kv.distill.trainer import Interrupted

    out = tmp_path / "resumed"
    with pytest.raises(Interrupted):
        run(tiny_args(out, teacher_dir, "stop_after=3"))  # warm-up done, on-policy stage at step 1 of 3
    assert (out / "state" / "indexer" / "step_000001").is_dir()
    assert not (out / "final").exists()
    run(tiny_args(out, teacher_dir))
    assert_same(weights(out), weights(reference))


def test_gradient_accumulation_invariance(tmp_path, teacher_dir):
    a, b = tmp_path / "micro2", tmp_path / "accum2"
    run(tiny_args(a, teacher_dir, "micro_batch=2", "grad_accum=1", "indexer.records_per_micro=4"))
    run(tiny_args(b, teacher_dir, "micro_batch=1", "grad_accum=2", "indexer.records_per_micro=2"))
    assert_same(weights(a), weights(b), atol=2e-4)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(os.name != "posix", reason="accelerate launch with gloo on POSIX")
def test_two_processes_match_one(tmp_path, teacher_dir):
    """Two real gloo ranks through the CLI (env.md §5 flags) give the weights of one process with micro-batch 2."""
    import json
    import subprocess
    import sys

    one, two = tmp_path / "one", tmp_path / "two"
    run(tiny_args(one, teacher_dir, "micro_batch=2", "indexer.records_per_micro=4"))
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--num_cpu_threads_per_process", "1", "--main_process_port", str(_free_port()),
           str(ROOT / "train.py"), *tiny_args(two, teacher_dir, "indexer.records_per_micro=2")]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((two / "summary.json").read_text())
    assert summary["num_processes"] == 2 and summary["docs_per_step"] == 2
    assert_same(weights(one), weights(two), atol=2e-4)


@pytest.mark.slow
@pytest.mark.skipif(os.name != "posix", reason="accelerate launch with gloo on POSIX")
def test_deepspeed_zero2_two_cpu_processes_match_one(tmp_path, teacher_dir):
    """The shipped DeepSpeed ZeRO-2 launcher config, 2 CPU ranks (env.md §2): DeepSpeed really runs, and the weights
    equal one plain process with micro-batch 2. Needs ``pip install -e .[deepspeed]`` (``make test-slow`` does it);
    the first run JIT-builds DeepSpeed's shm op (~1 min)."""
    import json
    import subprocess
    import sys

    pytest.importorskip("deepspeed", reason="make test-slow installs the deepspeed extra")
    one, two = tmp_path / "one", tmp_path / "two"
    run(tiny_args(one, teacher_dir, "micro_batch=2", "indexer.records_per_micro=4"))
    env = {
        **os.environ,
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "WANDB_MODE": "disabled",
    }
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "configs" / "accelerate" / "deepspeed_zero2.yaml"), "--num_processes", "2",
           "--mixed_precision", "no", "--main_process_port", str(_free_port()),
           str(ROOT / "train.py"), *tiny_args(two, teacher_dir, "indexer.records_per_micro=2")]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((two / "summary.json").read_text())
    assert summary["distributed_type"] == "DistributedType.DEEPSPEED"
    assert summary["num_processes"] == 2 and summary["docs_per_step"] == 2
    assert_same(weights(one), weights(two), atol=2e-4)


@pytest.mark.parametrize("path", sorted((ROOT / "configs" / "train").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_yaml_loads(path):
    from core_kv.config import load_config
    from core_kv.distill.config import TrainConfig
    from core_kv.distill.trainer import check_unread, recipe, train_schema

    cfg = load_config(TrainConfig, [str(path)], resolve=train_schema)
    assert isinstance(cfg, TrainConfig)
    assert cfg.micro_batch * cfg.grad_accum >= 1
    check_unread(cfg, recipe(cfg.recipe).unread)  # sets none it never reads


def test_a_plugin_recipe_without_its_plugin_names_the_option_and_the_fix(monkeypatch):
    """``recipe: released`` (the research plugin's) without ``plugins: [research.released]`` is refused at load,
    naming the option and how to enable it; the base Trainer knows no other recipe."""
    from core_kv.config import load_config
    from core_kv.distill import trainer
    from core_kv.distill.config import TrainConfig

    monkeypatch.setattr(trainer, "RECIPES", {"replay": trainer.Trainer})  # as in a run that imported no plugin
    with pytest.raises(ValueError, match=r"recipe: 'released' is not registered .*plugins: \[research.released\]"):
        load_config(TrainConfig, ["recipe=released"], resolve=trainer.train_schema)
    with pytest.raises(ValueError, match=r"recipe: 'released' is not the recipe of this config schema"):
        load_config(TrainConfig, ["recipe=released"])  # read without the resolver: the schema's own check
    with pytest.raises(ValueError, match=r"plugins: cannot import 'no_such_plugin'"):
        load_config(TrainConfig, ["plugins=[no_such_plugin]"], resolve=trainer.train_schema)


def test_memory_gate_scalars_train_at_their_own_learning_rate(reference):
    """Adam moves a parameter by at most ~lr per step, so the gate's init (gate_b = -2, gate_w = [0, 1, -1, 0]) can
    only move by more than memory.lr x steps if ``memory.gate_lr`` reaches the optimizer; W_phi stays bounded by
    memory.lr. Both bounds use the schedule's peak, so they hold for any warm-up."""
    from core_kv.distill.config import MemoryStage
    from core_kv.distill.loop import _param_groups
    from core_kv.memory import LatentMemory

    mc = MemoryStage(steps=2)
    w = weights(reference)
    init = LatentMemory(2, 4, 2, 16)
    init.reset_parameters(0)  # the trainer's seed
    moved = {k: (w[f"memory.{k}"] - getattr(init, k)).abs().max().item() for k in ("gate_w", "gate_b", "w_phi")}
    assert max(moved["gate_w"], moved["gate_b"]) > 2 * mc.lr * mc.steps
    assert max(moved["gate_w"], moved["gate_b"]) <= 1.01 * mc.gate_lr * mc.steps
    assert moved["w_phi"] <= 1.01 * mc.lr * mc.steps

    groups = _param_groups(init, mc)
    assert [g["lr_scale"] for g in groups] == [1.0, mc.gate_lr / mc.lr]
    assert {id(p) for p in groups[1]["params"]} == {id(init.gate_w), id(init.gate_b)}
    single = _param_groups(init, MemoryStage(gate_lr=None))
    assert len(single) == 1 and len(single[0]["params"]) == 3


# ---------------------------------------------------------------------------------------------------------------
# Issue 16: nothing finished is lost, every bad option is named before any work


def test_finished_artifact_is_never_deleted_by_another_config(tmp_path, teacher_dir, reference):
    """A relaunch with another config into a finished run folder refuses (naming overwrite=true / out_dir) and
    leaves the artifact and its report byte-identical."""
    import shutil

    out = tmp_path / "finished"
    shutil.copytree(reference, out)
    before = {p: p.read_bytes() for p in [*(out / "final").iterdir(), out / "summary.json", out / "run.json"]}
    with pytest.raises(ValueError, match=r"overwrite=true.*out_dir|out_dir.*overwrite=true"):
        run(tiny_args(out, teacher_dir, "indexer.lr=0.002"))
    assert {p: p.read_bytes() for p in before} == before
    assert sorted(p.name for p in (out / "final").iterdir()) == ["config.json", "model.safetensors"]


def test_default_out_dir_is_a_run_folder_not_the_shipped_checkpoint():
    """`make train` on a fresh clone trains into runs/..., never into the shipped checkpoints/core-proxy."""
    from core_kv.config import load_config
    from core_kv.distill.config import TrainConfig

    for cfg in (TrainConfig(), load_config(TrainConfig, [str(ROOT / "configs" / "train" / "default.yaml")])):
        assert cfg.out_dir.startswith("runs/"), cfg.out_dir


@pytest.mark.parametrize(
    "option",
    ["memory.lr=-1", "memory.lr=0", "indexer.lr=-1", "memory.gate_lr=0", "indexer.records_per_micro=0",
     "indexer.grad_clip=-1", "memory.weight_decay=-0.1", "calibration.grid=1", "calibration.log_t_min=5",
     "indexer.rank_weight=-1", "memory.gate_weight=-1", "indexer.warmup_lr_steps=-1", "eval_ratios=[]",
     "teacher.data.num_docs=0", "teacher.data.min_len=0", "teacher.records_per_shard=0", "teacher.d_z=0"],
)  # fmt: skip
def test_every_stage_option_is_validated_at_config_load(option):
    """A bad option of a later stage fails when the config loads (before the first stage runs), naming it."""
    from core_kv.config import load_config
    from core_kv.distill.config import TrainConfig

    name = option.split("=")[0].removeprefix("teacher.")
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        load_config(TrainConfig, [option])


def test_later_stage_change_keeps_finished_earlier_stages(tmp_path, teacher_dir, reference, capsys):
    """Changing only memory.* after an interruption reuses the finished warm-up, indexer and calibration stages
    (same weights as the reference) and retrains the memory stage from scratch."""
    from core_kv.distill.trainer import Interrupted

    out = tmp_path / "later"
    with pytest.raises(Interrupted):
        run(tiny_args(out, teacher_dir, "stop_after=6"))  # warm-up 2 + indexer 3 + memory 1 of 2
    assert (out / "stages" / "calibration.json").is_file() and (out / "state" / "memory").is_dir()
    capsys.readouterr()
    run(tiny_args(out, teacher_dir, "memory.lr=0.003"))
    log = capsys.readouterr().out
    for stage in ("indexer_warmup", "indexer", "calibration"):
        assert f"[{stage}] finished earlier" in log, log
    assert "[memory] resumed" not in log
    w, ref = weights(out), weights(reference)
    assert_same({k: v for k, v in w.items() if k.startswith("indexer.")},
                {k: v for k, v in ref.items() if k.startswith("indexer.")})  # fmt: skip
    assert not torch.equal(w["memory.w_phi"], ref["memory.w_phi"])


def test_corrupt_newest_state_falls_back_to_an_older_one(tmp_path, teacher_dir, reference):
    """Truncated files in the newest state/<stage>/step_* are skipped with a warning naming the folder; the run
    resumes from the newest readable step and reaches the reference weights."""
    from core_kv.distill.trainer import Interrupted

    out = tmp_path / "corrupt"
    with pytest.raises(Interrupted):
        run(tiny_args(out, teacher_dir, "stop_after=4"))  # warm-up 2 + indexer steps 1, 2
    newest = out / "state" / "indexer" / "step_000002"
    assert newest.is_dir() and (out / "state" / "indexer" / "step_000001").is_dir()
    for f in newest.rglob("*"):
        if f.is_file():
            f.write_bytes(f.read_bytes()[:10])
    with pytest.warns(UserWarning, match="step_000002"):
        run(tiny_args(out, teacher_dir))
    assert_same(weights(out), weights(reference))


def test_calibration_has_no_dead_docs_option():
    """``calibration.docs`` was never read (the stage uses ``calib_docs``): setting it must fail, not do nothing."""
    from core_kv.config import load_config
    from core_kv.distill.config import TrainConfig

    with pytest.raises(ValueError, match="docs"):
        load_config(TrainConfig, ["calibration.docs=4"])
    assert load_config(TrainConfig, ["calib_docs=3"]).calib_docs == 3


def test_cascade_on_policy_shares_the_warmup_and_changes_the_indexer(tmp_path, teacher_dir, reference):
    """``indexer.cascade=true`` trains on the compressed cascade's activations: the teacher-record warm-up (and its
    stage hash) is the reference's, the on-policy indexer is not; at its default the option leaves every hash as
    before (shipped runs stay recognised)."""
    import json

    from core_kv.distill.config import TrainConfig
    from core_kv.distill.trainer import _hashed

    assert "cascade" not in _hashed(TrainConfig())["indexer"]
    out = tmp_path / "cascade"
    run(tiny_args(out, teacher_dir, "indexer.cascade=true"))
    mine, ref = (json.loads((d / "run.json").read_text())["stages"] for d in (out, reference))
    assert mine["indexer_warmup"] == ref["indexer_warmup"] and mine["indexer"] != ref["indexer"]
    warm = lambda d: load_file(str(d / "stages" / "indexer_warmup.safetensors"))  # noqa: E731
    assert_same(warm(out), warm(reference))
    w, r = weights(out), weights(reference)
    assert any(not torch.equal(w[k], r[k]) for k in w if k.startswith("indexer.") and "temperature" not in k)


def test_shared_selection_trains_what_head_shared_serves(tmp_path, teacher_dir, reference):
    """``selection=shared`` (issue 56): every stage's hash changes (they all train or replay under the selection), the
    indexer and memory differ from the per-head run's, and the artifact records the selection it was trained under;
    at its default the option leaves every hash as before (shipped runs stay recognised)."""
    import json

    from core_kv.core_model import CoreModel
    from core_kv.distill.config import TrainConfig
    from core_kv.distill.trainer import _hashed

    assert "selection" not in _hashed(TrainConfig())
    out = tmp_path / "shared"
    run(tiny_args(out, teacher_dir, "selection=shared"))
    mine, ref = (json.loads((d / "run.json").read_text())["stages"] for d in (out, reference))
    assert all(mine[k] != ref[k] for k in ref)
    w, r = weights(out), weights(reference)
    for part in ("indexer.", "memory."):
        assert any(not torch.equal(w[k], r[k]) for k in w if k.startswith(part) and "temperature" not in k), part
    assert CoreModel.from_pretrained(out / "final").config.trained_selection == "shared"
    assert CoreModel.from_pretrained(reference / "final").config.trained_selection == "per_head"


def test_feature_spec_v2_trains_loads_and_compresses_to_the_budget(tmp_path, teacher_dir, reference):
    """``teacher.features=2``: the teacher records spec v2; a v1 dataset in that folder is never reused, nor replaced
    unless ``teacher.overwrite=true`` (then rebuilt); the artifact records v2 and its press computes v2 features (KeyDiff / twin columns) and keeps the exact budget; at
    the default (1) the option is left out of every hash, so v1 runs stay recognised."""
    import json

    from transformers import DynamicCache

    from core_kv.core_model import CoreModel
    from core_kv.distill.config import TrainConfig
    from core_kv.distill.trainer import _hashed
    from core_kv.features import FEATURE_SPECS
    from core_kv.models.cache import cache_kwarg, layer_lengths
    from core_kv.models.loading import ModelSpec, load_from_spec
    from core_kv.presses import build_press

    assert "features" not in _hashed(TrainConfig())["teacher"]
    teacher = tmp_path / "teacher"
    __import__("shutil").copytree(teacher_dir, teacher)  # the reference's v1 dataset, in the v2 run's folder
    out = tmp_path / "v2"
    from core_kv.teacher.dataset import TeacherDatasetMismatch

    before = (teacher / "manifest.json").read_bytes()
    with pytest.raises(TeacherDatasetMismatch, match=r"holds a finished teacher dataset of another config .*v1"):
        run(tiny_args(out, teacher, "teacher.features=2"))
    assert (teacher / "manifest.json").read_bytes() == before
    run(tiny_args(out, teacher, "teacher.features=2", "teacher.overwrite=true"))
    assert json.loads((teacher / "manifest.json").read_text())["feature_spec"]["version"] == 2
    base, _ = load_from_spec(
        ModelSpec(random_init=True, path="", hidden_size=64, num_layers=2, intermediate_size=128), "cpu"
    )
    core = CoreModel.from_pretrained(out / "final", base_model=base)
    assert core.config.feature_spec["names"] == list(FEATURE_SPECS[2])
    mine, ref = (json.loads((d / "run.json").read_text()) for d in (out, reference))
    assert mine["config_hash"] != ref["config_hash"]
    assert all(mine["stages"][k] != ref["stages"][k] for k in ref["stages"])  # no v1 stage is reused by a v2 run
    press = build_press("core", checkpoint=str(out / "final"), compression_ratio=0.75)
    ids = torch.randint(3, 500, (1, 160), generator=torch.Generator().manual_seed(0))
    cache = DynamicCache()
    with torch.inference_mode(), press(base):
        base(input_ids=ids, use_cache=True, **{cache_kwarg(base): cache})
    assert all(layer_lengths(layer).tolist() == [40, 40] for layer in cache.layers)  # 160 tokens at 75%: B = 40


def test_another_configs_teacher_dataset_is_refused_not_rebuilt(tmp_path, teacher_dir, reference):
    """``teacher.lam=3.0`` into a folder holding the λ = 2 dataset printed ``teacher lam=2.0, expected 3.0 ->
    building it`` and overwrote it; it is refused like the artifact folder, naming both ways out."""
    from core_kv.teacher.dataset import TeacherDatasetMismatch

    before = {p: p.read_bytes() for p in teacher_dir.rglob("*") if p.is_file()}
    with pytest.raises(TeacherDatasetMismatch, match=r"teacher lam=2\.0, expected 3\.0.*teacher\.out_dir=<another "
                       r"folder>.*teacher\.overwrite=true"):  # fmt: skip
        run(tiny_args(tmp_path / "lam3", teacher_dir, "teacher.lam=3.0"))
    assert {p: p.read_bytes() for p in teacher_dir.rglob("*") if p.is_file()} == before


def test_a_second_training_run_into_a_folder_being_written_is_refused(tmp_path, teacher_dir, reference):
    """Two runs into one out_dir interleaved their states (``FileNotFoundError .../.tmp-step_000015``) or left one
    config's weights under the other's report; the second is refused, naming the first."""
    from core_kv.lock import LOCK_NAME, FolderLocked

    out = tmp_path / "busy"
    out.mkdir()
    with locked_by_another(out, "training run", "train.py") as pid:
        with pytest.raises(FolderLocked, match=rf"being written by another training run \(pid {pid} on "):
            run(tiny_args(out, teacher_dir))
        assert sorted(p.name for p in out.iterdir()) == [LOCK_NAME]  # nothing written


def test_a_full_disk_while_saving_a_state_is_named_and_the_rerun_resumes(tmp_path, teacher_dir, reference, monkeypatch):
    """``RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos`` became a message naming the full
    disk and the state's path; the half-written state is removed and the relaunch reaches the reference weights."""
    from accelerate import Accelerator

    from core_kv import files as io

    out = tmp_path / "full"
    original, calls = Accelerator.save_state, {"n": 0}

    def fill_the_disk(self, output_dir=None, **kwargs):
        calls["n"] += 1
        if calls["n"] == 4:  # warm-up steps 1-2, indexer step 1, then the disk is full
            Path(output_dir).mkdir(parents=True, exist_ok=True)
            (Path(output_dir) / "model.safetensors").write_bytes(b"\0" * 100)
            monkeypatch.setattr(io, "_free_bytes", lambda path: 4096)
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 2112 vs 2010")
        return original(self, output_dir, **kwargs)

    monkeypatch.setattr(Accelerator, "save_state", fill_the_disk)
    with pytest.raises(OSError, match=r"the disk is full: cannot write the training state .*indexer/\.tmp-step_000002"):
        run(tiny_args(out, teacher_dir))
    assert not (out / "state" / "indexer" / ".tmp-step_000002").exists()  # its space is given back
    monkeypatch.undo()
    run(tiny_args(out, teacher_dir))
    assert_same(weights(out), weights(reference))


def test_a_run_ends_with_its_artifact_the_symbols_and_the_next_commands(teacher_dir, reference, capsys):
    """The console explains each symbol once and ends with the artifact, the report and two commands (issue 47)."""
    from core_kv.distill.report import SYMBOLS

    capsys.readouterr()
    run(tiny_args(reference, teacher_dir))  # finished: prints and returns
    out = capsys.readouterr().out
    for symbol, _ in SYMBOLS:
        assert f"    {symbol}: " in out
    assert out.index("what the numbers mean") < out.index("Table 7")  # explained before first use
    tail = out.rstrip().splitlines()[-6:]
    assert tail[0] == f"artifact: {reference / 'final'}   report: {reference / 'report.md'}" and tail[1] == "next:"
    assert "load it" in tail[2] and f"checkpoint='{reference / 'final'}'" in tail[3]
    assert "evaluate it" in tail[4] and tail[5].strip().startswith("make eval ARGS=")
    assert f"press_options.core.checkpoint={reference / 'final'}" in tail[5]
    assert "Symbols" in (reference / "report.md").read_text()


def test_next_commands_load_and_parse_for_a_real_artifact():
    """The two printed commands work for the shipped proxy artifact: the load command answers with CORE, and the
    evaluation's arguments are a valid eval.py config."""
    import shlex
    import subprocess
    import sys

    from core_kv.config import load_config
    from core_kv.distill.report import next_steps
    from core_kv.eval.runner import EvalConfig

    text = next_steps("checkpoints/proxy-lm", "checkpoints/core-proxy/final", "runs/core-proxy")
    lines = text.splitlines()
    load, evaluate = lines[3].strip(), lines[5].strip()
    argv = shlex.split(load)
    assert argv[:2] == [".venv/bin/python", "-c"]
    res = subprocess.run([sys.executable, "-c", argv[2]], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.startswith("full cache: ['") and "| CORE at 75%: ['" in res.stdout
    assert "KV bytes kept:" in res.stdout and "CORE memory bytes:" in res.stdout
    # the proxy answers the needle with neither cache (issue 59): the line says the check only shows the pipeline
    assert "only shows that the pipeline runs" in lines[2]
    assert "4242 is right" in next_steps("smollm2-135m", "runs/x/final", "runs/x").splitlines()[2]
    make = shlex.split(evaluate)
    assert make[:2] == ["make", "eval"] and make[2].startswith("ARGS=")
    cfg = load_config(EvalConfig, shlex.split(make[2].removeprefix("ARGS=")))
    assert cfg.methods[0] == "core" and cfg.press_options["core"]["checkpoint"] == "checkpoints/core-proxy/final"
    assert cfg.model.name == "checkpoints/proxy-lm" and cfg.benchmarks == ["ruler"]


# ------------------------------------------------------------------------------------------------------- issue 60
def test_the_policy_stage_runs_inside_the_run_folders_lock(teacher_dir, reference, monkeypatch):
    """A second train.py into the folder took the lock while the first was in its policy stage, ran its own stage and
    printed 'recorded in ...' while the file held the other's: the stage now runs before the lock is released."""
    import json
    import subprocess
    import sys

    from core_kv import run as run_module
    from core_kv.lock import LOCK_NAME

    seen = {}

    def stage(cfg, summary):
        seen["owner"] = json.loads((reference / LOCK_NAME).read_text())["pid"]
        probe = [sys.executable, "-c", f"from core_kv.lock import acquire; acquire({str(reference)!r}, 'training run')"]
        seen["second"] = subprocess.run(probe, capture_output=True, text=True, cwd=ROOT).stderr
        return summary

    monkeypatch.setattr(run_module, "choose_policy", stage)
    run(tiny_args(reference, teacher_dir))  # finished: the policy stage alone runs
    assert seen["owner"] == os.getpid()
    assert f"FolderLocked: {reference} is being written by another training run (pid {os.getpid()}" in seen["second"]
    assert not (reference / LOCK_NAME).exists()  # released after the stage


def test_the_policy_printed_is_the_policy_the_artifact_holds(tmp_path, monkeypatch, capsys):
    """``choose_policy`` prints and reports what ``final/config.json`` holds after its stage, not what it computed."""
    import json
    import shutil

    from core_kv import run as run_module
    from core_kv.config import load_config
    from core_kv.distill.config import TrainConfig
    from core_kv.eval import policy_stage
    from core_kv.policy import InferencePolicy, PolicyOptions

    out = tmp_path / "run"
    shutil.copytree(ROOT / "checkpoints" / "core-proxy" / "final", out / "final")
    recorded = json.loads((out / "final" / "config.json").read_text())["inference_policy"]
    mine = InferencePolicy.single(PolicyOptions(head_budgets="shared", memory=False))
    monkeypatch.setattr(run_module, "run_policy_stage", lambda *a, **k: mine)  # another record stays in the file
    cfg = load_config(TrainConfig, [f"out_dir={out}", "teacher.model.path=checkpoints/proxy-lm", "progress=false"])
    summary = run_module.choose_policy(cfg, {})
    printed = capsys.readouterr().out
    held = InferencePolicy.from_dict(recorded)
    assert summary["policy"] == held.to_dict() and "shared, memory off" not in printed
    for b in held.lengths[0].bands:
        assert f"[policy] 512 tokens, ratios up to {b.upto:g}: {b.options.describe()}" in printed
    assert policy_stage.policy_markdown(held) in (out / "report.md").read_text()


def test_lengths_beyond_the_models_window_are_refused_before_the_first_stage(tmp_path, teacher_dir):
    """``policy.length=100000`` ran the whole distillation, then the policy stage hung silently."""
    from core_kv.models.loading import ContextWindowError

    out = tmp_path / "long"
    with pytest.raises(ContextWindowError, match=r"^teacher\.data\.max_len=100,000 exceeds the context window of "
                                                 r"teacher\.model \(random_init\): 8,192 positions"):  # fmt: skip
        run(tiny_args(out, tmp_path / "teacher", "teacher.data.max_len=100000"))
    assert not (tmp_path / "teacher").exists() and not (out / "stages").exists()  # nothing built


def test_options_the_replay_recipe_never_reads_are_refused(tmp_path, teacher_dir):
    """A plugin recipe's section (``released.*``, or the ``online.*`` it replaced) is no option of the replay
    recipe's schema: refused at load, naming the key."""
    from core_kv.config import ConfigError

    for option in ("online.long_len=100", "released.memory.train=false"):
        with pytest.raises(ConfigError, match=rf"invalid config for TrainConfig: {option.split('.')[0]}: Key"):
            run(tiny_args(tmp_path / "run", teacher_dir, option))
    assert not (tmp_path / "run").exists()


def test_a_training_runs_files_get_the_umasks_modes(reference):
    """Under umask 022 ``final/model.safetensors``, ``config.json``, ``run.json``, ``summary.json`` and the report
    were 0600."""
    mask = os.umask(0o022)
    os.umask(mask)
    files = [p for p in reference.rglob("*") if p.is_file() and "wandb" not in p.parts and "state" not in p.parts]
    assert {"model.safetensors", "config.json", "run.json", "summary.json", "report.md"} <= {p.name for p in files}
    assert {str(p): p.stat().st_mode & 0o777 for p in files} == {str(p): 0o666 & ~mask for p in files}
