"""Train CORE stages 2–4 for one base model: ``accelerate launch train.py [--config configs/train/X.yaml] [a.b=v ...]``.

With no arguments it trains the shipped proxy configuration (builds or reuses the proxy teacher data) into the run
folder ``runs/core-proxy`` and prints where the artifact went (``runs/core-proxy/final/``); shipping it is a deliberate
``out_dir=checkpoints/<name>``. ``--help`` lists every option (``core_kv/distill/config.py``).
"""

from __future__ import annotations

import sys

from core_kv.config import load_config
from core_kv.distill.config import TrainConfig
from core_kv.distill.trainer import train


def main(argv: list[str] | None = None) -> dict:
    cfg = load_config(TrainConfig, sys.argv[1:] if argv is None else argv, usage=__doc__)
    return train(cfg)


if __name__ == "__main__":
    main()
