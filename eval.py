"""Evaluate KV-cache compression: methods × compression ratios × benchmarks on one model.

Usage::

    python eval.py [CONFIG.yaml ...] [a.b=v ...]

Arguments are YAML files (overriding :class:`core_kv.eval.runner.EvalConfig` defaults) and ``a.b=v`` overrides.
Run from the repository root with the project's environment: ``.venv/bin/python eval.py ...`` or
``make eval ARGS="..."`` (or activate it once: ``source .venv/bin/activate``).

Examples::

    python eval.py                                              # the default suite: SmolLM2, RULER 1k + NIAH, CORE + 4 presses at 75%
    python eval.py configs/eval/smoke.yaml                      # < 1 min pipeline check on a tiny random model
    python eval.py --help presses                               # every press's options: type, default, doc
    python eval.py "methods=[core,snapkv]" "ratios=[0.5,0.9]"   # CORE (the shipped SmolLM2 artifact) vs SnapKV
    python eval.py model.name=checkpoints/proxy-lm "methods=[core,knorm]" "benchmarks=[ruler]" \\
        press_options.core.checkpoint=checkpoints/core-proxy/final output_dir=results/proxy   # your artifact + model
    python eval.py configs/eval/llama31_8b_ruler.yaml "methods=[snapkv,knorm]" "ratios=[0.5]"   # GPU, real model
    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 --num_machines 1 \\
        --mixed_precision no --dynamo_backend no --num_cpu_threads_per_process 1 eval.py configs/eval/smoke.yaml

The run prints a table per benchmark and ends with where the report (``<output_dir>/report.md``) and the plots
(``<output_dir>/plots/``) went.
"""

import dataclasses
import sys
import textwrap

from core_kv.config import import_plugins, load_config, options_help, shipped_configs
from core_kv.eval.benchmarks import BENCHMARKS
from core_kv.eval.runner import DEFAULT_CORE_CHECKPOINT, EvalConfig, run_eval
from core_kv.models.loading import PROXY_PATH
from core_kv.presses.base import PRESSES, BasePress

ROOT = PROXY_PATH.parents[1]


def usage() -> str:
    """The docstring, then the registered presses and benchmarks and the shipped configs (``--help``)."""
    import core_kv.presses  # noqa: F401  (registers every press)

    presses = textwrap.fill(", ".join(sorted(PRESSES)), 116, initial_indent="  ", subsequent_indent="  ")
    return "\n".join([
        __doc__.strip(), "",
        "registered presses (methods=[...]; press_options.<method>.<option>=<value> sets a constructor option; "
        "`--help presses` lists them):",
        presses,
        f"  core needs its trained artifact: press_options.core.checkpoint=<folder> (default {DEFAULT_CORE_CHECKPOINT},",
        "  SmolLM2's); a label of your own runs a configured press: press_options.<label>={kind: <press>, ...}",
        f"registered benchmarks (benchmarks=[...], datasets.<name>.kind): {', '.join(sorted(BENCHMARKS))}",
        "", "shipped configs (configs/eval/):", shipped_configs(ROOT / "configs" / "eval", ROOT),
    ])  # fmt: skip


def with_plugins(raw) -> type[EvalConfig]:
    """The config's ``plugins`` imported first (each registers its presses), then :class:`EvalConfig`."""
    import_plugins(raw)
    return EvalConfig


def press_help() -> str:
    """Every registered press's constructor options (``--help presses``): those every press shares, then each press's
    own, read from the dataclass fields of :data:`~core_kv.presses.base.PRESSES`."""
    import core_kv.presses  # noqa: F401  (registers every press)

    shared = tuple(f.name for f in dataclasses.fields(BasePress))
    lines = ["press options: methods=[<press>] and press_options.<press>.<option>=<value> (docs/presses.md)", "",
             "every press:", *options_help(BasePress)]  # fmt: skip
    for name in sorted(PRESSES):
        cls = PRESSES[name]
        own = options_help(cls, skip=shared)
        lines += ["", f"{name} ({cls.__name__}){':' if own else ': no options of its own'}", *own]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if {"-h", "--help"} & set(argv) and "presses" in argv:
        print(press_help())
        return
    cfg = load_config(EvalConfig, argv, usage() if {"-h", "--help"} & set(argv) else __doc__, resolve=with_plugins)
    results = run_eval(cfg)
    if results.markdown:
        print(results.markdown)
        for warning in results.warnings:
            print(f"⚠ {warning}")
        print(f"report: {results.output_dir / 'report.md'} (tables; every cell's numbers in results.json)")
        plots = [f for f in results.files if f.suffix == ".png"]
        if plots:
            print(f"plots:  {plots[0].parent}/ ({len(plots)} PNG{'s' * (len(plots) > 1)}: {', '.join(p.name for p in plots[:4])}"
                  + (", ..." if len(plots) > 4 else "") + ")")  # fmt: skip


if __name__ == "__main__":
    main()
