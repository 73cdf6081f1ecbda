"""Reports read at a glance: markdown tables (methods × ratios, per task, with KV payload and auxiliary bytes),
compression-curve PNGs (score vs fraction of the cache removed, like the papers' figures), and tracker logging.

Cells are the ``metrics.json`` dicts the runner writes. The ``full`` reference is stored once as ratio 0 and shown at
every ratio: it is the uncompressed model, whatever the ratio.
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

from core_kv.eval.benchmarks import Benchmark, get_benchmark
from core_kv.eval.schema import ratio_label

REFERENCE = "full"
REFERENCE_FLOOR = 40.0
"""Default floor of the full-cache reference (0-100 scores): a benchmark or task the uncompressed model scores below
it cannot rank compression methods, and the report says so (the SmolLM2 card's rule, docs/models/smollm2-135m.md)."""


def reference_warnings(cells: list[dict], floor: float = REFERENCE_FLOOR) -> dict[str, list[str]]:
    """Per benchmark, the warnings its full-cache reference earns: its average, or any task, below ``floor``.

    Only 0-100 scores where higher is better are checked (a KL is 0 for the reference by definition).

    Returns:
        ``{benchmark: [warning, ...]}`` for the benchmarks with at least one warning.
    """
    out: dict[str, list[str]] = {}
    for bench in _benchmarks(cells):
        ref = _lookup([c for c in cells if c["benchmark"] == bench], REFERENCE, 0.0)
        if ref is None or not ref.get("higher_is_better", True) or not ref.get("unit", "").startswith("score (0-100)"):
            continue
        notes = []
        if ref.get("average") is not None and ref["average"] < floor:
            notes.append(
                f"{bench}: the full cache (no compression) scores {_fmt(ref['average'])} < {floor:g}: the model does not "
                "solve this benchmark uncompressed, so its cells cannot rank compression methods"
            )
        low = [f"{t} {_fmt(v)}" for t, v in ref.get("tasks", {}).items() if v is not None and v < floor]
        if low and not (notes and len(low) == len(ref.get("tasks", {}))):  # all tasks low: the average note says it
            notes.append(
                f"{bench}: tasks whose full-cache score is below {floor:g} cannot rank methods: {', '.join(low)}"
            )
        if notes:
            out[bench] = notes
    return out


def human_bytes(n: float | None) -> str:
    """``123456`` -> ``"120.6 KiB"``; ``None`` -> ``"-"``."""
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _fmt(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}" if 0 < abs(v) < 0.1 else f"{v:.2f}"
    return str(v)


def _benchmarks(cells: list[dict]) -> list[str]:
    return list(dict.fromkeys(c["benchmark"] for c in cells))


def _methods(cells: list[dict]) -> list[str]:
    return list(dict.fromkeys(c["method"] for c in cells))


def _ratios(cells: list[dict]) -> list[float]:
    return sorted({c["ratio"] for c in cells if c["method"] != REFERENCE})


def _lookup(cells: list[dict], method: str, ratio: float) -> dict | None:
    """The cell of ``method`` at ``ratio``; the reference answers for every ratio."""
    for c in cells:
        if c["method"] == method and (method == REFERENCE or math.isclose(c["ratio"], ratio)):
            return c
    return None


FEW_CONTEXTS = 30  # below this many contexts per cell a table says it cannot rank methods


def small_n_caveat(contexts: int) -> str:
    """The caveat printed beside a table of fewer than :data:`FEW_CONTEXTS` contexts per cell ("" above): one
    context moves a score by 100/n points, and the 95% interval of a 50% score spans ±98/√n."""
    if not contexts or contexts >= FEW_CONTEXTS:
        return ""
    return (f" ⚠ Too few to rank methods: one context moves a score by {100 / contexts:.0f} points and a 95% "
            f"interval around 50% spans ±{98 / math.sqrt(contexts):.0f}; a ranking needs more contexts (e.g. "
            f"configs/eval/smollm2_ruler.yaml).")  # fmt: skip


def markdown_report(cells: list[dict], model_label: str, cfg=None) -> str:
    """The run's tables, one section per benchmark.

    Each section has the headline table (methods × ratios of the benchmark's average, the reference row repeated
    at every ratio), then one row per (method, ratio) with every task, the average, and the mean KV payload bytes,
    auxiliary bytes and context tokens per context.

    Args:
        cells: cell metrics in run order.
        model_label: the model as reports name it (the tiny random model says so).
        cfg: the run config (for a header line), optional.

    Returns:
        Markdown text.
    """
    lines = [f"# core_kv evaluation - model: {model_label}", ""]
    floor = getattr(cfg, "reference_floor", REFERENCE_FLOOR)
    flagged = reference_warnings(cells, floor) if floor is not None else {}
    if flagged:
        lines += ["**Warnings (⚠):**", "", *(f"- ⚠ {w}" for ws in flagged.values() for w in ws), ""]
    if cfg is not None:
        cap = cfg.generation.max_new_tokens
        lines.append(
            f"methods {list(cfg.methods)} x ratios {list(cfg.ratios)} (fraction of the KV cache removed); "
            f"reference `{REFERENCE}` computed once per benchmark"
            + (f"; generation capped at {cap} new tokens (smoke: not comparable to published numbers)" if cap else "")
        )
        lines.append("")
    for bench in _benchmarks(cells):
        bc = [c for c in cells if c["benchmark"] == bench]
        ratios = _ratios(bc)
        first = bc[0]
        direction = "higher is better" if first.get("higher_is_better", True) else "lower is better"
        lines += [f"## {bench} - {first.get('average_label', 'average')} ({direction})", ""]
        lines += [f"⚠ {w}" + "  " for w in flagged.get(bench, [])] + ([""] if bench in flagged else [])
        ref = _lookup(bc, REFERENCE, 0.0)
        below = ref is not None and bench in flagged and ref.get("average") is not None and ref["average"] < floor
        lines += _grid_table(bc, ratios, "average", flag=below)
        for title, key in get_benchmark(first.get("kind", bench)).report_tables(bc):
            lines += [f"**{title}**", "", *_grid_table(bc, ratios, key, digits=4)]
        tasks = list(dict.fromkeys(t for c in bc for t in c.get("tasks", {})))
        lengths = list(dict.fromkeys(L for c in bc for L in c.get("by_length", {})))
        ref_tasks = ref.get("tasks", {}) if ref is not None and bench in flagged else {}
        low = {t for t in tasks if ref_tasks.get(t) is not None and ref_tasks[t] < floor}
        head = ["method", "ratio", *(f"{t} ⚠" if t in low else t for t in tasks), *(f"avg L={L}" for L in lengths)]
        head += ["average ⚠" if below else "average"]
        head += ["KV payload / ctx", "aux state / ctx", "ctx tokens"]
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "---|" * len(head))
        for c in bc:
            row = [c["method"], ratio_label(c["ratio"]), *(_fmt(c["tasks"].get(t)) for t in tasks)]
            row += [*(_fmt(c.get("by_length", {}).get(L)) for L in lengths), _fmt(c["average"])]
            row += [
                human_bytes(c.get("kv_bytes")),
                human_bytes(c.get("aux_bytes")),
                f"{c['context_tokens']:.0f}" if c.get("context_tokens") else "-",
            ]
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
        lines.append(f"{first['num_samples']} samples over {first['num_contexts']} contexts per cell."
                     + small_n_caveat(first["num_contexts"]))  # fmt: skip
        lines.append("")
    return "\n".join(lines)


def _grid_table(
    cells: list[dict], ratios: list[float], key: str, digits: int | None = None, flag: bool = False
) -> list[str]:
    """Methods × ratios of ``cell[key]``; the reference row repeats its one value at every ratio. ``flag`` marks the
    reference row as below the floor (⚠)."""
    columns = ratios or [0.0]  # a reference-only run has one column
    lines = ["| method | " + " | ".join(ratio_label(r) for r in columns) + " |", "|---|" + "---|" * len(columns)]
    for m in _methods(cells):
        vals = [_lookup(cells, m, r) for r in columns]
        name = (f"{m} (reference)" + (" ⚠ below the floor" if flag else "")) if m == REFERENCE else m
        shown = [v.get(key) if v else None for v in vals]
        text = [f"{x:.{digits}f}" if digits is not None and x is not None else _fmt(x) for x in shown]
        lines.append(f"| {name} | " + " | ".join(text) + " |")
    return [*lines, ""]


def wrap(text: str, width: int) -> str:
    """``text`` broken into lines of at most ``width`` characters (long titles and axis labels stay inside figures)."""
    return "\n".join(textwrap.wrap(text, width)) or text


def dodge(series: dict[str, list[tuple[float, float]]], step: float, spread: float) -> dict[tuple[str, float], float]:
    """Horizontal offsets that keep tied points visible: the methods with the same score at the same x are spread
    side by side around it, ``step`` apart (at most ``spread`` from the first to the last), in method order.

    Args:
        series: per method, its ``(x, y)`` points.
        step: distance between neighbours of a tie.
        spread: the widest a tie may be spread.

    Returns:
        ``{(method, x): offset}`` for every point (0 for a point that ties with none).
    """
    groups: dict[tuple[float, float], list[str]] = {}
    for m, pts in series.items():
        for x, y in pts:
            groups.setdefault((x, round(y, 6)), []).append(m)
    out: dict[tuple[str, float], float] = {}
    for (x, _), members in groups.items():
        k = len(members)
        gap = min(step, spread / (k - 1)) if k > 1 else 0.0
        for j, m in enumerate(members):
            out[(m, x)] = (j - (k - 1) / 2) * gap
    return out


MARKERS = "osD^vP<>X*phd"
"""One marker shape per method (cycled), so lines that share a colour family stay apart."""


def plot_compression_curves(cells: list[dict], path: str | Path, title: str, note: str = "") -> Path:
    """Score vs fraction removed, one line per method (starting from the reference at 0), reference dashed.

    Each method's measured points carry its own marker shape; points where several methods tie are drawn side by
    side (a figure note says so), so no marker hides another. The title and axis labels are wrapped and the figure
    is saved with a tight bounding box, so every text stays inside the image.

    Args:
        cells: the cells of one benchmark.
        path: output PNG (written atomically).
        title: figure title (benchmark and model).
        note: an extra line under the title (e.g. the reference-floor warning).

    Returns:
        The written path.
    """
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from core_kv.files import save_figure

    ref = _lookup(cells, REFERENCE, 0.0)
    methods = [m for m in _methods(cells) if m != REFERENCE]
    ncol = 1 + len(methods) // 15  # a legend column per 15 methods, so a long grid's legend stays inside the figure
    fig = Figure(figsize=(7.5 + 2.6 * (ncol - 1), 4.2))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    colors = matplotlib.colormaps["tab10" if len(methods) <= 10 else "tab20"].colors
    series = {m: sorted((c["ratio"], c["average"]) for c in cells if c["method"] == m) for m in methods}
    offsets = dodge(series, step=0.022, spread=0.12)
    for i, m in enumerate(methods):
        pts = [(x + offsets[(m, x)], y) for x, y in series[m]]
        start = [(0.0, ref["average"])] if ref is not None else []
        line = start + pts
        ax.plot(
            [p[0] for p in line],
            [p[1] for p in line],
            label=m,
            color=colors[i % len(colors)],
            marker=MARKERS[i % len(MARKERS)],
            markevery=list(range(len(start), len(line))),  # the shared reference point carries no marker
            markeredgecolor="black",
            markeredgewidth=0.5,
            markersize=7,
        )
    if ref is not None:
        ax.axhline(ref["average"], color="black", linestyle="--", linewidth=1, label=f"{REFERENCE} (no compression)")
    first = cells[0]
    tied = "\n(tied points drawn side by side)" if any(offsets.values()) else ""
    ax.set_xlabel("compression ratio (fraction of KV cache removed)" + tied)
    ax.set_ylabel(wrap(first.get("average_label", "score"), 40))
    head = wrap(title, 80) + (f"\n{wrap(note, 90)}" if note else "")
    ax.set_title(head, fontsize=10, loc="left")
    ax.set_xlim(-0.02, 1.0)
    if first.get("unit", "").startswith("score (0-100)"):
        ax.set_ylim(-2, 102)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5), ncol=ncol)  # outside: curves fill the plot
    fig.tight_layout()
    return save_figure(fig, path)


def benchmark_plots(
    bench: Benchmark, entry: str, cells: list[dict], out_dir: Path, floor: float | None = REFERENCE_FLOOR
) -> list[Path]:
    """The compression curve of one benchmark plus its own figures (e.g. NIAH heat maps).

    The benchmark's figures need the cells' rows, read back from each ``predictions.jsonl``. A reference below ``floor``
    (:func:`reference_warnings`) is noted under the curve's title.
    """
    from core_kv.eval.schema import cell_dir
    from core_kv.files import read_jsonl

    cells = [c for c in cells if c]
    if not cells:
        return []
    label = cells[0].get("model_label", cells[0]["model"])
    notes = reference_warnings(cells, floor).get(entry, []) if floor is not None else []
    note = "⚠ " + notes[0].split(": ", 1)[1] if notes else ""
    files = [plot_compression_curves(cells, Path(out_dir) / f"curves__{entry}.png", f"{entry} - {label}", note)]
    if type(bench).plots is not Benchmark.plots:
        root = Path(out_dir).parent
        scored = [(c, read_jsonl(cell_dir(root, entry, c["model"], c["method"], c["ratio"]) / "predictions.jsonl"))
                  for c in cells]  # fmt: skip
        files += bench.plots(scored, Path(out_dir), entry, label)
    return files


def log_to_tracker(accelerator, cells: list[dict], markdown: str, images: list[Path]) -> None:
    """Log every cell's metrics, the results table and the PNGs to the accelerator's trackers (main process)."""
    flat = {}
    for c in cells:
        key = f"{c['benchmark']}/{c['method']}/{ratio_label(c['ratio'])}"
        flat[f"{key}/average"] = c["average"]
        flat[f"{key}/kv_bytes"] = c.get("kv_bytes")
        flat[f"{key}/aux_bytes"] = c.get("aux_bytes")
        for t, v in c.get("tasks", {}).items():
            flat[f"{key}/{t}"] = v
    accelerator.log({k: v for k, v in flat.items() if v is not None})
    columns = ["benchmark", "method", "ratio", "average", "kv_bytes", "aux_bytes", "context_tokens"]
    data = [
        [
            c["benchmark"],
            c["method"],
            c["ratio"],
            c["average"],
            c.get("kv_bytes"),
            c.get("aux_bytes"),
            c.get("context_tokens"),
        ]
        for c in cells
    ]
    for tracker in accelerator.trackers:
        if tracker.name == "wandb":
            import wandb

            tracker.log_table("results", columns=columns, data=data)
            tracker.log({"report": wandb.Html(f"<pre>{markdown}</pre>")})
            if images:
                tracker.log_images({p.stem: [wandb.Image(str(p))] for p in images})
