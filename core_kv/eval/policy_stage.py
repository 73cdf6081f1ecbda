"""The policy stage: choose a CORE artifact's inference policy on the pipeline's own validation prompts.

``train.py`` runs it after the artifact is written (``policy.*`` options, :class:`~core_kv.policy.PolicyStageConfig`).
A recipe whose artifact runs another stack (a plugin's, e.g. ``research.released``) passes how to build a candidate
on it (``candidate``; ``None`` where one does not apply). For every validation ratio, every candidate composition
(:func:`~core_kv.policy.candidate_grid`: uniform or AdaKV head-wise budgets pooled over ``p`` or ``(p + ε)·‖v‖``,
with or without TwinKV's repair pass, or one kept set per layer shared by the KV heads; with or without the latent
memory) compresses the context of every validation prompt (:mod:`core_kv.eval.validation`: own wording, keys,
haystacks and seeds; no evaluation context is ever read), and the answer is scored by teacher forcing:

- ``accuracy``: the share of prompts whose every answer token is the model's top-1 (what greedy decoding would emit);
- ``logprob``: the mean log-probability of the answer tokens (averaged per prompt, then over prompts).

The chosen composition at a ratio (:func:`choose`) is the cheapest to serve of those within one standard error of the
highest accuracy (the one-SE rule: differences the prompts cannot resolve buy nothing, and the memory, head-wise
budgets and the repair pass each cost decode time), then the highest accuracy, log-probability, the fewest changes to
the paper's press. Bands of ratios get the choice of their validation ratio (edges halfway between). All of
this is done at every validation length (``policy.lengths``, with ``policy.per_task`` prompts per task there: fewer at
long lengths), which gives the policy one length band per length (:class:`~core_kv.policy.LengthBand`; the press runs
the one nearest to a context's length); ``final/config.json`` records, per length, the bands, every candidate's
scores, the full cache's scores on the same prompts and how the validation set was made. The full cache answers each
prompt once (its scores are every candidate's reference). Results of each (length, ratio, candidate) are kept in
``<run>/stages/policy/<length>/`` (atomic writes), so an interrupted stage resumes; a length's are discarded when the
artifact's weights or the options that make its prompts change (a stage folder written before lengths existed, with
its files directly in ``stages/policy/``, is not read). Several processes (``accelerate launch --num_processes N
train.py``) share the jobs of every length (:class:`Shard`): each scores its part into the same folder, and the main
process chooses once every score is there.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from core_kv.core_model import artifact_config
from core_kv.eval.fidelity import continuation_logprobs
from core_kv.eval.validation import validation_set
from core_kv.files import atomic_write_json
from core_kv.models.loading import check_context_window, check_lengths
from core_kv.pipeline import encode, prefill
from core_kv.policy import (
    InferencePolicy,
    LengthBand,
    PolicyOptions,
    PolicyStageConfig,
    bands_from_choices,
    complexity,
    serving_cost,
)
from core_kv.presses.base import BasePress
from core_kv.presses.core import compose
from core_kv.presses.core_scorer import CoreScorerPress

RULE = ("the cheapest composition within one standard error of the highest accuracy (every answer token top-1 under "
        "teacher forcing), then the highest accuracy, then the highest mean answer log-prob, then the fewest changes "
        "to the paper's press; with no prompt answered, the highest log-prob, then the fewest changes")  # fmt: skip


def score_prompt(model, tokenizer, prompt, press) -> dict:
    """Teacher-forced answer scores of one prompt under ``press`` (``None``: the full cache)."""
    enc = encode(tokenizer, prompt.context, [prompt.question], [prompt.prefix])
    answer = tokenizer.encode(prompt.answer, add_special_tokens=False)
    fed = torch.cat([enc.question_ids[0], torch.tensor([answer])], 1)
    n = enc.context_ids.shape[1]
    with torch.inference_mode():
        cache = prefill(model, enc.context_ids, press)
        lp = continuation_logprobs(model, cache, n, fed[:, :-1], press)
    rows = lp[-len(answer) :]
    target = torch.tensor(answer, device=rows.device)
    return {
        "top1": bool((rows.argmax(-1) == target).all()),
        "logprob": float(rows.gather(-1, target[:, None]).mean()),
    }


def prompt_tokens(tokenizer, prompt) -> int:
    """Positions :func:`score_prompt` feeds the model for ``prompt``: context, question and answer."""
    enc = encode(tokenizer, prompt.context, [prompt.question], [prompt.prefix])
    answer = tokenizer.encode(prompt.answer, add_special_tokens=False)
    return enc.context_ids.shape[1] + enc.question_ids[0].shape[1] + len(answer)


def summarise(rows: list[dict]) -> dict:
    return {
        "accuracy": sum(r["top1"] for r in rows) / len(rows),
        "logprob": statistics.fmean(r["logprob"] for r in rows),
        "n": len(rows),
    }


def choose(results: list[tuple[PolicyOptions, dict]]) -> PolicyOptions:
    """The stage's rule (:data:`RULE`): the one-standard-error rule (Breiman et al. 1984, *Classification and
    Regression Trees* §3.4.3; Hastie, Tibshirani & Friedman, *The Elements of Statistical Learning* §7.10) over the
    candidates' accuracy, with the serving cost (:func:`~core_kv.policy.serving_cost`) as the simplicity it prefers.

    ``se = sqrt(a (1 − a) / n)`` of the best accuracy ``a`` over its ``n`` prompts; every candidate within ``se`` of
    ``a`` is one the prompts cannot tell from the best, and of those the cheapest to serve wins (then accuracy, answer
    log-prob, the fewest changes to the paper's press). On 16 prompts at ``a`` = 0.56, ``se`` = 0.12: two prompts.
    When no candidate answers a prompt (``a`` = 0: a model too small for the prompts, e.g. the proxy), the accuracy
    tells nothing and the log-prob decides (then the fewest changes)."""
    best = max(results, key=lambda x: x[1]["accuracy"])[1]
    if best["accuracy"] <= 0:
        return max(results, key=lambda x: (x[1]["logprob"], -complexity(x[0])))[0]
    a = best["accuracy"]
    se = math.sqrt(a * (1 - a) / best["n"])
    tied = [x for x in results if x[1]["accuracy"] >= a - se - 1e-9]
    return max(tied, key=lambda x: (-serving_cost(x[0]), x[1]["accuracy"], x[1]["logprob"], -complexity(x[0])))[0]


def chosen(rows: list[dict]) -> dict:
    """The recorded candidate (a row of :attr:`~core_kv.policy.LengthBand.candidates`) the stage's rule
    (:func:`choose`) ranks first."""
    ranked = [(PolicyOptions.from_dict(r["options"]), r) for r in rows]
    pick = choose(ranked)
    return next(r for o, r in ranked if o == pick)


CONTEST_RULE = ("each artifact's chosen composition (the policy stage's rule) at every validated (length, ratio): "
                "highest accuracy, then highest mean answer log-prob")  # fmt: skip


def head_to_head(policies: list[InferencePolicy], ratios: list[float] | None = None) -> list[dict]:
    """The stage's rule between artifacts of one base model: one row per (length, ratio) that every policy validated
    (``ratios``: only these), with each policy's chosen composition (:func:`chosen`: label, accuracy, logprob, n) and
    ``winner``, the index of the best by :data:`CONTEST_RULE` (ties: the first). Raises ``ValueError`` when the
    policies' prompts at a common length differ (their scores do not compare) or no (length, ratio) is common."""
    rows = []
    for length in sorted(set.intersection(*(set(p.validated_lengths) for p in policies)), key=lambda n: n or 0):
        bands = [next(lb for lb in p.lengths if lb.length == length) for p in policies]
        keys = {(lb.validation.get("key") or {}).get("prompts") for lb in bands}
        if len(keys) != 1 or None in keys:
            raise ValueError(f"at {length} tokens the artifacts were validated on different prompts (hashes "
                             f"{sorted(map(str, keys))}): their scores do not compare")  # fmt: skip
        for r in sorted(set.intersection(*(set(lb.candidates) for lb in bands)), key=float):
            if ratios and not any(abs(float(r) - x) < 1e-9 for x in ratios):
                continue
            best = [chosen(lb.candidates[r]) for lb in bands]
            win = max(range(len(best)), key=lambda i: (best[i]["accuracy"], best[i]["logprob"]))
            rows.append({"length": length, "ratio": float(r), "winner": win,
                         "chosen": [{k: b.get(k) for k in ("label", "accuracy", "logprob", "n")} for b in best]})  # fmt: skip
    if not rows:
        raise ValueError("no (length, ratio) was validated by every artifact")
    return rows


def contest(policies: list[InferencePolicy], ratios: list[float]) -> list[dict]:
    """Each policy's score over ``ratios`` (and every validation length they share): the mean accuracy and mean
    answer log-prob of its chosen compositions, with the rows they average (``per_ratio``: length, ratio, the chosen
    composition's label, accuracy, logprob, n; :func:`head_to_head`). Rank by
    ``(accuracy, logprob)``; a ratio not validated by every policy raises ``ValueError``."""
    rows = head_to_head(policies, ratios)
    missing = [r for r in ratios if not any(abs(row["ratio"] - r) < 1e-9 for row in rows)]
    if missing:
        raise ValueError(f"ratios {missing} were not validated by every artifact (validated: "
                         f"{sorted({row['ratio'] for row in rows})})")  # fmt: skip
    return [
        {
            "accuracy": statistics.fmean(row["chosen"][i]["accuracy"] for row in rows),
            "logprob": statistics.fmean(row["chosen"][i]["logprob"] for row in rows),
            "per_ratio": [
                {
                    "length": row["length"],
                    "ratio": row["ratio"],
                    "composition": row["chosen"][i]["label"],
                    **{k: row["chosen"][i][k] for k in ("accuracy", "logprob", "n")},
                }
                for row in rows
            ],
        }
        for i in range(len(policies))
    ]


def stage_key(cfg: PolicyStageConfig, artifact: Path, prompts, length: int, per_task: int) -> dict:
    """What the cached results of one validation length depend on: the options that make its prompts, the artifact's
    weights, the prompts' text. Not the candidates or the ratios: each (ratio, candidate) result is cached under its
    own name, so adding or removing a candidate keeps the scores already computed; nor the other lengths."""
    weights = hashlib.sha256((artifact / "model.safetensors").read_bytes()).hexdigest()[:16]
    text = hashlib.sha256(json.dumps([asdict(p) for p in prompts]).encode()).hexdigest()[:16]
    options = {"tasks": list(cfg.tasks), "length": length, "per_task": per_task, "seed": cfg.seed}
    return {"options": options, "weights": weights, "prompts": text}


def core_candidate(artifact: Path, ratio: float, options: PolicyOptions) -> BasePress:
    """A candidate composition on a CORE artifact (:func:`~core_kv.presses.core.compose` around its scorer)."""
    return compose(CoreScorerPress(checkpoint=str(artifact), compression_ratio=ratio), options)


@dataclass(frozen=True)
class Shard:
    """This process's part of the stage when several processes run it (``accelerate launch`` / ``torchrun`` set
    ``RANK`` and ``WORLD_SIZE``): at every length it scores the jobs (the full cache, then every (ratio, candidate))
    whose index is ``rank`` modulo ``world``, in the same cached files; the main process (rank 0) checks each length's
    key first, then waits for the others' scores, chooses and records. One process is ``Shard()``: every job."""

    rank: int = 0
    world: int = 1

    def __post_init__(self):
        if not 0 <= self.rank < self.world:
            raise ValueError(f"a policy-stage shard needs 0 <= rank < world, got rank {self.rank} of {self.world}")

    @classmethod
    def from_env(cls) -> Shard:
        """The launcher's ``RANK`` / ``WORLD_SIZE`` (one process without them)."""
        return cls(int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")))

    def mine(self, index: int) -> bool:
        return index % self.world == self.rank


POLL_SECONDS = 2.0  # how often a process looks for another's key or scores


def run_policy_stage(
    cfg: PolicyStageConfig,
    artifact: str | Path,
    model,
    tokenizer,
    work_dir: str | Path,
    progress: bool = True,
    candidate: Callable[[Path, float, PolicyOptions], BasePress | None] | None = None,
    shard: Shard | None = None,
) -> InferencePolicy | None:
    """Score every candidate at every ratio and validation length, choose, and record the policy in ``artifact``'s
    ``config.json`` (one length band per entry of ``cfg.lengths``).

    ``candidate(artifact, ratio, options)`` builds a candidate's press, ``None`` where it does not apply to this
    artifact (left out; refused when ``cfg.candidates`` names it); default :func:`core_candidate`. ``shard``: this
    process's part when several run the stage (default :meth:`Shard.from_env`); only the main process chooses,
    records and returns the policy, the others return ``None`` once their scores are written."""
    candidate = candidate or core_candidate
    shard = shard or Shard.from_env()
    artifact, work = Path(artifact), Path(work_dir)
    config = artifact_config(artifact)  # of any registered kind
    # before building prompts that long
    check_lengths(model, {f"policy.lengths[{i}]": n for i, n in enumerate(cfg.lengths)}, "the base model")
    cfg.check_layers(config.num_layers)
    candidates = cfg.candidate_options()
    if candidate is not core_candidate:  # a plugin's stack: keep the candidates that apply to its artifact
        applies = [c for c in candidates if candidate(artifact, cfg.ratios[0], c) is not None]
        if cfg.candidates and len(applies) < len(candidates):
            refused = [c.describe() for c in candidates if c not in applies]
            raise ValueError(f"policy.candidates: {refused} do not apply to {artifact}")
        candidates = applies
    lengths = [
        LengthWork(cfg, i, length, per_task, artifact, model, tokenizer, work / str(length), candidates)
        for i, (length, per_task) in enumerate(cfg.per_length())
    ]
    if shard.rank == 0:  # every length's stale scores go before any process scores (the others wait for the key)
        for lw in lengths:
            lw.claim()
    for lw in lengths:
        lw.score(shard, candidate, progress)
    if shard.rank != 0:
        return None
    policy = InferencePolicy([lw.band(shard) for lw in lengths])
    record(artifact, policy)
    return policy


class LengthWork:
    """One validation length (``cfg.lengths[index]``): its prompts scored with the full cache (once per prompt) and
    with every (ratio, candidate), each result cached in ``work`` (``<out_dir>/stages/policy/<length>``) so an
    interrupted stage resumes, and the choice at every ratio."""

    def __init__(self, cfg: PolicyStageConfig, index: int, length: int, per_task: int, artifact: Path, model,
                 tokenizer, work: Path, candidates: list[PolicyOptions]):  # fmt: skip
        self.cfg, self.length, self.per_task, self.artifact = cfg, length, per_task, artifact
        self.model, self.tokenizer, self.work, self.candidates = model, tokenizer, work, candidates
        self.prompts = validation_set(tokenizer, cfg.tasks, length, per_task, cfg.seed)
        check_context_window(model, max(prompt_tokens(tokenizer, p) for p in self.prompts),
                             f"policy.lengths[{index}]={length}: the longest validation prompt (context, question "
                             "and answer)")  # fmt: skip
        self.jobs = [(None, None)] + [(r, c) for r in cfg.ratios for c in candidates]
        self.seconds = 0.0
        self.claimed: dict | None = None  # the key the main process wrote (the weights are hashed once there)

    def key(self) -> dict:
        return stage_key(self.cfg, self.artifact, self.prompts, self.length, self.per_task)

    def claim(self) -> None:
        """The main process: discard the cached scores when the key (weights, prompts, options) changed; write it."""
        key, key_file = self.key(), self.work / "key.json"
        if key_file.is_file() and json.loads(key_file.read_text()) != key:
            for f in self.work.glob("*.json"):  # another artifact or other options: the cached scores do not apply
                f.unlink()
        self.work.mkdir(parents=True, exist_ok=True)
        atomic_write_json(key_file, key)
        self.claimed = key

    def _cached(self, ratio, options) -> Path:
        return self.work / f"{_label(ratio, options)}.json"

    def score(self, shard: Shard, candidate, progress: bool) -> None:
        """Score this process's jobs that are not cached yet (another process waits until the main one has written
        this length's key: its scores must not be discarded as stale)."""
        t0 = time.perf_counter()
        if shard.rank != 0:
            key_file = self.work / "key.json"
            while not (key_file.is_file() and json.loads(key_file.read_text()) == self.key()):
                time.sleep(POLL_SECONDS)
        cfg, prompts = self.cfg, self.prompts
        mine = [job for i, job in enumerate(self.jobs) if shard.mine(i)]
        todo = sum(not self._cached(r, c).is_file() for r, c in mine) * len(prompts)
        share = "" if shard.world == 1 else f"; process {shard.rank} of {shard.world} runs {len(mine)} of the jobs"
        print(f"[policy] {cost_line(len(prompts), self.length, len(cfg.ratios), len(self.candidates))}{share}; "
              f"{todo} still to run", flush=True)  # fmt: skip
        bar = tqdm(total=len(mine) * len(prompts), desc=f"policy {self.length}", disable=not progress, unit="prompt")
        timed = None  # seconds of the first prompt this invocation scores: the estimate of the rest
        for ratio, options in mine:
            cached = self._cached(ratio, options)
            if cached.is_file():
                bar.update(len(prompts))
                continue
            press = None if options is None else candidate(self.artifact, ratio, options)
            rows = []
            for p in prompts:
                t = time.perf_counter()
                rows.append({"task": p.task, **score_prompt(self.model, self.tokenizer, p, press)})
                bar.update(1)
                if timed is None:
                    timed = time.perf_counter() - t
                    tqdm.write(f"[policy] {timed:.1f} s per prompt: about {todo * timed / 60:.1f} min for the "
                               f"{todo} to run")  # fmt: skip
            atomic_write_json(cached, {"ratio": ratio, "options": None if options is None else options.to_dict(),
                                       **summarise(rows), "per_task": {t: summarise([r for r in rows if r["task"] == t])
                                                                       for t in cfg.tasks}})  # fmt: skip
        bar.close()
        self.seconds += time.perf_counter() - t0

    def band(self, shard: Shard) -> LengthBand:
        """The main process: every job's scores (waiting for those other processes write), the choice at every ratio."""
        t0 = time.perf_counter()
        missing = [f for f in (self._cached(r, c) for r, c in self.jobs) if not f.is_file()]
        if missing and shard.world > 1:
            print(f"[policy] {self.length} tokens: waiting for {len(missing)} scores the other processes run",
                  flush=True)  # fmt: skip
        while missing and shard.world > 1:
            time.sleep(POLL_SECONDS)
            missing = [f for f in missing if not f.is_file()]
        scores = {_label(r, c): json.loads(self._cached(r, c).read_text()) for r, c in self.jobs}
        self.seconds += time.perf_counter() - t0
        choices, table = {}, {}
        for r in self.cfg.ratios:
            results = [(c, scores[_label(r, c)]) for c in self.candidates]
            choices[r] = choose(results)
            table[str(r)] = [{"label": c.describe(), **s} for c, s in results]
        bands = bands_from_choices(choices)
        default = min(range(len(bands)), key=lambda i: abs(bands[i].validated_at - 0.75))
        return LengthBand(
            self.length, bands, default, table,
            {"generator": "core_kv.eval.validation", "tasks": list(self.cfg.tasks), "per_task": self.per_task,
             "context_tokens": self.length, "seed": self.cfg.seed, "prompts": len(self.prompts),
             "full_cache": scores["full"], "rule": RULE, "seconds": round(self.seconds, 1), "key": self.claimed,
             **({"processes": shard.world} if shard.world > 1 else {})},
        )  # fmt: skip


def record(artifact: Path, policy: InferencePolicy) -> None:
    """Write ``policy`` into ``artifact/config.json`` (atomic; the other settings untouched)."""
    cfg_file = artifact / "config.json"
    config = json.loads(cfg_file.read_text())
    config["inference_policy"] = policy.to_dict()
    atomic_write_json(cfg_file, config)


def _slug(options: PolicyOptions) -> str:
    return hashlib.sha256(json.dumps(options.to_dict(), sort_keys=True).encode()).hexdigest()[:10]


def _label(ratio: float | None, options: PolicyOptions | None) -> str:
    """The name of a (ratio, candidate) result in the stage's folder (``full``: the full cache)."""
    return "full" if options is None else f"{ratio}__{_slug(options)}"


def cost_line(prompts: int, length: int, ratios: int, candidates: int) -> str:
    """The stage's size: prompts x (the full cache + ratios x candidates) prefills of ``length`` tokens."""
    return (f"{prompts} prompts of {length} tokens x (1 full cache + {ratios} ratios x {candidates} candidates) = "
            f"{prompts * (1 + ratios * candidates)} prefills")  # fmt: skip


def policy_markdown(policy: InferencePolicy) -> str:
    """The chosen policy and every candidate's validation scores, per validated length, for the run's report."""
    lines = ["## Inference policy (chosen on validation prompts)", "",
             "| length | ratios | validated at | chosen |", "|---|---|---|---|"]  # fmt: skip
    for lb in policy.lengths:
        lo = 0.0
        for b in lb.bands:
            lines.append(
                f"| {_tokens(lb.length)} | ({lo:g}, {b.upto:g}] | {b.validated_at:g} | {b.options.describe()} |"
            )
            lo = b.upto
    for lb in policy.lengths:
        v = lb.validation
        lines += [
            "",
            f"### {_tokens(lb.length)}" + (" tokens" if lb.length is not None else ""),
            "",
            f"{v.get('prompts')} prompts ({', '.join(v.get('tasks', []))}; {v.get('context_tokens')} tokens; seed "
            f"{v.get('seed')}; generator `{v.get('generator')}`); full cache: accuracy "
            f"{v['full_cache']['accuracy']:.2f}, answer log-prob {v['full_cache']['logprob']:.3f}. Rule: {v.get('rule')}.",
            "",
            "| ratio | candidate | accuracy | log-prob |",
            "|---|---|---|---|",
        ]
        for r, rows in lb.candidates.items():
            for row in sorted(rows, key=lambda x: (-x["accuracy"], -x["logprob"])):
                lines.append(f"| {r} | {row['label']} | {row['accuracy']:.2f} | {row['logprob']:.3f} |")
    return "\n".join(lines) + "\n"


def _tokens(length: int | None) -> str:
    return "any" if length is None else str(length)


__all__ = [
    "CONTEST_RULE", "RULE", "choose", "chosen", "contest", "head_to_head", "policy_markdown", "record",
    "run_policy_stage", "score_prompt", "LengthWork", "Shard",
]  # fmt: skip
