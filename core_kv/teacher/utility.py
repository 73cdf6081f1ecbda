"""Future-query utility ``π_U`` from the frozen model's full-cache attention (CORE.md stage 1, step 1).

At an eviction event at time ``t_e`` the candidates are the cached tokens ``i < t_e``; the future queries ``Q_f``
are the next chunk and, when the document has them, its question/answer tokens. Each future query ``τ`` attends
causally to **all** tokens ``j ≤ τ`` (not only the candidates); the utility of candidate i is the weighted mean over
``Q_f`` and the G query heads of its attention probability, ``π_U = u / Σ_i u_i`` [choice, indexmem_core.md §3.2(a)].

Shapes: Hkv KV heads, G query heads per KV head, T_q future queries, K keys visible to them, D head dim,
N candidates.
"""

from __future__ import annotations

import torch

POOLS = ("mean", "max")


def future_utility(
    queries: torch.Tensor,
    keys: torch.Tensor,
    query_pos: torch.Tensor,
    num_candidates: int,
    scaling: float,
    query_weights: torch.Tensor | None = None,
    block: int = 256,
    pools: tuple[str, ...] = ("mean",),
) -> dict[str, torch.Tensor]:
    """Mean (or max-pooled) full-cache attention mass the future queries put on each candidate, under each of
    ``pools`` from one pass over the attention.

    Args:
        queries: Post-RoPE future queries (Hkv, G, T_q, D).
        keys: Post-RoPE keys of positions ``0..K-1`` (Hkv, K, D), K > every query position.
        query_pos: Absolute positions of the queries (T_q,); each sees keys ``≤`` its position.
        num_candidates: N: candidates are the keys at positions ``0..N-1`` (the cache at the event).
        scaling: The attention score scale (``module.scaling``).
        query_weights: Weights of the queries (T_q,), summing to 1; uniform by default.
        block: Queries per block (bounds memory at Hkv·G·block·K floats).
        pools: The poolings to return. ``mean``: ``u_i = Σ_τ w_τ ā_τi`` (ā: mean over the G heads). ``max``: the
            queries of equal weight form a group (the next chunk, the QA tail) and ``u_i = Σ_c W_c max_{τ∈c} ā_τi``
            with ``W_c`` the group's total weight: a candidate is worth what its most demanding future query needs
            (a deviation; docs/method.md).

    Returns:
        ``{pool: u}``, ``u`` (Hkv, N) the pooled attention on each candidate (not normalised).
    """
    if not pools or any(p not in POOLS for p in pools):
        raise ValueError(f"utility pool must be one of {POOLS}, got {pools!r}")
    h, g, tq, d = queries.shape
    if query_weights is None:
        query_weights = torch.full((tq,), 1.0 / tq)
    query_weights = query_weights.to(device=keys.device, dtype=torch.float32)
    key_pos = torch.arange(keys.shape[1], device=keys.device)
    kf = keys.float()
    u = keys.new_zeros(h, num_candidates, dtype=torch.float32)
    groups = query_weights.unique()
    peak = keys.new_zeros(len(groups), h, num_candidates, dtype=torch.float32)  # max pool: per group
    group_of = (query_weights[:, None] == groups[None]).float().argmax(-1)  # (T_q,)
    for s in range(0, tq, block):
        q = queries[:, :, s : s + block].float()  # (Hkv, G, b, D)
        logits = (q @ kf[:, None].mT) * scaling  # (Hkv, G, b, K)
        mask = key_pos[None, :] > query_pos[s : s + block, None].to(keys.device)  # (b, K)
        probs = logits.masked_fill_(mask, float("-inf")).softmax(-1)[..., :num_candidates]
        if "mean" in pools:
            u += torch.einsum("hgbn,b->hn", probs, query_weights[s : s + block]) / g
        if "max" in pools:
            heads_mean = probs.mean(1)  # (Hkv, b, N)
            for c in group_of[s : s + block].unique().tolist():
                rows = group_of[s : s + block] == c
                peak[c] = torch.maximum(peak[c], heads_mean[:, rows].amax(1))
    out = {}
    if "mean" in pools:
        out["mean"] = u
    if "max" in pools:
        totals = torch.stack([query_weights[group_of == c].sum() for c in range(len(groups))])
        out["max"] = torch.einsum("chn,c->hn", peak, totals)
    return out


def normalise(u: torch.Tensor) -> torch.Tensor:
    """``π_U = u / Σu`` over the last dim."""
    return u / u.sum(-1, keepdim=True).clamp_min(1e-30)
