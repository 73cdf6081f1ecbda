"""Every bad value is named when it is read (issue 46): one rule per kind of input, each with the examples that used
to fail late, silently or without a name.

- config options (:func:`core_kv.config.check_config`, every field of train / teacher / eval / proxy configs);
- press options (:mod:`core_kv.presses.options`, from each press's annotations);
- generation arguments (:func:`core_kv.pipeline.check_generation_args`, and jsonl rows);
- files read (model folders, CORE artifacts, config files);
and two presses entered on one model, the folder lock, and a full disk named as such.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from core_kv.config import ConfigError, check_config, check_value, load_config
from core_kv.distill.config import TrainConfig
from core_kv.eval.runner import EvalConfig
from core_kv.presses import PRESSES, build_press
from core_kv.proxy.train import ProxyTrainConfig
from core_kv.teacher.config import TeacherConfig

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------------- config options
@pytest.mark.parametrize(
    "schema, args, message",
    [
        (TeacherConfig, ["lam=nan"], r"^lam must be a finite number >= 0, got nan$"),
        (TeacherConfig, ["model.dtype=bogus"], r"^model\.dtype must be one of 'float32', 'float16', 'bfloat16'"),
        (TeacherConfig, ["eta=abc"], r"^eta must be 'auto' or a number in \(0, 1\], got 'abc'"),
        (TeacherConfig, ["threads=-1"], r"^threads must be >= 0, got -1$"),
        (
            TeacherConfig,
            ["data.mix={nope: 1.0}"],
            r"^data\.mix must be a mapping of proxy tasks .* unknown: \['nope'\]",
        ),
        (TeacherConfig, ["model.attn_implementation=fast"], r"^model\.attn_implementation must be one of 'sdpa'"),
        (TrainConfig, ["teacher.lam=nan"], r"^teacher\.lam must be a finite number >= 0, got nan$"),
        (TrainConfig, ["calibration.log_t_min=-inf"], r"^calibration\.log_t_min must be a finite number, got -inf$"),
        (TrainConfig, ["teacher.model.dtype=bogus"], r"^teacher\.model\.dtype must be one of"),
        (TrainConfig, ["teacher.eta=abc"], r"^teacher\.eta must be 'auto' or a number"),
        (TrainConfig, ["threads=-1"], r"^threads must be >= 0, got -1$"),
        (TrainConfig, ["teacher.steps=20"], r"^teacher\.ref_steps must be >= teacher\.steps \(20\), got 16$"),
        (TrainConfig, ["ratios=[0.5,1.0]"], r"^ratios\[1\] must be in \(0, 1\), got 1\.0$"),
        (TrainConfig, ["memory.gate_lr=nan"], r"^memory\.gate_lr must be a finite number > 0 or null, got nan$"),
        (TrainConfig, ["teacher.out_dir=runs/core-proxy"], r"teacher\.out_dir must differ from out_dir"),
        (TrainConfig, ["threads=abc"], r"threads: Value 'abc' of type 'str' could not be converted to Integer"),
        (EvalConfig, ["ratios=[0.5,0.5]"], r"^ratios has duplicates: \[0\.5, 0\.5\]$"),
        (EvalConfig, ["ratios=[]"], r"^ratios is empty: methods \[.*\] need at least one compression ratio"),
        (EvalConfig, ["output_dir=''"], r"^output_dir must be a folder path \(non-empty\), got '' \(str\)$"),
        (EvalConfig, ["press_options.snapkv=[1,2]"], r"^press_options\.snapkv must be a mapping of snapkv's options"),
        (EvalConfig, ["model.dtype=fp8"], r"^model\.dtype must be one of 'auto'"),
        (EvalConfig, ["cpu_threads=0"], r"^cpu_threads must be >= 1, got 0$"),
        (EvalConfig, ["generation.max_new_tokens=-3"], r"^generation\.max_new_tokens must be >= 1, got -3$"),
        (EvalConfig, ["datasets.ruler.lengths=[1024,-1]"], r"^datasets\.ruler\.lengths\[1\] must be >= 1, got -1$"),
        (EvalConfig, ["press_options.snapkv.window_size='4'"], r"^press_options\.snapkv: press 'snapkv': window_size"),
        (EvalConfig, ["press_options.knorm.decoding='no'"], r"^press_options\.knorm: .*decoding must be true or false"),
        (ProxyTrainConfig, ["lr=nan"], r"^lr must be a finite number > 0, got nan$"),
        (ProxyTrainConfig, ["betas=[0.9]"], r"^betas must be two numbers \[beta1, beta2\]"),
        (ProxyTrainConfig, ["probe_tasks=[nope]"], r"^probe_tasks must be proxy tasks"),
    ],
)
def test_every_option_is_checked_at_load_naming_it(schema, args, message):
    with pytest.raises(ConfigError, match=message):
        load_config(schema, args)


def test_the_float_ratio_labels_round_trip_and_never_collide():
    """0.125 was labelled 0.12; 0.75 and 0.7549 shared a folder (the second cell then collided with the first)."""
    from core_kv.eval.schema import cell_dir, ratio_label

    assert [ratio_label(r) for r in (0.0, 0.5, 0.75, 0.9, 0.125, 0.7549, 0.751)] == [
        "0.00", "0.50", "0.75", "0.90", "0.125", "0.7549", "0.751",
    ]  # fmt: skip
    for r in (0.125, 0.7549, 0.751, 0.749, 1 / 3):
        assert float(ratio_label(r)) == r
    assert cell_dir("o", "b", "tiny", "knorm", 0.75) != cell_dir("o", "b", "tiny", "knorm", 0.7549)
    cfg = load_config(EvalConfig, ["ratios=[0.75,0.7549]", "methods=[knorm]"])  # distinct cells now: accepted
    assert cfg.ratios == [0.75, 0.7549]


def test_a_directly_built_config_is_checked_too():
    with pytest.raises(ConfigError, match=r"^lam must be a finite number >= 0, got nan"):
        TeacherConfig(lam=float("nan"))
    with pytest.raises(ConfigError, match=r"^calibration\.log_t_min must be a finite number"):
        check_config(TrainConfig(calibration=dataclasses.replace(TrainConfig().calibration, log_t_min=-float("inf"))))


@pytest.mark.parametrize(
    "content, message",
    [
        (b"- a\n- b\n", r"top level must be a mapping of options \(key: value\), got a list"),
        (bytes(range(256)), r"is not UTF-8 text"),
        (b"methods: [knorm\nratios: 0.5\n", r"is not valid YAML"),
    ],
)
def test_a_bad_config_file_is_named(tmp_path, content, message):
    path = tmp_path / "bad.yaml"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=f"config file {path}.*" if "top level" in message else str(path)):
        load_config(EvalConfig, [str(path)])
    with pytest.raises(ConfigError, match=message):
        load_config(EvalConfig, [str(path)])


def test_check_value_follows_the_annotation():
    for value, ann, ok in [
        (3, int, True), (3.0, int, False), (True, int, False), (2, float, True), (float("inf"), float, False),
        ("x", str, True), (Path("x"), str, True), (None, int | None, True), ("no", bool, False), ([1, "a"], list[int], False),
        ({"a": 1.0}, dict[str, float], True), ({"a": "1"}, dict[str, float], False),
    ]:  # fmt: skip
        if ok:
            check_value(value, ann, "x")
        else:
            with pytest.raises(ConfigError):
                check_value(value, ann, "x")


# -------------------------------------------------------------------------------------------------- press options
@pytest.mark.parametrize(
    "name, options, message",
    [
        ("snapkv", {"window_size": "4"}, r"press 'snapkv': window_size must be an integer, got '4' \(str\)"),
        ("pyramidkv", {"beta": "2"}, r"press 'pyramidkv': beta must be an integer, got '2'"),
        ("expected_attention", {"n_future_positions": "8"}, r"n_future_positions must be an integer, got '8'"),
        ("twinkv", {"threshold": "0.5"}, r"press 'twinkv': threshold must be a finite number, got '0.5'"),
        ("snapkv", {"decoding": "no"}, r"press 'snapkv': decoding must be true or false, got 'no'"),
        ("core", {"memory": "false"}, r"core: memory must be true or false \(a boolean\).*got the string 'false'"),
        ("knorm", {"compression_ratio": "0.5"}, r"compression_ratio must be a finite number, got '0.5'"),
        ("expected_attention", {"epsilon": float("nan")}, r"epsilon must be a finite number, got nan"),
        ("twin_repair", {"threshold": "0.5", "compression_ratio": 0.5}, r"press 'twin_repair': threshold"),
        ("twin_repair", {"press_options": [1]}, r"press 'twin_repair': press_options must be a mapping"),
        ("adakv", {"press": 3}, r"press 'adakv': press must be a ScorerPress or a string, got 3"),
        ("random", {"seed": "1"}, r"press 'random': seed must be an integer or null"),
    ],
)
def test_a_press_option_of_the_wrong_type_names_press_and_option(name, options, message):
    with pytest.raises(ValueError, match=message):
        build_press(name, **options)


def test_every_registered_press_builds_with_its_defaults():
    """The checker reads every press's annotations (unions with press classes, dicts, ``X | None``) without a false
    refusal."""
    for name in PRESSES:
        build_press(name)


def test_the_memory_is_not_run_when_memory_is_the_string_false():
    """core ``memory='false'`` used to be truthy: the memory ran."""
    with pytest.raises(ValueError, match="memory must be true or false"):
        build_press("core", checkpoint=str(ROOT / "checkpoints" / "core-proxy" / "final"), compression_ratio=0.5,
                    memory="false")  # fmt: skip


# ------------------------------------------------------------------------------------------- presses used together
@pytest.fixture(scope="module")
def proxy():
    from core_kv.models.loading import load_model

    if not (ROOT / "checkpoints" / "proxy-lm" / "config.json").is_file():
        pytest.skip("the shipped proxy LM is not in this checkout")
    return load_model(str(ROOT / "checkpoints" / "proxy-lm"))


CONTEXT = "The grass is green. " * 40 + "The secret code is 4242. " + "The sky is blue. " * 40


def test_a_second_press_on_one_model_is_refused(llama):
    kn, sn = build_press("knorm", compression_ratio=0.5), build_press("snapkv", compression_ratio=0.5)
    with kn(llama):
        with pytest.raises(ValueError, match=r"already has a press installed \(KnormPress\)"):
            with sn(llama):
                pass
        with pytest.raises(ValueError, match="entered twice"):
            with kn(llama.model):  # the body of the same model is the same model
                pass
    with sn(llama):  # the first press came off: the model is free again
        pass
    core = build_press("core", checkpoint=str(ROOT / "checkpoints" / "core-proxy" / "final"), compression_ratio=0.5)
    with kn(llama), pytest.raises(ValueError, match="already has a press installed"):
        with core(llama):
            pass


def test_wrappers_run_their_inner_press_as_one_press(llama):
    """AdaKV and TwinRepair run their inner press on their own hooks: not a second press; the budget is exact."""
    from core_kv.models.cache import layer_lengths
    from core_kv.pipeline import prefill

    ids = torch.randint(3, 200, (1, 96), generator=torch.Generator().manual_seed(0))
    for press in (
        build_press("adakv", press="knorm", compression_ratio=0.5),
        build_press("twin_repair", press="knorm", compression_ratio=0.5),
    ):
        cache = prefill(llama, ids, press)
        assert [int(layer_lengths(layer).sum()) for layer in cache.layers] == [2 * 48, 2 * 48]


def test_twin_repair_refuses_a_twin_repair_instance_like_its_name():
    inner = build_press("twin_repair", compression_ratio=0.5)
    with pytest.raises(ValueError, match="twin_repair cannot wrap itself"):
        build_press("twin_repair", press=inner)
    with pytest.raises(ValueError, match="twin_repair cannot wrap itself"):
        build_press("twin_repair", press="twin_repair", compression_ratio=0.5)


# ---------------------------------------------------------------------------------------------- generation args
@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"max_new_tokens": -5}, ValueError, r"^max_new_tokens must be >= 1, got -5$"),
        ({"max_new_tokens": 0}, ValueError, r"^max_new_tokens must be >= 1, got 0$"),
        ({"max_new_tokens": "4"}, ValueError, r"^max_new_tokens must be an integer >= 1, got '4' \(str\)$"),
        ({"max_new_tokens": 4.5}, ValueError, r"^max_new_tokens must be an integer >= 1, got 4\.5$"),
        ({"max_new_tokens": [4]}, ValueError, r"^max_new_tokens has 1 budgets for 2 questions"),
        ({"max_new_tokens": [4, -1]}, ValueError, r"^max_new_tokens\[1\] must be >= 1, got -1$"),
        ({"max_context_length": -5}, ValueError, r"^max_context_length must be >= 1, got -5$"),
        ({"chunk_size": 0}, ValueError, r"^chunk_size must be >= 1, got 0$"),
        ({"context": CONTEXT.encode()}, ValueError, r"^context must be a string, got b'The grass.*\(bytes\)$"),
        ({"questions": [None, "b"]}, ValueError, r"^questions\[0\] must be a string, got None$"),
        ({"questions": "What?"}, ValueError, r"^questions must be a list of strings, got 'What\?' \(str\)$"),
        ({"answer_prefixes": ["A:"]}, ValueError, r"^answer_prefixes has 1 entries for 2 questions$"),
        ({"press": "snapkv"}, ValueError, r"build it with build_press\('snapkv', compression_ratio=\.\.\.\)"),
        ({"press": object()}, ValueError, r"^press must be a press built with core_kv\.presses\.build_press"),
        ({"stop_at_newline": "yes"}, ValueError, r"^stop_at_newline must be true or false"),
    ],
)
def test_bad_generation_arguments_are_named_before_anything_runs(llama, kwargs, error, message):
    from core_kv.models.loading import tiny_tokenizer
    from core_kv.pipeline import answer_questions

    args = {"context": CONTEXT, "questions": ["What is the code?", "What color?"], "max_new_tokens": 2, **kwargs}
    with pytest.raises(error, match=message):
        answer_questions(llama, tiny_tokenizer(), **args)


def test_a_context_beyond_the_window_raises_as_eval_does(proxy):
    """A 33,597-token context answered on the proxy (8,192 positions) with no error; eval.py refuses the same."""
    from core_kv.models.loading import ContextWindowError
    from core_kv.pipeline import answer_questions

    model, tok = proxy
    with pytest.raises(ContextWindowError, match=r"needs \d+ tokens but the model's context window is 8192"):
        answer_questions(model, tok, "word " * 9000, ["What?"], max_new_tokens=2)


def test_a_negative_budget_in_a_jsonl_row_is_named_with_its_file(tmp_path):
    from core_kv.eval.benchmarks import BenchmarkConfig, JsonlSamples

    row = {"benchmark": "toy", "task": "t", "context": "c", "question": "q", "answer_prefix": "", "answers": ["a"],
           "max_new_tokens": 8, "metric": "string_match_all", "length": 10}  # fmt: skip
    for value, message in [
        (-3, r"max_new_tokens must be >= 1, got -3"),
        (0, r"max_new_tokens must be >= 1, got 0"),
        ("8", r"max_new_tokens must be an integer >= 1, got '8'"),
    ]:
        path = tmp_path / "rows.jsonl"
        path.write_text(json.dumps({**row, "max_new_tokens": 8}) + "\n" + json.dumps({**row, "max_new_tokens": value}))
        with pytest.raises(ValueError, match=f"{path}: record 2: {message}"):
            JsonlSamples().load(BenchmarkConfig(source=str(path)), None, 0)
    path.write_text(json.dumps({**row, "max_new_tokens": 8, "metric": "nope"}))
    with pytest.raises(ValueError, match=r"record 1: metric must be one of"):
        JsonlSamples().load(BenchmarkConfig(source=str(path)), None, 0)
    path.write_text(json.dumps({k: v for k, v in row.items() if k != "answers"}))
    with pytest.raises(ValueError, match=r"record 1: missing 1 required positional argument: 'answers'"):
        JsonlSamples().load(BenchmarkConfig(source=str(path)), None, 0)


# ------------------------------------------------------------------------------------------------------- loading
def test_a_missing_local_artifact_path_is_named_not_taken_for_a_hub_id(tmp_path):
    from core_kv.core_model import CoreModel

    for path in (tmp_path / "nope" / "final", "runs/nope/final"):
        with pytest.raises(FileNotFoundError, match=f"CORE artifact folder {path} does not exist"):
            CoreModel.from_pretrained(path)
    with pytest.raises(ValueError, match="is not a CORE artifact .*model_type 'llama'"):
        CoreModel.from_pretrained(ROOT / "checkpoints" / "proxy-lm")


def test_model_folders_without_a_tokenizer_or_with_broken_weights_are_named(tmp_path):
    from core_kv.models.loading import load_model

    src = ROOT / "checkpoints" / "proxy-lm"
    if not (src / "config.json").is_file():
        pytest.skip("the shipped proxy LM is not in this checkout")
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(src / name, bare / name)
    with pytest.raises(OSError, match=f"{bare} has no tokenizer files"):
        load_model(str(bare))
    with pytest.raises(OSError, match="is a CORE artifact, not a base model: .*build_press\\('core', checkpoint="):
        load_model(str(ROOT / "checkpoints" / "core-proxy" / "final"))
    truncated = tmp_path / "truncated"
    shutil.copytree(src, truncated)
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(OSError, match=f"{truncated / 'model.safetensors'}: unreadable weights file"):
        load_model(str(truncated))


# ------------------------------------------------------------------------------------------------ the folder lock
def test_a_second_writer_is_refused_and_a_stale_lock_replaced(tmp_path, capsys):
    from core_kv.lock import LOCK_NAME, FolderLocked, acquire, folder_lock

    with folder_lock(tmp_path, "training run") as path:
        owner = json.loads(path.read_text())
        assert owner["pid"] == os.getpid() and owner["what"] == "training run"
        with pytest.raises(FolderLocked, match=rf"being written by another training run \(pid {os.getpid()} on "):
            acquire(tmp_path)
    assert not (tmp_path / LOCK_NAME).exists()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": dead.pid, "host": os.uname().nodename, "what": "x"}))
    with folder_lock(tmp_path):  # the process is gone: stale, replaced with a message
        pass
    assert "removing the stale lock" in capsys.readouterr().err
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": 1, "host": "another-host", "what": "evaluation"}))
    with pytest.raises(FolderLocked, match=r"another evaluation \(pid 1 on another-host.*delete .*\.core_kv\.lock"):
        acquire(tmp_path)


# --------------------------------------------------------------------------------------------------- a full disk
def test_a_full_disk_while_writing_is_named(tmp_path, monkeypatch):
    from core_kv import files as io

    target = tmp_path / "state" / ".tmp-step_000002"
    with pytest.raises(OSError, match=rf"the disk is full: cannot write the training state {target}") as e:
        with io.writing(target, "training state"):
            raise OSError(errno.ENOSPC, "No space left on device")
    assert e.value.errno == errno.ENOSPC
    monkeypatch.setattr(io, "_free_bytes", lambda path: 1024)  # torch's writer says only "unexpected pos"
    with pytest.raises(OSError, match=r"the disk is full: .*1024 bytes free.*unexpected pos"):
        with io.writing(target, "training state"):
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")
    monkeypatch.setattr(io, "_free_bytes", lambda path: 10 * 2**30)
    with pytest.raises(RuntimeError, match="unrelated"):  # plenty of space: the error is not a full disk
        with io.writing(target, "training state"):
            raise RuntimeError("unrelated")


# ------------------------------------------------------------------- members of the same classes found by trying
def test_more_config_inputs_are_named():
    with pytest.raises(ConfigError, match=r"^invalid config for EvalConfig: press_options: .*a list where a mapping"):
        load_config(EvalConfig, ["press_options=[1]"])
    with pytest.raises(ConfigError, match=r"^model\.attn_implementation must be 'eager' for method 'h2o'"):
        load_config(EvalConfig, ["methods=[h2o]"])  # found at load, not after the model is loaded


def test_a_yaml_file_holding_one_value_is_named(tmp_path):
    path = tmp_path / "scalar.yaml"
    path.write_text("42\n")
    with pytest.raises(ConfigError, match=rf"config file {path}: the top level must be a mapping .*single value"):
        load_config(TrainConfig, [str(path)])


def test_numpy_scalars_are_the_numbers_they_hold():
    import numpy as np

    press = build_press("snapkv", budget=np.int64(64), window_size=np.int32(8))
    assert press.budget == 64 and type(press.budget) is int and type(press.window_size) is int
    assert build_press("knorm", compression_ratio=np.float32(0.5)).compression_ratio == 0.5


def test_a_file_where_a_folder_is_expected_is_named(tmp_path):
    from core_kv.core_model import CoreModel
    from core_kv.models.loading import load_model

    config = ROOT / "checkpoints" / "core-proxy" / "final" / "config.json"
    with pytest.raises(FileNotFoundError, match=rf"{config} is a file; a CORE artifact is a folder"):
        CoreModel.from_pretrained(config)
    with pytest.raises(OSError, match=r"it is a file; a model is a folder"):
        load_model(str(config))
    bad = tmp_path / "artifact"
    shutil.copytree(config.parent, bad)
    (bad / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=rf"{bad / 'config.json'}: not a CORE config \(a JSON object\), got a list"):
        CoreModel.from_pretrained(bad)


def test_a_folder_holding_another_writers_work_is_refused(tmp_path):
    """A teacher dataset as a training run's out_dir (or a run folder as eval's output_dir, ...): their config.yaml,
    report.md and metrics.json would overwrite each other."""
    from core_kv.lock import FolderLocked, acquire, release

    for marker, other, holds in [
        ("manifest.json", "training run", "a teacher dataset"),
        ("run.json", "evaluation", "a CORE training run"),
        ("results.json", "teacher run", "evaluation results"),
    ]:
        folder = tmp_path / marker
        folder.mkdir()
        (folder / marker).write_text("{}")
        with pytest.raises(FolderLocked, match=rf"{folder} holds {holds} \({marker}\); this {other} would overwrite"):
            acquire(folder, other)
    release(acquire(tmp_path / "manifest.json", "teacher run"))  # its own kind: fine


def test_every_atomic_write_names_a_full_disk(tmp_path, monkeypatch):
    from core_kv import files as io

    def full(tmp):
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match=rf"the disk is full: cannot write the file {tmp_path / 'x.json'}"):
        io.atomic_write(tmp_path / "x.json", full)
    assert list(tmp_path.iterdir()) == []  # no temporary file left


def test_one_press_on_two_models_at_once_is_refused(llama, qwen3):
    kn = build_press("knorm", compression_ratio=0.5)
    with kn(llama):
        with pytest.raises(ValueError, match="already installed on another model"):
            with kn(qwen3):
                pass
    with kn(qwen3):  # one after the other is fine
        pass
