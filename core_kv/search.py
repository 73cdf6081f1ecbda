"""The recipe search ``train.py`` runs when ``search.variants`` is set (:class:`~core_kv.distill.config.SearchConfig`):
the training choices that depend on the model (λ, the feature spec, the selection trained under, ...) chosen for the
model being trained, on the pipeline's own validation prompts, at a bounded cost.

Contestants: the base config (``base``) and one per variant (the base with its overrides, labelled by them:
``teacher.lam=4``). Each is an ordinary resumable run (:func:`core_kv.run.train` without a search) in its own folder,
followed by its policy stage on the same validation prompts (the run's ``policy.*``, never varied):

1. round 1 (when ``search.short`` is set): every contestant with ``short`` on top, into
   ``<out_dir>/search/<label>/``; the contest ranks them;
2. round 2: the ``keep`` best at the full schedule, into ``<out_dir>/search/<label>-full/`` (their round-1 hashes
   differ: ``short`` changed them), ranked again when ``keep`` > 1. Without ``short`` there is one round, at the full
   schedule, into ``<out_dir>/search/<label>/``.

The contest (:func:`~core_kv.eval.policy_stage.contest`): each contestant's chosen composition (the policy stage's
rule) at every ``search.ratios`` (and validation length), averaged: highest accuracy, then highest answer log-prob;
ties go to the earlier contestant (the base first). The winner's full run becomes ``<out_dir>/final`` (copied
atomically, with its inference policy), its ``config.json`` recording the search (``recipe_search``,
:func:`~core_kv.policy.check_recipe_search`); ``summary.json`` and ``report.md`` are the winner's with the search
added. Teacher data is shared by contestants of equal teacher options: the base's ``teacher.out_dir``, or
``<teacher.out_dir>-<label>`` for a contestant whose overrides change them. A relaunch resumes: finished contestants
are not retrained (their policy stages reread their cached scores). ``search.only`` trains the named round-1
contestants and stops, so that several processes can train round 1 side by side before the search decides it.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

from core_kv.config import ConfigError, to_dict
from core_kv.distill.config import overridden
from core_kv.eval.policy_stage import CONTEST_RULE, contest
from core_kv.files import atomic_write_json, atomic_write_text, read_json, swap_in
from core_kv.lock import folder_lock
from core_kv.policy import InferencePolicy, check_recipe_search, recorded_policy

TEACHER_RUNTIME = ("out_dir", "progress", "overwrite", "threads")  # teacher options that do not change its data


class Round(NamedTuple):
    """One round of a search: its name, the overrides it adds (``short``, or none at the full schedule) and the
    folder suffix of its runs."""

    name: str
    overrides: dict
    suffix: str


def rounds(cfg) -> list[Round]:
    """``short`` then ``full`` (``-full`` folders), or ``full`` alone when ``search.short`` is empty."""
    if not cfg.search.short:
        return [Round("full", {}, "")]
    return [Round("short", dict(cfg.search.short), ""), Round("full", {}, "-full")]


def _teacher_key(teacher) -> str:
    d = to_dict(teacher)
    return json.dumps({k: v for k, v in d.items() if k not in TEACHER_RUNTIME}, sort_keys=True)


def contestants(cfg) -> tuple[dict[tuple[str, str], object], dict[str, str]]:
    """The config of every (round name, contestant label), each with its own ``out_dir`` and a ``teacher.out_dir``
    shared by the contestants of equal teacher options; and those teacher folders (by teacher options)."""
    root, base_teacher = Path(cfg.out_dir) / "search", cfg.teacher.out_dir.rstrip("/")
    teachers = {_teacher_key(cfg.teacher): base_teacher}
    configs = {}
    for rd in rounds(cfg):
        for label, overrides in cfg.search.contestants():
            c = overridden(cfg, {**overrides, **rd.overrides}, f"search: {label}")
            key = _teacher_key(c.teacher)
            if key not in teachers:
                short = rd.name == "short" and any(k.startswith("teacher.") for k in rd.overrides)
                teachers[key] = f"{base_teacher}-{label}{'-short' if short else ''}"
            configs[rd.name, label] = replace(
                c, out_dir=str(root / f"{label}{rd.suffix}"), teacher=replace(c.teacher, out_dir=teachers[key])
            )
    return configs, teachers


def recipe_search(cfg, train_one: Callable[[object], dict]) -> dict:
    """Run the search of ``cfg`` (``train_one(cfg)``: one run and its policy stage, :func:`core_kv.run.train`'s
    body), write ``<out_dir>/final`` (the winner's artifact, recording the search), ``summary.json`` and
    ``report.md``; return the summary."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError("search.variants: the recipe search runs in one process (each contestant is a run of its "
                          "own): launch it without --num_processes, or one process per contestant with "
                          "search.only=[LABEL] to train round 1 side by side")  # fmt: skip
    s, out = cfg.search, Path(cfg.out_dir)
    if s.only:
        return _train_only(cfg, train_one)
    labels = [label for label, _ in s.contestants()]
    plan = rounds(cfg)
    _check_folder(out, cfg)
    with folder_lock(out, "recipe search"):
        runs, teachers = contestants(cfg)
        kept = min(s.keep, len(labels)) if len(plan) > 1 else len(labels)
        total = len(labels) + (kept if len(plan) > 1 else 0)
        p = cfg.policy
        prefills = sum(n * len(p.tasks) * (1 + len(p.ratios) * len(p.candidate_options())) for _, n in p.per_length())
        first = f"{len(labels)} contestants x round 1 ({_describe(plan[0].overrides) or 'full schedule'})"
        second = f" + {kept} x round 2 (full schedule)" if len(plan) > 1 else ""
        print(f"[search] {first}{second} = {total} training runs, each followed by its policy stage ({prefills} "
              f"prefills each, {total * prefills} in all); {len(set(teachers.values()))} teacher dataset(s); "
              f"contestants: {', '.join(labels)}", flush=True)  # fmt: skip
        record = {"version": 1, "rule": f"mean over search.ratios {list(s.ratios)} of {CONTEST_RULE}; ties: the "
                  "earlier contestant (the base first)", "ratios": list(s.ratios), "short": dict(s.short),
                  "keep": s.keep, "contestants": [{"label": la, "overrides": ov} for la, ov in s.contestants()],
                  "rounds": []}  # fmt: skip
        alive, done = labels, 0
        for r, rd in enumerate(plan):
            if r:  # round 2: the best of round 1
                alive = alive[:kept]
            summaries = {}
            for i, label in enumerate(alive):
                run_cfg = runs[rd.name, label]
                done += 1
                print(f"[search] round {r + 1}/{len(plan)} ({rd.name}), contestant {i + 1}/{len(alive)} {label} "
                      f"(run {done} of {total}): {run_cfg.out_dir}", flush=True)  # fmt: skip
                summaries[label] = train_one(run_cfg)
            scores = dict(zip(alive, contest([_policy(runs[rd.name, la]) for la in alive], s.ratios), strict=True))
            ranking = sorted(alive, key=lambda la: (-scores[la]["accuracy"], -scores[la]["logprob"], alive.index(la)))
            for la in ranking:
                print(f"[search] round {r + 1} ({rd.name}): {la}: accuracy {scores[la]['accuracy']:.3f}, answer "
                      f"log-prob {scores[la]['logprob']:.3f}", flush=True)  # fmt: skip
            record["rounds"].append({"name": rd.name, "overrides": rd.overrides, "scores": scores,
                                     "ranking": ranking})  # fmt: skip
            alive = ranking
        winner = alive[0]
        record["winner"] = winner
        check_recipe_search(record, "recipe_search")
        source = Path(runs[plan[-1].name, winner].out_dir)
        print(f"[search] winner: {winner} ({source}) -> {out / 'final'}", flush=True)
        return _write(cfg, source, record, summaries[winner])


def _train_only(cfg, train_one: Callable[[object], dict]) -> dict:
    """``search.only``: train those round-1 contestants (each its run and policy stage, in its own folder, under its
    own lock) and stop; no contest, nothing written to ``<out_dir>`` itself."""
    runs, _ = contestants(cfg)
    first, only = rounds(cfg)[0], cfg.search.only
    trained = {}
    for i, label in enumerate(only):
        run_cfg = runs[first.name, label]
        print(f"[search] search.only: round 1 ({first.name}) contestant {label} ({i + 1} of {len(only)}): "
              f"{run_cfg.out_dir}", flush=True)  # fmt: skip
        train_one(run_cfg)
        trained[label] = run_cfg.out_dir
    print(f"[search] search.only: {', '.join(trained)} trained; launch the search without search.only to decide it "
          "(finished contestants are not retrained)", flush=True)  # fmt: skip
    return {"recipe_search": None, "trained": trained}


def _describe(overrides: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in overrides.items())


def _policy(run_cfg) -> InferencePolicy:
    """The inference policy a contestant's policy stage recorded in its artifact."""
    policy = recorded_policy(Path(run_cfg.out_dir) / "final")
    if policy is None:
        raise ValueError(f"{Path(run_cfg.out_dir) / 'final' / 'config.json'}: no inference_policy: the contestant's "
                         "policy stage did not run (a base model without a tokenizer has no validation prompts; the "
                         "search needs them)")  # fmt: skip
    return policy


def _check_folder(out: Path, cfg) -> None:
    """A ``final/`` in ``out`` that no search of these contestants wrote is never replaced unless ``overwrite``."""
    cfg_file = out / "final" / "config.json"
    if cfg.overwrite or not cfg_file.is_file():
        return
    held = read_json(cfg_file, "CORE config").get("recipe_search")
    s = cfg.search
    same = isinstance(held, dict) and held.get("contestants") == [
        {"label": la, "overrides": ov} for la, ov in s.contestants()
    ] and held.get("short") == dict(s.short) and held.get("keep") == s.keep  # fmt: skip
    if not same:
        raise ValueError(
            f"{out} holds a finished CORE artifact ({out / 'final'}) "
            + ("of another search" if isinstance(held, dict) else "that no recipe search wrote")
            + ", which a new run never deletes: pass out_dir=<another folder>, or overwrite=true to replace it (every "
            "contestant then retrains from scratch)"
        )


def _write(cfg, source: Path, record: dict, summary: dict) -> dict:
    """``<out_dir>/final`` = the winner's artifact with ``recipe_search`` added (a temporary copy swapped into place: :func:`~core_kv.files.swap_in`),
    then ``summary.json``, ``report.md`` and ``config.yaml``."""
    from omegaconf import OmegaConf

    out = Path(cfg.out_dir)
    final, tmp = out / "final", out / ".tmp-final"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        shutil.copytree(source / "final", tmp)
        config = read_json(tmp / "config.json", "CORE config")
        atomic_write_json(tmp / "config.json", {**config, "recipe_search": record})
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    swap_in(tmp, final)
    summary = {**summary, "artifact": str(final), "recipe_search": record}
    atomic_write_json(out / "summary.json", summary)
    report = source / "report.md"
    text = report.read_text(encoding="utf-8") if report.is_file() else ""
    atomic_write_text(out / "report.md", text.rstrip() + "\n\n" + search_markdown(record))
    atomic_write_text(out / "config.yaml", OmegaConf.to_yaml(to_dict(cfg)))
    return summary


def search_markdown(record: dict) -> str:
    """The ``Recipe search`` section of the run's report: every contestant's scores per round and ratio."""
    per = [(row["length"], row["ratio"]) for row in next(iter(record["rounds"][0]["scores"].values()))["per_ratio"]]
    head = " | ".join(f"{r:g}" + ("" if len({n for n, _ in per}) == 1 else f" @ {n}") for n, r in per)
    lines = [
        "## Recipe search",
        "",
        f"Winner: **{record['winner']}**. Rule: {record['rule']}. Each cell: the chosen composition's accuracy "
        "(answer log-prob) on the policy stage's validation prompts.",
        "",
        f"| round | contestant | overrides | {head} | mean |",
        "|---|---|---|" + "---|" * len(per) + "---|",
    ]
    overrides = {c["label"]: c["overrides"] for c in record["contestants"]}
    for rd in record["rounds"]:
        name = rd["name"] + (f" ({_describe(rd['overrides'])})" if rd["overrides"] else "")
        for label in rd["ranking"]:
            sc = rd["scores"][label]
            cells = " | ".join(f"{x['accuracy']:.3f} ({x['logprob']:.3f})" for x in sc["per_ratio"])
            lines.append(f"| {name} | {label} | {_describe(overrides[label]) or 'the base config'} | {cells} | "
                         f"{sc['accuracy']:.3f} ({sc['logprob']:.3f}) |")  # fmt: skip
    return "\n".join(lines) + "\n"


__all__ = ["contestants", "recipe_search", "rounds", "search_markdown"]
