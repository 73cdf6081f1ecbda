"""CORE's latent memory and gate (CORE.md stage 4; paper Table 9; indexmem_core.md §3.6–3.7).

One memory state per (layer, KV head) [choice], in pre-W_O space, with the paper's shapes [paper Table 9]:
map ``φ: R^D → R^512`` without bias, state ``M ∈ R^{512×D}``, ``b ∈ R^512``, ``Z ∈ R``. Positive features
``φ⁺(x) = softplus(W_φ x)`` on pre-RoPE keys/queries [choice: a content-only kernel with positive normalisers].

Writes at an eviction event with evicted set E and weights w (:func:`write_weights`)::

    M += Σ_{i∈E} w_i φ⁺(k̃_i) v_iᵀ        b += Σ_{i∈E} w_i φ⁺(k̃_i)        Z += Σ_{i∈E} w_i

| rule            | w_i       | ΔZ per event | paper                         |
|-----------------|-----------|--------------|-------------------------------|
| mass-weighted   | p_i       | ε̂            | CORE's rule (Tables 3, 8)     |
| equal-event     | p_i / ε̂   | 1            | ablation (Table 8)            |
| uniform-token   | 1         | |E|          | ``CORE_ind`` (Table 3)        |

Readout for a query head with pre-RoPE query q̃: ``m(q) = Mᵀφ⁺(q̃) / (bᵀφ⁺(q̃) + ε)``; output before W_O:
``ô = o_R + g(q) (m(q) − o_R)`` with ``g = σ(w_lᵀ f(q) + β_{l,h})`` [paper form, gate features are a choice]:
``f = [log(Z+ε), log(bᵀφ⁺(q̃)+ε), lse_R(q), log(‖m − o_R‖ + ε) − log(‖o_R‖ + ε)]`` — the ideal gate is the
true evicted mass ``α_E(q) = σ(log S_E − lse_R)``, so the log-normalisers are its natural inputs.

The state also keeps ``s_v = Σ w_i v_i`` and ``r = max_{i∈E} ‖v_i − c_E‖`` (running) for the certificate's
write-weighted centroid ``c_E = s_v / Z`` (CORE.md "Certificate").

Everything here is a pure function of tensors, so the press (issue 8) and the trainer share it; gradients flow
from the readout through ``M`` and ``b`` into ``W_φ``.

Shapes: Hkv KV heads, H query heads (GQA: head h uses KV head h // G), E evicted tokens, T queries, D head dim,
P = 512 memory features, L layers, F_g = 4 gate features.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

MEMORY_DIM = 512  # [paper Table 9]
GATE_FEATURES = ("log_Z", "log_bphi", "lse_retained", "log_gap_ratio")
WRITE_RULES = ("mass", "equal_event", "uniform_token")
EPS = 1e-6


@dataclass
class MemoryState:
    """Memory of one layer, every KV head (fp32)."""

    M: torch.Tensor  # (Hkv, P, D)
    b: torch.Tensor  # (Hkv, P)
    Z: torch.Tensor  # (Hkv,)
    s_v: torch.Tensor  # (Hkv, D) Σ w_i v_i (certificate centroid numerator)
    radius: torch.Tensor  # (Hkv,) running max ‖v_i − c_E‖ over written tokens
    events: int = 0
    Mb: torch.Tensor | None = None  # (Hkv, P, D + 1) = [M | b] when written by write_fused (M, b are its views)

    @classmethod
    def empty(cls, kv_heads: int, head_dim: int, dim: int = MEMORY_DIM, device=None) -> MemoryState:
        z = lambda *s: torch.zeros(*s, device=device, dtype=torch.float32)  # noqa: E731
        return cls(z(kv_heads, dim, head_dim), z(kv_heads, dim), z(kv_heads), z(kv_heads, head_dim), z(kv_heads))

    @property
    def centroid(self) -> torch.Tensor:
        """Write-weighted evicted centroid ``c_E = s_v / Z`` (Hkv, D); zero where nothing was written."""
        return self.s_v / self.Z.clamp_min(EPS)[:, None]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.M, self.b, self.Z, self.s_v, self.radius))


def write_weights(p: torch.Tensor, evicted: torch.Tensor, rule: str = "mass") -> torch.Tensor:
    """Per-candidate write weights (zero outside E) for one event.

    Args:
        p: The calibrated distribution over candidates ``softmax(s / T)`` (Hkv, N).
        evicted: Evicted mask (Hkv, N).
        rule: ``mass`` (w = p), ``equal_event`` (w = p / ε̂) or ``uniform_token`` (w = 1).

    Returns:
        Weights (Hkv, N).
    """
    ev = evicted.to(p.dtype)
    if rule == "mass":
        return p * ev
    if rule == "equal_event":
        eps_hat = (p * ev).sum(-1, keepdim=True)
        return torch.where(eps_hat > 0, p * ev / eps_hat.clamp_min(1e-30), torch.zeros_like(p))
    if rule == "uniform_token":
        return ev
    raise ValueError(f"unknown write rule {rule!r}; expected one of {WRITE_RULES}")


def positive_features(w_phi: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``φ⁺(x) = softplus(W_φ x)``: ``w_phi`` (Hkv, P, D), ``x`` (Hkv, ..., D) -> (Hkv, ..., P)."""
    hkv, p, d = w_phi.shape
    flat = x.reshape(hkv, -1, d).float()
    return F.softplus(flat @ w_phi.float().mT).reshape(*x.shape[:-1], p)


def write(
    state: MemoryState, w_phi: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, weights: torch.Tensor
) -> MemoryState:
    """One eviction event's write (functional: returns a new state, differentiable in ``w_phi``).

    Args:
        state: The layer's state before the event.
        w_phi: The layer's map (Hkv, P, D).
        keys: Pre-RoPE keys of the candidates (Hkv, N, D) (or only the evicted ones).
        values: Their values (Hkv, N, D).
        weights: Write weights (Hkv, N), zero for tokens not written (:func:`write_weights`).
    """
    w = weights.float()
    fk = positive_features(w_phi, keys)  # (Hkv, N, P)
    v = values.float()
    wf = fk * w[..., None]  # (Hkv, N, P)
    s_v = state.s_v + (w[..., None] * v).sum(1)
    z = state.Z + w.sum(-1)
    centre = s_v / z.clamp_min(EPS)[:, None]
    dist = (v - centre[:, None]).norm(dim=-1).masked_fill(w <= 0, 0.0)  # (Hkv, N)
    return replace(
        state,
        M=state.M + wf.mT @ v,
        b=state.b + wf.sum(1),
        Z=z,
        s_v=s_v,
        radius=torch.maximum(state.radius, dist.amax(-1).detach()),
        events=state.events + 1,
    )


def write_fused(
    state: MemoryState,
    w_phi: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    weights: torch.Tensor,
    dtype: torch.dtype | None = None,
) -> MemoryState:
    """:func:`write` for inference (no gradients): ``[ΔM | Δb] = φ⁺(k)ᵀ [w v | w]``, one matmul per KV head.

    ``keys``, ``values`` and ``weights`` hold each KV head's written entries: ``(Hkv, E, ·)`` tensors, or sequences of
    Hkv tensors ``(E_h, ·)`` with each head's own count (the press's head-wise budgets evict different numbers per
    head, so nothing is padded to the longest head: a padded entry would cost its ``φ⁺`` and write nothing).
    Equal to :func:`write` up to float rounding (the weights multiply ``v`` (E × D) instead of ``φ⁺`` (E × P), an
    association change). ``M`` and ``b`` of the result are views of one ``(Hkv, P, D + 1)`` buffer ``Mb`` (what
    :func:`compensate_fused` multiplies), stored in ``dtype`` (default: the state's); the update is computed in fp32.
    ``Z``, ``s_v`` and the radius stay fp32 (they are O(D) numbers per head).
    """
    base = state.Mb if state.Mb is not None else torch.cat([state.M, state.b[..., None]], -1)
    mb = base.to(torch.float32, copy=True)
    s_v, z, radius = state.s_v.clone(), state.Z.clone(), state.radius.clone()
    for h in range(mb.shape[0]):
        w, v = weights[h].float()[:, None], values[h].float()  # (E_h, 1), (E_h, D)
        fk = positive_features(w_phi[h][None], keys[h][None])[0]  # (E_h, P)
        wv = w * v
        mb[h] += fk.mT @ torch.cat([wv, w], -1)  # (P, D + 1)
        s_v[h] += wv.sum(0)
        z[h] += w.sum()
        if v.shape[0]:
            dist = (v - s_v[h] / z[h].clamp_min(EPS)).norm(dim=-1).masked_fill(w[:, 0] <= 0, 0.0)  # (E_h,)
            radius[h] = torch.maximum(radius[h], dist.amax())
    mb = mb.to(dtype or base.dtype)
    d = mb.shape[-1] - 1
    return replace(state, M=mb[..., :d], b=mb[..., d], Z=z, s_v=s_v, radius=radius, events=state.events + 1, Mb=mb)


def read(state: MemoryState, w_phi: torch.Tensor, queries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Memory readout per query head.

    Args:
        state: Layer state (Hkv KV heads).
        w_phi: The layer's map (Hkv, P, D).
        queries: Pre-RoPE queries (H, T, D), H = G·Hkv (head h reads KV head h // G).

    Returns:
        ``(m (H, T, D), bᵀφ⁺(q) (H, T))``.
    """
    h, t, d = queries.shape
    hkv = state.M.shape[0]
    g = h // hkv
    fq = positive_features(w_phi, queries.reshape(hkv, g * t, d))  # (Hkv, G·T, P)
    num = fq @ state.M  # (Hkv, G·T, D)
    den = (fq * state.b[:, None]).sum(-1)  # (Hkv, G·T)
    m = num / (den + EPS)[..., None]
    return m.reshape(h, t, d), den.reshape(h, t)


def gate_features(
    state: MemoryState, bphi: torch.Tensor, lse_retained: torch.Tensor, m: torch.Tensor, o_r: torch.Tensor
) -> torch.Tensor:
    """Gate inputs ``f(q)`` (H, T, 4): ``[log Z, log bᵀφ⁺(q), lse_R(q), log ‖m − o_R‖/‖o_R‖]``."""
    h, t = bphi.shape
    g = h // state.Z.shape[0]
    log_z = (state.Z + EPS).log().repeat_interleave(g)[:, None].expand(h, t)
    gap = (m - o_r.float()).norm(dim=-1).add(EPS).log() - o_r.float().norm(dim=-1).add(EPS).log()
    return torch.stack([log_z, (bphi + EPS).log(), lse_retained.float(), gap], -1)


def compensate(
    state: MemoryState,
    w_phi: torch.Tensor,
    gate_w: torch.Tensor,
    gate_b: torch.Tensor,
    queries: torch.Tensor,
    o_retained: torch.Tensor,
    lse_retained: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated residual reconstruction ``ô = o_R + g (m − o_R)`` before W_O, per query head.

    Args:
        state: Layer state.
        w_phi: (Hkv, P, D).
        gate_w: Gate weights of the layer (F_g,).
        gate_b: Gate bias per query head (H,).
        queries: Pre-RoPE queries (H, T, D).
        o_retained: Attention output over the retained cache (H, T, D).
        lse_retained: Its log-partition ``log Σ_{i∈R} exp(q·k_i · scaling)`` (H, T).

    Returns:
        ``(ô (H, T, D), g (H, T))``; ``g = 0`` for heads whose memory is empty.
    """
    m, bphi = read(state, w_phi, queries)
    f = gate_features(state, bphi, lse_retained, m, o_retained)
    g = torch.sigmoid(f @ gate_w.float() + gate_b.float()[:, None])  # (H, T)
    h = queries.shape[0]
    written = (state.Z > 0).repeat_interleave(h // state.Z.shape[0])[:, None]
    g = g * written
    o = o_retained.float()
    return o + g[..., None] * (m - o), g


@dataclass(frozen=True)
class GateTerms:
    """The part of one layer's gate logit that does not depend on the query, fixed from one write to the next
    (:func:`gate_terms`): ``offset`` (H, 1) = ``β_h + w_0 · log(Z + ε)`` of the query head's KV head (``−∞`` where that
    head's memory is empty: its gate stays shut), ``weights`` = ``(w_1, w_2, w_3)`` of the query's features
    ``log bᵀφ⁺(q̃)``, ``lse_R(q)`` and the log gap ratio (:data:`GATE_FEATURES`)."""

    offset: torch.Tensor
    weights: tuple[float, float, float]


def gate_terms(state: MemoryState, gate_w: torch.Tensor, gate_b: torch.Tensor) -> GateTerms:
    """:class:`GateTerms` of a layer's state and gate (``gate_w`` (F_g,), ``gate_b`` (H,)), for :func:`compensate_fused`."""
    hkv, h = state.Z.shape[0], gate_b.shape[0]
    w0, w1, w2, w3 = gate_w.float().tolist()
    log_z = (state.Z + EPS).log()
    offset = (gate_b.float().view(hkv, h // hkv) + log_z[:, None] * w0).reshape(h, 1)  # query head h: KV head h // G
    empty = (state.Z <= 0).repeat_interleave(h // hkv)[:, None]
    return GateTerms(offset.masked_fill(empty, float("-inf")), (w1, w2, w3))


def compensate_fused(
    state: MemoryState,
    w_phi_t: torch.Tensor,
    gate: GateTerms,
    queries: torch.Tensor,
    o_retained: torch.Tensor,
    lse_retained: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`compensate` for inference on a state from :func:`write_fused`: numerator and ``bᵀφ⁺(q)`` from one
    matmul with ``[M | b]``; ``w_phi_t`` is ``W_φᵀ`` (Hkv, D, P) (a transposed view is fine); ``gate`` the layer's
    :func:`gate_terms` for this state (computed once per write, not per query). Equal to :func:`compensate` up to
    float rounding (``bᵀφ⁺`` is summed by the matmul); shapes and returns as :func:`compensate`."""
    h, t, d = queries.shape
    hkv = w_phi_t.shape[0]
    fq = F.softplus(queries.reshape(hkv, h // hkv * t, d).float() @ w_phi_t)  # (Hkv, G·T, P)
    nd = fq @ state.Mb.float()  # (Hkv, G·T, D + 1)
    den = nd[..., d:] + EPS  # (Hkv, G·T, 1)
    m = (nd[..., :d] / den).reshape(h, t, d)
    o = o_retained.float()
    diff = m - o
    # gate logit w·f + β, the features summed in place (fewer kernels than stacking f; equal up to rounding)
    w1, w2, w3 = gate.weights
    norms = torch.stack([diff, o]).norm(dim=-1).add_(EPS).log_()  # (2, H, T)
    logit = torch.add(gate.offset, den.reshape(h, t).log(), alpha=w1).add_(lse_retained.float(), alpha=w2)
    g_ = logit.add_(norms[0] - norms[1], alpha=w3).sigmoid_()  # (H, T); exactly 0 where the offset is −∞
    return torch.addcmul(o, g_[..., None], diff), g_


class LatentMemory(nn.Module):
    """Trainable parameters of the memory and gate for every layer.

    Args:
        num_layers: L.
        num_heads: H query heads.
        num_kv_heads: Hkv.
        head_dim: D.
        dim: P (512, paper Table 9).
        seed: Initialisation seed (``W_φ`` orthogonal rows scaled by 1/√D [choice, indexmem_core.md §3.6]).
    """

    def __init__(self, num_layers: int, num_heads: int, num_kv_heads: int, head_dim: int, dim: int = MEMORY_DIM):
        super().__init__()
        self.num_layers, self.num_heads, self.num_kv_heads, self.head_dim, self.dim = (
            num_layers, num_heads, num_kv_heads, head_dim, dim,
        )  # fmt: skip
        self.w_phi = nn.Parameter(torch.empty(num_layers, num_kv_heads, dim, head_dim))  # no bias [paper]
        self.gate_w = nn.Parameter(torch.zeros(num_layers, len(GATE_FEATURES)))
        self.gate_b = nn.Parameter(torch.zeros(num_layers, num_heads))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        w = torch.randn(self.num_layers * self.num_kv_heads, self.dim, self.head_dim, generator=g)
        q, _ = torch.linalg.qr(w)  # (.., P, D) orthonormal columns
        self.w_phi.copy_(q.reshape_as(self.w_phi) * (self.dim / self.head_dim) ** 0.5 / self.head_dim**0.5)
        self.gate_w.zero_()
        self.gate_w[:, 1] = 1.0  # more written kernel mass -> open the gate
        self.gate_w[:, 2] = -1.0  # more retained attention mass -> close it
        self.gate_b.fill_(-2.0)

    def empty_state(self, device=None) -> MemoryState:
        return MemoryState.empty(self.num_kv_heads, self.head_dim, self.dim, device=device)

    def write(self, state: MemoryState, layer: int, keys, values, weights) -> MemoryState:
        """:func:`write` with this layer's map."""
        return write(state, self.w_phi[layer], keys, values, weights)

    def read(self, state: MemoryState, layer: int, queries):
        """:func:`read` with this layer's map."""
        return read(state, self.w_phi[layer], queries)

    def compensate(self, state: MemoryState, layer: int, queries, o_retained, lse_retained):
        """:func:`compensate` with this layer's map and gate."""
        return compensate(
            state, self.w_phi[layer], self.gate_w[layer], self.gate_b[layer], queries, o_retained, lse_retained
        )

    def state_bytes(self, dtype_bytes: int = 4) -> int:
        """Auxiliary state bytes for the whole model: ``L · Hkv · (P·D + P + 1 + D + 1)`` numbers."""
        d, p = self.head_dim, self.dim
        return self.num_layers * self.num_kv_heads * (p * d + p + 1 + d + 1) * dtype_bytes
