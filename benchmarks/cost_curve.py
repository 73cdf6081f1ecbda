"""Cost against context length (issue 61): prefill ÷ no compression and decode ÷ SnapKV per CORE band, from the JSON
files ``benchmarks/cost_targets.py --out`` writes, plotted on one figure, with the growth exponent of each time.

Runs of the same model are merged (one run may cover some lengths or bands, another the rest). The exponent of a
time ``t(n)`` is the slope of ``log t`` against ``log n`` (least squares over the measured lengths): 1 for a cost
linear in the context, 2 for a quadratic one. Printed per band: the prefill of no compression and of CORE, CORE's
added prefill time (with the press minus without it: the features, the indexer, the selection), and the decode time
per token. Usage::

    .venv/bin/python -m benchmarks.cost_curve runs/cost_smollm2.json runs/cost_8b.json \\
        --plot docs/figures/cost_vs_length.png
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from benchmarks.core_cost import markdown_table
from core_kv.files import save_figure


def exponent(lengths: list[int], times: list[float]) -> float:
    """Least-squares slope of ``log t`` on ``log n`` (NaN with fewer than two lengths or a non-positive time)."""
    pts = [(math.log(n), math.log(t)) for n, t in zip(lengths, times, strict=True) if t > 0]
    if len(pts) < 2:
        return float("nan")
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sxx if sxx else float("nan")


def merge(runs: list[dict]) -> list[dict]:
    """Runs of the same model merged per (CORE band, length): each point keeps the times of the run that measured it,
    its baselines (no compression, SnapKV at the band's ratio) included, so a ratio is always one of a side-by-side
    run; a later run replaces an earlier one's point (e.g. a band re-measured after the policy changed)."""
    merged: dict[str, dict] = {}
    for run in runs:
        m = merged.setdefault(run["model"], {"model": run["model"], "args": run["args"], "points": {}})
        for label, by_length in run["compositions"].items():  # per CORE label: its composition at each length
            ratio = label.split("@")[1]
            for n, per in run["results"].items():
                if label in per:
                    m["points"].setdefault(label, {})[int(n)] = {
                        "composition": by_length[n], "none": per["none"]["prefill"], "prefill": per[label]["prefill"],
                        "decode": per[label]["decode"], "snapkv": per[f"snapkv@{ratio}"]["decode"]}  # fmt: skip
    return list(merged.values())


def growth(run: dict) -> list[dict]:
    """One row per CORE band of a (merged) ``cost_targets`` run: its ratios per length and the exponents."""
    out = []
    for label, points in run["points"].items():
        lengths = sorted(points)
        pts = [points[n] for n in lengths]
        composition = " / ".join(dict.fromkeys(p["composition"] for p in pts))  # one name unless bands differ
        none, pre, dec = ([p[k] for p in pts] for k in ("none", "prefill", "decode"))
        out.append({
            "model": run["model"], "shape": run["args"].get("model") is None, "ratio": float(label.split("@")[1]),
            "composition": composition, "lengths": lengths,
            "prefill_ratio": [p["prefill"] / p["none"] for p in pts],
            "decode_ratio": [p["decode"] / p["snapkv"] for p in pts],
            "exp_prefill_none": exponent(lengths, none), "exp_prefill": exponent(lengths, pre),
            "exp_added": exponent(lengths, [p - b for p, b in zip(pre, none, strict=True)]),
            "exp_decode": exponent(lengths, dec),
        })  # fmt: skip
    return out


def table(curves: list[dict]) -> str:
    header = ["model", "removed", "composition", "contexts", "prefill ÷ none", "decode ÷ SnapKV",
              "exponent: prefill none / CORE / CORE's added time", "exponent: decode"]  # fmt: skip
    return markdown_table(header, [[
        c["model"], f"{100 * c['ratio']:.0f}%", c["composition"], ", ".join(f"{n / 1024:g}k" for n in c["lengths"]),
        " / ".join(f"{x:.2f}" for x in c["prefill_ratio"]), " / ".join(f"{x:.2f}" for x in c["decode_ratio"]),
        f"{c['exp_prefill_none']:.2f} / {c['exp_prefill']:.2f} / {c['exp_added']:.2f}", f"{c['exp_decode']:.2f}",
    ] for c in curves])  # fmt: skip


def plot(curves: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_p, ax_d) = plt.subplots(1, 2, figsize=(11, 4.2))
    for c in curves:
        label = f"{c['model']}, {100 * c['ratio']:.0f}% ({c['composition']})"
        style = "--s" if c["shape"] else "-o"  # config-built layers dashed
        ax_p.plot(c["lengths"], c["prefill_ratio"], style, label=label)
        ax_d.plot(c["lengths"], c["decode_ratio"], style, label=label)
    for ax, title, bound in ((ax_p, "prefill ÷ no compression", None), (ax_d, "decode per token ÷ SnapKV", 1.05)):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context tokens")
        ax.set_title(title)
        ax.axhline(1.0, color="grey", lw=0.8)
        if bound:
            ax.axhline(bound, color="red", lw=0.8, ls=":")
        ax.grid(alpha=0.3)
    ax_p.axhline(1.20, color="red", lw=0.8, ls=":")
    ax_p.axhline(1.10, color="darkred", lw=0.8, ls=":")
    ax_d.legend(fontsize=7, loc="upper left")
    fig.suptitle("CORE's online cost against context length (CPU time, one thread; dotted: issue 61's bounds)")
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", help="JSON files written by benchmarks.cost_targets --out")
    ap.add_argument("--plot", default=None, help="write the figure (PNG) here")
    ap.add_argument("--markdown", default=None, help="write the table (markdown) here")
    args = ap.parse_args(argv)
    runs = []
    for path in args.runs:
        try:
            run = json.loads(Path(path).read_text(encoding="utf-8"))
            runs.append({k: run[k] for k in ("model", "args", "compositions", "results")})
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise SystemExit(f"cost_curve: {path} is not a cost_targets --out file ({type(e).__name__}: {e})") from None
    curves = [c for run in merge(runs) for c in growth(run)]
    print(table(curves))
    if args.markdown:
        Path(args.markdown).write_text(table(curves) + "\n", encoding="utf-8")
    if args.plot:
        plot(curves, Path(args.plot))
        print(f"[cost_curve] wrote {args.plot}")


if __name__ == "__main__":
    main()
