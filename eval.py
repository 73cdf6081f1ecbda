"""Evaluate KV-cache compression: methods × compression ratios × benchmarks on one model.

Usage::

    python eval.py                                              # small offline suite on the default model
    python eval.py configs/eval/smoke.yaml                      # < 1 min pipeline check
    python eval.py configs/eval/llama31_8b_ruler.yaml methods=[snapkv,knorm] ratios=[0.5]
    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 --num_machines 1 \\
        --mixed_precision no --dynamo_backend no --num_cpu_threads_per_process 1 eval.py configs/eval/smoke.yaml

Arguments are YAML files (overriding :class:`core_kv.eval.runner.EvalConfig` defaults) and ``a.b=v`` overrides;
``--help`` prints every option with its type, default and doc.
"""

import sys

from core_kv.config import load_config
from core_kv.eval.runner import EvalConfig, run_eval


def main(argv: list[str] | None = None) -> None:
    cfg = load_config(EvalConfig, sys.argv[1:] if argv is None else argv, usage=__doc__)
    results = run_eval(cfg)
    if results.markdown:
        print(results.markdown)
        print(f"report: {results.output_dir / 'report.md'}")


if __name__ == "__main__":
    main()
