"""Which of several CORE artifacts of one base model serves best, by their own policy stages' validation scores.

Two recipes of one model (e.g. the indexer trained per KV head and trained head-shared, issue 56; or two teacher
options) each run the policy stage, on the same validation prompts when their ``policy.*`` options agree (the stage
records a hash of the prompts' text). The stage's rule then also chooses between the artifacts: at each validation
(length, ratio), each artifact's chosen composition is compared by accuracy (every answer token top-1 under teacher
forcing), then mean answer log-prob (:func:`core_kv.eval.policy_stage.head_to_head`; ``train.py``'s recipe search
decides by the same rule). Prompts that differ (another seed, length or count) are refused: their scores do
not compare. Nothing is evaluated or written; only the recorded scores are read (never an evaluation context).

    .venv/bin/python -m research.compare_policies checkpoints/core-smollm2/final runs/core-smollm2-shared/final \\
        --ratios 0.75 0.9
"""

from __future__ import annotations

import argparse
from pathlib import Path

from core_kv.eval.policy_stage import head_to_head
from core_kv.policy import InferencePolicy, recorded_policy


def read_policy(artifact: Path) -> InferencePolicy:
    policy = recorded_policy(artifact)
    if policy is None:
        raise SystemExit(f"{artifact / 'config.json'}: no inference_policy (the policy stage did not run on this "
                         "artifact)")  # fmt: skip
    return policy


def compare(artifacts: list[Path], ratios: list[float] | None = None) -> list[dict]:
    """One row per (length, ratio) validated by every artifact: each artifact's chosen composition and scores, and the
    winner (:func:`core_kv.eval.policy_stage.head_to_head`, the rule the recipe search decides by). Raises
    ``SystemExit`` when the artifacts' prompts at a common length differ."""
    try:
        rows = head_to_head([read_policy(a) for a in artifacts], ratios)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    return [{**row, "winner": str(artifacts[row["winner"]]),
             "chosen": [{"artifact": str(a), **c} for a, c in zip(artifacts, row["chosen"], strict=True)]}
            for row in rows]  # fmt: skip


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
