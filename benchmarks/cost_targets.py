"""Issue 48's cost targets, measured side by side in one run: prefill, decode and bytes per press and configuration.

Every press of :data:`PRESSES` (no compression, SnapKV, ExpectedAttention, AdaKV, TwinKV, CORE's default and its
recommended configurations, each head-wise press beside its uniform counterpart) runs on the same context in one
process, ``--repeats`` rounds with the press order rotating (``benchmarks/core_cost.py``'s :func:`measure`: median
CPU seconds of a one-shot prefill and of a decode token — an 8-token question then 32 greedy tokens — one thread).
Printed per context length: prefill and decode as ratios to no compression, decode to SnapKV and to the press's
uniform counterpart, the KV bytes held (a ragged cache's free room included) and the kept entries, the auxiliary
state (CORE's memory) as a share of the KV; then the targets, each met or missed:

- default CORE prefill ≤ 1.15× no compression at 2k, ≤ 1.10× at 4k and 8k;
- default CORE decode ≤ 1.05× SnapKV;
- every head-wise press decodes ≤ 1.05× its uniform counterpart;
- default CORE's auxiliary state ≤ 25% of its kept KV at 2k;
- with ``--shape llama-3.1-8b --layers N``: default CORE prefill ≤ 1.05× no compression.

The last line is a one-line ratio summary to compare run to run. Usage::

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.cost_targets --model smollm2-135m \\
        --checkpoint checkpoints/core-smollm2/final --lengths 2048 4096 8192
    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.cost_targets --shape llama-3.1-8b --layers 2 \\
        --lengths 2048 4096 --only none snapkv core
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from benchmarks.core_cost import add_model_args, bench_model, build_artifact, measure

CORE_75 = {"head_budgets": "adaptive", "head_pool": "output", "memory": False}  # README's 75% recommendation
CORE_90 = {"head_budgets": "adaptive", "repair": True, "memory": False}  # README's 90% recommendation
PRESSES = {  # label -> (press name, options, uniform counterpart's label or None)
    "none": (None, {}, None),
    "snapkv": ("snapkv", {}, None),
    "adakv_snapkv": ("adakv", {"press": "snapkv"}, "snapkv"),
    "expected_attention": ("expected_attention", {"epsilon": 1e-2}, None),
    "adakv_expected_attention": ("adakv_expected_attention", {}, "expected_attention"),
    "twinkv_uniform": ("twinkv", {"capacity": "uniform"}, None),
    "twinkv": ("twinkv", {}, "twinkv_uniform"),
    "core": ("core", {}, None),  # the artifact's defaults: what build_press("core", checkpoint=..., ratio) does
    "core_uniform_nomem": ("core", {"memory": False}, None),
    "core_75": ("core", CORE_75, "core_uniform_nomem"),
    "core_uniform_repair": ("core", {"repair": True, "memory": False}, None),
    "core_90": ("core", CORE_90, "core_uniform_repair"),
}


def build(label: str, ratio: float, checkpoint: Path | None):
    from core_kv.presses import build_press

    name, options, _ = PRESSES[label]
    if name is None:
        return None
    if name == "core":
        options = {"checkpoint": str(checkpoint), **options}
    return build_press(name, compression_ratio=ratio, **options)


def table(results: dict) -> str:
    rows = [
        "| context | press | prefill s | prefill ÷ none | decode ms/token | decode ÷ none | decode ÷ SnapKV | "
        "decode ÷ uniform | KV bytes held (kept) | aux ÷ kept KV |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for n, r in results.items():
        for label, v in r.items():
            uniform = PRESSES[label][2]
            ratio_u = f"{v['decode'] / r[uniform]['decode']:.3f} ({uniform})" if uniform in r else ""
            snap = f"{v['decode'] / r['snapkv']['decode']:.3f}" if "snapkv" in r else ""
            kept = v.get("kv_payload", v["kv_bytes"])
            rows.append(
                f"| {n} | {label} | {v['prefill']:.2f} | {v['prefill'] / r['none']['prefill']:.3f} | "
                f"{1e3 * v['decode']:.1f} | {v['decode'] / r['none']['decode']:.3f} | {snap} | {ratio_u} | "
                f"{v['kv_bytes'] / 2**20:.1f} MiB ({kept / 2**20:.1f}) | {100 * v['aux_bytes'] / kept:.0f}% |"
            )
    return "\n".join(rows)


def targets(results: dict, llama: bool) -> list[tuple[str, float, float, bool]]:
    """``(what, measured, bound, met)`` for every target the run can check."""
    out = []
    for n, r in results.items():
        n = int(n)
        if "core" not in r:
            continue
        pre = r["core"]["prefill"] / r["none"]["prefill"]
        bound = 1.05 if llama else (1.15 if n <= 2048 else 1.10)
        out.append((f"default CORE prefill ÷ none at {n}", pre, bound, pre <= bound))
        if llama:
            continue
        if "snapkv" in r:
            dec = r["core"]["decode"] / r["snapkv"]["decode"]
            out.append((f"default CORE decode ÷ SnapKV at {n}", dec, 1.05, dec <= 1.05))
        if n == 2048:
            kept = r["core"].get("kv_payload", r["core"]["kv_bytes"])
            aux = r["core"]["aux_bytes"] / kept
            out.append(("default CORE aux ÷ kept KV at 2048", aux, 0.25, aux <= 0.25))
    if llama:
        return out
    for n, r in results.items():
        for label, v in r.items():
            uniform = PRESSES[label][2]
            if uniform in r:
                x = v["decode"] / r[uniform]["decode"]
                out.append((f"{label} decode ÷ {uniform} at {n}", x, 1.05, x <= 1.05))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument("--ratio", type=float, default=0.75)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    add_model_args(ap, feature_spec=2)
    ap.add_argument("--only", nargs="+", choices=sorted(PRESSES), default=None, help="a subset of the presses")
    ap.add_argument("--out", default=None, help="write the results JSON here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    labels = [p for p in PRESSES if args.only is None or p in args.only]
    if "none" not in labels:
        ap.error("--only must keep 'none' (every ratio is to no compression)")

    model = bench_model(args.model, args.shape, args.layers)
    llama = args.model is None and args.shape == "llama-3.1-8b"
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = None
        if any(PRESSES[p][0] == "core" for p in labels):
            ckpt = (
                Path(args.checkpoint)
                if args.checkpoint
                else build_artifact(model, Path(tmp) / "core", args.feature_spec)
            )
        for n in args.lengths:
            methods = {label: build(label, args.ratio, ckpt) for label in labels}
            results[str(n)] = measure(model, methods, n, None, args.repeats)
            print(f"[cost_targets] {n}: {json.dumps(results[str(n)])}", flush=True)
    print(f"\n{args.model or args.shape}{f' ({args.layers} layers)' if args.layers else ''}, ratio {args.ratio}, "
          f"one-shot prefill, median of {args.repeats} rounds, {args.threads} thread(s)\n")  # fmt: skip
    print(table(results))
    checks = targets(results, llama)
    print("\n| target | measured | bound | |\n|---|---|---|---|")
    for what, x, bound, met in checks:
        print(f"| {what} | {x:.3f} | {bound} | {'met' if met else 'MISSED'} |")
    cells = [f"{what.replace(' ÷ ', '/')} {x:.2f}" for what, x, _, _ in checks]
    print(f"[cost_targets] {sum(m for *_, m in checks)}/{len(checks)} targets met: " + "; ".join(cells))
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
