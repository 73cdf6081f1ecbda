"""Tables and a compression-curve plot from one or more ``eval.py`` fidelity results folders (research/notebook.md).

Each folder's cells (``<benchmark>__<model>__<method>__<ratio>/metrics.json``) become rows; a ``label=folder``
argument prefixes that folder's methods (e.g. ``chunk512=results/core_fidelity_chunk512``) so one-shot and
chunked runs of the same press sit side by side. Usage (research/notebook.md, CORE ablations)::

    .venv/bin/python -m research.core_fidelity_table results/core_fidelity_proxy results/fidelity_proxy \\
        --plot docs/figures/core_fidelity_proxy.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from core_kv.files import save_figure


def load(specs: list[str]) -> dict:
    """``{method label: {ratio: metrics}}`` over every folder."""
    rows: dict[str, dict[float, dict]] = {}
    for spec in specs:
        label, _, folder = spec.rpartition("=")
        for m in sorted(Path(folder).glob("*/metrics.json")):
            d = json.loads(m.read_text(encoding="utf-8"))
            name = d["method"] if not label or d["method"] == "full" else f"{d['method']} ({label})"
            rows.setdefault(name, {})[float(d["ratio"])] = d
    return rows


def table(rows: dict, key: str, fmt: str) -> str:
    ratios = sorted({r for v in rows.values() for r in v if r > 0})
    out = ["| method | " + " | ".join(f"{r:.0%}" for r in ratios) + " |", "|---|" + "---|" * len(ratios)]
    for name, cells in rows.items():
        if name == "full":
            continue
        vals = [format(cells[r][key], fmt) if r in cells else "—" for r in ratios]
        out.append(f"| {name} | " + " | ".join(vals) + " |")
    return "\n".join(out)


def bytes_table(rows: dict) -> str:
    ratios = sorted({r for v in rows.values() for r in v if r > 0})
    out = ["| method | " + " | ".join(f"{r:.0%} KV / aux (KiB)" for r in ratios) + " |", "|---|" + "---|" * len(ratios)]
    for name, cells in rows.items():
        if name == "full":
            continue
        vals = [f"{cells[r]['kv_bytes'] / 1024:.0f} / {cells[r]['aux_bytes'] / 1024:.0f}" if r in cells else "—"
                for r in ratios]  # fmt: skip
        out.append(f"| {name} | " + " | ".join(vals) + " |")
    return "\n".join(out)


def plot(rows: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    names = [n for n in rows if n != "full"]
    colors = plt.get_cmap("tab10" if len(names) <= 10 else "tab20").colors  # one colour per curve
    for i, name in enumerate(names):
        cells = rows[name]
        rs = sorted(cells)
        core = name.startswith("core")
        ax.plot([100 * r for r in rs], [cells[r]["average"] for r in rs], marker="o" if core else ".",
                linestyle="-" if core else "--", linewidth=2 if name == "core" else 1, label=name,
                color="black" if name == "core" else colors[i % len(colors)])  # fmt: skip
    ax.set_xlabel("KV cache removed (%)")
    ax.set_ylabel("KL(full ‖ compressed), nats/token (lower is better)")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    save_figure(fig, path)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("folders", nargs="+", help="results folders, optionally label=folder")
    ap.add_argument("--plot", default=None)
    ap.add_argument("--title", default="Natural-text fidelity (KL to the full cache)")
    args = ap.parse_args(argv)
    rows = load(args.folders)
    print("KL(full ‖ compressed), nats/token (lower is better)\n\n" + table(rows, "average", ".4f"))
    print("\nTop-1 agreement with the full cache (higher is better)\n\n" + table(rows, "top1_agreement", ".3f"))
    print("\nKV payload / auxiliary state per context\n\n" + bytes_table(rows))
    if args.plot:
        plot(rows, Path(args.plot), args.title)


if __name__ == "__main__":
    main()
