"""Cost of the TwinKV repair pass on top of the press it wraps (paper 001 §3.5).

Construction (prefill + compression) of ``twin_repair(snapkv)`` against SnapKV alone, same model, lengths and
protocol as ``benchmarks/twinkv_cost.py`` (interleaved median CPU time in one process per length; peak RSS above
the primed level, one process per condition). A second table times the best-surviving-twin statistic ``b`` for
one layer's KV heads: the retained-set-only blockwise form used here (``O(n·K·d)``) against the paper's full
``n × n`` matrix. Usage::

    .venv/bin/python benchmarks/repair_cost.py --lengths 1024 2048 4096 8192 --repeats 3
"""

from __future__ import annotations

import argparse
import sys

import torch

from benchmarks.twinkv_cost import MODEL, interleaved_cpu_seconds, run_job


def construction_table(lengths, repeats, threads, ratio, inner) -> str:
    presses = {
        "alone": {"name": inner, "options": {"compression_ratio": ratio}},
        "repair": {"name": "twin_repair", "options": {"press": inner, "compression_ratio": ratio}},
    }
    rows = [
        f"| N | {inner} (CPU s) | {inner} + repair (CPU s) | time ratio | {inner} peak (MiB) "
        "| + repair peak (MiB) | peak ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for n in lengths:
        job = {"n": n, "repeats": repeats, "threads": threads}
        t = run_job({"kind": "construct_time", "presses": presses} | job)
        m = {k: run_job({"kind": "construct_peak", "presses": {k: presses[k]}} | job)["peak_bytes"] for k in presses}
        rows.append(
            f"| {n} | {t['alone']:.3f} | {t['repair']:.3f} | {t['repair'] / t['alone']:.2f} "
            f"| {m['alone'] / 2**20:.1f} | {m['repair'] / 2**20:.1f} | {m['repair'] / max(m['alone'], 1):.2f} |"
        )
        print(rows[-1], file=sys.stderr, flush=True)
    return "\n".join(rows)


def twin_statistic_table(lengths, repeats, ratio) -> str:
    from core_kv.presses.twin_repair import best_twin, naive_best_twin

    heads, d = MODEL["num_key_value_heads"], MODEL["hidden_size"] // MODEL["num_attention_heads"]
    rows = ["| N | K | retained-only blockwise (CPU s) | full n×n (CPU s) | ratio |", "|---|---|---|---|---|"]
    for n in lengths:
        g = torch.Generator().manual_seed(n)
        keys = torch.randn(heads, n, d, generator=g)
        k = int(n * (1 - ratio))
        kept = [torch.randperm(n, generator=g)[:k].sort().values for _ in range(heads)]
        fns = {
            name: (lambda fn=fn, keys=keys, kept=kept: [fn(keys[h], kept[h]) for h in range(heads)])
            for name, fn in (("block", best_twin), ("naive", naive_best_twin))
        }
        best_twin(keys[0, :256], kept[0][kept[0] < 256])  # warmup
        naive_best_twin(keys[0, :256], kept[0][kept[0] < 256])
        cost = interleaved_cpu_seconds(fns, repeats)
        rows.append(f"| {n} | {k} | {cost['block']:.4f} | {cost['naive']:.4f} | {cost['block'] / cost['naive']:.2f} |")
    return "\n".join(rows)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--ratio", type=float, default=0.75)
    p.add_argument("--press", default="snapkv", help="the wrapped press")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"### Repair pass around {args.press}, r = {args.ratio}, {args.threads} CPU thread(s)\n")
    print(construction_table(args.lengths, args.repeats, args.threads, args.ratio, args.press))
    print(f"\n### Best-surviving-twin statistic b, one layer ({MODEL['num_key_value_heads']} KV heads, d = 64)\n")
    print(twin_statistic_table(args.lengths, args.repeats, args.ratio))


if __name__ == "__main__":
    main()
