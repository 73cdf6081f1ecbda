"""Record kvpress 0.5.5's scores and kept indices on tiny seeded models, as fixtures for tests/test_kvpress_fidelity.py.

Runs in a throwaway venv that has kvpress (it pins transformers<5.3, so it cannot share core_kv's venv)::

    python3 -m venv /tmp/kvp
    /tmp/kvp/bin/pip install torch==2.13.0 transformers==5.2.0 kvpress==0.5.5 safetensors
    /tmp/kvp/bin/python scripts/kvpress_fidelity.py            # writes tests/fixtures/kvpress/

Writes, under ``tests/fixtures/kvpress/``:

- ``{llama,qwen3}.safetensors``: the tiny models' weights (built from ``meta.json``'s configs with a fixed seed;
  stored because random initialisation is not guaranteed to be bit-identical across transformers versions), plus
  the rotary ``inv_freq`` under ``_ref.inv_freq`` for a config sanity check;
- ``records.safetensors``: ``input_ids`` and, per ``{model}/{case}/L{layer}``, kvpress's ``scores`` ``(Hkv, S)``
  (float32) and ``kept`` ``(Hkv, k)`` (int32, sorted; for AdaKV the complement of ``masked_key_indices``, padded
  with -1 to the longest head);
- ``meta.json``: versions, model configs, the cases (press name, kvpress class and options).

CI never needs kvpress: the test only reads these files.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

if __name__ == "__main__" and {"-h", "--help"} & set(sys.argv[1:]):  # before importing kvpress (another venv)
    print("usage: python scripts/kvpress_fidelity.py  (no options)\n\n" + __doc__)
    sys.exit(0)

import kvpress
import torch
import transformers
from kvpress import (
    AdaKVPress,
    ExpectedAttentionPress,
    KeyDiffPress,
    KnormPress,
    ObservedAttentionPress,
    PyramidKVPress,
    RandomPress,
    SnapKVPress,
    StreamingLLMPress,
    TOVAPress,
)
from kvpress.utils import compute_n_kept
from safetensors.torch import save_file
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # core_kv is not installed in kvpress's venv
from core_kv.models.tiny import TINY  # noqa: E402  (imports torch only)

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "kvpress"
SEQ_LEN = 160
# core_kv's test shape (core_kv.models.tiny.TINY) with a smaller vocabulary, MLP and window, tied embeddings
COMMON = dict(TINY, vocab_size=96, intermediate_size=96, max_position_embeddings=1024, tie_word_embeddings=True)
MODELS = {
    "llama": (LlamaConfig, LlamaForCausalLM, dict(COMMON)),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(COMMON, head_dim=16)),
}


def same(press: str, ctor, eager: bool = False, **options) -> tuple:
    """A case whose core_kv press and kvpress constructor take the same ``options``."""
    return press, options, ctor, dict(options), eager


# case name -> (core_kv press name, core_kv options, kvpress constructor, kvpress options, eager)
CASES = {
    "knorm": same("knorm", KnormPress, compression_ratio=0.5),
    "knorm_r0.3": same("knorm", KnormPress, compression_ratio=0.3),
    "snapkv": same("snapkv", SnapKVPress, compression_ratio=0.5),
    "snapkv_w8": same("snapkv", SnapKVPress, compression_ratio=0.5, window_size=8),
    "streaming_llm": same("streaming_llm", StreamingLLMPress, compression_ratio=0.5),
    "pyramidkv": same("pyramidkv", PyramidKVPress, compression_ratio=0.5),
    # infeasible pyramid: kvpress falls back to SnapKV's uniform budget
    "pyramidkv_r0.8": same("pyramidkv", PyramidKVPress, compression_ratio=0.8),
    # window 4 makes the pyramid feasible at 160 tokens (the default falls back to SnapKV)
    "pyramidkv_w4": same("pyramidkv", PyramidKVPress, compression_ratio=0.5, window_size=4),
    "tova": same("tova", TOVAPress, compression_ratio=0.5),
    "keydiff": same("keydiff", KeyDiffPress, compression_ratio=0.5),
    "random": same("random", RandomPress, compression_ratio=0.5, seed=0),
    # kvpress's registry value 1e-2 (core_kv's default is the class's 0, as kvpress's)
    "expected_attention": same("expected_attention", ExpectedAttentionPress, compression_ratio=0.5, epsilon=1e-2),
    "expected_attention_eps0": (
        "expected_attention",
        {"compression_ratio": 0.5, "epsilon": 0.0},
        ExpectedAttentionPress,
        {"compression_ratio": 0.5},
        False,
    ),
    "h2o": same("h2o", ObservedAttentionPress, eager=True, compression_ratio=0.5),
    "adakv_expected_attention": same("adakv_expected_attention", None, compression_ratio=0.5),
}


def build(name: str, eager: bool) -> torch.nn.Module:
    cfg_cls, model_cls, kwargs = MODELS[name]
    torch.manual_seed(0)
    model = model_cls(cfg_cls(**kwargs, attn_implementation="eager" if eager else "sdpa"))
    return model.eval()


def make_press(case: str):
    _, _, ctor, opts, _ = CASES[case]
    if case.startswith("adakv"):
        return AdaKVPress(ExpectedAttentionPress(epsilon=1e-2, **opts))
    return ctor(**opts)


def kept_from_gather(before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """Recover the gathered positions: kept keys are rows of the original keys (unique floats)."""
    eq = (after[0, :, :, None, :] == before[0, :, None, :, :]).all(-1)  # (Hkv, k, S)
    assert bool((eq.sum(-1) == 1).all()), "kept keys must match exactly one original key"
    return eq.float().argmax(-1).sort(-1).values.to(torch.int32)


def record(model: torch.nn.Module, case: str, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    press = make_press(case)
    scorer = press.press if isinstance(press, AdaKVPress) else press
    out: dict[str, torch.Tensor] = {}
    score_fn = scorer.score

    def score(module, hidden_states, keys, values, attentions, kwargs):
        s = score_fn(module, hidden_states, keys, values, attentions, kwargs)
        out[f"L{module.layer_idx}/scores"] = s[0].float().clone()
        return s

    scorer.score = score
    if not isinstance(press, AdaKVPress):
        compress_fn = press.compress

        def compress(module, hidden_states, keys, values, attentions, kwargs):
            k, v = compress_fn(module, hidden_states, keys, values, attentions, kwargs)
            out[f"L{module.layer_idx}/kept"] = kept_from_gather(keys, k)
            if not isinstance(press, PyramidKVPress):
                assert k.shape[2] == compute_n_kept(keys.shape[2], press.compression_ratio)
            return k, v

        press.compress = compress
    with torch.no_grad(), press(model):
        model.model(input_ids=ids, past_key_values=DynamicCache())
    if isinstance(press, AdaKVPress):
        for i, layer in enumerate(model.model.layers):
            _, heads, seq = layer.self_attn.masked_key_indices
            keep = torch.ones(model.config.num_key_value_heads, ids.shape[1], dtype=torch.bool)
            keep[heads, seq] = False
            kept = [keep[h].nonzero().flatten() for h in range(keep.shape[0])]
            width = max(len(k) for k in kept)
            padded = torch.full((len(kept), width), -1, dtype=torch.int32)
            for h, k in enumerate(kept):
                padded[h, : len(k)] = k.to(torch.int32)
            out[f"L{i}/kept"] = padded
            layer.self_attn.masked_key_indices = None
    return out


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(1234)
    ids = torch.randint(0, COMMON["vocab_size"], (1, SEQ_LEN))
    records: dict[str, torch.Tensor] = {"input_ids": ids.to(torch.int32)}
    for name in MODELS:
        model = build(name, eager=False)
        state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
        state["_ref.inv_freq"] = model.model.rotary_emb.inv_freq.clone()
        save_file(state, str(OUT / f"{name}.safetensors"))
        eager = build(name, eager=True)
        eager.load_state_dict(model.state_dict())
        for case, (*_, is_eager) in CASES.items():
            for key, value in record(eager if is_eager else model, case, ids).items():
                records[f"{name}/{case}/{key}"] = value.contiguous()
    save_file(records, str(OUT / "records.safetensors"))
    meta = {
        "versions": {
            "kvpress": kvpress.__version__ if hasattr(kvpress, "__version__") else "0.5.5",
            "transformers": transformers.__version__,
            "torch": torch.__version__,
        },
        "seq_len": SEQ_LEN,
        "models": {
            name: {"config": cfg_cls.__name__, "kwargs": kwargs} for name, (cfg_cls, _, kwargs) in MODELS.items()
        },
        "cases": {
            case: {
                "press": p,
                "options": o,
                "kvpress": "AdaKVPress(ExpectedAttentionPress(epsilon=1e-2))"
                if ctor is None
                else f"{ctor.__name__}(**{kvo})",
                "eager": e,
            }
            for case, (p, o, ctor, kvo, e) in CASES.items()
        },
    }
    (OUT / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    total = sum(f.stat().st_size for f in OUT.iterdir())
    print(f"wrote {len(records)} tensors to {OUT} ({total / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
