"""A policy keyed by (ratio, context length) (issue 56 item 2): the lookup against a hand-computed table, version-1
records loading as one length band, and the ``core`` press choosing its composition at each prefill: at a short and at
a long prefill it keeps exactly what the directly built composition of that length band keeps, a question fed after
the prefill runs the same composition, and a context outside the validated lengths gets one warning per length band."""

from __future__ import annotations

import json
import math
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from core_kv.eval.policy_stage import record as record_policy
from core_kv.policy import (
    OUTSIDE,
    PAPER,
    Band,
    InferencePolicy,
    LengthBand,
    PolicyOptions,
    bands_from_choices,
)
from core_kv.presses import build_press
from core_kv.presses.core import compose
from core_kv.presses.core_scorer import CoreScorerPress
from tests.fixtures.core_flags.make import record
from tests.helpers import ids

ROOT = Path(__file__).resolve().parents[1]
# the shipped artifacts whose policy predates length bands (version 1) and those recorded since (version 2)
PROXY = ROOT / "checkpoints" / "core-proxy" / "final"  # one validated length (512 tokens)
SHIPPED_V1 = [PROXY]
SHIPPED_V2 = [ROOT / "checkpoints" / n / "final" for n in ("core-smollm2", "core-gemma3-270m")]

# four validated lengths, each with its own choice at 50% and 90% (edges: 0.7): 8 distinct compositions
CHOICES = {
    1024: (PolicyOptions(), PolicyOptions(memory=False)),
    2048: (PolicyOptions(head_budgets="adaptive"), PolicyOptions(head_budgets="adaptive", memory=False)),
    4096: (PolicyOptions(head_budgets="shared"), PolicyOptions(head_budgets="shared", memory=False)),
    8192: (PolicyOptions(repair=True), PolicyOptions(repair=True, memory=False)),
}


def four_lengths() -> InferencePolicy:
    return InferencePolicy([LengthBand(n, bands_from_choices({0.5: a, 0.9: b})) for n, (a, b) in CHOICES.items()])


# (tokens, ratio) -> (validated length, ratio band's validation ratio), computed by hand: length edges at the
# geometric means sqrt(1024*2048) = 1448.2, sqrt(2048*4096) = 2896.3, sqrt(4096*8192) = 5792.6; ratio edge 0.7
TABLE = [
    (1, 0.5, 1024, 0.5), (700, 0.95, 1024, 0.9), (1024, 0.7, 1024, 0.5), (1448, 0.71, 1024, 0.9),
    (1449, 0.5, 2048, 0.5), (2048, 0.9, 2048, 0.9), (2896, 0.3, 2048, 0.5),
    (2897, 0.75, 4096, 0.9), (5792, 0.7, 4096, 0.5),
    (5793, 0.7, 8192, 0.5), (8192, 0.9, 8192, 0.9), (10**6, 0.99, 8192, 0.9),
]  # fmt: skip


@pytest.mark.parametrize("tokens, ratio, length, validated_at", TABLE)
def test_lookup_takes_the_nearest_length_on_a_log_scale_then_the_ratio_band(tokens, ratio, length, validated_at):
    policy = four_lengths()
    assert policy.length_band(tokens).length == length
    band = policy.band(ratio, tokens)
    assert band.validated_at == validated_at
    assert policy.for_ratio(ratio, tokens) == CHOICES[length][0 if validated_at == 0.5 else 1]


def test_outside_is_beyond_a_factor_two_of_the_validated_lengths():
    policy = four_lengths()
    assert OUTSIDE == 2
    assert [n for n in (1, 511, 512, 1024, 3000, 8192, 16384, 16385) if policy.outside(n)] == [1, 511, 16385]
    one = InferencePolicy.single(PAPER, length=2048)
    assert [n for n in (1023, 1024, 4096, 4097) if one.outside(n)] == [1023, 4097]
    assert not InferencePolicy.single(PAPER).outside(1) and not InferencePolicy.single(PAPER).outside(10**6)
    assert policy.length_band(None).length == 1024 and policy.band(None, 2500) == policy.lengths[1].bands[0]


@pytest.mark.parametrize("artifact", SHIPPED_V1, ids=lambda p: p.parent.name)
def test_a_version_1_record_loads_as_one_length_band_and_behaves_as_before(artifact):
    """A shipped artifact recorded before length bands (version 1): its bands, default band, candidates and validation
    load unchanged as one length band at ``validation.context_tokens``, whose ratio bands answer every length; the v2
    record of it round-trips."""
    v1 = json.loads((artifact / "config.json").read_text())["inference_policy"]
    assert v1["version"] == 1
    policy = InferencePolicy.from_dict(v1)
    (lb,) = policy.lengths
    assert lb.length == v1["validation"]["context_tokens"]
    assert {k: v for k, v in lb.to_dict().items() if k != "length"} == {k: v for k, v in v1.items() if k != "version"}
    for ratio in (None, 0.1, 0.5, 0.625, 0.7, 0.75, 0.9, 0.99):
        want = v1["bands"][v1["default_band"]] if ratio is None else next(
            (b for b in v1["bands"] if ratio <= b["upto"]), v1["bands"][-1])  # fmt: skip
        for tokens in (None, 1, 700, lb.length, 10**5):
            assert policy.for_ratio(ratio, tokens).to_dict() == want["options"]
    again = InferencePolicy.from_dict(json.loads(json.dumps(policy.to_dict())))
    assert again == policy and again.to_dict()["version"] == 2 and not again.v1


@pytest.mark.parametrize("artifact", SHIPPED_V2, ids=lambda p: p.parent.name)
def test_a_version_2_record_answers_every_length_and_ratio_from_its_own_bands(artifact):
    """A shipped length-keyed record: every (tokens, ratio) gets the options of the nearest validated length's ratio
    band, read off the JSON by hand here, and the record round-trips unchanged."""
    rec = json.loads((artifact / "config.json").read_text())["inference_policy"]
    assert rec["version"] == 2
    policy = InferencePolicy.from_dict(rec)
    lengths = sorted(lb["length"] for lb in rec["lengths"])
    assert [lb.length for lb in policy.lengths] == lengths
    for tokens in (1, 700, *lengths, 10**5):
        nearest = min(lengths, key=lambda n: abs(math.log(tokens / n)))
        bands = next(lb["bands"] for lb in rec["lengths"] if lb["length"] == nearest)
        for ratio in (0.1, 0.5, 0.625, 0.7, 0.75, 0.9, 0.99):
            want = next((b for b in bands if ratio <= b["upto"]), bands[-1])
            assert policy.for_ratio(ratio, tokens).to_dict() == want["options"], (tokens, ratio)
    assert json.loads(json.dumps(policy.to_dict())) == rec


# ---------------------------------------------------------------------------------------------- the press, at prefill
SHORT = PolicyOptions(head_budgets="shared", memory=False)  # validated at 64 tokens
LONG = PolicyOptions(head_budgets="adaptive", repair=True)  # validated at 256 tokens (with the memory)


@pytest.fixture(scope="module")
def two_lengths(tiny_artifact, tmp_path_factory) -> Path:
    """The tiny artifact with a policy validated at 64 and 256 tokens (one ratio band each)."""
    _, path = tiny_artifact
    art = tmp_path_factory.mktemp("two") / "final"
    shutil.copytree(path, art)
    record_policy(
        art, InferencePolicy([LengthBand(64, [Band(1.0, SHORT, 0.5)]), LengthBand(256, [Band(1.0, LONG, 0.5)])])
    )
    return art


def direct(art: Path, options: PolicyOptions):
    return compose(CoreScorerPress(checkpoint=str(art), compression_ratio=0.5), options)


def test_the_press_runs_the_composition_of_each_prefills_length_band(two_lengths, llama, monkeypatch):
    """One press, a short prefill (100 tokens: nearest 64), a long one (200: nearest 256), the short again: each keeps
    exactly the sets, and gives the question exactly the logits, of the directly built composition of its band; the
    question after a prefill runs that prefill's composition (the long band's memory reads out)."""
    from core_kv.core_model import CoreModel

    loads = []
    load = CoreModel.from_pretrained.__func__
    monkeypatch.setattr(
        CoreModel, "from_pretrained", classmethod(lambda cls, *a, **k: loads.append(a) or load(cls, *a, **k))
    )
    press = build_press("core", checkpoint=str(two_lengths), compression_ratio=0.5)
    assert len(loads) == 1  # the artifact, once, for both stacks
    monkeypatch.undo()
    assert press.served == {64: SHORT, 256: LONG} and press.length == 64
    assert press.composition(100) == SHORT and press.composition(200) == LONG and press.length == 64  # a lookup only
    text = repr(press)
    assert "64 tokens: shared, memory off (running); 256 tokens: adaptive/score + repair, memory" in text
    assert [s["length"] for s in press.config_dict()["served"]] == [64, 256]
    question = ids(6, seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # inside the validated lengths: no warning
        for n, options, stack in ((100, SHORT, "HeadSharedPress(CoreScorerPress)"),
                                  (200, LONG, "LatentMemoryPress(TwinRepairPress(AdaKVPress(CoreScorerPress)))"),
                                  (100, SHORT, "HeadSharedPress(CoreScorerPress)")):  # fmt: skip
            context = ids(n, seed=n)
            events, logits, _ = record(llama, context, question, press, None, 0)
            want_events, want_logits, _ = record(llama, context, question, direct(two_lengths, options), None, 0)
            assert press.options == options and repr(press).endswith(f"; {stack})")
            assert events == want_events and len(events) == 2  # one event per layer, the same kept sets
            assert torch.equal(logits, want_logits)
    assert press.memory_press is None and press.length == 64
    press.at_length(200)
    assert press.memory_press is press.press and press.options == LONG and "256 tokens: " in repr(press)


def test_a_chunked_prefill_chooses_by_the_declared_length_and_decoding_keeps_the_composition(two_lengths, llama):
    """A chunked prefill of 200 tokens in chunks of 50 runs the long band (the pipeline declares the length; the first
    chunk alone would choose the short one), and greedy decoding after it runs the same composition."""
    context, question = ids(200, seed=5), ids(4, seed=6)
    press = build_press("core", checkpoint=str(two_lengths), compression_ratio=0.5)
    events, _, tokens = record(llama, context, question, press, 50, 5)
    want_events, _, want_tokens = record(llama, context, question, direct(two_lengths, LONG), 50, 5)
    assert press.length == 256 and events == want_events and tokens == want_tokens and len(tokens) == 5


def test_outside_the_validated_lengths_the_nearest_band_runs_with_one_warning_per_band(two_lengths, llama):
    """Validated at 64 and 256 tokens: 20 tokens (< 32) and 600 (> 512) are outside; each warns once per press and
    length band, naming the validated lengths and the band that runs; 40 tokens is inside (no warning)."""
    press = build_press("core", checkpoint=str(two_lengths), compression_ratio=0.5)
    question = ids(3, seed=2)
    with pytest.warns(UserWarning) as caught:
        for n in (20, 20, 40, 600, 600):
            events, _, _ = record(llama, ids(n, seed=n), question, press, None, 0)
            want, _, _ = record(llama, ids(n, seed=n), question, direct(two_lengths, SHORT if n < 100 else LONG),
                                None, 0)  # fmt: skip
            assert events == want
    texts = [str(w.message) for w in caught if "outside the lengths" in str(w.message)]
    assert texts == [
        f"core: a context of 20 tokens is outside the lengths the inference policy of {two_lengths} was validated "
        "at (64, 256 tokens): it runs the band validated at 64 tokens (shared, memory off); validate at this length "
        "to serve it (train.py policy.lengths)",
        f"core: a context of 600 tokens is outside the lengths the inference policy of {two_lengths} was validated "
        "at (64, 256 tokens): it runs the band validated at 256 tokens (adaptive/score + repair, memory); validate at "
        "this length to serve it (train.py policy.lengths)",
    ]
    again = build_press("core", checkpoint=str(two_lengths), compression_ratio=0.5)
    with pytest.warns(UserWarning, match="a context of 20 tokens is outside"):  # another press warns again
        again.at_length(20)


def test_overrides_apply_at_every_length_and_paper_has_one_band(two_lengths):
    press = build_press("core", checkpoint=str(two_lengths), compression_ratio=0.5, memory=False)
    assert press.served == {64: SHORT, 256: PolicyOptions(head_budgets="adaptive", repair=True, memory=False)}
    assert "overrides={'memory': False}" in repr(press)
    paper = build_press("core", checkpoint=str(two_lengths), compression_ratio=0.5, policy="paper")
    assert paper.served == {None: PAPER} and "served" not in paper.config_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert paper.at_length(5) is paper.press  # no policy: no length band, no warning
    with pytest.raises(ValueError, match="write_rule, budget_matched and memory_dtype apply to the memory"):
        build_press("core", checkpoint=str(two_lengths), compression_ratio=0.5, memory=False, budget_matched=True)
    assert build_press("core", checkpoint=str(two_lengths), compression_ratio=0.5, budget_matched=True)  # LONG has it


def test_a_one_length_press_is_what_it_was():
    """A shipped artifact with one validated length (the proxy's): one stack, its repr names the length, its
    results-folder dict is the one of before lengths (no ``served``)."""
    press = build_press("core", checkpoint=str(PROXY), compression_ratio=0.75)
    assert list(press.served) == [512] and len(press._stacks) == 1
    assert "policy='artifact': adaptive/output, memory off (validated at 512 tokens); " in repr(press)
    assert "served" not in press.config_dict() and "length" not in press.config_dict()
