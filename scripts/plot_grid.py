"""Plot a RULER-style grid (score vs fraction removed) from a CSV of measured cells, one line per method.

The grids in ``docs/results.md`` are assembled from several ``eval.py`` runs (different output folders, different
days); this script draws their tables from one CSV that names, for every cell, the results folder it came from::

    python scripts/plot_grid.py docs/figures/smollm2_ruler_2k.csv docs/figures/smollm2_ruler_2k.png \\
        --title "RULER 2k, SmolLM2-135M-Instruct (48 contexts per cell)"

CSV columns: ``method,ratio,average,results`` (``results`` is provenance only). The row ``full`` at ratio 0 is the
reference (drawn dashed); every other method starts from it. The figure uses the same function as ``eval.py``'s
own plots (:func:`core_kv.eval.report.plot_compression_curves`).
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

from core_kv.eval.benchmarks import Benchmark
from core_kv.eval.report import plot_compression_curves

COLUMNS = ("method", "ratio", "average")


def read_cells(path: Path) -> list[dict]:
    """Cells ``{"method", "ratio", "average", "unit", "average_label", "benchmark"}`` from the CSV at ``path``."""
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path}: missing column(s) {missing}; expected at least {list(COLUMNS)}")
        cells = []
        for i, row in enumerate(reader, start=2):
            try:
                ratio, average = float(row["ratio"]), float(row["average"])
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
                }
            )
    if not cells:
        raise ValueError(f"{path}: no rows")
    return cells


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv", type=Path, help="cells: method,ratio,average[,results]")
    ap.add_argument("png", type=Path, help="output figure (written atomically)")
    ap.add_argument("--title", default="", help="figure title")
    args = ap.parse_args(argv)
    out = plot_compression_curves(read_cells(args.csv), args.png, args.title or args.csv.stem)
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()
