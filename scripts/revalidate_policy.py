"""Choose a finished CORE artifact's inference policy again without retraining it: other validation lengths, more
prompts or other candidates. It runs ``train.py``'s policy stage (:func:`core_kv.run.choose_policy`) on a copy of the
artifact, with the options of a train config (``--config``, then ``policy.*`` overrides).

Usage (from the repository root)::

    .venv/bin/python scripts/revalidate_policy.py checkpoints/core-smollm2/final runs/core-smollm2-lengths \\
        --config configs/train/smollm2.yaml "policy.lengths=[1024,2048,4096,8192]" "policy.per_task=[4,4,2,1]"

- the artifact is copied to ``OUT/final`` (the source is never written); an ``OUT/final`` holding other weights is
  refused, one holding the same weights is reused, so an interrupted stage resumes (relaunch the same command);
- the base model is the train config's ``teacher.model`` (the one the artifact was trained for: the scorer refuses
  another model at its first prefill);
- the scores of every (length, ratio, candidate) are cached in ``OUT/stages/policy/``; ``OUT/final/config.json``
  records the new policy and ``OUT/report.md`` its table (every candidate's scores);
- several processes share the work: ``torchrun --nproc_per_node 2 scripts/revalidate_policy.py ...`` (or
  ``accelerate launch --num_processes 2``); each scores its part of every length, the main one records.

Options other than ``policy.*``, ``threads`` and ``progress`` are the train config's and change nothing here.
"""

from __future__ import annotations

import filecmp
import shutil
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> dict:
    from core_kv.config import load_config
    from core_kv.distill.config import TrainConfig
    from core_kv.distill.trainer import train_schema
    from core_kv.eval.policy_stage import Shard
    from core_kv.lock import folder_lock
    from core_kv.run import choose_policy

    argv = sys.argv[1:] if argv is None else list(argv)
    if {"-h", "--help"} & set(argv) or len(argv) < 2:
        print(__doc__)
        raise SystemExit(0 if {"-h", "--help"} & set(argv) else 2)
    source, out, options = Path(argv[0]), Path(argv[1]), argv[2:]
    weights = source / "model.safetensors"
    if not (source / "config.json").is_file() or not weights.is_file():
        raise SystemExit(f"{source}: not a CORE artifact (config.json and model.safetensors expected)")
    cfg = load_config(TrainConfig, options + [f"out_dir={out}"], __doc__, resolve=train_schema)
    if Shard.from_env().rank != 0:  # another process of a launch: its share of the scores, from the same weights
        return choose_policy(cfg, {}, artifact=source)
    final = out / "final"
    with folder_lock(out, "policy stage"):
        if final.exists():
            if not filecmp.cmp(final / "model.safetensors", weights, shallow=False):
                raise SystemExit(f"{final} holds another artifact's weights: choose another output folder (nothing "
                                 "was changed)")  # fmt: skip
            print(f"[policy] reusing {final} (the same weights as {source})", flush=True)
        else:
            tmp = out / ".final.partial"
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.copytree(source, tmp)
            tmp.rename(final)
        return choose_policy(cfg, {"artifact": str(final), "revalidated_from": str(source)})


if __name__ == "__main__":
    main()
