"""``benchmarks/needle_wording.py``: what its JSON holds while it runs and when it ends."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import needle_wording
from core_kv.files import atomic_write_json

ROOT = Path(__file__).resolve().parents[1]


def test_needle_wording_writes_each_finished_cell_and_marks_the_last_write_finished(tmp_path, monkeypatch):
    """The JSON holds every cell after each one (``finished`` false until the last), and the final payload's counts
    are the per-prompt rows' counts."""
    writes = []

    def spy(path, payload):
        writes.append(json.loads(json.dumps(payload)))
        atomic_write_json(path, payload)

    monkeypatch.setattr("core_kv.files.atomic_write_json", spy)
    out = tmp_path / "needles.json"
    payload = needle_wording.main(["--model", str(ROOT / "checkpoints" / "proxy-lm"), "--methods", "full", "keydiff",
                                   "--ratios", "0.5", "--wordings", "ruler", "--haystacks", "noise", "--lengths", "256",
                                   "--n", "2", "--seed", "3", "--no-chat-template", "--max-new-tokens", "4",
                                   "--json", str(out)])  # fmt: skip
    assert [w["finished"] for w in writes] == [False, False, True]
    assert [len(w["results"]) for w in writes] == [1, 2, 2]
    assert json.loads(out.read_text()) == writes[-1] == json.loads(json.dumps(payload))
    for r in payload["results"]:
        rows = [a for a in payload["answers"] if a["method"] == r["method"]]
        assert r["n"] == len(rows) == 2 and r["answered"] == sum(a["ok"] for a in rows)
