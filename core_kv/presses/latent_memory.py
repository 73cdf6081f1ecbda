"""CORE's second channel: a latent memory that the evicted entries are written into, read back before ``W_O``.

Paper: Liu et al., 2026 (``../shared/papers/002_8a6c3448532074fc.txt``): "eviction error equals evicted attention mass
times the directional gap", so the evicted set is written into a memory in proportion to its mass; CORE.md "Stage 4"
and "Inference". At every eviction event of the wrapped press (with the *final* evicted set: a repair or head-wise
wrapper inside this one has had its say)::

    E = candidates \\ kept;  w = write_weights(p, E, rule)         # p: the CORE scorer's calibrated distribution
    memory ← write(memory, φ⁺(k̃_E), v_E, w)                        # pre-RoPE keys, from the scorer's event

and before ``o_proj`` of every later query (chunk queries, question and generated tokens) the gated readout
``ô = o_R + g(q)(m(q) − o_R)`` (:func:`core_kv.memory.compensate_fused`) replaces the retained-cache output. The
memory's weights (``W_φ``, the gate) are the artifact's, handed in by the ``core`` press that loaded it.

So the paper's CORE is ``LatentMemoryPress(CoreScorerPress(...))``; the ``core`` press composes it from the
artifact's inference policy, outermost, whatever else the policy adds. Shapes: H query heads, Hkv KV heads, T tokens
of the current forward, E evicted, D head dim, P = 512 memory features.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from core_kv.config import parse_layers
from core_kv.memory import (
    WRITE_RULES,
    GateTerms,
    LatentMemory,
    MemoryState,
    compensate_fused,
    gate_terms,
    write_fused,
    write_weights,
)
from core_kv.models.attention import LSE_SINK, apply_rope, attention_modules
from core_kv.models.cache import RaggedLayer
from core_kv.presses.base import BasePress, WrapperPress

MEMORY_DTYPES = (None, "float32", "bfloat16", "float16")


@dataclass
class MemoryLayer:
    """Per-layer state of the memory: the state ``M, b, Z`` (``None`` before the first write) and its gate's
    query-independent terms (:func:`~core_kv.memory.gate_terms`, set at each write), ``survive`` = Π_e (1 − ε̂_e) per
    KV head (1 − it is the predicted evicted mass), the cache's bytes per element, and the current forward (the cache,
    its RoPE tables and, for a decode step, the log-partition the attention returned)."""

    survive: torch.Tensor
    mem: MemoryState | None = None
    gate: GateTerms | None = None
    fwd: dict | None = None
    element_size: int = 4


@dataclass
class LatentMemoryPress(WrapperPress, name="latent_memory"):
    """Mass-weighted latent-memory writes of the finally evicted entries, and the gated readout (paper 002; CORE.md
    "Stage 4", "Inference"), around a press whose stack contains the CORE scorer. The scorer's event (its
    distribution ``p``, the candidates' pre-RoPE keys and positions: :class:`~core_kv.presses.core_scorer.CoreEvent`)
    reaches this press as data, in the stack's per-layer state (``layer_state[layer]["event"]``) during the
    :meth:`evicted` phase; the queries of a forward are the stack's one capture (:meth:`BasePress.queries`).

    Built by the ``core`` press (:mod:`core_kv.presses.core`), which loads the artifact once and hands this press its
    memory: ``LatentMemoryPress(press=stack, memory=core.memory, write_rule=core.config.write_rule)``.

    Args:
        press: The wrapped press (its stack must contain a ``core_scorer``).
        memory: The artifact's trained memory (:attr:`CoreModel.memory <core_kv.core_model.CoreModel>`: ``W_φ``, the
            gate); required unless the press is a no-op.
        write_rule: ``mass`` (CORE), ``equal_event`` or ``uniform_token`` (paper Tables 3, 8).
        layers: Layers that write and read a memory (``"0-5,8"``); ``""`` = every layer. A policy chosen on
            validation data may keep the memory only where it helps [a deviation from the paper's all-layer memory;
            docs/method.md "Inference policy"].
        budget_matched: Reduce B by the memory state's token-equivalent (state bytes per KV head / bytes of one
            cached token), so CORE's total bytes match a baseline at the same nominal ratio (CORE.md "Inference").
        memory_dtype: Storage dtype of the memory's ``[M | b]`` (``"bfloat16"``, ``"float16"``, ``"float32"``;
            ``None`` = the cache's: fp32 for an fp32 model, bf16 for a 2-byte one); writes and reads compute in fp32
            (``Z``, ``s_v``, the radius stay fp32).
    """

    press: BasePress | str = "core_scorer"
    memory: LatentMemory | None = field(default=None, repr=False, compare=False)
    write_rule: str = "mass"
    layers: str = ""
    budget_matched: bool = False
    memory_dtype: str | None = None

    _memory: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _layer_set: set = field(default_factory=set, init=False, repr=False, compare=False)

    def validate(self) -> None:
        super().validate()
        if self.memory is None and not self.is_noop:
            raise ValueError(f"{self.name} needs the artifact's trained memory: memory=<CoreModel>.memory (the core "
                             "press hands it in: build_press('core', checkpoint=..., ...))")  # fmt: skip
        if self.write_rule not in WRITE_RULES:
            raise ValueError(f"write_rule must be one of {WRITE_RULES}, got {self.write_rule!r}")
        if self.memory_dtype not in MEMORY_DTYPES:
            raise ValueError(f"memory_dtype must be None, float32, bfloat16 or float16, got {self.memory_dtype!r}")
        self._layer_set = set(parse_layers(self.layers, "layers"))

    def active(self, layer: int) -> bool:
        return not self._layer_set or layer in self._layer_set

    def memory_state(self, layer: int) -> MemoryState | None:
        """The latent memory of ``layer`` after the last event (``None`` before any write)."""
        st = self._memory.get(layer)
        return None if st is None else st.mem

    # ------------------------------------------------------------------------------------------------------------
    # Budget accounting

    def token_equivalent(self, cache_element_size: int) -> int:
        """Cached tokens one KV head's memory state is worth: ``ceil(state bytes / (2 · D · bytes(dtype)))``."""
        m = self.memory
        mb = self._memory_dtype(cache_element_size).itemsize  # [M | b] in the storage dtype, Z/s_v/radius fp32
        per_head = m.dim * (m.head_dim + 1) * mb + (m.head_dim + 2) * 4
        return math.ceil(per_head / (2 * m.head_dim * cache_element_size))

    def _memory_dtype(self, cache_element_size: int) -> torch.dtype:
        if self.memory_dtype:
            return getattr(torch, self.memory_dtype)
        return torch.float32 if cache_element_size >= 4 else torch.bfloat16

    def eviction_target(self, module: nn.Module, seen: int, prefill: bool) -> int:
        b = self.press.eviction_target(module, seen, prefill)
        if self.budget_matched and self.active(module.layer_idx):
            b = max(1, b - self.token_equivalent(self._memory[module.layer_idx].element_size))
        return b

    def aux_breakdown(self) -> dict:
        """``{"memory_state": bytes, ...}`` plus the wrapped stack's bookkeeping."""
        mem = sum(st.mem.nbytes() for st in self._memory.values() if st.mem is not None)
        return {"memory_state": mem, **self.press.aux_breakdown()}

    # ------------------------------------------------------------------------------------------------------------
    # Hooks

    def captures_queries(self) -> bool:
        """The readout reads the queries of every forward (:meth:`BasePress.queries`)."""
        return not self.is_noop or super().captures_queries()

    def uninstall(self, model: nn.Module) -> None:
        for attn in attention_modules(model):
            attn.__dict__.pop(LSE_SINK, None)
        super().uninstall(model)

    def before_forward(self, module: nn.Module, hs: torch.Tensor, cache, kwargs: dict) -> None:
        super().before_forward(module, hs, cache, kwargs)
        idx = module.layer_idx
        if self.is_noop or not self.active(idx):
            return
        st = self._memory.get(idx)
        if st is None or self._state[idx]["empty_before"]:
            st = self._memory[idx] = MemoryLayer(
                survive=torch.ones(module.config.num_key_value_heads, device=hs.device)
            )
        st.fwd = {"cache": cache, "position_embeddings": kwargs["position_embeddings"]}
        # a forward that will read the memory: let the attention return its log-partition (no q·K recompute) — a
        # decode step, or any forward on a ragged layer (its per-head kernel returns it for T queries too)
        ragged = idx < len(cache.layers) and isinstance(cache.layers[idx], RaggedLayer)
        if st.mem is not None and (hs.shape[1] == 1 or ragged) and self.sink_log_partition:
            module.__dict__[LSE_SINK] = st.fwd
        else:
            module.__dict__.pop(LSE_SINK, None)

    sink_log_partition = True  # the certificate observer (research/) recomputes it instead

    def after_forward(self, module: nn.Module, hs: torch.Tensor, cache, kwargs: dict) -> None:
        st = self._memory.get(module.layer_idx)
        if st is not None:
            st.fwd = None
            layer = cache.layers[module.layer_idx]  # its bytes per element: the token equivalent of budget matching
            st.element_size = layer.dtype.itemsize if layer.keys is None else layer.keys.element_size()
        super().after_forward(module, hs, cache, kwargs)

    # ------------------------------------------------------------------------------------------------------------
    # Writes: the final evicted set of every event

    @torch.no_grad()
    def evicted(self, module, keys, values, kept, lengths=None) -> None:
        idx = module.layer_idx
        st = self._memory.get(idx)
        if st is not None:
            self.write(module, st, keys, values, kept)
        super().evicted(module, keys, values, kept, lengths)  # the scorer then keeps the retained positions

    def write(self, module, st: MemoryLayer, keys, values, kept) -> None:
        """Write the evicted entries of this event with the CORE scorer's distribution (:func:`write_weights`), from the
        event the scorer published in the per-layer state."""
        ev = self.layer_state[module.layer_idx]["event"]
        v = values[0]  # (Hkv, N, D)
        hkv, n = ev.p.shape
        keep = torch.zeros(hkv, n, dtype=torch.bool, device=v.device)
        heads = kept[0] if isinstance(kept, torch.Tensor) else kept
        for h in range(hkv):
            keep[h, heads[h]] = True
        evicted = ~keep & (torch.arange(n, device=v.device)[None] < ev.lengths[:, None])
        st.survive = st.survive * (1 - (ev.p * evicted).sum(-1))
        if not bool(evicted.any()):
            return
        # each head's evicted indices in position order, at its own count (head-wise budgets: counts differ)
        ev_idx = [evicted[h].nonzero().squeeze(1) for h in range(hkv)]
        wts = self.write_weights(module.layer_idx, ev.p, evicted)
        mem = st.mem if st.mem is not None else self.memory.empty_state(device=v.device)
        dtype = self._memory_dtype(keys.dtype.itemsize)
        w_phi = self.memory.w_phi[module.layer_idx].detach()
        st.mem = write_fused(mem, w_phi, [ev.k_pre[h, i] for h, i in enumerate(ev_idx)],
                             [v[h, i] for h, i in enumerate(ev_idx)], [wts[h, i] for h, i in enumerate(ev_idx)],
                             dtype=dtype)  # fmt: skip
        m = self.memory
        st.gate = gate_terms(st.mem, m.gate_w[module.layer_idx].detach(), m.gate_b[module.layer_idx].detach())

    def write_weights(self, layer: int, p: torch.Tensor, evicted: torch.Tensor) -> torch.Tensor:
        """Write weight of every candidate (Hkv, N) (:func:`core_kv.memory.write_weights` with the rule)."""
        return write_weights(p, evicted, self.write_rule)

    # ------------------------------------------------------------------------------------------------------------
    # The readout

    @torch.no_grad()
    def readout(self, module: nn.Module, attn_output: torch.Tensor) -> torch.Tensor | None:
        """``ô = o_R + g (m − o_R)`` per query head before ``o_proj`` once this layer's memory holds writes."""
        out = self.press.readout(module, attn_output)  # nothing in the shipped stacks; kept for composition
        attn_output = attn_output if out is None else out
        st = self._memory.get(module.layer_idx)
        if self.is_noop or st is None or st.mem is None or st.fwd is None:
            return out
        q_pre = self.queries(module)  # (H, T, D)
        h, t, d = q_pre.shape
        o_r = attn_output[0].view(t, h, d).transpose(0, 1).float()  # (H, T, D)
        lse = st.fwd.get("lse")  # from the attention kernel (see before_forward), else computed here
        if lse is None:
            lse = self.retained_lse(module, st, q_pre)
        o_hat, g = self.compensate(module.layer_idx, st.mem, q_pre, o_r, lse.float())
        self.observe(module, st, q_pre, o_r, o_hat, g, lse.float())
        return o_hat.transpose(0, 1).reshape(1, t, h * d).to(attn_output.dtype)

    def observe(self, module, st: MemoryLayer, q_pre, o_r, o_hat, gate, lse) -> None:
        """After each readout (a diagnostic subclass logs the certificate here; nothing by default)."""

    def compensate(self, layer: int, mem: MemoryState, q_pre, o_r, lse):
        """``(ô, g)`` (:func:`core_kv.memory.compensate_fused` with the gate terms of the layer's last write;
        :func:`~core_kv.memory.compensate` up to rounding)."""
        w_phi_t = self.memory.w_phi[layer].detach().mT  # a transposed view: the matmul reads it in place
        return compensate_fused(mem, w_phi_t, self._memory[layer].gate, q_pre, o_r, lse)

    def retained_lse(self, module, st: MemoryLayer, q_pre: torch.Tensor) -> torch.Tensor:
        """Log-partition of each query (H, T) over the layer's cached keys, the T new ones causally; a ragged layer
        group by group."""
        q_post = apply_rope(module, q_pre[None], st.fwd["position_embeddings"])[0].float()
        layer = st.fwd["cache"].layers[module.layer_idx]
        if not isinstance(layer, RaggedLayer):
            return _lse(module, q_post, layer.keys[0])
        h = q_post.shape[0]
        g = h // layer.num_heads
        out = q_post.new_empty(h, q_post.shape[1])
        for grp in layer.groups:
            qh = (grp.heads[:, None] * g + torch.arange(g, device=grp.heads.device)[None]).reshape(-1)
            out[qh] = _lse(module, q_post[qh], grp.keys[0])
        return out


def _lse(module, q_post: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Log-partition of queries (h, T) over keys (h_kv, S, D) of their KV heads, the T new ones causally."""
    h, t, d = q_post.shape
    hkv, s, _ = keys.shape
    scaling = float(getattr(module, "scaling", d**-0.5))
    logits = (q_post.reshape(hkv, h // hkv * t, d) @ keys.float().mT) * scaling  # (Hkv, G·T, S), row g·T + t
    if t > 1:
        visible = torch.arange(s, device=keys.device)[None] <= (s - t + torch.arange(t, device=keys.device))[:, None]
        logits = logits.masked_fill(~visible.repeat(h // hkv, 1), float("-inf"))
    return logits.logsumexp(-1).reshape(h, t)


__all__ = ["LatentMemoryPress", "MemoryLayer"]
