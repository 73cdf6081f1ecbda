"""Plot a RULER-style grid (score vs fraction removed) from a CSV of measured cells, one line per method.

The grids in ``research/notebook.md`` are assembled from several ``eval.py`` runs (different output folders, different
days); this script draws their tables from one CSV that names, for every cell, the results folder it came from::

    python scripts/plot_grid.py docs/figures/smollm2_ruler_2k.csv docs/figures/smollm2_ruler_2k.png \\
        --title "RULER 2k, SmolLM2-135M-Instruct (48 contexts per cell)"

CSV columns: ``method,ratio,average,results`` (``results`` is provenance only). The row ``full`` at ratio 0 is the
reference (drawn dashed); every other method starts from it. The figure uses the same function as ``eval.py``'s
own plots (:func:`core_kv.eval.report.plot_compression_curves`).

A needle grid (score vs context length) adds a ``length`` column (tokens); it is drawn as score vs length, one
panel per compression ratio, the ``full`` rows (ratio 0) dashed in every panel::

    python scripts/plot_grid.py docs/figures/smollm2_needles.csv docs/figures/smollm2_needles.png
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

from core_kv.eval.benchmarks import Benchmark
from core_kv.eval.report import MARKERS, dodge, plot_compression_curves, wrap

COLUMNS = ("method", "ratio", "average")


def read_cells(path: Path) -> list[dict]:
    """Cells ``{"method", "ratio", "average", "unit", "average_label", "benchmark"}`` from the CSV at ``path``."""
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path}: missing column(s) {missing}; expected at least {list(COLUMNS)}")
        cells = []
        by_length = "length" in (reader.fieldnames or [])
        for i, row in enumerate(reader, start=2):
            try:
                ratio, average = float(row["ratio"]), float(row["average"])
                length = int(row["length"]) if by_length else None
            except ValueError:
                raise ValueError(f"{path}:{i}: ratio and average must be numbers, got {row}") from None
            cells.append(
                {
                    "benchmark": path.stem,
                    "method": row["method"].strip(),
                    "ratio": ratio,
                    "average": average,
                    "unit": Benchmark.unit,  # QA benchmarks' unit: the plot fixes the 0-100 axis for it
                    "average_label": f"mean {Benchmark.unit}",
                    **({"length": length} if by_length else {}),
                }
            )
    if not cells:
        raise ValueError(f"{path}: no rows")
    return cells


def plot_length_curves(cells: list[dict], path: Path, title: str) -> Path:
    """Score vs context length, one panel per compression ratio > 0, one line per method; ``full`` dashed."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from core_kv.files import save_figure

    ratios = sorted({c["ratio"] for c in cells if c["ratio"] > 0})
    if not ratios:
        raise ValueError("a length grid needs rows at a compression ratio > 0")
    methods = list(dict.fromkeys(c["method"] for c in cells if c["ratio"] > 0))
    ref = sorted((c["length"], c["average"]) for c in cells if c["method"] == "full" and c["ratio"] == 0)
    fig = Figure(figsize=(4.2 * len(ratios) + 2.0, 3.8))
    FigureCanvasAgg(fig)
    axes = [fig.add_subplot(1, len(ratios), k + 1) for k in range(len(ratios))]
    for ax, r in zip(axes, ratios, strict=True):
        if ref:
            ax.plot(*zip(*ref, strict=True), color="black", linestyle="--", linewidth=1, label="full (no compression)")
        series = {m: sorted((c["length"], c["average"]) for c in cells if c["method"] == m and c["ratio"] == r)
                  for m in methods}  # fmt: skip
        offsets = dodge(series, step=0.06, spread=0.4)  # in octaves: tied points side by side on the log axis
        for i, m in enumerate(methods):
            pts = [(x * 2 ** offsets[(m, x)], y) for x, y in series[m]]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker=MARKERS[i % len(MARKERS)], color=f"C{i % 10}", label=m,
                        markeredgecolor="black", markeredgewidth=0.5)  # fmt: skip
        ax.set_xscale("log", base=2)
        lengths = sorted({c["length"] for c in cells})
        ax.set_xticks(lengths, [f"{n // 1024}k" if n % 1024 == 0 else str(n) for n in lengths])
        ax.set_ylim(-2, 102)
        ax.set_xlabel("context length (tokens)")
        ax.set_title(f"{r:.0%} removed", fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(wrap(cells[0]["average_label"], 40))
    axes[-1].legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.suptitle(wrap(title, 40 * len(ratios) + 20), fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv", type=Path, help="cells: method,ratio,average[,results]")
    ap.add_argument("png", type=Path, help="output figure (written atomically)")
    ap.add_argument("--title", default="", help="figure title")
    args = ap.parse_args(argv)
    cells = read_cells(args.csv)
    plot = plot_length_curves if "length" in cells[0] else plot_compression_curves
    out = plot(cells, args.png, args.title or args.csv.stem)
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()
