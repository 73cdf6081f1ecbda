"""The cost of what ships (issue 61): an artifact's own inference policy at each of its ratio bands, side by side with
no compression and SnapKV, on the artifact's model or on config-built Llama-3.1-8B-shaped layers.

For every band of the artifact's recorded policy (its validation ratio: 50 / 75 / 90% for the shipped artifacts;
``--ratios`` to choose) the press is exactly what a user builds, ``build_press("core", checkpoint=...,
compression_ratio=r)``, named by the composition its repr shows (e.g. ``shared, memory off``); nothing is hand-listed.
SnapKV at the same ratio (the same budget) is the decode baseline. Every press runs on the same context in one
process, ``--repeats`` rounds with the press order rotating after a short priming round
(``benchmarks/core_cost.py``'s :func:`~benchmarks.core_cost.measure`: median CPU seconds of a one-shot prefill and of
a decode token — an 8-token question then 32 greedy tokens, five passes per round interleaved across the presses —
one thread). Printed per context length and band:

- prefill ÷ no compression (the time with the press over the time without it),
- decode ms/token ÷ SnapKV's at the same budget,
- the KV payload kept and the auxiliary state (``press.aux_bytes()`` after the prefill: what the press holds beside
  the kept KV while it decodes, the definition eval reports and ``answer_questions`` use too), and its share of the KV;

then the issue's targets, each met or missed: on the 8B shape prefill ≤ 1.10× no compression and decode ≤ 1.05×
SnapKV at every length; on the artifact's model prefill ≤ 1.20× at 2k and 4k and decode ≤ 1.05× SnapKV. ``--markdown``
writes the table ``docs/results.md`` §5 shows; ``--out`` the raw results (``benchmarks/cost_curve.py`` plots several
against context length).

``--shape llama-3.1-8b --layers N`` measures the first N decoder layers of Llama-3.1-8B built from its config with
random weights (hidden 4096, 32 query / 8 KV heads, head dim 128, MLP 14336; :data:`benchmarks.core_cost.SHAPES`)
instead of ``--model``: the artifact's components cannot run on another model's keys, so an untrained artifact is
fitted to those layers (:func:`~benchmarks.core_cost.build_artifact`: geometry on their keys, default MLPs) with the
checkpoint's feature spec, protected positions and inference policy — the same shapes, features and composition per
band, which is what the cost depends on. Usage::

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.cost_targets --model smollm2-135m \\
        --checkpoint checkpoints/core-smollm2/final --lengths 2048 4096 --threads 1
    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.cost_targets --shape llama-3.1-8b --layers 1 \\
        --checkpoint checkpoints/core-smollm2/final --lengths 4096 8192 16384 --threads 1
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from benchmarks.core_cost import add_model_args, bench_model, markdown_table, measure, shape_artifact

SHAPE_TARGETS = {"prefill": 1.10, "decode": 1.05}  # config-built 8B layers, at every length
MODEL_TARGETS = {"prefill": 1.20, "decode": 1.05}  # the artifact's model; the prefill bound at <= PREFILL_UPTO tokens
PREFILL_UPTO = 4096


def policy_ratios(checkpoint: Path) -> list[float]:
    """The validation ratio of every band of the artifact's inference policy, at any of its validated lengths (the
    paper's press: 0.75 alone)."""
    from core_kv.core_model import CoreModel

    core = CoreModel.from_pretrained(checkpoint)
    if core.config.inference_policy is None:
        return [0.75]
    return sorted({b.validated_at for lb in core.policy().lengths for b in lb.bands})


def presses(checkpoint: Path, ratios: list[float]) -> dict:
    """``{"none": None, "snapkv@r": SnapKV, "core@r": the artifact's policy at r}`` for every ratio."""
    from core_kv.presses import build_press

    out: dict = {"none": None}
    for r in ratios:
        out[f"snapkv@{r:g}"] = build_press("snapkv", compression_ratio=r)
        out[f"core@{r:g}"] = build_press("core", checkpoint=str(checkpoint), compression_ratio=r)
    return out


def rows(results: dict, compositions: dict) -> list[dict]:
    """One row per (context, CORE band): the ratios and bytes of the table (``compositions``: per CORE label, the
    composition it runs at each context length)."""
    out = []
    for n, r in results.items():
        for label, by_length in compositions.items():
            ratio = label.split("@")[1]
            core, snap, none = r[label], r[f"snapkv@{ratio}"], r["none"]
            out.append({
                "context": int(n), "ratio": float(ratio), "composition": by_length[n],
                "prefill_none_s": none["prefill"], "prefill_s": core["prefill"],
                "prefill_ratio": core["prefill"] / none["prefill"],
                "decode_ms": 1e3 * core["decode"], "decode_snapkv_ms": 1e3 * snap["decode"],
                "decode_ratio": core["decode"] / snap["decode"],
                "kv_payload": core["kv_payload"], "aux_bytes": core["aux_bytes"],
            })  # fmt: skip
    return out


def table(table_rows: list[dict]) -> str:
    header = ["context", "removed", "composition", "prefill s, none", "prefill ÷ none", "decode ms/token",
              "decode ÷ SnapKV", "KV kept", "aux", "aux ÷ kept KV"]  # fmt: skip
    return markdown_table(header, [[
        str(x["context"]), f"{100 * x['ratio']:.0f}%", x["composition"], f"{x['prefill_none_s']:.2f}",
        f"{x['prefill_ratio']:.3f}", f"{x['decode_ms']:.1f}", f"{x['decode_ratio']:.3f}",
        f"{x['kv_payload'] / 2**20:.1f} MiB", f"{x['aux_bytes'] / 2**20:.2f} MiB",
        f"{100 * x['aux_bytes'] / x['kv_payload']:.1f}%",
    ] for x in table_rows])  # fmt: skip


def targets(table_rows: list[dict], shape: bool) -> list[tuple[str, float, float, bool]]:
    """``(what, measured, bound, met)`` for every target the run can check."""
    bounds = SHAPE_TARGETS if shape else MODEL_TARGETS
    out = []
    for x in table_rows:
        where = f"{x['context']}, {100 * x['ratio']:.0f}% ({x['composition']})"
        if shape or x["context"] <= PREFILL_UPTO:
            out.append((f"prefill ÷ none at {where}", x["prefill_ratio"], bounds["prefill"],
                        x["prefill_ratio"] <= bounds["prefill"]))  # fmt: skip
        out.append((f"decode ÷ SnapKV at {where}", x["decode_ratio"], bounds["decode"],
                    x["decode_ratio"] <= bounds["decode"]))  # fmt: skip
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=None, help="default: 2048 4096 (8B shape: 4k-16k)")
    ap.add_argument("--ratios", type=float, nargs="+", default=None, help="default: the policy's band ratios")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    add_model_args(ap)
    ap.add_argument("--markdown", default=None, help="write the table (markdown) here")
    ap.add_argument("--out", default=None, help="write the results JSON here")
    args = ap.parse_args(argv)
    if args.checkpoint is None:
        ap.error("--checkpoint: the artifact whose policy is measured (e.g. checkpoints/core-smollm2/final)")
    checkpoint = Path(args.checkpoint)
    shape = args.model is None
    lengths = args.lengths or ([4096, 8192, 16384] if shape else [2048, 4096])
    ratios = args.ratios or policy_ratios(checkpoint)
    torch.set_num_threads(args.threads)

    model = bench_model(args.model, args.shape, args.layers)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = shape_artifact(model, checkpoint, Path(tmp) / "core") if shape else checkpoint
        methods = presses(ckpt, ratios)
        compositions = {k: {str(n): p.composition(n).describe() for n in lengths}  # a length band's at each length
                        for k, p in methods.items() if k.startswith("core@")}  # fmt: skip
        for n in lengths:
            results[str(n)] = measure(model, methods, n, None, args.repeats)
            print(f"[cost_targets] {n}: {json.dumps(results[str(n)])}", flush=True)
    table_rows = rows(results, compositions)
    what = args.model or f"{args.shape} ({args.layers or 'all'} layers)"
    head = (f"{what}, {checkpoint}'s policy, one-shot prefill, median of {args.repeats} rounds (press order rotating), "
            f"CPU time of {args.threads} thread(s)")  # fmt: skip
    print(f"\n{head}\n\n{table(table_rows)}")
    checks = targets(table_rows, shape)
    print("\n| target | measured | bound | |\n|---|---|---|---|")
    for name, x, bound, met in checks:
        print(f"| {name} | {x:.3f} | {bound} | {'met' if met else 'MISSED'} |")
    print(f"[cost_targets] {sum(m for *_, m in checks)}/{len(checks)} targets met")
    if args.markdown:
        Path(args.markdown).write_text(f"{head}\n\n{table(table_rows)}\n", encoding="utf-8")
    if args.out:
        record = {"args": vars(args), "model": what, "compositions": compositions, "results": results,
                  "rows": table_rows}  # fmt: skip
        Path(args.out).write_text(json.dumps(record, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
