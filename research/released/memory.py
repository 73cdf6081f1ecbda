"""The released CORE memory: one fast-weight state per layer, read with post-RoPE queries, holding values before o_proj.

Source: GitHub ``zhutizi23-coder/CORE`` ``core/indexer.py`` (``MemoryModule``), ``core/kvpress_adapter.py``
(``COREMemoryPress``) and ``core/train.py`` (``train_joint_online``); the IndexMem design (its ``--joint_training``
help cites IndexMem §3.2). Our own implementation of that specification.

Per layer ``l`` a bias-free map ``θ_l: R^W → R^P`` (``W = H·D``, the concatenated query heads; ``P = 512``) is shared
by writes (keys) and reads (queries), and a gate ``g_l(q) = σ(MLP(q))`` (``W → 64 → 1``, GELU). Keys are GQA-expanded
to the query heads (``k̃ = [k_{h//G}]_h``), values too (``ṽ``, before ``o_proj``).

**Write** at an eviction event with evicted set ``E`` and the student's calibrated distribution ``p`` over all the
event's candidates: conditional weights ``p̄_i = p_i / μ_E`` with ``μ_E = Σ_{i∈E} p_i``, then::

    M̄ = Σ_E p̄_i (θ k̃_i) ṽ_iᵀ      b̄ = Σ_E p̄_i (θ k̃_i)²
    Z' = γ Z + μ_E      M' = (γ Z M + μ_E M̄) / (Z' + ε)      b' = (γ Z b + μ_E b̄) / (Z' + ε)

(decay ``γ = 0.9`` across events, ``ε = 1e-8``; the first write of an empty state is ``μ_E M̄ / (μ_E + ε)``).

**Read** for a query ``q`` (post-RoPE, concatenated over heads): ``m(q) = (θq)ᵀ M / sqrt((θq)² · b + ε)``, and the
attention output before ``o_proj`` becomes ``o_R + g(q) m(q)`` (``readout="residual"``, the release: an additive
residual, not an interpolation) or ``o_R + g(q) (m(q) − o_R)`` (``readout="interpolate"``: the paper's form, CORE.md
stage 4 and :mod:`core_kv.memory`). Not in the release: with the full cache split into retained and evicted keys,
``o* = (1 − α_E) o_R + α_E o_E`` exactly (``α_E`` the evicted share of the query's attention, ``o_E`` the attention
output over the evicted keys alone), so the interpolation is exact with ``m = o_E`` and ``g = α_E``, while the residual
form has to produce ``α_E (o_E − o_R)`` from a normalised mixture of evicted values. Measured on our CPU-scaled recipe
(``docs/method.md`` "The released recipe"): the residual form's gate closes and the memory stays at × 1.00 of the
retained-only error.

**Loss** (training): ``‖o* − o_R − g(q) m(q)‖²`` summed over the ``W`` output coordinates, averaged over the
supervised queries (the last 16 of a training sequence).

GQA folding: ``θ k̃ = θ_fold k`` with ``θ_fold`` the sum of ``θ``'s column blocks of the G query heads that share a KV
head, and ``M`` is stored with the compact ``Hkv·D`` value columns (the expanded ones are copies): ``m`` is expanded
to ``W`` only at the read. Same numbers, ``G`` times smaller state.

Shapes: L layers, H query heads, Hkv KV heads, G = H/Hkv, D head dim, W = H·D, V = Hkv·D, P memory width, E evicted
tokens, T queries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

MEMORY_DIM = 512  # [release: memory_dim]
GATE_HIDDEN = 64  # [release: memory_gate_hidden]
DECAY = 0.9  # [release: memory_decay]
READOUTS = ("residual", "interpolate")  # the release's additive correction; the paper's interpolation
KERNELS = ("released", "positive")  # the release's signed (θq)·(θk) / sqrt norm; elu + 1 features / their mass
EPS = 1e-8


@dataclass
class FastState:
    """One layer's fast weights: ``M`` (P, V), ``b`` (P,), decayed mass ``Z`` (scalar tensor)."""

    M: torch.Tensor
    b: torch.Tensor
    Z: torch.Tensor
    events: int = 0

    @classmethod
    def empty(cls, dim: int, value_width: int, device=None) -> FastState:
        return cls(torch.zeros(dim, value_width, device=device), torch.zeros(dim, device=device),
                   torch.zeros((), device=device))  # fmt: skip

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.M, self.b, self.Z))


def expand_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``(Hkv, N, D)`` -> ``(N, Hkv·G·D)``: each KV head repeated for its G query heads, heads concatenated."""
    hkv, n, d = x.shape
    return x.repeat_interleave(groups, 0).transpose(0, 1).reshape(n, hkv * groups * d)


def concat_heads(x: torch.Tensor) -> torch.Tensor:
    """``(Hkv, N, D)`` -> ``(N, Hkv·D)`` (compact value columns, heads in order)."""
    hkv, n, d = x.shape
    return x.transpose(0, 1).reshape(n, hkv * d)


def fold_theta(theta: torch.Tensor, kv_heads: int, groups: int) -> torch.Tensor:
    """``θ`` (P, H·D) -> ``θ_fold`` (P, Hkv·D) with ``θ_fold k = θ k̃`` for every compact key ``k``."""
    p, w = theta.shape
    d = w // (kv_heads * groups)
    return theta.reshape(p, kv_heads, groups, d).sum(2).reshape(p, kv_heads * d)


def expand_values(m: torch.Tensor, kv_heads: int, groups: int) -> torch.Tensor:
    """Compact value columns (..., Hkv·D) -> the query heads' (..., H·D)."""
    *lead, v = m.shape
    d = v // kv_heads
    return m.reshape(*lead, kv_heads, 1, d).expand(*lead, kv_heads, groups, d).reshape(*lead, kv_heads * groups * d)


def conditional_weights(p: torch.Tensor, evicted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(p̄ (N,), μ_E)``: the distribution conditioned on the evicted set, and the evicted mass."""
    e = evicted.to(p.dtype)
    mass = (p * e).sum()
    return p * e / torch.where(mass > 0, mass, torch.ones_like(mass)), mass


def write(
    state: FastState,
    theta_fold: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    weights: torch.Tensor,
    mass: torch.Tensor,
    decay: float = DECAY,
    eta: float = 1.0,
    kernel: str = "released",
) -> FastState:
    """One event's decayed, mass-weighted write (functional; differentiable in ``theta_fold``).

    Args:
        state: The layer's state before the event.
        theta_fold: Folded map (P, V) (:func:`fold_theta`).
        keys: Compact post-RoPE keys of the evicted tokens (E, V) (:func:`concat_heads`).
        values: Their compact values (E, V).
        weights: Conditional write weights ``p̄`` (E,), summing to 1.
        mass: The evicted mass ``μ_E`` (scalar tensor).
        decay: γ.
        eta: Write scale η (1 in the release).
        kernel: ``released``: ``b̄ = Σ p̄ (θk)²``; ``positive``: features ``φ(k) = elu(θk) + 1`` and ``b̄ = Σ p̄ φ(k)``
            (the normaliser of :func:`read`).
    """
    phi = keys.float() @ theta_fold.float().T  # (E, P)
    w = weights.float()[:, None]
    if kernel == "positive":
        phi = F.elu(phi) + 1
    m_bar = (phi * w).T @ values.float() * eta  # (P, V)
    b_bar = ((phi if kernel == "positive" else phi.pow(2)) * w).sum(0) * eta  # (P,)
    old = decay * state.Z
    z = old + mass.float()
    return FastState((old * state.M + mass * m_bar) / (z + EPS), (old * state.b + mass * b_bar) / (z + EPS), z,
                     state.events + 1)  # fmt: skip


def read(
    state: FastState, theta: torch.Tensor, queries: torch.Tensor, kv_heads: int, kernel: str = "released"
) -> torch.Tensor:
    """``m(q)`` (T, W) for post-RoPE queries concatenated over heads (T, W), before the gate: the release's
    ``(θq)ᵀM / sqrt((θq)²·b + ε)``, or with the ``positive`` kernel ``φ(q)ᵀM / (φ(q)·b + ε)``, ``φ = elu(θ·) + 1``:
    ``Σ p̄_i κ(q, k_i) v_i / Σ p̄_i κ(q, k_i)`` with ``κ = φ(q)·φ(k) > 0``, a convex combination of the evicted values
    (one event; across events the decayed mixture of them)."""
    phi = queries.float() @ theta.float().T  # (T, P)
    if kernel == "positive":
        phi = F.elu(phi) + 1
    num = phi @ state.M.float()  # (T, V)
    den = phi @ state.b.float() + EPS if kernel == "positive" else (phi.pow(2) @ state.b.float() + EPS).sqrt()
    w = queries.shape[-1]
    return expand_values(num / den[:, None], kv_heads, w // state.M.shape[1])


def memory_mse(o_full: torch.Tensor, o_retained: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """``mean_q ‖o* − o_R − r(q)‖²`` (rows: queries)."""
    return (o_full.float() - o_retained.float() - residual).pow(2).sum(-1).mean()


class FastMemory(nn.Module):
    """The slow weights of every layer: ``θ`` and the gate MLP.

    Args:
        num_layers: L.
        num_heads, kv_heads, head_dim: H, Hkv, D of the base model (``W = H·D``, ``V = Hkv·D``).
        dim: P (512 in the release).
        gate_hidden: The gate's hidden width (64 in the release).
        readout: ``residual`` (the release: ``o_R + g m``) or ``interpolate`` (``o_R + g (m − o_R)``).
        kernel: ``released`` (the release's signed kernel) or ``positive`` (:func:`read`).
    """

    def __init__(
        self,
        num_layers: int,
        num_heads: int,
        kv_heads: int,
        head_dim: int,
        dim: int = MEMORY_DIM,
        gate_hidden: int = GATE_HIDDEN,
        readout: str = "residual",
        kernel: str = "released",
    ):
        super().__init__()
        if num_heads % kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of kv_heads ({kv_heads})")
        self.num_layers, self.num_heads, self.kv_heads, self.head_dim = num_layers, num_heads, kv_heads, head_dim
        if readout not in READOUTS:
            raise ValueError(f"readout must be one of {READOUTS}, got {readout!r}")
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
        self.dim, self.gate_hidden, self.readout_form, self.kernel = dim, gate_hidden, readout, kernel
        self.width, self.groups = num_heads * head_dim, num_heads // kv_heads
        self.theta = nn.Parameter(torch.empty(num_layers, dim, self.width))
        self.gate_w1 = nn.Parameter(torch.empty(num_layers, gate_hidden, self.width))
        self.gate_b1 = nn.Parameter(torch.empty(num_layers, gate_hidden))
        self.gate_w2 = nn.Parameter(torch.empty(num_layers, gate_hidden))
        self.gate_b2 = nn.Parameter(torch.empty(num_layers))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0) -> None:
        """``nn.Linear``'s default initialisation (uniform ``±1/√fan_in``), drawn from ``seed``."""
        g = torch.Generator().manual_seed(seed)
        for p, fan_in in ((self.theta, self.width), (self.gate_w1, self.width), (self.gate_b1, self.width),
                          (self.gate_w2, self.gate_hidden), (self.gate_b2, self.gate_hidden)):  # fmt: skip
            bound = 1.0 / math.sqrt(fan_in)
            p.copy_(torch.rand(p.shape, generator=g) * 2 * bound - bound)

    def empty_state(self, device=None) -> FastState:
        return FastState.empty(self.dim, self.kv_heads * self.head_dim, device=device)

    def gate(self, layer: int, queries: torch.Tensor) -> torch.Tensor:
        """``g(q) = σ(w2 · GELU(W1 q + b1) + b2)`` (T,) for concatenated queries (T, W)."""
        hidden = F.gelu(queries.float() @ self.gate_w1[layer].T + self.gate_b1[layer])
        return torch.sigmoid(hidden @ self.gate_w2[layer] + self.gate_b2[layer])

    def write(self, state: FastState, layer: int, keys, values, weights, mass, decay: float = DECAY) -> FastState:
        """:func:`write` with this layer's folded ``θ`` (keys and values compact, (E, Hkv·D))."""
        theta = fold_theta(self.theta[layer], self.kv_heads, self.groups)
        return write(state, theta, keys, values, weights, mass, decay, kernel=self.kernel)

    def write_event(
        self,
        state: FastState,
        layer: int,
        scores: torch.Tensor,
        evicted: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        temperature: float = 1.0,
        decay: float = DECAY,
    ) -> FastState:
        """One eviction event as training and inference run it: ``p = softmax(s/τ)`` over all the event's candidates
        (sinks included), weights conditioned on the evicted set, the decayed write.

        Args:
            scores: The student's scores of the candidates (N,) (head-shared).
            evicted: Which candidates leave the cache (N,) bool.
            keys, values: The candidates' post-RoPE keys and values (Hkv, N, D).
        """
        p = torch.softmax(scores.detach().float() / temperature, -1)
        weights, mass = conditional_weights(p, evicted)
        return self.write(state, layer, concat_heads(keys)[evicted], concat_heads(values)[evicted], weights[evicted],
                          mass, decay)  # fmt: skip

    def readout_heads(
        self, state: FastState, layer: int, queries: torch.Tensor, retained: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`readout` for per-head post-RoPE queries (H, T, D): the correction to add to the attention output
        before ``o_proj``, (T, H·D), and the gate (T,)."""
        h, t, d = queries.shape
        return self.readout(state, layer, queries.transpose(0, 1).reshape(t, h * d), retained)

    def readout(
        self, state: FastState, layer: int, queries: torch.Tensor, retained: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(g(q) m(q) (T, W), g (T,))`` for concatenated post-RoPE queries (T, W); with the ``interpolate`` readout
        ``g(q) (m(q) − o_R)``, which needs ``retained`` = ``o_R`` (T, W), the attention output over the kept keys."""
        g = self.gate(layer, queries)
        return g[:, None] * self.correction(state, layer, queries, retained), g

    def correction(self, state: FastState, layer: int, queries: torch.Tensor, retained: torch.Tensor | None = None):
        """The ungated correction (T, W): ``m(q)``, or ``m(q) − o_R`` with the ``interpolate`` readout."""
        m = read(state, self.theta[layer], queries, self.kv_heads, self.kernel)
        if self.readout_form == "residual":
            return m
        if retained is None:
            raise ValueError("the interpolate readout needs the retained attention output o_R (retained=...)")
        return m - retained.float()

    def state_bytes(self, dtype_bytes: int = 4) -> int:
        """Fast-state bytes for the whole model: ``L · (P·V + P + 1)`` numbers."""
        return self.num_layers * (self.dim * self.kv_heads * self.head_dim + self.dim + 1) * dtype_bytes


__all__ = ["DECAY", "GATE_HIDDEN", "KERNELS", "MEMORY_DIM", "READOUTS", "FastMemory", "FastState", "concat_heads", "conditional_weights",
           "expand_heads", "expand_values", "fold_theta", "memory_mse", "read", "write"]  # fmt: skip
