"""Golden retained sets of the shipped CORE compositions, recorded before issue 61's speed work (features, batching,
the scorer's decode path), so a faster press must keep exactly what the slower one kept.

``tests/fixtures/core_kept/kept.safetensors`` holds, for every case of :data:`CASES` (an artifact's own inference
policy at each of its bands, ``build_press("core", checkpoint=..., compression_ratio=r)`` with no other option, on
fixed token ids), the original positions the scorer keeps after every eviction event, per KV head (``-1`` pads a
ragged layer). The proxy cases run the spec-v1 proxy artifact (head-wise budgets); the SmolLM2 cases the shipped
spec-v2 artifact at 768 tokens (twin and KeyDiff features; its policy's 1,024-token band: head-wise budgets without
the memory at 50%, head-shared selection at 75 / 90%), one-shot and chunked. Recorded at commit 7cde7b2; the SmolLM2
policy's 1,024-token band ran repair at 75% for a while (the stage's rule before its one-standard-error form) and the
file was re-recorded for it; the recording under today's policy is byte-identical to the first. With::

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python tests/test_core_kept.py --write
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers import record_core_kept

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "core_kept" / "kept.safetensors"
PROXY = ("checkpoints/proxy-lm", "checkpoints/core-proxy/final")
SMOLLM2 = ("smollm2-135m", "checkpoints/core-smollm2/final")
CASES = {  # name -> (model and artifact, compression ratio, context tokens, chunk size)
    "proxy_50": (PROXY, 0.5, 400, None),
    "proxy_75": (PROXY, 0.75, 400, None),
    "proxy_90": (PROXY, 0.9, 400, None),
    "proxy_75_chunked": (PROXY, 0.75, 400, 128),
    "smollm2_50": (SMOLLM2, 0.5, 768, None),
    "smollm2_75": (SMOLLM2, 0.75, 768, None),
    "smollm2_90": (SMOLLM2, 0.9, 768, None),
    "smollm2_75_chunked": (SMOLLM2, 0.75, 768, 256),
}


def context_ids(vocab: int, n: int) -> torch.Tensor:
    """Seeded random tokens with a repeated stretch, so the twin features see far twins (1, n)."""
    ids = torch.randint(3, vocab, (1, n), generator=torch.Generator().manual_seed(61))
    ids[0, n // 2 : n // 2 + n // 8] = ids[0, n // 8 : n // 4]
    return ids


def load(name: str):
    from core_kv.models.loading import load_model

    return load_model(name if not name.startswith("checkpoints/") else str(ROOT / name), dtype="float32")[0]


def kept_sets(model, checkpoint: str, ratio: float, n: int, chunk: int | None) -> list[torch.Tensor]:
    """The scorer's retained positions (Hkv, k) after every eviction event, in event order."""
    from core_kv.pipeline import prefill
    from core_kv.presses import build_press

    press = build_press("core", checkpoint=str(ROOT / checkpoint), compression_ratio=ratio)
    layers = range(model.config.num_hidden_layers)
    record = record_core_kept(press, layers)
    prefill(model, context_ids(model.config.vocab_size, n), press, chunk)
    events = max(len(v) for v in record.values())
    return [record[layer][e] for e in range(events) for layer in layers if e < len(record[layer])]


def cases_of(model_name: str) -> list[str]:
    return [c for c, (m, *_) in CASES.items() if m[0] == model_name]


def check(model, case: str, want: dict) -> None:
    (_, checkpoint), ratio, n, chunk = CASES[case]
    got = kept_sets(model, checkpoint, ratio, n, chunk)
    count = sum(1 for k in want if k.startswith(f"{case}/"))
    assert len(got) == count > 0, f"{case}: {len(got)} events, recorded {count}"
    for e, pos in enumerate(got):
        assert torch.equal(pos, want[f"{case}/{e}"].long()), f"{case}: event {e} keeps other positions"


@pytest.fixture(scope="module")
def golden() -> dict:
    return load_file(str(FIXTURE))


@pytest.fixture(scope="module")
def proxy_model():
    return load(PROXY[0])


@pytest.fixture(scope="module")
def smollm2_model():
    return load(SMOLLM2[0])


@pytest.mark.parametrize("case", cases_of(PROXY[0]))
def test_proxy_artifact_keeps_the_recorded_positions(proxy_model, golden, case):
    check(proxy_model, case, golden)


@pytest.mark.parametrize("case", cases_of(SMOLLM2[0]))
def test_smollm2_artifact_keeps_the_recorded_positions(smollm2_model, golden, case):
    check(smollm2_model, case, golden)


def write() -> None:
    torch.set_num_threads(1)
    out = {}
    for model_name in (PROXY[0], SMOLLM2[0]):
        model = load(model_name)
        for case in cases_of(model_name):
            (_, checkpoint), ratio, n, chunk = CASES[case]
            for e, pos in enumerate(kept_sets(model, checkpoint, ratio, n, chunk)):
                out[f"{case}/{e}"] = pos.to(torch.int16).contiguous()  # positions < 2^15
            print(f"{case}: {sum(k.startswith(case + '/') for k in out)} events", flush=True)
    FIXTURE.parent.mkdir(parents=True, exist_ok=True)
    save_file(out, str(FIXTURE))


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        raise SystemExit("usage: python tests/test_core_kept.py --write")
    write()
