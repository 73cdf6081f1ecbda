"""Golden check of the released CORE stack (feature spec v3: head-shared scorer + fast memory), issue 58.

A tiny spec-v3 artifact is built from seeds alone (every parameter drawn in name order from one generator, the fixed
key geometry drawn from its seed), so the same artifact can be rebuilt whatever class holds it. The retained set of
every eviction event (kept candidate indices per KV head), the question's logits and the decoded tokens were recorded
in ``fixtures/released_golden.json`` (commit 989ff0a) with the stack as it was inside ``core_kv`` (``core`` on a
feature spec v3 ``CoreModel``), before it moved into ``research/released``; the plugin's ``core_released`` must keep
exactly the same sets. ``RECORD=1`` rewrites the fixture.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

from core_kv.models.cache import cache_kwarg
from core_kv.models.fingerprint import model_fingerprint
from core_kv.models.tiny import tiny_lm
from core_kv.pipeline import greedy_answer, prefill
from core_kv.presses import base as press_base
from core_kv.presses import build_press
from research.released.geometry import KeyGeometry
from research.released.model import ReleasedConfig, ReleasedModel

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "released_golden.json"
N, SPECIAL = 150, 7
# tag -> (press options, chunk size, decoded tokens)
SETTINGS = {
    "prefill_r75": ({"compression_ratio": 0.75}, None, 0),
    "prefill_r90_nomem": ({"compression_ratio": 0.9, "memory": False}, None, 0),
    "chunked_r50": ({"compression_ratio": 0.5}, 40, 0),
    "chunked_r75_decoding": ({"compression_ratio": 0.75, "decoding": True, "decoding_slack": 2}, 50, 12),
    "layer1_memory_r75": ({"compression_ratio": 0.75, "memory": "1-1"}, 50, 0),
}


@pytest.fixture(scope="module")
def model():
    return tiny_lm("llama", 0, "sdpa", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)  # fmt: skip


def seeded(core: torch.nn.Module) -> list[str]:
    """Draw every parameter in name order from one generator (independent of the module's construction order);
    returns the names."""
    g = torch.Generator().manual_seed(0)
    names = []
    with torch.no_grad():
        for name, p in sorted(core.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
            names.append(name)
    return names


@pytest.fixture(scope="module")
def artifact(model, tmp_path_factory) -> tuple[str, list[str]]:
    fp = model_fingerprint(model)
    cfg = ReleasedConfig(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=fp["head_dim"], d_z=64, num_prototypes=64,
                         memory_dim=32, protected_sinks=4, protected_recent=0, fingerprint=fp,
                         special_token_ids=[SPECIAL])  # fmt: skip
    core = ReleasedModel(cfg)
    names = seeded(core)
    core.set_key_geometry(KeyGeometry.draw(2, 2, fp["head_dim"]))
    core.indexer.temperature.fill_(0.8)
    path = tmp_path_factory.mktemp("released") / "final"
    core.save_pretrained(path)
    return str(path), names


def build(checkpoint: str, options: dict):
    return build_press("core_released", checkpoint=checkpoint, **options)


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    context = torch.randint(8, 128, (1, N), generator=g)
    context[0, 40] = SPECIAL
    return context, torch.randint(8, 128, (1, 6), generator=g)


def run(model, press, chunk: int | None, decode: int) -> dict:
    """Every eviction event's (layer, kept indices per KV head), then the question's logits or decoded tokens."""
    events = []
    apply = press_base.BasePress._apply

    def spy(cache, idx, keys, values, kept):
        heads = kept[0] if isinstance(kept, torch.Tensor) else kept
        events.append([idx, [h.tolist() for h in heads]])
        return apply(cache, idx, keys, values, kept)

    context, question = inputs()
    press_base.BasePress._apply = staticmethod(spy)
    try:
        cache = prefill(model, context, press, chunk)
        if decode:
            tokens = greedy_answer(model, cache, N, question, decode, press, eos_token_ids=[], trim=False)
            return {"events": events, "tokens": tokens}
        pos = torch.arange(N, N + question.shape[1])[None]
        with torch.inference_mode(), press(model):
            out = model(input_ids=question, position_ids=pos, use_cache=True, **{cache_kwarg(model): cache})
        return {"events": events, "logits": [[round(x, 5) for x in row] for row in out.logits[0, -2:].tolist()]}
    finally:
        press_base.BasePress._apply = staticmethod(apply)


def test_the_released_stack_keeps_the_recorded_sets(model, artifact):
    checkpoint, names = artifact
    got = {"parameters": names}
    for tag, (options, chunk, decode) in SETTINGS.items():
        got[tag] = run(model, build(checkpoint, options), chunk, decode)
    if os.environ.get("RECORD"):
        FIXTURE.write_text(json.dumps(got, separators=(",", ":")) + "\n")
    want = json.loads(FIXTURE.read_text())
    assert got["parameters"] == want["parameters"], "the artifact's parameter names changed: the seeded draw differs"
    for tag in SETTINGS:
        g, w = got[tag], want[tag]
        assert len(g["events"]) == len(w["events"]), f"{tag}: {len(g['events'])} events, recorded {len(w['events'])}"
        for e, (a, b) in enumerate(zip(g["events"], w["events"], strict=True)):
            assert a == b, f"{tag} event {e} (layer {b[0]}): kept sets differ"
        assert g.get("tokens") == w.get("tokens"), f"{tag}: decoded tokens differ"
        if "logits" in w:
            torch.testing.assert_close(torch.tensor(g["logits"]), torch.tensor(w["logits"]), rtol=0, atol=1e-4)
