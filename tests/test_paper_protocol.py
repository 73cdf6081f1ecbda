"""The CORE paper's evaluation protocol (``paper_protocol``) around every registered press, and ``protocol:
core_paper`` in the runner: the sinks kept inside the prefill budget, decode-time events every ``interval`` forwards
back to the prefill budget (not to a share of the tokens seen), the buffered forwards as the wrapped press's queries,
and the cells named ``<method>@core_paper``."""

from __future__ import annotations

import pytest
import torch

from core_kv.eval.runner import EvalConfig, cell_method, run_eval
from core_kv.models.attention import attention_modules
from core_kv.models.cache import RaggedLayer, layer_lengths
from core_kv.pipeline import greedy_answer, prefill
from core_kv.presses import PRESSES
from core_kv.presses.paper_protocol import PaperProtocolPress
from tests.helpers import COMMON, N_CTX, build_press, can_compress, eval_argv, ids, model_for

WRAPPABLE = sorted(n for n in PRESSES if n not in ("full", "paper_protocol"))
HKV = COMMON["num_key_value_heads"]
pytestmark = pytest.mark.usefixtures("contract_artifacts")  # the folder of the CORE presses' artifacts


def _layer_keys(layer) -> tuple[torch.Tensor, torch.Tensor]:
    keys = layer.padded()[0] if isinstance(layer, RaggedLayer) else layer.keys
    return keys, layer_lengths(layer)


def _sinks_kept(cache, full, sinks: int) -> None:
    for i, (layer, ref) in enumerate(zip(cache.layers, full.layers, strict=True)):
        keys, lens = _layer_keys(layer)
        for h in range(keys.shape[1]):
            kept = keys[0, h, : lens[h]]
            for pos in range(sinks):
                assert (kept - ref.keys[0, h, pos]).abs().amax(-1).min() < 1e-5, f"layer {i} head {h}: sink {pos} lost"


@pytest.mark.filterwarnings("ignore:.*overrides the artifact's setting")
@pytest.mark.parametrize("name", WRAPPABLE)
def test_sinks_inside_the_budget_and_events_hold_the_prefill_budget(name):
    if not can_compress(name):
        pytest.skip(f"{name} never compresses")
    inner = build_press(name, compression_ratio=0.75)
    if name == "twinkv":  # compresses a whole prefix once (paper §4): no decode-time events
        with pytest.raises(ValueError, match="paper_protocol: TwinKV compresses the prefix once"):
            PaperProtocolPress(press=inner)
        return
    press = PaperProtocolPress(press=inner, interval=4)
    model = model_for(press)
    budget = N_CTX // 4  # floor(200 x 0.25)
    cache = prefill(model, ids(), press)
    full = prefill(model, ids(), None)
    for layer, attn in zip(cache.layers, attention_modules(model), strict=True):
        target = press.layer_target(attn, N_CTX)
        assert int(layer_lengths(layer).sum()) == HKV * target
        assert name == "pyramidkv" or target == budget
    _sinks_kept(cache, full, 4)
    # 10 decoding forwards (a 3-token question, then 9 generated tokens): events after forwards 4 and 8 compress
    # back to the prefill budget, then 2 more tokens arrive (a share of the tokens seen would keep 52, then hold 54)
    greedy_answer(model, cache, N_CTX, torch.tensor([[5, 6, 7]]), 10, press, eos_token_ids=[], trim=False)
    for layer, attn in zip(cache.layers, attention_modules(model), strict=True):
        assert int(layer_lengths(layer).sum()) == HKV * (press.layer_target(attn, N_CTX) + 2), name
    _sinks_kept(cache, full, 4)


def test_the_wrapped_press_scores_with_the_buffered_forwards():
    """At a decode-time event the inner press sees the hidden states (and RoPE tables) of every forward since the
    last event: the 3-token question and the next 3 generated tokens at the first event, 4 single tokens at the
    second; at most ``buffer`` forwards."""
    seen = []
    press = PaperProtocolPress(press=build_press("snapkv", compression_ratio=0.75), interval=4)
    inner_compress = press.press.compress

    def spy(module, hidden_states, keys, values, attentions, kwargs, n_kept, lengths=None):
        if module.layer_idx == 0:
            cos, _ = kwargs["position_embeddings"]
            seen.append((hidden_states.shape[1], cos.shape[-2], n_kept, keys.shape[2]))
        return inner_compress(module, hidden_states, keys, values, attentions, kwargs, n_kept, lengths=lengths)

    press.press.compress = spy
    model = model_for(press)
    cache = prefill(model, ids(), press)
    greedy_answer(model, cache, N_CTX, torch.tensor([[5, 6, 7]]), 10, press, eos_token_ids=[], trim=False)
    assert seen == [(N_CTX, N_CTX, 50, N_CTX), (6, 6, 50, 56), (4, 4, 50, 54)]
    seen.clear()
    press = PaperProtocolPress(press=build_press("snapkv", compression_ratio=0.75), interval=4, buffer=2)
    inner_compress = press.press.compress
    press.press.compress = spy
    cache = prefill(model, ids(), press)
    greedy_answer(model, cache, N_CTX, torch.tensor([[5, 6, 7]]), 5, press, eos_token_ids=[], trim=False)
    assert seen == [(N_CTX, N_CTX, 50, N_CTX), (2, 2, 50, 56)]


def test_options_are_checked_and_the_stack_gets_the_sinks():
    for bad in ({"interval": 0}, {"buffer": 0}, {"sinks": -1}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            PaperProtocolPress(press="snapkv", compression_ratio=0.5, **bad)
    press = PaperProtocolPress(press=build_press("adakv", press="snapkv", compression_ratio=0.5))
    stack = [press.press, press.press.press]
    assert all(p.decoding and p.protected_sinks == 4 for p in stack)
    kept = PaperProtocolPress(press=build_press("snapkv", compression_ratio=0.5, protected_sinks=8, protected_recent=3))
    assert (kept.press.protected_sinks, kept.press.protected_recent) == (8, 3)
    assert PaperProtocolPress(press="knorm", compression_ratio=0.5).config_dict()["press"]["name"] == "knorm"


def test_runner_protocol_names_cells_and_wraps_every_compressed_method(toy_data, tmp_path):
    from core_kv.config import load_config

    out = tmp_path / "paper"
    cfg = load_config(EvalConfig, eval_argv(toy_data, out, "protocol=core_paper", "ratios=[0.5]"))
    assert cell_method(cfg, "snapkv") == "snapkv@core_paper" and cell_method(cfg, "full") == "full"
    res = run_eval(cfg)
    methods = sorted(c["method"] for c in res.cells)
    assert methods == ["full", "knorm@core_paper", "snapkv@core_paper"]
    folder = out / "toy__tiny-random__snapkv@core_paper__0.50"
    spec = (folder / "config.yaml").read_text()
    assert "protocol: core_paper" in spec and "name: paper_protocol" in spec
    assert (out / "toy__tiny-random__full__0.00" / "metrics.json").is_file()
    assert "snapkv@core_paper" in res.markdown
    with pytest.raises(ValueError, match="protocol"):
        load_config(EvalConfig, eval_argv(toy_data, out, "protocol=paper"))


def test_decoding_false_is_refused_not_silently_turned_on():
    """``paper_protocol(decoding=False)`` was silently turned on: the protocol is decode-time compression."""
    with pytest.raises(ValueError, match=r"paper_protocol: decoding=False, but the protocol compresses again while "
                                         r"decoding .* use the wrapped press alone"):  # fmt: skip
        build_press("paper_protocol", press="snapkv", compression_ratio=0.5, decoding=False)
    with pytest.raises(
        ValueError, match=r"decoding must be true or false or null, got 0"
    ):  # the option's type, as for any wrapper (null: the wrapped press's)
        build_press("paper_protocol", press="snapkv", compression_ratio=0.5, decoding=0)
    assert build_press("paper_protocol", press="snapkv", compression_ratio=0.5).decoding is True
    assert build_press("paper_protocol", press="snapkv", compression_ratio=0.5, decoding=True).press.decoding is True
