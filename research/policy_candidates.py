"""Score press labels on a CORE artifact's own policy-stage validation prompts (never evaluation contexts).

The policy stage (:mod:`core_kv.eval.policy_stage`) records in ``final/config.json`` how its validation prompts were
made (tasks, prompts per task, length, seed) and a hash of their text. This script rebuilds the same prompts, checks
the hash, and scores any labelled press (``--press-option label.kind=...``) by the stage's rule (accuracy: every answer
token top-1 under teacher forcing; then the mean answer log-prob), so a composition the stage does not offer can be
compared with the recorded candidates on the same validation data before it is proposed as a default.

``--candidate '{"head_budgets": "shared", "memory": false}'`` scores a policy composition built exactly as the stage
builds it (:func:`core_kv.presses.core.compose` around the artifact's scorer). With ``--record`` the scored
compositions join the recorded ones and the stage's rule chooses again at every validated ratio: what the stage would
record had the composition been among its candidates (the stage caches each (ratio, candidate) result, so adding a
candidate keeps the others' scores; here the cache is the artifact's own record, valid because the prompts' hash and
the artifact's weights match what the stage recorded). Without ``--record`` nothing is written to the artifact.

    .venv/bin/python -m research.policy_candidates --artifact checkpoints/core-smollm2/final --ratios 0.5 0.75 0.9 \
        --candidate '{"head_budgets": "shared", "memory": false}' --record --json results/pc_record.json

    .venv/bin/python -m research.policy_candidates --artifact checkpoints/core-smollm2/final --ratios 0.75 0.9 \
        --methods hs ph --press-option hs.kind=head_shared hs.press=core_scorer \
        hs.press_options='{"checkpoint": "checkpoints/core-smollm2/final"}' \
        --press-option ph.kind=core_scorer ph.checkpoint=checkpoints/core-smollm2/final --json results/pc.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
from dataclasses import asdict
from pathlib import Path

VALIDATION_FIELDS = ("tasks", "per_task", "context_tokens", "seed", "key")  # what rebuilding the prompts reads
KEY_FIELDS = ("prompts", "weights")


def parse_candidates(texts: list[str]) -> list:
    """The ``--candidate`` JSON objects as :class:`~core_kv.policy.PolicyOptions` (a bad one exits naming it)."""
    from core_kv.policy import PolicyOptions

    out = []
    for text in texts:
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise SystemExit(f"--candidate {text!r}: not JSON ({e.msg}); give a JSON object of policy options, e.g. "
                             """--candidate '{"head_budgets": "shared", "memory": false}'""") from None  # fmt: skip
        try:
            out.append(PolicyOptions.from_dict(d, f"--candidate {text!r}"))
        except ValueError as e:
            raise SystemExit(str(e)) from None
    return out


def recorded_policy(artifact: Path) -> tuple[dict, dict]:
    """``(config.json, the length band of its inference_policy)`` of ``artifact``, the policy checked field by field
    (one validated length) and its ``validation`` record holding what rebuilding the prompts reads (a missing field
    exits naming it)."""
    from core_kv.files import read_json
    from core_kv.policy import InferencePolicy

    cfg_file = artifact / "config.json"
    config = read_json(cfg_file, "CORE config")
    policy = config.get("inference_policy") if isinstance(config, dict) else None
    if not policy or not (policy.get("validation") or policy.get("lengths")):
        raise SystemExit(f"{cfg_file}: records no policy stage (no validation prompts to rebuild)")
    try:
        lengths = InferencePolicy.from_dict(policy, f"{cfg_file}: inference_policy").lengths
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if len(lengths) > 1:
        raise SystemExit(f"{cfg_file}: the policy was validated at {len(lengths)} lengths; this script rescores a "
                         "one-length policy")  # fmt: skip
    policy = lengths[0].to_dict()  # the length band: bands, candidates, validation (a version-1 record's fields)
    val = policy["validation"]
    missing = [f"validation.{k}" for k in VALIDATION_FIELDS if k not in val]
    if not missing:
        key = val["key"]
        missing = [f"validation.key.{k}" for k in KEY_FIELDS if not isinstance(key, dict) or k not in key]
    if missing:
        raise SystemExit(f"{cfg_file}: inference_policy lacks {', '.join(missing)} (recorded by the policy stage): the "
                         "validation prompts cannot be rebuilt and checked; rerun the policy stage (train.py)")  # fmt: skip
    return config, policy


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--artifact", required=True, help="a CORE artifact folder whose config.json records a policy")
    ap.add_argument("--model", default="smollm2-135m", help="model name or folder (core_kv.models.loading)")
    ap.add_argument("--methods", nargs="+", default=[], help="press labels (names, or labels given a kind)")
    ap.add_argument("--candidate", action="append", default=[], help="a policy composition as JSON (PolicyOptions)")
    ap.add_argument("--record", action="store_true", help="re-choose with the --candidate scores and record the policy")
    ap.add_argument("--press-option", nargs="+", action="extend", default=[], help="label.option=value")
    ap.add_argument("--ratios", nargs="+", type=float, required=True)
    ap.add_argument("--json", help="write the scores here (atomic)")
    args = ap.parse_args(argv)

    import torch
    from tqdm import tqdm

    import core_kv.presses  # noqa: F401  (registers every press)
    from core_kv.core_model import CoreModel, FingerprintMismatch
    from core_kv.eval.policy_stage import RULE, choose, record, score_prompt, summarise
    from core_kv.eval.press_labels import build_labelled_presses, parse_press_options
    from core_kv.eval.validation import validation_set
    from core_kv.files import atomic_write_json
    from core_kv.models.loading import load_model
    from core_kv.policy import InferencePolicy, LengthBand, PolicyOptions, bands_from_choices
    from core_kv.presses.core import compose
    from core_kv.presses.core_scorer import CoreScorerPress

    candidates = parse_candidates(args.candidate)
    if not args.methods and not candidates:
        raise SystemExit("give --methods and/or --candidate")
    if args.record and not candidates:
        raise SystemExit("--record needs at least one --candidate")

    config, policy_record = recorded_policy(Path(args.artifact))
    val = policy_record["validation"]
    torch.set_num_threads(1)
    model, tok = load_model(args.model, dtype="float32")
    try:  # another base model rebuilds other prompts: name the model, not the prompts' hash
        CoreModel.from_pretrained(args.artifact, base_model=model)
    except FingerprintMismatch as e:
        raise SystemExit(f"--model {args.model} is not the base model of {args.artifact} (trained on "
                         f"{config.get('fingerprint', {}).get('name')!r}): {e}; pass that model as --model") from None  # fmt: skip
    prompts = validation_set(tok, val["tasks"], val["context_tokens"], val["per_task"], val["seed"])
    digest = hashlib.sha256(json.dumps([asdict(p) for p in prompts]).encode()).hexdigest()[:16]
    if digest != val["key"]["prompts"]:
        raise SystemExit(f"rebuilt validation prompts hash {digest}, the artifact recorded {val['key']['prompts']}")
    weights = hashlib.sha256((Path(args.artifact) / "model.safetensors").read_bytes()).hexdigest()[:16]
    if args.record and weights != val["key"]["weights"]:
        raise SystemExit(f"{args.artifact}: weights {weights} differ from the ones the policy was chosen for")
    options = parse_press_options(args.press_option)
    out = {"artifact": args.artifact, "validation": {k: val[k] for k in ("tasks", "per_task", "context_tokens", "seed")},
           "recorded": policy_record["candidates"], "scores": {}}  # fmt: skip
    for ratio in args.ratios:
        presses = build_labelled_presses(args.methods, options, ratio)
        for c in candidates:
            presses[c.describe()] = compose(CoreScorerPress(checkpoint=args.artifact, compression_ratio=ratio), c)
        for label, press in presses.items():
            rows = [{"task": p.task, **score_prompt(model, tok, p, press)}
                    for p in tqdm(prompts, desc=f"{label} @ {ratio}", unit="prompt")]  # fmt: skip
            s = {
                **summarise(rows),
                "per_task": {t: summarise([r for r in rows if r["task"] == t]) for t in val["tasks"]},
            }
            out["scores"][f"{ratio}__{label}"] = s
            print(f"{ratio} {label}: accuracy {s['accuracy']:.4f} logprob {s['logprob']:.3f}", flush=True)
            if args.json:
                atomic_write_json(Path(args.json), out)
    if args.record:
        policy = policy_record
        table, choices = {}, {}
        for band in policy["bands"]:
            r = band["validated_at"]
            rows = [x for x in policy["candidates"][str(r)] if PolicyOptions.from_dict(x["options"]) not in candidates]
            for c in candidates:
                s = out["scores"].get(f"{r}__{c.describe()}")
                if s is None:
                    raise SystemExit(f"--record: ratio {r} is validated in the policy; score it (--ratios)")
                rows.append({"label": c.describe(), "ratio": r, "options": c.to_dict(), **s})
            table[str(r)] = rows
            choices[r] = choose([(PolicyOptions.from_dict(x["options"]), x) for x in rows])
        bands = bands_from_choices(choices)
        default = min(range(len(bands)), key=lambda i: abs(bands[i].validated_at - 0.75))
        added = (policy["validation"].get("extended") or {}).get("candidates", [])  # earlier --record runs' additions
        added += [c.to_dict() for c in candidates if c.to_dict() not in added]
        validation = {**policy["validation"], "rule": RULE,
                      "extended": {"candidates": added, "by": "research.policy_candidates"}}  # fmt: skip
        record(Path(args.artifact), InferencePolicy([LengthBand(policy["length"], bands, default, table, validation)]))
        print("recorded:", {r: o.describe() for r, o in choices.items()})
    return out


if __name__ == "__main__":
    main()
