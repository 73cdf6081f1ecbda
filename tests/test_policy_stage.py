"""The policy stage (issue 43 item 3): it chooses an artifact's inference policy on the pipeline's own validation
prompts — never on an evaluation context — records the policy with every candidate's scores in the artifact, and
``build_press("core", checkpoint=...)`` applies it per ratio, an explicit option overriding it visibly."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import core_kv.eval.policy_stage as stage
from core_kv.core_model import CoreModel
from core_kv.eval import needles, ruler, validation
from core_kv.policy import (
    PAPER,
    InferencePolicy,
    LengthBand,
    PolicyOptions,
    PolicyStageConfig,
    bands_from_choices,
    candidate_grid,
    complexity,
    serving_cost,
)
from core_kv.presses import build_press

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ROOT / "checkpoints" / "proxy-lm")


@pytest.fixture(scope="module")
def llama():  # the proxy LM (its tokenizer's vocabulary), with the shipped proxy artifact
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(ROOT / "checkpoints" / "proxy-lm").eval()


@pytest.fixture(scope="module")
def artifact():
    return ROOT / "checkpoints" / "core-proxy" / "final"


SMALL = dict(ratios=[0.5, 0.9], lengths=[160], per_task=1,
             candidates=[{}, {"memory": False}, {"head_budgets": "adaptive", "memory": False}])  # fmt: skip


def test_policy_stage_reads_no_evaluation_context(monkeypatch, tmp_path, artifact, llama, tok):
    """Every loader of an evaluation set (RULER, NIAH, LongBench, LooGLE, the held-out needle prompts) and the essays
    (RULER's and NIAH's haystack) raise if called: the stage still runs to a recorded policy."""
    import shutil

    from core_kv import corpus
    from core_kv.eval import longbench, loogle, niah

    def forbidden(*args, **kwargs):
        raise AssertionError("the policy stage read an evaluation source")

    for module in (ruler, niah, longbench, loogle, needles):
        for name, fn in vars(module).items():
            if callable(fn) and getattr(fn, "__module__", None) == module.__name__ and not isinstance(fn, type):
                monkeypatch.setattr(module, name, forbidden)
    for name in ("essays_text", "essay_files", "essay", "essay_dir"):
        monkeypatch.setattr(corpus, name, forbidden)
    art = tmp_path / "final"
    shutil.copytree(artifact, art)
    policy = stage.run_policy_stage(PolicyStageConfig(**SMALL), art, llama, tok, tmp_path / "work", progress=False)
    recorded = json.loads((art / "config.json").read_text())["inference_policy"]
    assert InferencePolicy.from_dict(recorded).to_dict() == policy.to_dict()
    assert recorded["version"] == 2 and [lb["length"] for lb in recorded["lengths"]] == [160]
    (band,) = recorded["lengths"]
    assert set(band["candidates"]) == {"0.5", "0.9"}
    assert all(len(rows) == 3 for rows in band["candidates"].values())
    v = band["validation"]
    assert v["generator"] == "core_kv.eval.validation" and v["seed"] >= validation.MIN_SEED and "full_cache" in v


def test_validation_templates_share_nothing_with_the_evaluation_templates():
    """No sentence of a validation template (needles, questions, answer prefixes, filler) appears in RULER's templates
    or the held-out needle wordings, and the keys have another form."""
    ours = [validation.NEEDLE, validation.NEEDLE_MULTI, validation.QUESTION, validation.QUESTION_MULTI,
            validation.PREFIX, validation.PREFIX_MULTI]  # fmt: skip
    theirs = " ".join(
        [ruler.NEEDLE, ruler.NOISE, *["".join(t) for t in ruler.TEMPLATES.values()]]
        + [x for w in needles.WORDINGS.values() for x in w]
    ).lower()
    stem = lambda s: re.sub(r"\{[a-z0-9_]+\}", "", s).lower().strip(" .:?")  # noqa: E731
    for template in ours:
        for part in re.split(r"[.:?]", stem(template)):
            part = part.strip()
            if len(part.split()) >= 3:
                assert part not in theirs, (template, part)
    for sentence in filter(None, (x.strip(". ").lower() for x in validation.FILLER.split(". "))):
        assert sentence not in theirs
    from core_kv.corpus import essays_text

    essays = re.sub(r"\s+", " ", essays_text())
    prose = validation.prose_sentences()
    assert len(prose) > 800 and not any(s in essays for s in prose[::50])  # the prose is not the essays'
    assert not any(re.search(r"[={}\[\]#_*]|\(\)", s) for s in prose)  # no code


def test_validation_prompts_are_deterministic_and_sized(tok):
    a = validation.validation_set(tok, validation.VALIDATION_TASKS, 300, 2, 1000)
    b = validation.validation_set(tok, validation.VALIDATION_TASKS, 300, 2, 1000)
    assert a == b and len(a) == 8
    assert a != validation.validation_set(tok, validation.VALIDATION_TASKS, 300, 2, 1001)
    for p in a:
        n = len(tok.encode(p.context, add_special_tokens=False))
        assert 150 <= n <= 300, (p.task, n)
        assert p.answer.strip(" .").split(" and ")[0] in p.context
        assert re.fullmatch(r"[a-z]+-\d{3}", p.question.split(" of ")[-1].rstrip("?"))
    multi = [p for p in a if p.task == "multivalue_noise"][0]
    v1, v2 = multi.answer.strip(" .").split(" and ")
    assert multi.context.index(v1) < multi.context.index(v2)  # the answer lists the values in reading order


@pytest.mark.parametrize("seed", [7, 42, 46, 999, -1])
def test_evaluation_seeds_are_refused(seed, tok):
    with pytest.raises(ValueError, match="seed"):
        validation.build(tok, "single_noise", 200, 1, seed)
    with pytest.raises(ValueError, match="policy.seed"):
        PolicyStageConfig(seed=seed).check()


def test_choice_is_the_cheapest_within_one_standard_error():
    a, b = PAPER, PolicyOptions(memory=False)
    c = PolicyOptions(head_budgets="adaptive", head_pool="output", memory=False)
    d = PolicyOptions(head_budgets="shared", memory=False)
    assert [serving_cost(o) for o in (a, b, c, d)] == [2, 0, 1, 0]
    s = lambda acc, lp, n=16: {"accuracy": acc, "logprob": lp, "n": n}  # noqa: E731
    # se of 10/16 = sqrt(0.625 * 0.375 / 16) = 0.121: 9/16 is within it, 8/16 is not
    assert stage.choose([(a, s(10 / 16, -0.3)), (c, s(9 / 16, -0.3)), (b, s(8 / 16, -0.1))]) == c
    # cost before log-prob
    assert stage.choose([(a, s(10 / 16, -0.3)), (c, s(9 / 16, -0.3)), (d, s(9 / 16, -0.9))]) == d
    assert stage.choose([(a, s(10 / 16, -0.3)), (c, s(8 / 16, -0.3))]) == a  # two prompts behind: not tied
    # more prompts narrow the tie: at n = 160, se = 0.038 and 0.55 is beyond it
    assert stage.choose([(a, s(0.625, -0.3, 160)), (c, s(0.55, -0.3, 160))]) == a
    # equally cheap: accuracy, then log-prob, then the fewest changes to the paper's press
    assert stage.choose([(d, s(9 / 16, -0.3)), (b, s(10 / 16, -0.9))]) == b
    assert stage.choose([(d, s(0.5, -1.0)), (b, s(0.5, -0.5))]) == b
    assert stage.choose([(d, s(0.5, -1.0)), (b, s(0.5, -1.0))]) == b
    # all correct: se = 0, only the best are tied
    assert stage.choose([(a, s(1.0, -0.3)), (b, s(15 / 16, -0.1))]) == a
    # no prompt answered: the log-prob, then the fewest changes (the old rule without accuracy)
    assert stage.choose([(b, s(0.0, -1.0)), (c, s(0.0, -2.0))]) == b
    assert stage.choose([(c, s(0.0, -1.0)), (b, s(0.0, -1.0)), (a, s(0.0, -1.0))]) == a


def _naive_choose(results):
    """The rule written out candidate by candidate (the reference for the property test)."""
    top = max(r["accuracy"] for _, r in results)
    if top == 0:
        ranked = sorted(results, key=lambda x: (-x[1]["logprob"], complexity(x[0])))
        return ranked[0][0]
    n = next(r["n"] for _, r in results if r["accuracy"] == top)
    width = (top * (1 - top) / n) ** 0.5
    tied = []
    for o, r in results:
        if top - r["accuracy"] <= width + 1e-9:
            tied.append((o, r))
    tied.sort(key=lambda x: (serving_cost(x[0]), -x[1]["accuracy"], -x[1]["logprob"], complexity(x[0])))
    return tied[0][0]


@pytest.mark.parametrize("seed", range(20))
def test_choice_matches_a_naive_reference(seed):
    import random

    rng = random.Random(seed)
    grid = PolicyStageConfig().candidate_options()
    n = rng.choice([8, 12, 16, 24])
    results = [(o, {"accuracy": rng.randint(0, n) / n if seed % 5 else 0.0, "logprob": -rng.randint(1, 9) / 4, "n": n})
               for o in rng.sample(grid, len(grid))]  # fmt: skip
    assert stage.choose(results) == _naive_choose(results)


def test_bands_split_halfway_and_the_press_applies_them(tmp_path, artifact):
    import shutil

    choices = {0.5: PolicyOptions(head_budgets="adaptive", head_pool="output", memory=False),
               0.75: PolicyOptions(memory=False),
               0.9: PolicyOptions(head_budgets="adaptive", repair=True, memory="0-1")}  # fmt: skip
    bands = bands_from_choices(choices)
    assert [b.upto for b in bands] == [0.625, 0.825, 1.0]
    art = tmp_path / "final"
    shutil.copytree(artifact, art)
    stage.record(art, InferencePolicy([LengthBand(512, bands, 1)]))
    for ratio, want in ((0.3, choices[0.5]), (0.625, choices[0.5]), (0.7, choices[0.75]), (0.95, choices[0.9])):
        press = build_press("core", checkpoint=str(art), compression_ratio=ratio)
        assert press.options == want and press.overrides() == {}
        assert want.describe() in repr(press)
    assert build_press("core", checkpoint=str(art), budget=100).options == choices[0.75]  # the default band
    paper = build_press("core", checkpoint=str(art), compression_ratio=0.7, policy="paper")
    assert paper.options == PAPER and paper.memory_press is not None
    over = build_press("core", checkpoint=str(art), compression_ratio=0.95, repair=False)
    assert over.options.repair is False and over.options.head_budgets == "adaptive"
    assert "overrides={'repair': False}" in repr(over)
    cfg = over.config_dict()
    assert cfg["overrides"] == {"repair": False} and cfg["applied"]["memory"] == "0-1"
    assert over.memory_press.layers == "0-1" and over.memory_press.active(1) and not over.memory_press.active(2)


def test_stage_resumes_from_its_cached_scores_and_refreshes_them_for_new_weights(monkeypatch, tmp_path, artifact,
                                                                                   llama, tok, capsys):  # fmt: skip
    import shutil

    art = tmp_path / "final"
    shutil.copytree(artifact, art)
    cfg = PolicyStageConfig(**{**SMALL, "candidates": [{}, {"memory": False}]})
    calls = []
    real = stage.score_prompt
    monkeypatch.setattr(stage, "score_prompt", lambda *a: calls.append(1) or real(*a))
    first = stage.run_policy_stage(cfg, art, llama, tok, tmp_path / "work", progress=False)
    n = len(calls)
    assert n == 4 * (1 + 2 * 2)  # 4 prompts x (full cache + 2 ratios x 2 candidates)
    out = capsys.readouterr().out  # the stage's size up front, then the estimate from its first prompt
    size = "[policy] 4 prompts of 160 tokens x (1 full cache + 2 ratios x 2 candidates) = 20 prefills"
    assert f"{size}; 20 still to run" in out
    assert re.search(r"\[policy\] [\d.]+ s per prompt: about [\d.]+ min for the 20 to run", out), out
    second = stage.run_policy_stage(cfg, art, llama, tok, tmp_path / "work", progress=False)
    assert len(calls) == n and second.lengths[0].candidates == first.lengths[0].candidates  # all from the cache
    assert "= 20 prefills; 0 still to run" in capsys.readouterr().out
    more = PolicyStageConfig(**{**SMALL, "candidates": [{}, {"memory": False}, {"repair": True}]})
    third = stage.run_policy_stage(more, art, llama, tok, tmp_path / "work", progress=False)
    assert len(calls) == n + 4 * 2  # a candidate added: only its 2 ratios x 4 prompts scored, the rest kept
    assert {r: rows[:2] for r, rows in third.lengths[0].candidates.items()} == first.lengths[0].candidates
    core = CoreModel.from_pretrained(art)
    core.indexer.temperature.fill_(3.0)
    core.save_pretrained(art)
    stage.run_policy_stage(cfg, art, llama, tok, tmp_path / "work", progress=False)
    assert len(calls) == 2 * n + 4 * 2  # other weights: every score recomputed


def test_the_stage_validates_at_every_length_with_its_own_prompt_count(monkeypatch, tmp_path, artifact, llama, tok,
                                                                        capsys):  # fmt: skip
    """``policy.lengths`` gives one length band per length, each chosen on prompts of that length (``per_task`` per
    length), with its cost line and its own resumable folder; a length band is exactly what a one-length stage at that
    length records, and the full cache answers each prompt once."""
    import shutil

    art, alone = tmp_path / "final", tmp_path / "alone"
    shutil.copytree(artifact, art)
    shutil.copytree(artifact, alone)
    small = dict(ratios=[0.75], tasks=["single_noise", "multikey_prose"],
                 candidates=[{}, {"head_budgets": "adaptive", "memory": False}])  # fmt: skip
    calls = []
    real = stage.score_prompt
    monkeypatch.setattr(stage, "score_prompt", lambda m, t, p, press: calls.append(press) or real(m, t, p, press))
    cfg = PolicyStageConfig(**small, lengths=[128, 256], per_task=[2, 1])
    policy = stage.run_policy_stage(cfg, art, llama, tok, tmp_path / "work", progress=False)
    assert len(calls) == 4 * 3 + 2 * 3 and sum(p is None for p in calls) == 4 + 2  # full cache: once per prompt
    out = capsys.readouterr().out
    assert "[policy] 4 prompts of 128 tokens x (1 full cache + 1 ratios x 2 candidates) = 12 prefills; 12 still" in out
    assert "[policy] 2 prompts of 256 tokens x (1 full cache + 1 ratios x 2 candidates) = 6 prefills; 6 still" in out
    recorded = InferencePolicy.from_dict(json.loads((art / "config.json").read_text())["inference_policy"])
    assert recorded == policy and recorded.validated_lengths == [128, 256]
    for lb, per_task in zip(recorded.lengths, (2, 1), strict=True):
        v = lb.validation
        assert (v["context_tokens"], v["per_task"], v["prompts"]) == (lb.length, per_task, 2 * per_task)
        assert set(lb.candidates) == {"0.75"} and len(lb.candidates["0.75"]) == 2
    assert {p.name for p in (tmp_path / "work").iterdir()} == {"128", "256"}
    one = stage.run_policy_stage(PolicyStageConfig(**small, lengths=[256], per_task=1), alone, llama, tok,
                                 tmp_path / "work_alone", progress=False)  # fmt: skip
    drop = lambda lb: {**lb.to_dict(), "validation": {k: v for k, v in lb.validation.items() if k != "seconds"}}  # noqa: E731
    assert drop(one.lengths[0]) == drop(recorded.lengths[1])
    stage.run_policy_stage(cfg, art, llama, tok, tmp_path / "work", progress=False)
    assert len(calls) == 18 + 6 and "= 12 prefills; 0 still to run" in capsys.readouterr().out  # resumed: nothing
    markdown = stage.policy_markdown(recorded)  # the report's policy table names the length of every band
    assert "| 128 | (0, 1] | 0.75 |" in markdown and "| 256 | (0, 1] | 0.75 |" in markdown
    assert "### 128 tokens" in markdown and "### 256 tokens" in markdown


def test_stage_lengths_are_checked_against_the_window_and_per_task(llama, tok, tmp_path, artifact):
    from core_kv.models.loading import ContextWindowError

    window = llama.config.max_position_embeddings
    with pytest.raises(ContextWindowError, match=rf"^policy\.lengths\[1\]={window * 2:,} exceeds the context window"):
        stage.run_policy_stage(PolicyStageConfig(lengths=[128, window * 2]), artifact, llama, tok, tmp_path / "w")
    for bad, what in (({"lengths": []}, r"policy\.lengths must be a non-empty list"),
                      ({"lengths": [256, 128]}, r"policy\.lengths must be ascending without repeats"),
                      ({"lengths": [128, 128]}, r"policy\.lengths must be ascending without repeats"),
                      ({"lengths": [32]}, r"policy\.lengths must be a non-empty list of integers >= 64"),
                      ({"per_task": 0}, r"policy\.per_task must be an integer >= 1 or a list"),
                      ({"lengths": [128, 256], "per_task": [2]}, r"policy\.per_task lists 1 counts for 2 lengths"),
                      ({"lengths": [128, 256], "per_task": [2, 0]}, r"policy\.per_task must be an integer >= 1")):  # fmt: skip
        with pytest.raises(ValueError, match=what):
            PolicyStageConfig(**bad).check()
    assert PolicyStageConfig(lengths=[128, 256], per_task=3).per_length() == [(128, 3), (256, 3)]


def test_candidate_grid_and_bad_policy_options():
    grid = candidate_grid()
    assert len(grid) == 14 and grid[0] == PAPER and len(set(grid)) == 14
    assert [g.describe() for g in grid[-2:]] == ["shared, memory", "shared, memory off"]
    for bad, what in (({"head_pool": "output"}, "head_budgets"), ({"memory": "x"}, "memory"),
                      ({"head_budgets": "shared", "repair": True}, "repair=false"),
                      ({"repair": "yes"}, "repair"), ({"alpha_safeguard": 2}, "alpha_safeguard"), ({"k": 1}, "k")):  # fmt: skip
        with pytest.raises(ValueError, match=what):
            PolicyStageConfig(candidates=[bad]).check()


def test_one_loading_bar_per_model_and_none_per_candidate(artifact, capsys):
    """``make train`` printed ~43 "Loading weights" bars (issue 59): a model's first load in a process shows
    transformers' bar, a later load of it and every CORE artifact load (one per candidate press) show none."""
    from core_kv.models import loading

    path = str(ROOT / "checkpoints" / "proxy-lm")
    loading._LOADED.discard(path)
    capsys.readouterr()
    loading.load_model(path)
    assert "Loading weights" in capsys.readouterr().err
    loading.load_model(path)
    CoreModel.from_pretrained(artifact)
    build_press("core", checkpoint=str(artifact), compression_ratio=0.5)
    assert "Loading weights" not in capsys.readouterr().err


def test_processes_share_the_jobs_and_the_main_one_records_what_one_process_would(monkeypatch, tmp_path, artifact,
                                                                                  llama, tok):  # fmt: skip
    """Two shards (as ``accelerate launch --num_processes 2`` runs them; here two threads, each with its own model):
    the second waits for the main one's key, each scores exactly its jobs (index modulo 2: the full cache and every
    other (ratio, candidate)) at every length, only the main one records, and the recorded policy is the one a single
    process records (its timing and process count aside)."""
    import shutil
    import threading

    from transformers import AutoModelForCausalLM

    cfg = PolicyStageConfig(**{**SMALL, "lengths": [128, 160]})
    alone, shared = tmp_path / "alone", tmp_path / "shared"
    shutil.copytree(artifact, alone)
    shutil.copytree(artifact, shared)
    one = stage.run_policy_stage(cfg, alone, llama, tok, tmp_path / "work_alone", progress=False)
    calls: dict[str, list] = {}
    real = stage.score_prompt
    monkeypatch.setattr(stage, "POLL_SECONDS", 0.05)
    monkeypatch.setattr(stage, "score_prompt", lambda m, t, p, press: calls.setdefault(
        threading.current_thread().name, []).append(press is None) or real(m, t, p, press))  # fmt: skip
    out, errors = {}, []

    def run(rank, model):
        try:
            out[rank] = stage.run_policy_stage(cfg, shared, model, tok, tmp_path / "work", progress=False,
                                               shard=stage.Shard(rank, 2))  # fmt: skip
        except BaseException as e:  # noqa: BLE001 (re-raised below, in the test's thread)
            errors.append(e)

    other = AutoModelForCausalLM.from_pretrained(ROOT / "checkpoints" / "proxy-lm").eval()
    threads = [threading.Thread(target=run, args=(1, other), name="rank1"),
               threading.Thread(target=run, args=(0, llama), name="rank0")]  # fmt: skip
    threads[0].start()  # the second process first: it must wait for the main one's key
    threads[1].start()
    for t in threads:
        t.join(timeout=600)
    assert not errors, errors
    assert out[1] is None
    prompts = sum(lb.validation["prompts"] for lb in one.lengths)  # over both lengths
    # 1 + 2 ratios x 3 candidates = 7 jobs a length: indices 0, 2, 4, 6 for the main process, 1, 3, 5 for the other
    assert len(calls["rank0"]) == 4 * prompts and len(calls["rank1"]) == 3 * prompts
    assert sum(calls["rank0"]) == prompts and not any(calls["rank1"])  # the full cache is job 0: the main one's
    drop = lambda d: [{**lb, "validation": {k: v for k, v in lb["validation"].items() if k not in ("seconds",  # noqa: E731
                      "processes")}} for lb in d["lengths"]]  # fmt: skip
    recorded = json.loads((shared / "config.json").read_text())["inference_policy"]
    assert drop(recorded) == drop(one.to_dict()) and drop(out[0].to_dict()) == drop(recorded)
    assert all(lb["validation"]["processes"] == 2 for lb in recorded["lengths"])
