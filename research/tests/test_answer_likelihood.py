"""``research/answer_likelihood.py``: the needle's teacher-forced likelihood under a compressed cache (issue 20's
end-to-end retrieval signal). Row alignment of the scores, and a run on the proxy LM where the full cache must be
its own reference and a press must change the cache it is scored on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from research import answer_likelihood

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = vars(answer_likelihood)


def test_answer_scores_read_the_rows_that_predict_the_answer():
    vocab, answer = 6, [2, 4, 1]
    lp = torch.full((5, vocab), -10.0)  # rows 0..4 predict fed tokens 1..5; the last 3 predict the answer
    lp[0, 5] = lp[1, 5] = -0.1  # rows before the answer's: must not count
    lp[2, 2] = -0.5
    lp[3, 3] = -0.2  # argmax 3, the answer's token 4 has -10: the first miss is at index 1
    lp[3, 4] = -1.0
    lp[4, 1] = -0.3
    got = SCRIPT["answer_scores"](lp, answer)
    assert got["nll"] == pytest.approx((0.5 + 1.0 + 0.3) / 3)
    assert got["top1"] is False and got["first_miss"] == 1
    lp[3, 4] = 0.0
    got = SCRIPT["answer_scores"](lp, answer)
    assert got["top1"] is True and got["first_miss"] == len(answer)


@pytest.mark.skipif(not (ROOT / "checkpoints" / "proxy-lm").is_dir(), reason="the shipped proxy LM is not checked out")
def test_full_cache_is_its_own_reference_and_a_press_is_scored_on_its_cache(tmp_path):
    out = SCRIPT["main"]([
        "--model", str(ROOT / "checkpoints" / "proxy-lm"), "--methods", "full", "streaming_llm", "--ratio", "0.9",
        "--haystacks", "noise", "--n", "2", "--length", "256", "--json", str(tmp_path / "al.json"),
    ])  # fmt: skip
    assert (tmp_path / "al.json").is_file()
    rows = {(r["method"], r["prompt"]): r for r in out["rows"]}
    assert len(rows) == 4
    summary = {s["method"]: s for s in out["summary"]}
    assert summary["full"]["dnll"] == 0.0
    # StreamingLLM at 90% keeps 4 sinks + the last ~20 tokens of a 256-token noise haystack: the needle's value is
    # gone unless it sits in that window, so its likelihood must differ from the full cache's on some prompt
    assert any(rows[("streaming_llm", i)]["nll"] != rows[("full", i)]["nll"] for i in range(2))


def test_memory_audit_is_the_query_weighted_compensation_gain_of_each_forward():
    """G = 1 − Σ‖o* − ô‖ / Σ‖o* − o_R‖ over (query, head), each row's per-head means weighted by its query count;
    the question forward's rows never enter the answer's numbers."""
    row = lambda layer, q, comp, ret, gate, alpha: {  # noqa: E731
        "layer": layer, "queries": q, "comp_err": comp, "ret_err": ret, "gate": gate, "alpha": alpha,
    }  # fmt: skip
    answer = [
        row(0, 3, [1.0, 3.0], [2.0, 2.0], [0.1, 0.3], [0.2, 0.2]),
        row(1, 3, [4.0, 0.0], [1.0, 1.0], [0.5, 0.5], [0.1, 0.3]),
    ]
    question = [row(0, 10, [0.0, 0.0], [5.0, 5.0], [0.9, 0.9], [0.9, 0.9])]
    got = SCRIPT["memory_audit"](question, answer)
    assert got["gain_answer"] == pytest.approx(1 - (3 * 4 + 3 * 4) / (3 * 4 + 3 * 2))
    assert got["gain_question"] == pytest.approx(1.0)
    assert got["gate_answer"] == pytest.approx((0.1 + 0.3 + 0.5 + 0.5) / 4)
    assert got["alpha_answer"] == pytest.approx(0.2)
    assert got["gain_answer_layers"] == {"0": pytest.approx(0.0), "1": pytest.approx(-1.0)}


@pytest.mark.skipif(
    not (ROOT / "checkpoints" / "core-proxy" / "final").is_dir(),
    reason="the shipped proxy CORE artifact is not checked out",
)
def test_audited_core_press_scores_the_answer_as_the_unaudited_one(tmp_path):
    """Logging the certificate feeds the question and the answer-predicting queries in two forwards: the answer's
    likelihood must not move, and the audit's gate and true evicted mass are shares in [0, 1]."""
    ckpt = str(ROOT / "checkpoints" / "core-proxy" / "final")
    out = SCRIPT["main"]([
        "--model", str(ROOT / "checkpoints" / "proxy-lm"), "--methods", "core", "audited", "--ratio", "0.75",
        "--press-option", f"core.checkpoint={ckpt}", "--press-option", "audited.kind=core_certified",
        "--press-option", f"audited.checkpoint={ckpt}", "--press-option", 'audited.policy="paper"',
        "--press-option", 'core.policy="paper"',
        "--haystacks", "noise", "--n", "2", "--length", "256",
    ])  # fmt: skip
    rows = {(r["method"], r["prompt"]): r for r in out["rows"]}
    for i in range(2):
        assert rows[("audited", i)]["nll"] == pytest.approx(rows[("core", i)]["nll"], abs=1e-4)
        assert "gain_answer" not in rows[("core", i)]
        a = rows[("audited", i)]
        assert 0 <= a["gate_answer"] <= 1 and 0 < a["alpha_answer"] <= 1
        assert a["gain_answer"] == a["gain_answer"] and a["gain_question"] == a["gain_question"]  # not NaN
        assert len(a["gain_answer_layers"]) > 0


@pytest.mark.skipif(
    not (ROOT / "checkpoints" / "core-proxy" / "final").is_dir(),
    reason="the shipped proxy CORE artifact is not checked out",
)
def test_memory_audit_without_a_memory_is_refused_naming_the_label():
    ckpt = str(ROOT / "checkpoints" / "core-proxy" / "final")
    with pytest.raises(SystemExit, match=r"nomem: core_certified audits the memory"):
        SCRIPT["main"]([
            "--model", str(ROOT / "checkpoints" / "proxy-lm"), "--methods", "nomem", "--ratio", "0.75",
            "--press-option", "nomem.kind=core_certified", "--press-option", f"nomem.checkpoint={ckpt}",
            "--press-option", "nomem.memory=false",
            "--haystacks", "noise", "--n", "1", "--length", "256",
        ])  # fmt: skip
