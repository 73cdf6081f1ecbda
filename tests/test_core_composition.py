"""The composed CORE presses keep exactly what the flag-based press of commit 7693641 kept (issue 43).

``tests/fixtures/core_flags/make.py`` recorded, with the flag-based ``CorePress`` and the shipped proxy artifact, every
eviction event's kept positions per KV head and the logits of a question fed on the compressed cache, for the
configurations below. The composed press for each (the same artifact, the same token ids) must keep the same sets
exactly and give the same logits up to float rounding.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from core_kv.presses import build_press
from tests.fixtures.core_flags.make import record  # the recording the fixtures were made with

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "core_flags"
# the flag-based options -> the composed press's (policy="paper" is the flag press's default composition)
RENAME = {"head_pool": {"mass": "score", "output": "output"}}


def composed_options(flag_options: dict) -> dict:
    out = {"policy": "paper"}
    for k, v in flag_options.items():
        out[k] = RENAME.get(k, {}).get(v, v)
    return out


def unpack(t: dict, tag: str) -> list:
    layers, sizes, kept = t[f"{tag}/layers"].tolist(), t[f"{tag}/sizes"].tolist(), t[f"{tag}/kept"].tolist()
    out, i = [], 0
    for layer, counts in zip(layers, sizes, strict=True):
        heads = []
        for c in counts:
            heads.append(kept[i : i + c])
            i += c
        out.append((layer, heads))
    return out


def check(model, name: str, checkpoint: str, tags: list[str] | None = None, atol: float = 2e-4):
    meta = json.loads((FIXTURES / f"{name}.json").read_text())
    tensors = load_file(str(FIXTURES / f"{name}.safetensors"))
    ids = load_file(str(FIXTURES / f"{name}_ids.safetensors"))
    context, question = ids["context"].long()[None], ids["question"].long()[None]
    for tag, cfg in meta["configs"].items():
        if tags is not None and tag not in tags:
            continue
        press = build_press(cfg["kind"], checkpoint=checkpoint, compression_ratio=cfg["ratio"],
                            **composed_options(cfg["options"]))  # fmt: skip
        events, logits, tokens = record(model, context, question, press, cfg["chunk_size"], cfg["decode"])
        want = unpack(tensors, tag)
        assert len(events) == len(want), f"{tag}: {len(events)} events, the flag press had {len(want)}"
        for e, ((layer, heads), (w_layer, w_heads)) in enumerate(zip(events, want, strict=True)):
            assert layer == w_layer, f"{tag} event {e}: layer {layer} vs {w_layer}"
            for h, (got, exp) in enumerate(zip(heads, w_heads, strict=True)):
                assert got == exp, f"{tag} event {e} (layer {layer}) head {h}: kept sets differ"
        assert tokens == cfg["tokens"], f"{tag}: generated tokens differ"
        if not cfg["decode"]:  # a decoding run records tokens, no logits
            torch.testing.assert_close(logits[-2:, :512], tensors[f"{tag}/logits"], rtol=0, atol=atol, msg=tag)


@pytest.fixture(scope="module")
def proxy():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(ROOT / "checkpoints" / "proxy-lm").eval()


PROXY_TAGS = sorted(json.loads((FIXTURES / "proxy.json").read_text())["configs"])


@pytest.mark.parametrize("tag", PROXY_TAGS)
def test_composed_press_keeps_what_the_flag_press_kept(proxy, tag):
    check(proxy, "proxy", str(ROOT / "checkpoints" / "core-proxy" / "final"), [tag])


@pytest.mark.slow
def test_composed_press_keeps_what_the_flag_press_kept_on_smollm2():
    """The headline settings of the flag press on SmolLM2-135M and its spec-v2 artifact (1k-token context)."""
    from core_kv.models.loading import load_model

    meta = json.loads((FIXTURES / "smollm2.json").read_text())
    checkpoint = ROOT / "checkpoints" / "core-smollm2" / "final"
    if json.loads((checkpoint / "config.json").read_text())["feature_spec"]["version"] != 2:
        checkpoint = ROOT / meta["checkpoint"]  # before the v2 artifact took the name
    model, _ = load_model("smollm2-135m", attn_implementation="sdpa")
    check(model, "smollm2", str(checkpoint))
