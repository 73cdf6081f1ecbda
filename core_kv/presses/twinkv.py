"""TwinKV: value energy discounted by nonlocal post-RoPE key frequency, under an exact protected per-head budget.

Chen et al., "Small Frequency Corrections Can Change What Survives KV Cache Compression" (arXiv 2608.27128;
``../shared/papers/000_b875d3eb09a55c6d.txt`` §3 and App. A). Per layer, with ``B = floor(N (1 - r))``:

- protect the first ``s = min(4, B)`` and last ``w = min(64, B - s)`` positions in every head (``P = s + w``,
  ``U = B - P``), inside the budget (§3.1);
- count nonlocal twins ``c_{h,i} = #{j : |i - j| > 32, k̂_i·k̂_j > 0.85}`` on post-RoPE keys over the whole prefix
  (protected positions included), blockwise over 512 query keys so the workspace is ``O(H·512·N)`` (§3.2, §3.5);
- score ``s_{h,i} = ||v_{h,i}||² · log((N + 1) / (c_{h,i} + 1))``; ties by higher energy, then lower position;
- head capacities ``b_h = P + u_h`` from the last 32 prefix queries (Ada-KV global count, half-uniform floor,
  deterministic rounding; §3.3, App. A.2), so ``Σ_h b_h = H·B`` exactly;
- keep ``P`` and the top ``b_h - P`` unprotected positions, original K/V gathered in sequence order (§3.4); the
  framework stores unequal quotas in a :class:`~core_kv.models.cache.RaggedLayer` without padding.

The pure functions (:func:`nonlocal_counts`, :func:`twin_order`, :func:`head_quotas`, :func:`twin_select`) carry
the algorithm and are tested against the paper's examples; :class:`TwinKVPress` wires them to a model layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from core_kv.models.attention import attention_logits, queries_with_rope
from core_kv.presses.base import BasePress, Kept

SCORINGS = ("twin", "value", "rarity")
CAPACITIES = ("adapted", "uniform")


def nonlocal_counts(
    keys: torch.Tensor, local_window: int = 32, threshold: float = 0.85, block_size: int = 512
) -> torch.Tensor:
    """Nonlocal twin counts ``c_{h,i} = #{j : |i - j| > local_window, k̂_i·k̂_j > threshold}``, ``(B, H, N)`` long.

    ``block_size`` query keys are compared with all ``N`` keys at a time, so the similarity workspace is
    ``(B, H, block_size, N)``, never ``N × N`` (paper §3.5).
    """
    khat = F.normalize(keys.float(), dim=-1)  # (B, H, N, D)
    n = khat.shape[2]
    pos = torch.arange(n, device=keys.device)
    counts = torch.zeros(khat.shape[:3], dtype=torch.long, device=keys.device)
    for start in range(0, n, block_size):
        end = min(n, start + block_size)
        # 1.0 where k̂_i·k̂_j > τ, in place: float sums are exact below 2^24 and much faster than bool sums
        hits = (khat[:, :, start:end] @ khat.transpose(-1, -2)).gt_(threshold)  # (B, H, C, N)
        lo, hi = max(0, start - local_window), min(n, end + local_window)  # the local band |i - j| <= ℓ
        near = (pos[start:end, None] - pos[None, lo:hi]).abs() <= local_window  # (C, C + 2ℓ)
        local = (hits[..., lo:hi] * near).sum(-1)
        counts[:, :, start:end] = (hits.sum(-1) - local).long()
    return counts


def naive_nonlocal_counts(keys: torch.Tensor, local_window: int = 32, threshold: float = 0.85) -> torch.Tensor:
    """Reference for :func:`nonlocal_counts` with the full ``N × N`` similarity matrix (tests and benchmarks)."""
    khat = F.normalize(keys.float(), dim=-1)
    n = khat.shape[2]
    pos = torch.arange(n, device=keys.device)
    sim = khat @ khat.transpose(-1, -2)  # (B, H, N, N)
    far = (pos[:, None] - pos[None, :]).abs() > local_window
    return ((sim > threshold) & far).sum(-1)


def twin_order(energy: torch.Tensor, counts: torch.Tensor, scoring: str = "twin") -> torch.Tensor:
    """Positions best-first along the last axis, ``(..., N)``.

    ``twin``: ``e · log((N+1)/(c+1))``, ties by higher energy then lower position (§3.2); ``value``: energy, then
    position; ``rarity``: ``log((N+1)/(c+1))``, then position (count ties resolved by position, not value; §5.3).
    """
    n = energy.shape[-1]
    rarity = torch.log((n + 1) / (counts.double() + 1))  # (..., N)
    if scoring == "twin":
        keys = [energy.double() * rarity, energy.double()]
    elif scoring == "value":
        keys = [energy.double()]
    elif scoring == "rarity":
        keys = [rarity]
    else:
        raise ValueError(f"scoring must be one of {SCORINGS}, got {scoring!r}")
    order = torch.arange(n, device=energy.device).expand(energy.shape).contiguous()
    for key in reversed(keys):  # least significant key first; stable sorts keep earlier orders within ties
        o = key.gather(-1, order).sort(dim=-1, descending=True, stable=True).indices
        order = order.gather(-1, o)
    return order


def head_quotas(z: torch.Tensor, unprotected: int) -> torch.Tensor:
    """Unprotected quotas ``u_h`` of one layer from capacity scores ``z`` ``(H, M)`` over its unprotected positions.

    ``g_h`` = how many of the layer's top ``H·U`` scores fall in head h (equal scores ordered by head, then
    position); ``ũ_h = (g_h + U) / 2``; ``u_h = floor(ũ_h) + δ_h`` where the ``R = H·U - Σ floor(ũ_h)`` leftover
    slots go to the first ``R`` heads whose remainder is 1/2. All-zero scores give ``g_h = U`` (App. A.2).
    Guarantees ``Σ u_h = H·U`` and ``floor(U/2) <= u_h <= M``.
    """
    h, m = z.shape
    if unprotected > m:
        raise ValueError(f"unprotected budget {unprotected} exceeds the {m} unprotected positions")
    if unprotected == 0:
        return torch.zeros(h, dtype=torch.long)
    z = z.detach().float().cpu()
    if not torch.any(z != 0):
        g = torch.full((h,), unprotected, dtype=torch.long)
    else:
        top = z.reshape(-1).sort(descending=True, stable=True).indices[: h * unprotected]  # head-major flat index
        g = torch.bincount(top // m, minlength=h)
    twice = g + unprotected  # 2·ũ_h
    u = twice // 2
    leftover = h * unprotected - int(u.sum())
    halves = torch.nonzero(twice % 2 == 1).flatten()[:leftover]
    u[halves] += 1
    return u


def protected_mask(n: int, sinks: int, recent: int, device=None) -> torch.Tensor:
    """``(N,)`` bool: the first ``sinks`` and last ``recent`` positions."""
    pos = torch.arange(n, device=device)
    return (pos < sinks) | (pos >= n - recent)


def twin_select(order: torch.Tensor, quotas: torch.Tensor, prot: torch.Tensor) -> list[torch.Tensor]:
    """Per head: the protected positions plus the first ``quotas[h]`` unprotected ones of ``order`` ``(H, N)``,
    sorted (sequence order)."""
    prot_idx = torch.nonzero(prot).flatten()
    kept = []
    for h in range(order.shape[0]):
        o = order[h]
        chosen = o[~prot[o]][: int(quotas[h])]
        kept.append(torch.cat([prot_idx, chosen]).sort().values)
    return kept


def observation_scores(
    module: nn.Module, hidden_states: torch.Tensor, keys: torch.Tensor, kwargs: dict, window: int, kernel: int
) -> torch.Tensor:
    """Capacity signal ``(B, Hkv, N)`` FP32: causal attention of the last ``window`` prefix queries, averaged over
    those queries and over the G query heads of each KV head, max-pooled with width ``kernel`` (§3.3, App. A.2)."""
    b, hkv, n, d = keys.shape
    w = min(window, hidden_states.shape[1], n)
    cos, sin = kwargs["position_embeddings"]
    q = queries_with_rope(module, hidden_states[:, -w:], (cos[:, -w:], sin[:, -w:])).float()  # (B, Hq, W, D)
    g = q.shape[1] // hkv
    k = keys.float().repeat_interleave(g, dim=1)  # (B, Hq, N, D)
    logits = attention_logits(module, q, k)  # (B, Hq, W, N): the model's scale (and softcap, Gemma 2)
    qpos = n - w + torch.arange(w, device=keys.device)
    future = torch.arange(n, device=keys.device)[None, :] > qpos[:, None]  # (W, N)
    attn = logits.masked_fill(future, float("-inf")).softmax(dim=-1).mean(dim=2)  # (B, Hq, N)
    attn = attn.view(b, hkv, g, n).mean(dim=2)  # (B, Hkv, N)
    return F.max_pool1d(attn, kernel_size=kernel, stride=1, padding=kernel // 2)


@dataclass
class TwinKVPress(BasePress, name="twinkv"):
    """TwinKV (``../shared/papers/000_b875d3eb09a55c6d.txt`` §3, App. A): frequency-discounted value energy with
    Ada-KV-style head capacities under an exact budget ``Σ_h b_h = H·floor(N (1 - r))`` per layer.

    Defaults are the paper's fixed parameters. The component controls of §4/§5 are options: ``scoring`` "value"
    (energy only) or "rarity" (frequency only), ``capacity="uniform"`` (every head keeps B), and
    ``permute_seed`` (paper seeds 11, 29, 47), which permutes the unprotected counts within each KV head.

    Deviations: the paper leaves the permutation PRNG unspecified; here a ``torch.Generator`` seeded with
    ``permute_seed * 1_000_003 + layer_idx`` draws one ``randperm`` per head in head order. App. A.2 does not say
    how the W observation queries are pooled; they are averaged, as in the Ada-KV reference (any per-head-equal
    pooling gives the same ``g_h``). TwinKV compresses a whole prefix once (§4: "generated tokens are not
    evicted"), so ``decoding=True`` and re-compressing an already compressed cache (a chunked prefill after the
    first chunk) raise ``ValueError``.

    Args:
        threshold: cosine threshold τ of a twin (strict ``>``).
        local_window: ℓ; twins must satisfy ``|i - j| > local_window``.
        block_size: query keys per counting block (workspace ``O(H·block_size·N)``).
        window_size: W, the last prefix queries whose attention sets head capacities.
        kernel_size: max-pooling width of the capacity signal.
        scoring: "twin" | "value" | "rarity".
        capacity: "adapted" | "uniform".
        permute_seed: permute unprotected counts within each head with this seed (``None``: true counts).
    """

    protected_sinks: int = 4
    protected_recent: int = 64
    threshold: float = 0.85
    local_window: int = 32
    block_size: int = 512
    window_size: int = 32
    kernel_size: int = 7
    scoring: str = "twin"
    capacity: str = "adapted"
    permute_seed: int | None = None

    capacities: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    """Per-layer ``b_h`` of the last compression (diagnostics)."""

    def validate(self) -> None:
        super().validate()
        if self.scoring not in SCORINGS:
            raise ValueError(f"scoring must be one of {SCORINGS}, got {self.scoring!r}")
        if self.capacity not in CAPACITIES:
            raise ValueError(f"capacity must be one of {CAPACITIES}, got {self.capacity!r}")
        if not -1.0 <= self.threshold < 1.0:
            raise ValueError(f"threshold must be a cosine in [-1, 1), got {self.threshold!r}")
        for name in ("local_window", "block_size", "window_size", "kernel_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "local_window" else 1):
                raise ValueError(f"{name} must be a {'non-negative' if name == 'local_window' else 'positive'} int")
        if self.kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be odd (centred pooling), got {self.kernel_size}")
        if self.permute_seed is not None and self.scoring == "value":
            raise ValueError("permute_seed permutes counts; it has no effect with scoring='value'")
        if self.decoding:
            raise ValueError("TwinKV compresses the prefix once (paper §4); decoding=True is not supported")

    def compress(
        self,
        module: nn.Module,
        hidden_states: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        attentions: torch.Tensor | None,
        kwargs: dict,
        n_kept: int,
        lengths: torch.Tensor | None = None,
    ) -> Kept:
        b, h, n, _ = keys.shape
        seen = self.layer_state.get(getattr(module, "layer_idx", None), {}).get("seen", n)
        if seen != n or (lengths is not None and bool((lengths != n).any())):
            raise ValueError(
                f"TwinKV compresses a whole prefix once (paper §4): this cache holds {n} of the {seen} tokens seen, "
                "so it was compressed before (chunked prefill re-compression is outside the method)"
            )
        sinks, recent = self.protected(n_kept)
        prot = protected_mask(n, sinks, recent, keys.device)
        unprotected = n_kept - sinks - recent
        counts = None
        if self.scoring != "value":
            counts = nonlocal_counts(keys, self.local_window, self.threshold, self.block_size)  # (B, H, N)
            if self.permute_seed is not None:
                counts = self._permute(counts, prot, module.layer_idx)
        energy = values.float().pow(2).sum(-1)  # (B, H, N)
        order = twin_order(energy, counts if counts is not None else torch.zeros_like(energy), self.scoring)
        if self.capacity == "uniform" or unprotected == 0:
            quotas = torch.full((b, h), unprotected, dtype=torch.long)
        else:
            z = observation_scores(module, hidden_states, keys, kwargs, self.window_size, self.kernel_size)
            quotas = torch.stack([head_quotas(z[i][:, ~prot], unprotected) for i in range(b)])  # (B, H)
        self.capacities[module.layer_idx] = (quotas + sinks + recent).tolist()
        kept = [twin_select(order[i], quotas[i], prot) for i in range(b)]
        if b == 1:
            return kept[0]
        if bool((quotas != unprotected).any()):
            raise ValueError("adapted per-head capacities need batch size 1; use capacity='uniform' for batches")
        return torch.stack([torch.stack(k) for k in kept])  # (B, H, n_kept)

    def _permute(self, counts: torch.Tensor, prot: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """Permute the unprotected counts within each (batch, KV head), preserving their multiset (§5.5)."""
        gen = torch.Generator().manual_seed(self.permute_seed * 1_000_003 + layer_idx)
        out = counts.clone()
        free = torch.nonzero(~prot).flatten()
        for i in range(counts.shape[0]):
            for h in range(counts.shape[1]):
                perm = torch.randperm(free.numel(), generator=gen).to(counts.device)
                out[i, h, free] = counts[i, h, free[perm]]
        return out
