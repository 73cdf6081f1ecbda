"""``scripts/kvpress_compare.py`` (issue 18's parity check against kvpress): the core_kv side of its loop, its
kept-position digests and its resume. kvpress itself is not installed in CI; the kvpress side runs the same code."""

from __future__ import annotations

import hashlib
import json
import runpy
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from core_kv.models.tiny import tiny_lm
from core_kv.pipeline import greedy_answer, prefill
from core_kv.presses import build_press

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = runpy.run_path(str(ROOT / "scripts" / "kvpress_compare.py"))


def _digest(positions: list[int]) -> str:
    return hashlib.sha1(json.dumps(sorted(positions)).encode()).hexdigest()[:16]


def test_kept_digests_name_the_positions_each_head_kept():
    g = torch.Generator().manual_seed(0)
    full = DynamicCache()
    keys = torch.randn(1, 2, 10, 4, generator=g)
    full.update(keys, torch.randn(1, 2, 10, 4, generator=g), 0)
    kept = [[0, 3, 7], [1, 2, 9]]
    small = DynamicCache()
    idx = torch.tensor(kept)[None, :, :, None].expand(1, 2, 3, 4)
    small.update(keys.gather(2, idx), torch.zeros(1, 2, 3, 4), 0)
    out = SCRIPT["_kept_digests"](small, [layer.keys for layer in full.layers])
    assert out == [_digest(kept[0]), _digest(kept[1])]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kvp")
    model = tiny_lm(num_hidden_layers=2, max_position_embeddings=512)
    model.save_pretrained(tmp / "model")
    g = torch.Generator().manual_seed(1)
    samples = [
        {"task": "t", "answers": ["x"], "metric": "string_match_all",
         "context_ids": torch.randint(3, 60, (96,), generator=g).tolist(),
         "question_ids": torch.randint(3, 60, (5,), generator=g).tolist()}
        for _ in range(3)
    ]  # fmt: skip
    prompts = tmp / "prompts.json"
    prompts.write_text(json.dumps({"model": str(tmp / "model"), "length": 96, "tasks": ["t"], "samples": samples}))
    return tmp, prompts, samples


def _run(prompts, out, *extra):
    SCRIPT["main"](["run", "--library", "core_kv", "--prompts", str(prompts), "--ratio", "0.5",
                    "--max-new-tokens", "6", "--out", str(out), *extra])  # fmt: skip
    return json.loads(out.read_text())


def test_answers_match_core_kv_pipeline_and_resume(setup):
    tmp, prompts, samples = setup
    out = tmp / "core_kv.json"
    first = _run(prompts, out, "--methods", "snapkv", "--limit", "1")
    assert list(first["results"]["snapkv"]) == ["0"]
    done = _run(prompts, out, "--methods", "snapkv", "full")
    assert done["results"]["snapkv"]["0"] == first["results"]["snapkv"]["0"]  # resumed, not recomputed
    assert sorted(done["results"]["snapkv"], key=int) == ["0", "1", "2"]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp / "model", dtype=torch.float32).eval()
    for i, s in enumerate(samples):
        ctx, q = torch.tensor([s["context_ids"]]), torch.tensor([s["question_ids"]])
        for method in ("snapkv", "full"):
            press = None if method == "full" else build_press("snapkv", compression_ratio=0.5)
            with torch.no_grad():
                cache = prefill(model, ctx, press)
                ref = greedy_answer(model, cache, ctx.shape[1], q, 6, press)  # stops at the eos, as the script
            assert done["results"][method][str(i)]["tokens"] == ref, (method, i)
        assert len(done["results"]["snapkv"][str(i)]["kept"]) == 2 * model.config.num_key_value_heads


def test_other_ratio_in_the_same_file_is_refused(setup):
    tmp, prompts, _ = setup
    out = tmp / "refuse.json"
    _run(prompts, out, "--methods", "full", "--limit", "1")
    with pytest.raises(SystemExit, match="holds another run"):
        SCRIPT["main"](["run", "--library", "core_kv", "--prompts", str(prompts), "--ratio", "0.9", "--out", str(out)])
