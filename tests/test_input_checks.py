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


# ------------------------------------------------------------------------- issue 60: the policy record, one field each
def _with_policy(tmp_path: Path, edit) -> Path:
    """A copy of the shipped proxy artifact (4 layers) whose ``config.json`` policy record ``edit`` changed."""
    art = tmp_path / "final"
    shutil.copytree(ROOT / "checkpoints" / "core-proxy" / "final", art)
    config = json.loads((art / "config.json").read_text())
    edit(config["inference_policy"])
    (art / "config.json").write_text(json.dumps(config))
    return art


def _set(path: str, value):
    """An edit setting the field at ``path`` (``bands/0/upto``) of the record; ``DELETE`` removes it."""

    def edit(record):
        *head, last = [int(p) if p.isdigit() else p for p in path.split("/")]
        for p in head:
            record = record[p]
        if value is DELETE:
            del record[last]
        else:
            record[last] = value

    return edit


DELETE = object()
RECORD_CASES = [
    ("bands/0/upto", "abc", r"bands\[0\]\.upto \(a compression ratio\) must be a finite number, got 'abc'"),
    ("bands/0/upto", float("nan"), r"bands\[0\]\.upto \(a compression ratio\) must be a finite number, got nan"),
    ("bands/0/upto", -0.2, r"bands\[0\]\.upto \(a compression ratio\) must be in \(0, 1\], got -0\.2"),
    ("bands/2/upto", 1.5, r"bands\[2\]\.upto \(a compression ratio\) must be in \(0, 1\], got 1\.5"),
    ("bands/1/upto", 0.5, r"bands: must be in ascending order of 'upto', got \[0\.625, 0\.5, 1\.0\]"),
    ("bands/0/upto", True, r"bands\[0\]\.upto \(a compression ratio\) must be a finite number, got True"),
    ("bands/0/validated_at", "0.5", r"bands\[0\]\.validated_at \(a compression ratio\) must be a finite number"),
    ("bands/0/validated_at", 1.0, r"bands\[0\]\.validated_at \(a compression ratio\) must be in \(0, 1\)"),
    ("bands/0/options", DELETE, r"bands\[0\] has no \['options'\] field"),
    ("bands/0/extra", 1, r"bands\[0\] has unknown field\(s\) \['extra'\]"),
    (
        "bands/0/options/memory",
        "0-99",
        r"bands\[0\]\.options: memory '0-99' names layers \[4, .*\] but the model has 4 "
        r"layers \(0-3\)",
    ),  # fmt: skip
    ("bands/0/options/memory", "x", r"bands\[0\]\.options: memory expects layer ranges"),
    ("bands/0/options/head_budgets", "all", r"bands\[0\]\.options: head_budgets must be one of"),
    ("bands/0/options/repair_threshold", "high", r"bands\[0\]\.options: repair_threshold must be a number"),
    ("bands/0/options/colour", "red", r"bands\[0\]\.options: unknown policy option\(s\) \['colour'\]"),
    ("bands/0/options", [1], r"bands\[0\]\.options: policy options must be a mapping"),
    ("bands", {}, r"bands must be a list of bands"),
    ("bands", [], r"bands: an inference policy needs at least one band"),
    ("bands/0", 0.5, r"bands\[0\] must be a mapping \(upto, validated_at, options\)"),
    ("default_band", "x", r"default_band must be the index of a band \(an integer\), got 'x'"),
    ("default_band", 1.7, r"default_band must be the index of a band \(an integer\), got 1\.7"),
    ("default_band", True, r"default_band must be the index of a band \(an integer\), got True"),
    ("default_band", 3, r"default_band 3 is not one of the 3 bands \(0-2\)"),
    ("default_band", -1, r"default_band -1 is not one of the 3 bands"),
    ("version", 3, r"version 3, this code reads v1 and v2"),
    ("version", DELETE, r"version None, this code reads v1 and v2"),
    ("lengths", [], r"unknown field\(s\) \['lengths'\]; a v1 policy records"),
    ("validation/context_tokens", "2k", r"validation\.context_tokens must be a positive number of tokens, got '2k'"),
    ("validation/context_tokens", 0, r"validation\.context_tokens must be a positive number of tokens, got 0"),
    ("colour", "red", r"unknown field\(s\) \['colour'\]"),
    ("candidates", [], r"candidates must be a mapping of ratios to scored candidates"),
    ("candidates/abc", [], r"candidates: key 'abc' is not a compression ratio in \(0, 1\)"),
    ("candidates/0.5", {}, r"candidates\['0\.5'\] must be a list of scored candidates"),
    ("candidates/0.5/0/accuracy", float("nan"), r"candidates\['0\.5'\]\[0\]\.accuracy must be a finite number"),
    ("candidates/0.5/0/accuracy", 1.5, r"candidates\['0\.5'\]\[0\]\.accuracy must be in \[0, 1\], got 1\.5"),
    ("candidates/0.5/0/logprob", "low", r"candidates\['0\.5'\]\[0\]\.logprob must be a finite number"),
    ("candidates/0.5/0/label", DELETE, r"candidates\['0\.5'\]\[0\]: no 'label' field"),
    ("candidates/0.5/0/options/memory", "0-9", r"candidates\['0\.5'\]\[0\]\.options: memory"),
    ("validation", [], r"validation must be a mapping"),
]


# a version-2 record (issue 56: one length band per validated length): the shipped record at 512 and 2048 tokens
V2_CASES = [
    ("lengths/1/length", "2k", r"lengths\[1\]\.length must be a positive number of context tokens, got '2k'"),
    ("lengths/1/length", 0, r"lengths\[1\]\.length must be a positive number of context tokens, got 0"),
    ("lengths/1/length", True, r"lengths\[1\]\.length must be a positive number of context tokens, got True"),
    ("lengths/1/length", 512, r"lengths: must be in ascending order of 'length', no two equal, got \[512, 512\]"),
    ("lengths/0/length", 4096, r"lengths: must be in ascending order of 'length', no two equal, got \[4096, 2048\]"),
    ("lengths/1/length", None, r"lengths: a policy of several length bands records each one's length"),
    ("lengths/0/length", DELETE, r"lengths\[0\] has no 'length' field"),
    ("lengths/0/colour", "red", r"lengths\[0\] has unknown field\(s\) \['colour'\]; a length band records"),
    ("lengths/0", 512, r"lengths\[0\] must be a mapping \(length, bands, default_band, candidates, validation\)"),
    ("lengths", {}, r"lengths must be a list of length bands"),
    ("lengths", [], r"lengths: an inference policy needs at least one length band"),
    ("lengths", DELETE, r"no 'lengths' field"),
    ("bands", [], r"unknown field\(s\) \['bands'\]; a v2 policy records \['lengths', 'version'\]"),
    (
        "lengths/1/bands/0/upto",
        "abc",
        r"lengths\[1\]\.bands\[0\]\.upto \(a compression ratio\) must be a finite number",
    ),
    ("lengths/1/bands/1/upto", 0.5, r"lengths\[1\]\.bands: must be in ascending order of 'upto'"),
    ("lengths/1/bands/0/options/colour", "red", r"lengths\[1\]\.bands\[0\]\.options: unknown policy option"),
    ("lengths/1/bands/0/extra", 1, r"lengths\[1\]\.bands\[0\] has unknown field\(s\) \['extra'\]"),
    ("lengths/1/bands/0/options/memory", "0-99", r"lengths\[1\]\.bands\[0\]\.options: memory '0-99' names layers"),
    ("lengths/1/bands", DELETE, r"no 'lengths\[1\]\.bands' field"),
    ("lengths/0/default_band", 3, r"lengths\[0\]\.default_band 3 is not one of the 3 bands"),
    ("lengths/1/candidates/abc", [], r"lengths\[1\]\.candidates: key 'abc' is not a compression ratio"),
    ("lengths/1/candidates/0.5/0/options/memory", "0-9", r"lengths\[1\]\.candidates\['0\.5'\]\[0\]\.options: memory"),
    ("lengths/0/validation", [], r"lengths\[0\]\.validation must be a mapping"),
]


def _two_lengths(edit):
    """An edit of the shipped (version-1) record rewritten as a version-2 one validated at 512 and 2048 tokens."""
    from dataclasses import replace

    from core_kv.policy import InferencePolicy

    def v2(record):
        one = InferencePolicy.from_dict(dict(record)).lengths[0]
        record.clear()
        record.update(json.loads(json.dumps(InferencePolicy([one, replace(one, length=2048)]).to_dict())))
        edit(record)

    return v2


@pytest.mark.parametrize(
    "version, field, value, message",
    [(1, *c) for c in RECORD_CASES] + [(2, *c) for c in V2_CASES],
    ids=[f"v1:{c[0]}={c[1]!r}" for c in RECORD_CASES] + [f"v2:{c[0]}={c[1]!r}" for c in V2_CASES],
)
def test_every_field_of_a_damaged_policy_record_is_named_with_its_file(tmp_path, version, field, value, message):
    """``upto: "abc"`` gave ``could not convert string to float`` (no file, no field); NaN passed the order check; a
    negative edge, ``default_band: 1.7`` (truncated) and memory in layers the model lacks were accepted. Version 2
    (a length band per validated length) names the length band's index with the field."""
    from core_kv.core_model import CoreModel

    edit = _set(field, value)
    art = _with_policy(tmp_path, edit if version == 1 else _two_lengths(edit))
    with pytest.raises(ValueError, match=rf"{art / 'config.json'}: inference_policy: {message}"):
        CoreModel.from_pretrained(art)


def test_the_undamaged_two_length_record_loads():
    """The version-2 rewrite the damage cases start from is itself valid, and round-trips."""
    from core_kv.policy import InferencePolicy

    record = json.loads((ROOT / "checkpoints" / "core-proxy" / "final" / "config.json").read_text())["inference_policy"]
    _two_lengths(lambda r: None)(record)
    policy = InferencePolicy.from_dict(record)
    assert policy.validated_lengths == [512, 2048] and policy.to_dict() == record


def test_a_memory_layer_list_beyond_the_model_is_named_as_a_candidate_and_as_a_press_override():
    from core_kv.policy import PolicyStageConfig

    art = str(ROOT / "checkpoints" / "core-proxy" / "final")
    with pytest.raises(ValueError, match=r"core: .*core-proxy/final: memory '2-7' names layers \[4, 5, 6, 7\] but the "
                                         r"model has 4 layers \(0-3\)"):  # fmt: skip
        build_press("core", checkpoint=art, compression_ratio=0.5, memory="2-7")
    assert build_press("core", checkpoint=art, compression_ratio=0.5, memory="2-3").options.memory == "2-3"
    stage = PolicyStageConfig(candidates=[{}, {"memory": "0-3"}, {"memory": "1,9"}])
    stage.check()  # the model is not known at config load
    with pytest.raises(
        ValueError, match=r"policy\.candidates\[2\]: memory '1,9' names layers \[9\] but the model has 4"
    ):
        stage.check_layers(4)


@pytest.mark.parametrize(
    "candidates, message",
    [
        (
            [{}, {"memory": False}, {"memory": False}],
            r"candidates\[2\] repeats candidates\[1\] \(uniform, memory off\)",
        ),
        ([{}, {"memory": True}], r"candidates\[1\] repeats candidates\[0\] \(uniform, memory\)"),
        (
            [{"head_budgets": "adaptive"}, {"head_budgets": "adaptive", "head_pool": "score", "alpha_safeguard": 0.2}],
            r"candidates\[1\] repeats candidates\[0\]",
        ),  # fmt: skip
    ],
)
def test_a_duplicate_policy_candidate_is_refused(candidates, message):
    """A duplicate entry was accepted and scored twice."""
    with pytest.raises(ValueError, match=rf"^policy\.{message}"):
        load_config(TrainConfig, [f"policy.candidates={json.dumps(candidates)}"])


# ------------------------------------------------------------- issue 60: artifacts, model folders, labels, partials
def test_an_artifact_config_without_feature_spec_is_refused_naming_the_field(tmp_path):
    """It loaded silently as spec v1; a genuine v1 artifact records its version."""
    from core_kv.core_model import CoreModel

    art = tmp_path / "final"
    shutil.copytree(ROOT / "checkpoints" / "core-proxy" / "final", art)
    config = json.loads((art / "config.json").read_text())
    assert config["feature_spec"]["version"] == 1  # the shipped v1 artifact records its version, and loads
    CoreModel.from_pretrained(art)
    for bad in (DELETE, "v1", {"names": []}):
        if bad is DELETE:
            config.pop("feature_spec")
        else:
            config["feature_spec"] = bad
        (art / "config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError, match=rf"{art / 'config.json'}: no feature_spec field with a version"):
            CoreModel.from_pretrained(art)


def test_a_model_folder_missing_only_tokenizer_json_or_holding_a_damaged_one_names_the_file(tmp_path):
    """``Couldn't instantiate the backend tokenizer ... sentencepiece or tiktoken`` and a bare ``JSONDecodeError``
    named no file."""
    from core_kv.models.loading import load_model

    folder = tmp_path / "lm"
    shutil.copytree(ROOT / "checkpoints" / "proxy-lm", folder)
    assert (folder / "tokenizer_config.json").is_file()
    good = (folder / "tokenizer.json").read_bytes()
    (folder / "tokenizer.json").unlink()
    with pytest.raises(OSError, match=rf"^{folder / 'tokenizer.json'} is missing: {folder} holds tokenizer_config"):
        load_model(str(folder))
    (folder / "tokenizer.json").write_bytes(b"\0" * len(good))
    with pytest.raises(OSError, match=rf"^{folder / 'tokenizer.json'}: unreadable tokenizer file \(JSONDecodeError"):
        load_model(str(folder))
    (folder / "tokenizer.json").write_bytes(good)
    (folder / "tokenizer_config.json").write_text("{")
    with pytest.raises(OSError, match=rf"^{folder / 'tokenizer_config.json'}: unreadable tokenizer file"):
        load_model(str(folder))


def test_a_tokenizer_of_another_model_is_named_before_the_first_forward():
    """The proxy LM with a larger tokenizer failed with ``IndexError: index out of range in self`` in the embedding."""
    from transformers import AutoTokenizer

    from core_kv.models.loading import check_vocabulary, tiny_model, tiny_tokenizer

    proxy_tok = AutoTokenizer.from_pretrained(ROOT / "checkpoints" / "proxy-lm")
    small = tiny_model(tiny_tokenizer())  # 2,048 ids
    with pytest.raises(ValueError, match=rf"^teacher\.model x: the tokenizer has {proxy_tok.vocab_size:,} ids but the "
                                         r"model's embedding only 2,048 rows"):  # fmt: skip
        check_vocabulary(small, proxy_tok, "teacher.model x")
    check_vocabulary(small, tiny_tokenizer())


def test_a_proxy_lm_with_smollm2s_tokenizer_names_18880_vs_49152_ids(tmp_path):
    """The issue's case end to end: the teacher run refuses before its first forward."""
    from core_kv.models.packaged import PackagedModelError, ensure_converted
    from core_kv.teacher.config import DataSpec, ModelSpec
    from core_kv.teacher.run import run_teacher

    try:
        smollm2 = ensure_converted("smollm2-135m", progress=False)
    except PackagedModelError as e:
        pytest.skip(str(e))
    cfg = TeacherConfig(out_dir=str(tmp_path / "t"), progress=False, data=DataSpec(source="random", num_docs=1),
                        model=ModelSpec(path="checkpoints/proxy-lm", tokenizer=str(smollm2)))  # fmt: skip
    with pytest.raises(ValueError, match=r"the tokenizer has 49,152 ids but the model's embedding only 18,880 rows"):
        run_teacher(cfg)


@pytest.mark.parametrize("label", ["a/b", "../escape", "..", ".hidden", "a\\b", "x\ny"])
def test_a_method_or_benchmark_label_that_is_not_a_folder_name_is_refused(tmp_path, label):
    """``a/b`` wrote a nested results folder (``niah__proxy-lm__a/b__0.50``), ``../escape`` one outside the root."""
    from core_kv.eval.schema import cell_dir

    with pytest.raises(ConfigError, match=r"^methods: the label .* becomes a results folder's name, but"):
        load_config(EvalConfig, [f"output_dir={tmp_path}", f"methods={json.dumps([label])}",
                                 f"press_options={json.dumps({label: {'kind': 'knorm'}})}"])  # fmt: skip
    with pytest.raises(ConfigError, match=r"^benchmarks: the label .* becomes a results folder's name"):
        load_config(EvalConfig, [f"output_dir={tmp_path}", f"benchmarks={json.dumps([label])}"])
    with pytest.raises(ValueError, match=r"^method label .* names a results folder, but"):
        cell_dir(tmp_path, "niah", "tiny", label, 0.5)
    assert list(tmp_path.iterdir()) == []  # nothing written
    assert cell_dir(tmp_path, "niah", "tiny", "core:paper", 0.5).parent == tmp_path


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"group": 0}', r"expected \{'group': \.\.\., 'rows': \[\.\.\.\]\}"),
        ('{"group": "0", "rows": []}', r"'group' must be an integer and 'rows' a list"),
        ('{"group": 0, "rows": [{"sample_id": 0}]}', r"row 0 lacks the field\(s\) \['group_id', 'benchmark', 'task'"),
        ("[1, 2]", r"expected \{'group'"),
    ],
)
def test_a_partial_results_line_lacking_fields_names_the_file_and_line(tmp_path, line, message):
    """A valid JSON line without ``task`` raised ``KeyError: 'task'`` naming no file."""
    from core_kv.eval.runner import ROW_FIELDS, _read_partials

    row = dict.fromkeys(ROW_FIELDS, 0)
    path = tmp_path / "predictions.partial.rank0.jsonl"
    path.write_text(json.dumps({"group": 3, "rows": [row]}) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=rf"^{path}:2: {message}"):
        _read_partials(tmp_path)
    path.write_text(json.dumps({"group": 3, "rows": [row]}) + "\n")
    assert _read_partials(tmp_path) == {3: [row]}


# ----------------------------------------------------------------------------- issue 60: modes of the files written
@pytest.mark.parametrize("mask", [0o022, 0o027, 0o077])
def test_atomic_writes_get_the_mode_a_plain_write_gets(tmp_path, mask):
    """Under umask 022 every atomically written file was 0600: another user could not load an artifact or read
    results."""
    from core_kv import files as io
    from core_kv.lock import folder_lock

    old = os.umask(mask)
    try:
        plain = tmp_path / "plain.txt"
        plain.write_text("x")
        written = [io.atomic_write_text(tmp_path / "a.txt", "x"), io.atomic_write_json(tmp_path / "b.json", {}),
                   io.atomic_write_jsonl(tmp_path / "c.jsonl", [{}]),
                   io.atomic_write(tmp_path / "d.bin", lambda t: Path(t).write_bytes(b"1"))]  # fmt: skip
        with folder_lock(tmp_path / "run") as lock:
            written.append(lock)
            for p in written:
                assert (p.stat().st_mode & 0o777) == (plain.stat().st_mode & 0o777) == 0o666 & ~mask, p
        import safetensors.torch

        folder = tmp_path / "saved"
        folder.mkdir()
        safetensors.torch.save_file({"x": torch.zeros(1)}, str(folder / "model.safetensors"))
        io.plain_modes(folder)
        assert (folder / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~mask
        assert folder.stat().st_mode & 0o777 == 0o777 & ~mask
    finally:
        os.umask(old)


def test_a_folder_swapped_in_is_never_missing_and_an_interruption_keeps_the_old_one(tmp_path, monkeypatch):
    """``swap_in`` (trainer artifacts, recipe-search winners, training states, the proxy's checkpoints): the old
    folder is renamed aside, never deleted before the new one is in place; the new one gets plain modes."""
    from core_kv import files as io

    final, tmp = tmp_path / "final", tmp_path / ".tmp-final"
    final.mkdir()
    (final / "w").write_text("old")
    tmp.mkdir(mode=0o700)
    (tmp / "w").write_text("new")
    os.chmod(tmp / "w", 0o600)
    real, calls = os.replace, []

    def interrupted(src, dst):  # the second rename (tmp -> final) never happens
        calls.append((Path(src).name, Path(dst).name))
        if len(calls) == 2:
            raise KeyboardInterrupt
        real(src, dst)

    monkeypatch.setattr(io.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        io.swap_in(tmp, final)
    assert calls == [("final", "final.old"), (".tmp-final", "final")]
    assert (tmp_path / "final.old" / "w").read_text() == "old" and (tmp / "w").read_text() == "new"
    monkeypatch.setattr(io.os, "replace", real)
    (tmp_path / "final.old").rename(final)
    assert io.swap_in(tmp, final, old=tmp_path / ".aside") == final
    assert (final / "w").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]
    mask = io.umask()
    assert (final / "w").stat().st_mode & 0o777 == 0o666 & ~mask and final.stat().st_mode & 0o777 == 0o777 & ~mask
