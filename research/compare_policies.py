"""Which of several CORE artifacts of one base model serves best, by their own policy stages' validation scores.

Two recipes of one model (e.g. the indexer trained per KV head and trained head-shared, issue 56; or two teacher
options) each run the policy stage, on the same validation prompts when their ``policy.*`` options agree (the stage
records a hash of the prompts' text). The stage's rule then also chooses between the artifacts: at each validation
(length, ratio), each artifact's chosen composition is compared by accuracy (every answer token top-1 under teacher
forcing), then mean answer log-prob. Prompts that differ (another seed, length or count) are refused: their scores do
not compare. Nothing is evaluated or written; only the recorded scores are read (never an evaluation context).

    .venv/bin/python -m research.compare_policies checkpoints/core-smollm2/final runs/core-smollm2-shared/final \\
        --ratios 0.75 0.9
"""

from __future__ import annotations

import argparse
from pathlib import Path

from core_kv.files import read_json
from core_kv.policy import InferencePolicy


def read_policy(artifact: Path) -> InferencePolicy:
    cfg_file = artifact / "config.json"
    record = read_json(cfg_file, "CORE config").get("inference_policy")
    if record is None:
        raise SystemExit(f"{cfg_file}: no inference_policy (the policy stage did not run on this artifact)")
    return InferencePolicy.from_dict(record, f"{cfg_file}: inference_policy")


def chosen(band_candidates: list[dict]) -> dict:
    """The recorded candidate the stage's rule ranks first (accuracy, then log-prob; ties: the first recorded)."""
    return max(band_candidates, key=lambda c: (c["accuracy"], c["logprob"]))


def compare(artifacts: list[Path], ratios: list[float] | None = None) -> list[dict]:
    """One row per (length, ratio) validated by every artifact: each artifact's chosen composition and scores, and the
    winner. Raises ``SystemExit`` when the artifacts' prompts at a common length differ."""
    policies = [read_policy(a) for a in artifacts]
    rows = []
    for length in sorted(set.intersection(*(set(p.validated_lengths) for p in policies))):
        bands = [next(lb for lb in p.lengths if lb.length == length) for p in policies]
        keys = {(lb.validation.get("key") or {}).get("prompts") for lb in bands}
        if len(keys) != 1 or None in keys:
            raise SystemExit(f"at {length} tokens the artifacts were validated on different prompts (hashes "
                             f"{sorted(map(str, keys))}): their scores do not compare")  # fmt: skip
        common = set.intersection(*(set(lb.candidates) for lb in bands))
        for r in sorted(common, key=float):
            if ratios and not any(abs(float(r) - x) < 1e-9 for x in ratios):
                continue
            best = [chosen(lb.candidates[r]) for lb in bands]
            win = max(range(len(best)), key=lambda i: (best[i]["accuracy"], best[i]["logprob"]))
            rows.append({"length": length, "ratio": float(r), "winner": str(artifacts[win]),
                         "chosen": [{"artifact": str(a), "label": b["label"], "accuracy": b["accuracy"],
                                     "logprob": b["logprob"], "n": b["n"]} for a, b in zip(artifacts, best, strict=True)]})  # fmt: skip
    if not rows:
        raise SystemExit("no (length, ratio) was validated by every artifact")
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifacts", nargs="+", type=Path, help="two or more artifact folders (final/) of one base model")
    ap.add_argument("--ratios", nargs="*", type=float, default=None, help="only these validation ratios")
    args = ap.parse_args(argv)
    if len(args.artifacts) < 2:
        ap.error("give at least two artifacts")
    rows = compare(args.artifacts, args.ratios)
    print("| length | ratio | " + " | ".join(f"`{a}`" for a in args.artifacts) + " | better |")
    print("|---|---|" + "---|" * len(args.artifacts) + "---|")
    for row in rows:
        cells = [f"{c['label']}: {c['accuracy']:.3f} ({c['logprob']:.3f}, n={c['n']})" for c in row["chosen"]]
        print(f"| {row['length']} | {row['ratio']:g} | " + " | ".join(cells) + f" | `{row['winner']}` |")
    return rows


if __name__ == "__main__":
    main()
