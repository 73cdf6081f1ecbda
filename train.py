"""Train CORE for one base model into ``<out_dir>/final/``: teacher data, distillation, calibration, memory, then the
policy stage that chooses the artifact's inference policy on the pipeline's own validation prompts and records it in
``final/config.json``.

Usage::

    accelerate launch train.py [--config configs/train/X.yaml] [a.b=v ...]
    make train ARGS="[--config configs/train/X.yaml] [a.b=v ...]"      # the same, CPU, from the repository root

With no arguments it trains the proxy recipe, ``configs/train/default.yaml`` (the ``TrainConfig`` defaults written out;
the options below show them), building or reusing the proxy teacher data, into the run folder ``runs/core-proxy``;
shipping it is a deliberate ``out_dir=checkpoints/<name>``. With ``search.variants`` set, a staged recipe search trains
the base recipe and each variant (``<out_dir>/search/<label>/``) and its winner on validation prompts becomes the
artifact (``docs/train-your-model.md``, "Recipe search"). The policy stage's size is the recipe's ``policy:``
section; the stage prints its prefills and an estimate of its time when it starts. The run ends by printing where the
artifact went, the report, and the commands that load and evaluate it. Resumable: relaunch the same command.

Examples::

    make train                                                        # the proxy LM, CPU, 4.9 min
    make train ARGS="--config configs/train/quick.yaml"              # SmolLM2-135M, a first run (docs/train-your-model.md)
    make train ARGS="out_dir=/tmp/core-proxy"                        # the proxy recipe into another folder
    make train ARGS="--config my-model.yaml teacher.lam=4"           # your copy of quick.yaml, another λ
    make train-gemma3                                                # Gemma-3-270M: 4 recipes, the best on validation
    accelerate launch train.py --config configs/train/llama31_8b.yaml    # 8 GPUs, DDP, bf16
    accelerate launch --config_file configs/accelerate/deepspeed_zero2.yaml train.py --config configs/train/qwen3_8b.yaml

Every option below is a field of ``core_kv/distill/config.py``; a guide to training your own model:
``docs/train-your-model.md``. A plugin recipe (``plugins: [research.released]`` with ``recipe: released``) adds its own
section: ``train.py --config research/released/configs/proxy.yaml --help`` lists it.
"""

from __future__ import annotations

import sys

from core_kv.config import load_config, shipped_configs
from core_kv.distill.config import TrainConfig
from core_kv.distill.trainer import train_schema
from core_kv.models.loading import PROXY_PATH
from core_kv.run import train

ROOT = PROXY_PATH.parents[1]


def usage() -> str:
    """The docstring and the shipped configs (``--help``)."""
    return (
        f"{__doc__.strip()}\n\nshipped configs (configs/train/):\n{shipped_configs(ROOT / 'configs' / 'train', ROOT)}"
    )


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    # the config's plugins are imported first: a plugin's recipe brings its own config schema (train_schema)
    cfg = load_config(TrainConfig, argv, usage() if {"-h", "--help"} & set(argv) else __doc__, resolve=train_schema)
    return train(cfg)


if __name__ == "__main__":
    main()
