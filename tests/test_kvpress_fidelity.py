"""core_kv's training-free presses against kvpress 0.5.5's own scores and kept indices.

The fixtures come from ``scripts/kvpress_fidelity.py`` (run in a separate venv with kvpress; CI needs no kvpress):
tiny seeded Llama and Qwen3 models (GQA 4/2) stored as safetensors, 160 fixed tokens, and per layer/head kvpress's
scores and kept positions. Deterministic presses must keep exactly the same sets and produce allclose scores; the
intentional deviations (documented in the press docstrings) are asserted as such.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from core_kv.pipeline import prefill
from core_kv.presses import build_press

FIX = Path(__file__).parent / "fixtures" / "kvpress"
META = json.loads((FIX / "meta.json").read_text())
RECORDS = load_file(str(FIX / "records.safetensors"))
# streaming_llm: kvpress encodes the ratio in 0/1 scores, core_kv scores positions (rank-equivalent): kept sets only
SCORES_DIFFER = {"streaming_llm"}


def load_model(name: str, eager: bool) -> torch.nn.Module:
    spec = META["models"][name]
    cfg = getattr(transformers, spec["config"])(**spec["kwargs"], attn_implementation="eager" if eager else "sdpa")
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    state = load_file(str(FIX / f"{name}.safetensors"))
    inv_freq = state.pop("_ref.inv_freq")
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    assert torch.equal(model.model.rotary_emb.inv_freq, inv_freq), "config drift: RoPE frequencies differ"
    return model


_MODELS: dict = {}


def model_for(name: str, eager: bool) -> torch.nn.Module:
    if (name, eager) not in _MODELS:
        _MODELS[name, eager] = load_model(name, eager)
    return _MODELS[name, eager]


def run_core_kv(model, case: str) -> dict[str, torch.Tensor]:
    spec = META["cases"][case]
    press = build_press(spec["press"], **spec["options"])
    scorer = getattr(press, "press", press) if spec["press"].startswith("adakv") else press
    out: dict[str, torch.Tensor] = {}
    score_fn, select_fn = scorer.score, press.select

    def score(module, hidden_states, keys, values, attentions, kwargs):
        s = score_fn(module, hidden_states, keys, values, attentions, kwargs)
        out[f"L{module.layer_idx}/scores"] = s[0].float().clone()
        return s

    def select(scores, n_kept, module, kwargs):
        kept = select_fn(scores, n_kept, module, kwargs)
        rows = list(kept[0]) if isinstance(kept, torch.Tensor) else kept
        width = max(len(r) for r in rows)
        padded = torch.full((len(rows), width), -1, dtype=torch.int32)
        for h, r in enumerate(rows):
            padded[h, : len(r)] = r.sort().values.to(torch.int32)
        out[f"L{module.layer_idx}/kept"] = padded
        return kept

    scorer.score, press.select = score, select
    prefill(model, RECORDS["input_ids"].long(), press)
    return out


@pytest.mark.parametrize("model_name", sorted(META["models"]))
@pytest.mark.parametrize("case", sorted(META["cases"]))
def test_matches_kvpress(model_name: str, case: str):
    spec = META["cases"][case]
    got = run_core_kv(model_for(model_name, spec["eager"]), case)
    for layer in range(META["models"][model_name]["kwargs"]["num_hidden_layers"]):
        key = f"{model_name}/{case}/L{layer}"
        ref_kept, ref_scores = RECORDS[f"{key}/kept"], RECORDS[f"{key}/scores"]
        assert torch.equal(got[f"L{layer}/kept"], ref_kept), f"{key}: kept positions differ from kvpress"
        if spec["press"] in SCORES_DIFFER:
            assert not torch.allclose(got[f"L{layer}/scores"], ref_scores)  # the documented deviation
        else:
            torch.testing.assert_close(got[f"L{layer}/scores"], ref_scores, rtol=1e-5, atol=1e-6, msg=key)


def test_fixture_covers_every_shared_press():
    shared = {"knorm", "snapkv", "streaming_llm", "pyramidkv", "tova", "keydiff", "expected_attention", "h2o"}
    shared |= {"adakv_expected_attention"}  # AdaKV around ExpectedAttention(epsilon=1e-2), kvpress's registry entry
    assert shared <= {spec["press"] for spec in META["cases"].values()}
    assert sum(f.stat().st_size for f in FIX.iterdir()) < 2_000_000
