"""The released CORE memory at inference: evicted tokens written into one fast-weight state per layer, read back as an
additive residual before ``o_proj``.

Source: the CORE authors' release, GitHub ``zhutizi23-coder/CORE`` ``core/kvpress_adapter.py`` (``COREMemoryPress``),
read for the specification; the math is :mod:`core_kv.fast_memory` (shared with training). At every eviction event of
the wrapped press, with the *final* evicted set ``E``::

    p = softmax(s / T_l) over all the event's candidates        # the head-shared scores of the v3 scorer
    Z' = γ Z + μ_E,   M' = (γ Z M + μ_E M̄) / (Z' + ε), ...      # FastMemory.write_event (γ: the artifact's decay)

and every later query (chunks, question and generated tokens) adds ``g(q) m(q)`` to its attention output before
``o_proj``, ``q`` its post-RoPE query heads concatenated. The memory's weights (``θ``, the gate) come from the artifact
the scorer loaded. The ``core`` press puts it outermost around
:class:`~core_kv.presses.released_scorer.CoreReleasedScorerPress` for a spec-v3 artifact.

Shapes: H query heads, Hkv KV heads, T tokens of the current forward, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn

from core_kv.config import parse_layers
from core_kv.fast_memory import FastState
from core_kv.models.attention import apply_rope, attention_modules, prerope_queries_from_projection
from core_kv.presses.base import WrapperPress
from core_kv.presses.released_scorer import CoreReleasedScorerPress


@dataclass
class FastMemoryLayer:
    """One layer's fast state (``None`` before the first write) and the current forward's queries/RoPE tables."""

    state: FastState | None = None
    fwd: dict | None = None


@dataclass
class FastMemoryPress(WrapperPress, name="fast_memory"):
    """The released memory around a spec-v3 scorer (its stack must contain ``core_released_scorer``).

    Args:
        press: The wrapped press.
        layers: Layers that write and read the memory (``"0-5,8"``); ``""`` = every layer.
        decay: γ across events; ``None`` = the artifact's (the release: 0.9).
        gate: A fixed gate in [0, 1] instead of the learned one (the release's ``memory_gate_override`` ablation);
            ``None`` = learned.
    """

    press: WrapperPress | CoreReleasedScorerPress | str = "core_released_scorer"
    layers: str = ""
    decay: float | None = None
    gate: float | None = None

    _memory: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _layer_set: set = field(default_factory=set, init=False, repr=False, compare=False)

    def validate(self) -> None:
        super().validate()
        if self.scorer is None:
            raise ValueError(f"{self.name} needs core_released_scorer in the press it wraps, got {self.press!r}")
        if self.decay is not None and not 0 <= self.decay <= 1:
            raise ValueError(f"{self.name}: decay must be in [0, 1], got {self.decay!r}")
        if self.gate is not None and not 0 <= self.gate <= 1:
            raise ValueError(f"{self.name}: gate must be in [0, 1] or None, got {self.gate!r}")
        self._layer_set = set(parse_layers(self.layers, "layers"))

    @property
    def scorer(self) -> CoreReleasedScorerPress | None:
        return self.inner(CoreReleasedScorerPress)

    def active(self, layer: int) -> bool:
        return not self._layer_set or layer in self._layer_set

    def memory_state(self, layer: int) -> FastState | None:
        st = self._memory.get(layer)
        return None if st is None else st.state

    def aux_bytes(self) -> int:
        return sum(self.aux_breakdown().values())

    def aux_breakdown(self) -> dict:
        mem = sum(st.state.nbytes() for st in self._memory.values() if st.state is not None)
        return {"memory_state": mem, **self.scorer.aux_breakdown()}

    # ------------------------------------------------------------------------------------------------------------
    # Hooks

    def install(self, model: nn.Module) -> list:
        handles = super().install(model)
        if self.is_noop:
            return handles
        for attn in attention_modules(model):
            if self.active(attn.layer_idx):
                proj = attn.qkv_proj if hasattr(attn, "qkv_proj") else attn.q_proj
                handles.append(proj.register_forward_hook(partial(self._q_hook, attn)))
        return handles

    def before_forward(self, module: nn.Module, hs: torch.Tensor, cache, kwargs: dict) -> None:
        super().before_forward(module, hs, cache, kwargs)
        idx = module.layer_idx
        if self.is_noop or not self.active(idx):
            return
        st = self._memory.get(idx)
        if st is None or self._state[idx]["empty_before"]:
            st = self._memory[idx] = FastMemoryLayer()
        st.fwd = {"rope": kwargs["position_embeddings"]}

    def _q_hook(self, attn: nn.Module, proj: nn.Module, args, output: torch.Tensor) -> None:
        st = self._memory.get(attn.layer_idx)
        if st is not None and st.fwd is not None and st.state is not None:
            q_pre = prerope_queries_from_projection(attn, output)
            st.fwd["q"] = apply_rope(attn, q_pre, st.fwd["rope"])[0].float()  # (H, T, D)

    def after_forward(self, module: nn.Module, hs: torch.Tensor, cache, kwargs: dict) -> None:
        st = self._memory.get(module.layer_idx)
        if st is not None:
            st.fwd = None
        super().after_forward(module, hs, cache, kwargs)

    # ------------------------------------------------------------------------------------------------------------
    # Writes and the readout

    @torch.no_grad()
    def evicted(self, module, keys, values, kept, lengths=None) -> None:
        idx = module.layer_idx
        st = self._memory.get(idx)
        if st is not None and isinstance(kept, torch.Tensor):
            core = self.scorer.core
            n = keys.shape[2]
            evicted = torch.ones(n, dtype=torch.bool, device=keys.device)
            evicted[kept[0, 0]] = False
            if bool(evicted.any()):
                state = st.state if st.state is not None else core.memory.empty_state(keys.device)
                decay = core.config.memory_decay if self.decay is None else self.decay
                temp = float(core.indexer.temperature[idx]) if self.scorer.calibrated else 1.0
                st.state = core.memory.write_event(state, idx, self.scorer.event(idx).scores, evicted, keys[0].float(),
                                                   values[0].float(), temp, decay)  # fmt: skip
        super().evicted(module, keys, values, kept, lengths)

    @torch.no_grad()
    def readout(self, module: nn.Module, attn_output: torch.Tensor) -> torch.Tensor | None:
        """``o + g(q) m(q)`` (or ``o + g(q) (m(q) − o)``, the ``interpolate`` readout) before ``o_proj`` once this
        layer's memory holds writes."""
        out = self.press.readout(module, attn_output)
        attn_output = attn_output if out is None else out
        st = self._memory.get(module.layer_idx)
        if self.is_noop or st is None or st.state is None or st.fwd is None or "q" not in st.fwd:
            return out
        mem = self.scorer.core.memory
        q = st.fwd["q"]
        retained = attn_output[0].float()
        if self.gate is None:
            residual, _ = mem.readout_heads(st.state, module.layer_idx, q, retained)
        else:
            h, t, d = q.shape
            residual = self.gate * mem.correction(st.state, module.layer_idx, q.transpose(0, 1).reshape(t, h * d),
                                                  retained)  # fmt: skip
        return (attn_output.float() + residual[None]).to(attn_output.dtype)


__all__ = ["FastMemoryLayer", "FastMemoryPress"]
