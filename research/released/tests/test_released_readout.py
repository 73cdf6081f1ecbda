"""``research/released/readout.py``: the released memory's readout against the evicted-only attention output.
The ideal correction (``m = o_E``) against the mixture identity, and a run on the proxy LM."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from core_kv.models.attention import LayerQKV
from research.released import readout as fmr
from research.released.memory import FastMemory

ROOT = Path(__file__).resolve().parents[3]


def _layer(seed: int = 0, hkv: int = 2, g: int = 2, t: int = 40, d: int = 8) -> LayerQKV:
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(hkv * g, t, d, generator=gen), torch.randn(hkv, t, d, generator=gen)
    return LayerQKV(q_pre=q, k_pre=k, v=torch.randn(hkv, t, d, generator=gen), q_post=q, k_post=k, scaling=d**-0.5)


def test_the_ideal_interpolation_removes_the_error_with_one_head():
    """One query head: ``o* = (1 − α_E) o_R + α_E o_E`` exactly, so ``m = o_E`` with the best gate leaves no error
    when α_E is the same for every tail query (one query here), and the signed and positive kernels leave some."""
    a = _layer(hkv=1, g=1)
    memory = FastMemory(1, 1, 1, 8, dim=16, gate_hidden=4)
    memory.reset_parameters(0)
    gen = torch.Generator().manual_seed(1)
    out = fmr.layer_stats(a, memory, 0, n=39, tail=1, ratio=0.5, sinks=2, gen=gen)
    assert out["ideal_rel"] == pytest.approx(0.0, abs=1e-5)
    assert out["ideal_gate"] == pytest.approx(out["alpha_e"], rel=1e-4)
    assert 0 < out["interpolate_rel"] <= 1 and 0 < out["residual_rel"] <= 1
    memory.kernel = "positive"
    pos = fmr.layer_stats(a, memory, 0, n=39, tail=1, ratio=0.5, sinks=2, gen=torch.Generator().manual_seed(1))
    assert pos["cos_m_oE"] > 0 and pos["ideal_rel"] == pytest.approx(0.0, abs=1e-5)


@pytest.mark.skipif(not (ROOT / "checkpoints" / "proxy-lm").is_dir(), reason="the shipped proxy LM is not checked out")
def test_a_run_on_the_proxy_prints_one_row_per_layer(capsys):
    fmr.main(["--config", str(ROOT / "research" / "released" / "configs" / "proxy.yaml"), "--docs", "1"])
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("| ")]
    assert lines[0].startswith("| layer | alpha_e") and lines[-1].startswith("| mean |")
    assert len(lines) == 2 + 4  # header + the proxy's 4 layers + mean (the separator starts with "|---")
