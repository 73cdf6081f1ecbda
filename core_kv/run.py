"""What ``train.py`` runs: CORE's distillation (:func:`core_kv.distill.trainer.train`), then the policy stage
(:func:`core_kv.eval.policy_stage.run_policy_stage`) that records the artifact's inference policy; with
``search.variants`` set, a staged recipe search of such runs (:func:`core_kv.search.recipe_search`) whose winner becomes
the artifact.

Both resume: a relaunch with the same config skips the finished distillation stages and the (ratio, candidate) scores
already in ``<out_dir>/stages/policy/``.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from core_kv.distill.report import next_steps
from core_kv.distill.trainer import recipe
from core_kv.distill.trainer import train as distill
from core_kv.eval.policy_stage import Shard, policy_markdown, run_policy_stage
from core_kv.files import atomic_write_json, atomic_write_text
from core_kv.policy import recorded_policy
from core_kv.search import recipe_search


def train(cfg) -> dict:
    """Distil (or reuse) the artifact of ``cfg``, choose its inference policy, and return the run's summary; the last
    lines printed are the artifact, its report and the commands that load and evaluate it. The policy stage runs
    inside the run folder's lock, as the distillation does: a second run into the folder is refused until it ends.
    With ``search.variants`` set, the recipe search runs such runs (its contestants) and its winner is the artifact."""
    summary = recipe_search(cfg, train_one) if cfg.search.enabled else train_one(cfg)
    if int(os.environ.get("RANK", "0")) != 0 or cfg.search.only:  # search.only: no artifact yet
        return summary
    spec = cfg.teacher.model
    model = "<the base model (random_init: build it as teacher.model describes)>" if spec.random_init else spec.path
    print(next_steps(model, str(Path(cfg.out_dir) / "final"), cfg.out_dir), flush=True)
    return summary


def train_one(cfg) -> dict:
    """One run: the distillation, then the policy stage (every process scores its share; the main one, in the run
    folder's lock, records)."""
    return distill(cfg, then=(lambda s: choose_policy(cfg, s)) if cfg.policy.enabled else None)


def choose_policy(cfg, summary: dict, artifact: Path | None = None) -> dict:
    """The policy stage on ``<out_dir>/final`` (skipped, with a note, for a base model without a tokenizer). Every
    process of a launch takes its share of the prompts (:class:`~core_kv.eval.policy_stage.Shard`); the main one
    records the policy, the report and the summary. ``artifact``: where this process reads the weights (default
    ``<out_dir>/final``; the same weights elsewhere, e.g. before the main process has copied them there)."""
    from core_kv.models.loading import load_from_spec

    out = Path(cfg.out_dir)
    shard = Shard.from_env()
    artifact = artifact or out / "final"  # (summary["artifact"] is where it was trained, maybe another folder)
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if torch.cuda.is_available() else "cpu"
    model, tok = load_from_spec(cfg.teacher.model, device)
    if tok is None:  # a random-init base model without a tokenizer (tests, benchmarks): no prompts to validate on
        if shard.rank == 0:
            print("[policy] skipped: the base model has no tokenizer (teacher.model.tokenizer); the artifact keeps no "
                  "policy (the paper's press)", flush=True)  # fmt: skip
        return summary
    if shard.rank == 0:
        print(f"[policy] choosing the inference policy on validation prompts ({out / 'stages' / 'policy'})",
              flush=True)  # fmt: skip
    run_policy_stage(cfg.policy, artifact, model, tok, out / "stages" / "policy", progress=cfg.progress,
                     candidate=recipe(cfg.recipe).policy_candidate, shard=shard)  # fmt: skip
    if shard.rank != 0:
        return summary
    cfg_file = artifact / "config.json"
    policy = recorded_policy(artifact)  # what is printed and reported is what the artifact holds
    summary["policy"] = policy.to_dict()
    atomic_write_json(out / "summary.json", summary)
    report = out / "report.md"
    text = report.read_text(encoding="utf-8") if report.is_file() else ""
    cut = text.find("## Inference policy")
    atomic_write_text(report, (text[:cut] if cut >= 0 else text).rstrip() + "\n\n" + policy_markdown(policy))
    for lb in policy.lengths:
        for b in lb.bands:
            print(f"[policy] {lb.length} tokens, ratios up to {b.upto:g}: {b.options.describe()} (validated at "
                  f"{b.validated_at:g})")  # fmt: skip
    seconds = sum(lb.validation["seconds"] for lb in policy.lengths)
    print(f"[policy] recorded in {cfg_file} after {seconds:.0f} s (every candidate's scores: {report})")
    return summary


__all__ = ["choose_policy", "train", "train_one"]
