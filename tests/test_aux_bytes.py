"""One definition of a press's auxiliary state (issue 61): ``press.aux_bytes()`` read right after the prefill — what
the press holds beside the kept KV while it decodes — is the figure eval rows, the cost benchmark
(``benchmarks/core_cost.py``'s ``measure``, which ``benchmarks/cost_targets.py`` runs) and ``answer_questions`` report;
and a compression after which no event can follow frees what only a later event would read (the CORE scorer's
observation window and persistence), so the figure does not depend on when it is read."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks.core_cost import measure
from core_kv.eval.benchmarks import Benchmark, GenerationConfig, GroupJob
from core_kv.eval.schema import Sample
from core_kv.models.loading import load_model
from core_kv.pipeline import answer_questions, encode, greedy_answer, prefill
from core_kv.presses import build_press

ROOT = Path(__file__).resolve().parents[1]
ARTIFACT = ROOT / "checkpoints" / "core-proxy" / "final"
CONTEXT = "The grass is green. " * 30 + "The special magic number is 4817263. " + "The sky is blue. " * 30
QUESTION = "What is the special magic number?"


@pytest.fixture(scope="module")
def proxy():
    return load_model(str(ROOT / "checkpoints" / "proxy-lm"), dtype="float32")


def core(**options):
    return build_press("core", checkpoint=str(ARTIFACT), compression_ratio=0.75, **options)


@pytest.mark.parametrize("options", [{}, {"policy": "paper"}])  # the artifact's policy (no memory); the paper's press
def test_eval_rows_the_cost_benchmark_and_answer_questions_report_one_aux_figure(proxy, options):
    model, tok = proxy
    press = core(**options)
    answered = answer_questions(model, tok, CONTEXT, [QUESTION], press=press, max_new_tokens=4)
    held = press.aux_bytes()  # after answering: what it held while it decoded
    sample = Sample(benchmark="ruler", task="niah", context=CONTEXT, question=QUESTION, answer_prefix="",
                    answers=["4817263"], max_new_tokens=4, metric="string_match_all", length=0)  # fmt: skip
    rows = Benchmark().evaluate_group(GroupJob(model, tok, core(**options), [sample], GenerationConfig()))
    ids = encode(tok, CONTEXT, [QUESTION]).context_ids
    cost = measure(model, {"core": core(**options)}, 0, None, 1, context=ids)["core"]
    assert rows[0]["aux_bytes"] == answered["aux_bytes"] == cost["aux_bytes"] == held > 0
    breakdown = press.aux_breakdown()
    assert sum(breakdown.values()) == held
    assert (breakdown["memory_state"] > 0) == ("policy" in options)  # the paper's press holds its memory


@pytest.mark.parametrize("chunk", [None, 64])
def test_a_prefill_only_compression_frees_what_no_later_event_reads(proxy, chunk):
    model, tok = proxy
    ids = encode(tok, CONTEXT, [QUESTION]).context_ids
    press = core()
    cache = prefill(model, ids, press, chunk)
    held = press.aux_breakdown()
    assert held["obs_window"] == 0 and held["persistence"] == 0 and held["positions"] > 0
    greedy_answer(model, cache, ids.shape[1], ids[:, :5], 3, press, eos_token_ids=[])
    assert press.aux_breakdown() == held  # decoding adds nothing: the scorer no longer tracks forwards
    with pytest.raises(RuntimeError, match="layer 0 released its bookkeeping"):
        prefill(model, ids[:, :80], press, 64, cache=cache)  # a chunked continuation would need the freed state
    # with decode-time eviction later events read the window and the persistence: they stay
    press = core(decoding=True)
    prefill(model, ids, press, chunk)
    held = press.aux_breakdown()
    assert held["obs_window"] > 0 and held["persistence"] > 0
    assert held["obs_window"] == sum(
        st.wq_pre.numel() * 4 + st.wpos.numel() * 8 for st in press.scorer._layers.values()
    ) and all(st.wq_pre.shape[1] == 32 for st in press.scorer._layers.values())
    assert torch.is_tensor(press.scorer._layers[0].persist)
