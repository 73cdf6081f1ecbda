"""Does a head-wise (ragged) cache decode as fast as a uniform one? Each head-wise press beside its uniform counterpart.

Pairs (the head-wise press first; same compression ratio, so the same number of kept entries per layer):

| pair                   | head-wise                                       | uniform counterpart                      |
|------------------------|-------------------------------------------------|------------------------------------------|
| adakv_snapkv           | ``adakv`` over ``snapkv``                       | ``snapkv``                               |
| adakv_ea               | ``adakv_expected_attention`` (ε = 1e-2)         | ``expected_attention`` (ε = 1e-2)        |
| twinkv                 | ``twinkv`` (adapted capacities)                 | ``twinkv`` with ``capacity="uniform"``   |
| core_pool              | ``core``, adaptive, output pooling, no memory    | ``core``, no memory                      |
| core_repair            | ``core``, adaptive, repair, no memory            | ``core``, repair, no memory              |
| core_memory            | ``core``, adaptive, output pooling, memory       | ``core``, memory                         |

(the CORE rows are the README's 75% and 90% recommendations and the artifact's defaults with head-wise budgets;
they need ``--checkpoint``, else an untrained artifact fitted to the model is used: cost depends on shapes).

Per context length: one prefill per press (one-shot), then ``--steps`` single-token decode steps on its compressed
cache, ``--repeats`` rounds with the press order rotating; the decode time is the median over rounds of CPU seconds
per step (one thread: CPU time, not wall time, because the host is shared). Printed per length: ms per token of
each side, the ratio head-wise ÷ uniform, the bytes each cache holds (a ragged cache's pages, free slots and slot
mask included) and its kept entries alone, and how unequal the heads are (mean over layers of longest ÷ mean head).
The last line is a one-line ratio summary to compare run to run. Usage::

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.ragged_decode --model smollm2-135m \\
        --checkpoint checkpoints/core-smollm2/final --lengths 2048 4096 8192
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.core_cost import add_model_args, bench_model, build_artifact

CORE_POOL = {"memory": False, "head_pool": "output"}
PAIRS = {  # name -> (head-wise press, its uniform counterpart): (press name, options)
    "adakv_snapkv": (("adakv", {"press": "snapkv"}), ("snapkv", {})),
    "adakv_ea": (("adakv_expected_attention", {}), ("expected_attention", {"epsilon": 1e-2})),
    "twinkv": (("twinkv", {}), ("twinkv", {"capacity": "uniform"})),
    "core_pool": (("core", {"head_budgets": "adaptive", **CORE_POOL}), ("core", {"memory": False})),
    "core_repair": (
        ("core", {"head_budgets": "adaptive", "repair": True, "memory": False}),
        ("core", {"repair": True, "memory": False}),
    ),  # fmt: skip
    "core_memory": (("core", {"head_budgets": "adaptive", "head_pool": "output"}), ("core", {})),
}


def build(name: str, options: dict, ratio: float, checkpoint: Path | None):
    from core_kv.presses import build_press

    if name == "core":
        options = {"checkpoint": str(checkpoint), **options}
    return build_press(name, compression_ratio=ratio, **options)


def decode_seconds(model, cache, n: int, steps: int, press) -> float:
    """CPU seconds per single-token decode step on ``cache`` (the cache is trimmed back afterwards)."""
    from core_kv.pipeline import greedy_answer

    token = torch.tensor([[7]])
    t0 = time.process_time()
    greedy_answer(model, cache, n, token, steps, press, eos_token_ids=[])
    return (time.process_time() - t0) / steps


def imbalance(tokens_per_head: list[list[int]]) -> float:
    """Mean over layers of (longest head ÷ mean head)."""
    return statistics.mean(max(t) / (sum(t) / len(t)) for t in tokens_per_head)


def measure(model, presses: dict, n: int, steps: int, repeats: int) -> dict:
    from core_kv.models.cache import kv_bytes
    from core_kv.pipeline import prefill

    ctx = torch.randint(3, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(n))
    caches, info = {}, {}
    for name, press in presses.items():
        caches[name] = prefill(model, ctx, press)
        acc = kv_bytes(caches[name])
        info[name] = {
            "kv_bytes": acc["total"],
            "kv_payload": acc.get("payload", acc["total"]),
            "imbalance": imbalance(acc["tokens_per_head"]),
        }
    names = list(presses)
    times = {m: [] for m in names}
    for r in range(repeats + 1):  # round 0 primes (first-call overheads) and is dropped
        for m in names[r % len(names) :] + names[: r % len(names)]:
            t = decode_seconds(model, caches[m], n, steps, presses[m])
            if r:
                times[m].append(t)
    return {m: {"decode": statistics.median(times[m])} | info[m] for m in names}


def table(results: dict, pairs: list[str]) -> str:
    rows = [
        "| context | pair | uniform ms/token | head-wise ms/token | head-wise ÷ uniform | bytes uniform | "
        "bytes head-wise (payload) | longest ÷ mean head |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n, r in results.items():
        if "none" in r:
            rows.append(
                f"| {n} | (no compression) | {1e3 * r['none']['decode']:.2f} | | | {r['none']['kv_bytes']:,} | | |"
            )
        for p in pairs:
            u, h = r[f"{p}/uniform"], r[f"{p}/headwise"]
            rows.append(
                f"| {n} | {p} | {1e3 * u['decode']:.2f} | {1e3 * h['decode']:.2f} | {h['decode'] / u['decode']:.3f} | "
                f"{u['kv_bytes']:,} | {h['kv_bytes']:,} ({h['kv_payload']:,}) | {h['imbalance']:.2f} |"
            )
    return "\n".join(rows)


def summary(results: dict, pairs: list[str]) -> str:
    cells = []
    for p in pairs:
        ratios = [r[f"{p}/headwise"]["decode"] / r[f"{p}/uniform"]["decode"] for r in results.values()]
        cells.append(f"{p} " + "/".join(f"{x:.2f}" for x in ratios))
    return f"[ragged_decode] head-wise ÷ uniform decode at {'/'.join(results)}: " + "; ".join(cells)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument("--ratio", type=float, default=0.75)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    add_model_args(ap)
    ap.add_argument("--pairs", nargs="+", choices=sorted(PAIRS), default=list(PAIRS))
    ap.add_argument("--no-baseline", action="store_true", help="skip the uncompressed reference row")
    ap.add_argument("--page", type=int, default=None, help="tokens per page of a ragged layer (default: the library's)")
    ap.add_argument("--out", default=None, help="write the results JSON here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.page:
        import core_kv.models.cache as cache_mod

        cache_mod.PAGE_TOKENS = args.page

    model = bench_model(args.model, args.shape, args.layers)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        needs_core = any(PAIRS[p][0][0] == "core" for p in args.pairs)
        ckpt = Path(args.checkpoint) if args.checkpoint else None
        if needs_core and ckpt is None:
            ckpt = build_artifact(model, Path(tmp) / "core")
        for n in args.lengths:
            presses = {} if args.no_baseline else {"none": None}
            for p in args.pairs:
                (hw, hw_opts), (un, un_opts) = PAIRS[p]
                presses[f"{p}/headwise"] = build(hw, hw_opts, args.ratio, ckpt)
                presses[f"{p}/uniform"] = build(un, un_opts, args.ratio, ckpt)
            results[str(n)] = measure(model, presses, n, args.steps, args.repeats)
            print(f"[ragged_decode] {n}: {json.dumps(results[str(n)])}", flush=True)
    print(f"\n{args.model or args.shape}, ratio {args.ratio}, {args.steps} decode steps, median of {args.repeats} "
          f"rounds, {args.threads} thread(s)\n")  # fmt: skip
    print(table(results, args.pairs))
    print(summary(results, args.pairs))
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
