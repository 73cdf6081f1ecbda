"""Train CORE for one base model: ``accelerate launch train.py [--config configs/train/X.yaml] [a.b=v ...]``.

Stages 1-4 (teacher data, indexer, calibration, memory), then the policy stage that chooses the artifact's inference
policy on the pipeline's own validation prompts and records it in ``final/config.json``.

With no arguments it trains the shipped proxy configuration (builds or reuses the proxy teacher data) into the run
folder ``runs/core-proxy`` and prints where the artifact went (``runs/core-proxy/final/``); shipping it is a deliberate
``out_dir=checkpoints/<name>``. ``--help`` lists every option (``core_kv/distill/config.py``).
"""

from __future__ import annotations

import sys

from core_kv.config import load_config
from core_kv.distill.config import TrainConfig
from core_kv.run import train


def main(argv: list[str] | None = None) -> dict:
    cfg = load_config(TrainConfig, sys.argv[1:] if argv is None else argv, usage=__doc__)
    return train(cfg)


if __name__ == "__main__":
    main()
