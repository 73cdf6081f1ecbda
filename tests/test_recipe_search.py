"""The recipe search ``train.py`` runs when ``search.variants`` is set (issue 57, :mod:`core_kv.search`): on a tiny
random model, the contestants train in their own folders (round 1 short, the winner at the full schedule), the
contest follows the policy stage's rule on each contestant's recorded validation scores, the winner's weights become
the artifact with the search recorded, and a relaunch retrains nothing. The tiny model has no tokenizer, so its policy
stage is replaced by one that records known scores (the scores decide; the rule is the product's)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from core_kv.config import ConfigError, load_config
from core_kv.distill.config import TrainConfig
from tests.helpers import run, tiny_args

ROOT = Path(__file__).resolve().parents[1]
SEARCH = ("search.variants=[{teacher.lam: 3.0}]", "search.short={indexer.steps: 1, memory.steps: 0}")


def _record_scores(scores: dict[str, float]):
    """A stand-in for ``choose_policy``: records, in the contestant's artifact, validation scores of the paper's press
    at 0.75 and 0.9 (accuracy ``scores[folder name]``, log-prob -1; a second candidate scores lower), on one prompt
    set (the same hash for every contestant)."""
    from core_kv.eval.policy_stage import record
    from core_kv.policy import PAPER, Band, InferencePolicy, LengthBand, PolicyOptions

    other = PolicyOptions(memory=False)

    def stage(cfg, summary):
        acc = scores[Path(cfg.out_dir).name]
        rows = [{"label": PAPER.describe(), "options": PAPER.to_dict(), "accuracy": acc, "logprob": -1.0, "n": 8},
                {"label": other.describe(), "options": other.to_dict(), "accuracy": 0.0, "logprob": -2.0, "n": 8}]  # fmt: skip
        band = LengthBand(256, [Band(0.825, PAPER, 0.75), Band(1.0, PAPER, 0.9)], 0,
                          {"0.75": rows, "0.9": rows}, {"key": {"prompts": "0123456789abcdef"}})  # fmt: skip
        record(Path(cfg.out_dir) / "final", InferencePolicy([band]))
        return {**summary, "policy": "recorded"}

    return stage


def _policy(acc: float, prompts: str = "0123456789abcdef", ratios: tuple = (0.75, 0.9)):
    from core_kv.policy import PAPER, Band, InferencePolicy, LengthBand

    row = {"label": PAPER.describe(), "options": PAPER.to_dict(), "accuracy": acc, "logprob": -acc, "n": 8}
    bands = [Band(1.0 if i == len(ratios) - 1 else r + 0.01, PAPER, r) for i, r in enumerate(ratios)]
    return InferencePolicy([LengthBand(256, bands, 0, {str(r): [row] for r in ratios}, {"key": {"prompts": prompts}})])


def test_the_contest_averages_the_ratios_and_refuses_what_does_not_compare():
    from core_kv.eval.policy_stage import contest

    scores = contest([_policy(0.5), _policy(0.25)], [0.75, 0.9])
    assert [(s["accuracy"], s["logprob"], len(s["per_ratio"])) for s in scores] == [(0.5, -0.5, 2), (0.25, -0.25, 2)]
    assert contest([_policy(0.5)], [0.9])[0]["per_ratio"][0]["ratio"] == 0.9  # only the contest's ratios
    with pytest.raises(ValueError, match=r"at 256 tokens the artifacts were validated on different prompts"):
        contest([_policy(0.5), _policy(0.5, prompts="ffffffffffffffff")], [0.75])
    with pytest.raises(ValueError, match=r"ratios \[0\.9\] were not validated by every artifact"):
        contest([_policy(0.5), _policy(0.5, ratios=(0.75,))], [0.75, 0.9])


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    """A finished search (base vs λ = 3, the variant scoring higher) and the number of trainings it ran."""
    from core_kv import run as run_module
    from core_kv.distill.trainer import Trainer

    tmp = tmp_path_factory.mktemp("search")
    out, teacher = tmp / "run", tmp / "teacher"
    mp = pytest.MonkeyPatch()
    trained = []
    original = Trainer.run_stages
    mp.setattr(Trainer, "run_stages", lambda self, t0: trained.append(self.cfg.out_dir) or original(self, t0))
    mp.setattr(run_module, "choose_policy",
               _record_scores({"base": 0.25, "teacher.lam=3": 0.5, "teacher.lam=3-full": 0.75}))  # fmt: skip
    try:
        summary = run(tiny_args(out, teacher, *SEARCH))
        first = list(trained)
        trained.clear()
        again = run(tiny_args(out, teacher, *SEARCH))
    finally:
        mp.undo()
    return {"out": out, "teacher": teacher, "summary": summary, "again": again, "first": first, "relaunch": trained}


def test_the_winner_by_the_rule_becomes_the_artifact_with_the_search_recorded(searched):
    from core_kv.core_model import CoreModel

    out, root = searched["out"], searched["out"] / "search"
    assert searched["first"] == [str(root / "base"), str(root / "teacher.lam=3"), str(root / "teacher.lam=3-full")]
    weights = (out / "final" / "model.safetensors").read_bytes()
    assert weights == (root / "teacher.lam=3-full" / "final" / "model.safetensors").read_bytes()
    assert weights != (root / "base" / "final" / "model.safetensors").read_bytes()
    rec = json.loads((out / "final" / "config.json").read_text())["recipe_search"]
    assert rec["winner"] == "teacher.lam=3"
    assert rec["contestants"] == [{"label": "base", "overrides": {}},
                                  {"label": "teacher.lam=3", "overrides": {"teacher.lam": 3.0}}]  # fmt: skip
    assert [r["name"] for r in rec["rounds"]] == ["short", "full"]
    assert rec["rounds"][0]["ranking"] == ["teacher.lam=3", "base"]
    assert rec["rounds"][0]["scores"]["base"]["accuracy"] == 0.25  # the chosen composition: the paper's press
    assert [(x["ratio"], x["composition"]) for x in rec["rounds"][0]["scores"]["base"]["per_ratio"]] == [
        (0.75, "uniform, memory"), (0.9, "uniform, memory")]  # fmt: skip
    assert rec["rounds"][1]["scores"] == {"teacher.lam=3": {
        "accuracy": 0.75, "logprob": -1.0, "per_ratio": [
            {"length": 256, "ratio": r, "composition": "uniform, memory", "accuracy": 0.75, "logprob": -1.0, "n": 8}
            for r in (0.75, 0.9)]}}  # fmt: skip
    core = CoreModel.from_pretrained(out / "final")  # the record is checked at load
    assert core.config.teacher["lam"] == 3.0 and core.config.inference_policy["lengths"][0]["length"] == 256
    summary = json.loads((out / "summary.json").read_text())
    assert summary["recipe_search"] == rec and summary["artifact"] == str(out / "final")
    report = (out / "report.md").read_text()
    assert "## Recipe search" in report and "| short (indexer.steps=1, memory.steps=0) | base | the base config | " \
        "0.250 (-1.000) | 0.250 (-1.000) | 0.250 (-1.000) |" in report  # fmt: skip


def test_contestants_of_other_teacher_options_get_their_own_teacher_data(searched):
    teacher = searched["teacher"]
    lam = {p.name: json.loads((p / "manifest.json").read_text())["teacher"]["lam"]
           for p in teacher.parent.iterdir() if (p / "manifest.json").is_file()}  # fmt: skip
    assert lam == {"teacher": 2.0, "teacher-teacher.lam=3": 3.0}


def test_a_relaunch_retrains_no_finished_contestant(searched):
    assert searched["relaunch"] == []
    assert searched["again"]["recipe_search"] == searched["summary"]["recipe_search"]


def test_the_record_is_checked_at_load_naming_file_and_field(searched, tmp_path):
    from core_kv.core_model import CoreModel

    art = tmp_path / "final"
    shutil.copytree(searched["out"] / "final", art)
    cfg = json.loads((art / "config.json").read_text())
    cfg["recipe_search"]["rounds"][0]["scores"]["base"]["accuracy"] = 1.5
    (art / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=rf"{art}/config.json: recipe_search: rounds\[0\]\.scores\['base'\]\.accuracy "
                       r"must be in \[0, 1\], got 1\.5"):  # fmt: skip
        CoreModel.from_pretrained(art)
    cfg["recipe_search"]["rounds"][0]["scores"]["base"]["accuracy"] = 0.25
    cfg["recipe_search"]["winner"] = "base"  # not in the last round
    (art / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"recipe_search: winner 'base' is not a contestant of the last round"):
        CoreModel.from_pretrained(art)


def test_ties_go_to_the_base_and_a_finished_artifact_of_no_search_is_kept(tmp_path, monkeypatch):
    """Equal scores: the base wins (the earlier contestant). One round (no ``short``): every contestant trains at the
    full schedule in ``search/<label>``. A folder holding a plain run's artifact is refused before any training."""
    from core_kv import run as run_module

    out, teacher = tmp_path / "run", tmp_path / "teacher"
    monkeypatch.setattr(run_module, "choose_policy", _record_scores({"base": 0.5, "indexer.lr=0.002": 0.5}))
    summary = run(tiny_args(out, teacher, "search.variants=[{indexer.lr: 0.002}]", "indexer.steps=1",
                            "memory.steps=1"))  # fmt: skip
    rec = summary["recipe_search"]
    assert rec["winner"] == "base" and [r["name"] for r in rec["rounds"]] == ["full"]
    assert (out / "final" / "model.safetensors").read_bytes() == (
        out / "search" / "base" / "final" / "model.safetensors"
    ).read_bytes()
    assert not (out / "search" / "base-full").exists()
    plain = tmp_path / "plain"
    shutil.copytree(out / "search" / "base", plain)
    with pytest.raises(ValueError, match=r"holds a finished CORE artifact .* that no recipe search wrote.*overwrite"):
        run(tiny_args(plain, teacher, "search.variants=[{indexer.lr: 0.002}]", "indexer.steps=1", "memory.steps=1"))
    assert not (plain / "search").exists()


def test_keep_two_decides_again_at_the_full_schedule(tmp_path, monkeypatch):
    """``keep: 2``: both contestants go on to the full schedule and the second round decides: the variant led round 1,
    the base wins round 2, so the artifact is the base's full run."""
    from core_kv import run as run_module

    out = tmp_path / "run"
    scores = {"base": 0.25, "indexer.lr=0.002": 0.5, "base-full": 0.75, "indexer.lr=0.002-full": 0.5}
    monkeypatch.setattr(run_module, "choose_policy", _record_scores(scores))
    rec = run(tiny_args(out, tmp_path / "teacher", "search.variants=[{indexer.lr: 0.002}]", "search.keep=2",
                        "search.short={indexer.steps: 1}", "indexer.steps=2", "memory.steps=1"))["recipe_search"]  # fmt: skip
    assert [r["ranking"] for r in rec["rounds"]] == [["indexer.lr=0.002", "base"], ["base", "indexer.lr=0.002"]]
    assert rec["winner"] == "base"
    assert (out / "final" / "model.safetensors").read_bytes() == (
        out / "search" / "base-full" / "final" / "model.safetensors"
    ).read_bytes()


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ("search.variants=[{teacher.lamb: 4}]", r"search\.variants\[0\]: 'teacher\.lamb' is not an option: teacher has no 'lamb'"),
        ("search.variants=[{indexer.lr: 0.002}, {out_dir: x}]", r"search\.variants\[1\]: 'out_dir' is not an option a search varies"),
        ("search.variants=[{policy.per_task: 1}]", r"search\.variants\[0\]: 'policy\.per_task' is not an option a search varies"),
        ("search.variants=[{wandb_mode: online}]", r"search\.variants\[0\]: 'wandb_mode' is not an option a search varies"),
        ("search.variants=[{teacher.lam: -1}]", r"search\.variants\[0\]: teacher\.lam must be .*>= 0, got -1"),
        ("search.variants=[{teacher.lam.x: 1}]", r"search\.variants\[0\]: 'teacher\.lam\.x' is not an option: teacher\.lam is a value"),
        ("search.variants=[{teacher.model: {path: x}}]", r"search\.variants\[0\]: 'teacher\.model' is a section: give its options by dotted name"),
        ("search.variants=[{teacher.lam: abc}]", r"search\.variants\[0\]: teacher\.lam: Value 'abc'"),
        ("search.variants=[{}]", r"search\.variants\[0\]: empty; the base config is always a contestant"),
        ("search.variants=[{teacher.lam: 4}, {teacher.lam: 4.0}]", r"search\.variants\[1\] repeats search\.variants\[0\]"),
        ("search.short={search.keep: 2}", r"search\.short: 'search\.keep' is not an option a search varies"),
    ],
)  # fmt: skip
def test_bad_variants_are_refused_at_load_by_name(option, message):
    with pytest.raises(ConfigError, match=message):
        load_config(TrainConfig, ["search.variants=[{indexer.lr: 0.002}]", option])


def test_a_mapping_option_is_replaced_whole_not_merged():
    from core_kv.distill.config import overridden

    variant = 'search.variants=[{teacher.lam_layers: {"17": 8.0}}]'
    cfg = load_config(TrainConfig, ['teacher.lam_layers={"18-21": 32.0}', variant])
    label, overrides = cfg.search.contestants()[1]
    assert label == "teacher.lam_layers=17_8"
    assert overridden(cfg, overrides, "x").teacher.lam_layers == {"17": 8.0}
    assert cfg.teacher.lam_layers == {"18-21": 32.0}


def test_the_contest_needs_the_policy_stage_at_its_ratios():
    with pytest.raises(ConfigError, match=r"search\.variants: the contest is decided on the policy stage's validation "
                       r"scores: set policy\.enabled=true"):  # fmt: skip
        load_config(TrainConfig, ["search.variants=[{teacher.lam: 4}]", "policy.enabled=false"])
    with pytest.raises(ConfigError, match=r"search\.ratios \[0\.6\] are not validation ratios of the policy stage"):
        load_config(TrainConfig, ["search.variants=[{teacher.lam: 4}]", "search.ratios=[0.6]"])


def test_the_default_config_keeps_every_run_hash():
    """No search (the default) and a search alike leave the run and stage hashes as main computed them before the
    option existed (``Trainer.run_key`` with a fixed fingerprint), so finished runs stay recognised."""
    from core_kv.distill.trainer import Trainer, train_schema

    expected = {
        (): ("154429410f649a8b", {"indexer_warmup": "cf8743ab53f389b7", "indexer": "d7748c77ac79f0fa",
                                  "calibration": "eaa7d550b382e976", "memory": "8398d33ca350cdc8"}),
        ("configs/train/gemma3.yaml",): ("5bb023c29a48b4c9", {
            "indexer_warmup": "07afdf5929146ef8", "indexer": "0d6a26fc3d79e5fe", "calibration": "7e7c7f4e765c0f2f",
            "memory": "e7dcdf8911fc6e69"}),
    }  # fmt: skip
    for argv, (config_hash, stages) in expected.items():
        for extra in ([], ["search.variants=[{teacher.lam: 4}]"]):
            tr = Trainer.__new__(Trainer)
            tr.cfg = load_config(TrainConfig, [*(str(ROOT / a) for a in argv), *extra], resolve=train_schema)
            tr.fingerprint = {"layers": 2}
            key = tr.run_key()
            assert (key["config_hash"], key["stages"]) == (config_hash, stages), (argv, extra)


def test_the_gemma3_search_overlay_loads_and_names_its_contestants():
    """``configs/train/gemma3_search.yaml`` on ``gemma3.yaml``: λ = 8 (the base) against λ = 32 in layer 17, λ = 32
    and qa_weight 1.0 (docs/method.md's Gemma analysis), round 1 short, the winner alone at the full schedule; the
    base reuses gemma3.yaml's teacher data."""
    gemma = str(ROOT / "configs" / "train" / "gemma3.yaml")
    cfg = load_config(TrainConfig, [gemma, str(ROOT / "configs" / "train" / "gemma3_search.yaml")])
    assert [label for label, _ in cfg.search.contestants()] == [
        "base",
        "teacher.lam_layers=17_32",
        "teacher.lam=32",
        "teacher.qa_weight=1",
    ]
    assert cfg.teacher.lam == 8.0 and cfg.teacher.features == 2 and cfg.search.keep == 1 and cfg.search.short
    assert cfg.teacher.out_dir == load_config(TrainConfig, [gemma]).teacher.out_dir
    assert cfg.out_dir != load_config(TrainConfig, [gemma]).out_dir


def test_search_only_trains_the_named_contestants_and_the_search_then_retrains_none(tmp_path, monkeypatch):
    """``search.only``: one process per contestant trains round 1 side by side (each under its own folder's lock, not
    the search's), writes no artifact and decides nothing; the search launched afterwards retrains none of them. An
    unknown label, or ``only`` without a search, is refused at load by name."""
    from core_kv import run as run_module
    from core_kv.distill.trainer import Trainer

    out, teacher = tmp_path / "run", tmp_path / "teacher"
    trained = []
    original = Trainer.run_stages
    monkeypatch.setattr(Trainer, "run_stages", lambda self, t0: trained.append(self.cfg.out_dir) or original(self, t0))
    monkeypatch.setattr(run_module, "choose_policy", _record_scores({"base": 0.5, "teacher.lam=3": 0.25,
                                                                     "base-full": 0.5}))  # fmt: skip
    only = run(tiny_args(out, teacher, *SEARCH, "search.only=[teacher.lam=3]"))
    root = out / "search"
    assert trained == [str(root / "teacher.lam=3")]
    assert only["trained"] == {"teacher.lam=3": str(root / "teacher.lam=3")}
    assert (root / "teacher.lam=3" / "final" / "config.json").is_file()
    assert not (out / "final").exists() and not (out / "summary.json").exists() and not (root / "base").exists()
    trained.clear()
    summary = run(tiny_args(out, teacher, *SEARCH))
    assert trained == [str(root / "base"), str(root / "base-full")]  # the variant's round 1 was not retrained
    assert summary["recipe_search"]["winner"] == "base"
    assert summary["recipe_search"]["rounds"][0]["scores"]["teacher.lam=3"]["accuracy"] == 0.25
    with pytest.raises(ConfigError, match=r"search\.only: 'lam=3' is no contestant of this search \(its contestants: "
                       r"base, teacher\.lam=3\)"):  # fmt: skip
        load_config(TrainConfig, [*SEARCH, "search.only=[lam=3]"])
    with pytest.raises(ConfigError, match=r"search\.only names contestants of a recipe search: set search\.variants"):
        load_config(TrainConfig, ["search.only=[base]"])
