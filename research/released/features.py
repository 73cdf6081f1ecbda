"""Feature spec v3: the 14 features of the CORE authors' release, one vector per token per layer (:data:`SPEC`).

Source: GitHub ``zhutizi23-coder/CORE`` (commit 92839850c47d), ``core/features.py`` and ``core/config.py`` defaults;
notes in ``../shared/research/anchors_turn3.md`` §5.2. Our own implementation of that specification.

All 14 features are computed from one layer's post-RoPE queries and keys and its values, at one event whose candidates
are the cached tokens ``i`` (positions ``pos_i``) and whose query set is every query the event sees (all prefill
queries at a prefill event; the queries of the last decode interval at a decode event). The features are pooled over
heads, so one vector (and one indexer score) serves every KV head of the layer ("head-shared" scores).

**Query–key relation (6)**, on the *attention advantage* of query ``t``, query head ``h`` on candidate ``i``::

    r(t, h, i) = logaddexp(log p_h(i | t) + log |C_t|, log 1e-8)     (C_t: candidates visible to t, causal)

``r = 0`` is uniform attention. Per KV group ``m`` (its G query heads), ``R(t, m, i)`` = TopMean over the heads of
``r`` (mean of the ``min(4, G)`` largest); invisible pairs sit at the floor ``log 1e-8``. Then, with
``v_i = #{t : pos_t ≥ pos_i}`` (≥ 1) and ``Hkv`` KV groups:

| # | name        | definition                                                                                          |
|---|-------------|-----------------------------------------------------------------------------------------------------|
| 0 | qk_max      | ``max_{t,m} R``                                                                                     |
| 1 | qk_topmean  | mean of the ``k_i = clip(v_i·Hkv, 1, min(4, T·Hkv))`` largest ``R`` over the (t, m) pairs           |
| 2 | qk_posmean  | mean of the positive ``R`` over (t, m) (0 when none)                                               |
| 3 | qk_recent   | ``qk_topmean`` over the last ``min(16, T)`` queries only                                            |
| 4 | qk_posfrac  | ``#{t visible : max_m R(t, m, i) > 0} / T``                                                         |
| 5 | qk_groups   | share of KV groups ``m`` whose mean of the ``⌈v_i / 4⌉`` largest ``R(·, m, i)`` is > 0             |

Queries are streamed in blocks of 128: per block only ``(Hkv, G, 128, N)`` logits are live, with running maxima,
running Top-K buffers (exact: the union of per-block Top-K sets holds the global Top-K) and running sums.

**Coverage (4)**, on ``z_i`` of :class:`~research.released.geometry.KeyGeometry` (one per token): centred directions
``ẑ_i = (z_i − z̄)/‖z_i − z̄‖`` (a token within 1e-6 of the centroid has none: ``reliable = False``), nearest and
second-nearest of the 64 fixed prototypes by cosine, ``n_m`` = reliable tokens whose nearest prototype is ``m``:

| # | name          | definition                                                                                   |
|---|---------------|----------------------------------------------------------------------------------------------|
| 6 | occupancy     | ``log(1 + n_{m1(i)})`` (0 when not reliable)                                                  |
| 7 | proto_dist    | ``1 − cos(ẑ_i, c_{m1})`` (1 when not reliable)                                                |
| 8 | proto_margin  | ``cos(ẑ_i, c_{m1}) − cos(ẑ_i, c_{m2})`` (0 when not reliable)                                 |
| 9 | deviation     | ``log(1 + mean_d (z̃_id − μ_d)² / σ̃²_d)``, ``z̃ = R z`` (Hadamard), μ, σ² over the candidates,   |
|   |               | ``σ̃² = 0.9 σ² + 0.1 mean(σ²) + 1e-8`` (shrinkage ρ = 0.1)                                      |

**Auxiliary (4)**, with ``S`` the number of tokens processed so far (the original sequence length):

| #  | name         | definition                                                                              |
|----|--------------|-----------------------------------------------------------------------------------------|
| 10 | age          | ``log(1 + S − 1 − pos_i) / log(1 + max(S − 1, 1))``                                      |
| 11 | sink         | ``1[pos_i < 4 or token i is a special token]``                                          |
| 12 | value_energy | ``log(1 + mean_h ‖v_ih‖² / D)``                                                          |
| 13 | phase        | 0 at a prefill event, 1 at a decode event                                               |

Shapes: H query heads, Hkv KV heads, G = H / Hkv, T queries, N candidates, D head dim, d_z projected dim.
"""

from __future__ import annotations

import math

import torch

from research.released.geometry import KeyGeometry

FEATURE_NAMES_V3 = (
    "qk_max",
    "qk_topmean",
    "qk_posmean",
    "qk_recent",
    "qk_posfrac",
    "qk_groups",
    "occupancy",
    "proto_dist",
    "proto_margin",
    "deviation",
    "age",
    "sink",
    "value_energy",
    "phase",
)
FEATURE_GROUPS_V3 = {"qk": FEATURE_NAMES_V3[:6], "coverage": FEATURE_NAMES_V3[6:10], "auxiliary": FEATURE_NAMES_V3[10:]}


def ablated_names(entries: list[str]) -> list[str]:
    """Feature names (in spec order) for ``entries``, each a feature name or a group of :data:`FEATURE_GROUPS_V3`.

    Raises:
        ValueError: an entry that is neither, named with the choices.
    """
    names = set()
    for e in entries:
        if e in FEATURE_GROUPS_V3:
            names.update(FEATURE_GROUPS_V3[e])
        elif e in FEATURE_NAMES_V3:
            names.add(e)
        else:
            raise ValueError(f"unknown feature or group {e!r}; choose from groups {sorted(FEATURE_GROUPS_V3)} or "
                             f"features {list(FEATURE_NAMES_V3)}")  # fmt: skip
    return [n for n in FEATURE_NAMES_V3 if n in names]


TOP_HEADS = 4  # [release: topk_qk] TopMean over the query heads of a KV group, and the K of f2 / f4
RECENT_QUERIES = 16  # [release: n_recent_queries]
QUERY_BLOCK = 128  # [release: qk_query_block_size]
TOP_FRACTION = 0.25  # f6: mean of the top quarter of a group's queries
ADVANTAGE_FLOOR = math.log(1e-8)
SHRINKAGE = 0.1  # [release: shrinkage_rho]
SINK_TOKENS = 4  # [release: n_sink]
RELIABLE = 1e-6  # a centred z shorter than this has no direction
F6_MERGE_ROWS = 1024  # f6's running Top-K is merged with the staged query rows once this many are staged: one
# topk per 128-query block costs 6x the whole statistic on CPU; the result is the same (exact Top-K of the union)


def _visible_counts(query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
    """``#{t : pos_t ≥ pos_i}`` per candidate (N,), queries sorted ascending."""
    return len(query_pos) - torch.searchsorted(query_pos.contiguous(), key_pos.contiguous(), right=False)


def _top_mean_heads(x: torch.Tensor, k: int) -> torch.Tensor:
    """Mean over dim 1 of its ``k`` largest entries (a plain mean when ``k`` is the whole dim)."""
    return x.mean(1) if k >= x.shape[1] else x.topk(k, dim=1).values.mean(1)


def _merge_top(buffer: torch.Tensor | None, block: torch.Tensor, k: int, dim: int) -> torch.Tensor:
    """The ``k`` largest along ``dim`` of ``buffer`` ∪ ``block`` (sorted descending)."""
    both = block if buffer is None else torch.cat([buffer, block], dim)
    return both.topk(min(k, both.shape[dim]), dim=dim).values


def _mean_of_top(top: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Mean of the first ``k_i`` rows of a descending Top-K buffer (K, N), per candidate."""
    return top.cumsum(0).gather(0, (k - 1)[None]).squeeze(0) / k.float()


@torch.no_grad()
def qk_statistics(
    queries: torch.Tensor,
    keys: torch.Tensor,
    query_pos: torch.Tensor,
    key_pos: torch.Tensor,
    scaling: float,
    block: int = QUERY_BLOCK,
    with_utility: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The six query–key features (and optionally the DRIVE teacher's utility) of one layer, streamed over queries.

    Args:
        queries: Post-RoPE queries (H, T, D) at ``query_pos`` (T,), ascending.
        keys: Post-RoPE candidate keys (Hkv, N, D) at ``key_pos`` (N,).
        scaling: The attention score scale (``module.scaling``).
        block: Queries per block (128 in the release).
        with_utility: Also return the DRIVE teacher's raw-logit utility ``u_i = max_{t visible, m}
            TopMean_heads(q·k · scaling)`` (``−inf`` for a candidate no query sees), computed from the same logits.

    Returns:
        ``(features (N, 6) float32, utility (N,) or None)``.
    """
    h, t_len, d = queries.shape
    hkv, n, _ = keys.shape
    if h % hkv:
        raise ValueError(f"query heads ({h}) must be a multiple of KV heads ({hkv})")
    g = h // hkv
    k_heads = min(TOP_HEADS, g)
    dev = keys.device
    qpos, kpos = query_pos.to(dev).long(), key_pos.to(dev).long()
    kf = keys.float().mT  # (Hkv, D, N)
    q = queries.float().view(hkv, g, t_len, d)
    n_recent = min(RECENT_QUERIES, t_len)
    recent_from = t_len - n_recent
    k2_max = min(TOP_HEADS, t_len * hkv)
    k4_max = min(TOP_HEADS, n_recent * hkv)
    kf_max = (t_len + 3) // 4
    f1 = torch.full((n,), ADVANTAGE_FLOOR, device=dev)
    util = torch.full((n,), float("-inf"), device=dev) if with_utility else None
    top2 = top4 = top6 = None
    staged: list[torch.Tensor] = []  # f6 rows not yet merged into top6 (merged every ``merge_rows`` queries)
    merge_rows = max(kf_max, F6_MERGE_ROWS)
    pos_sum = torch.zeros(n, device=dev)
    pos_cnt = torch.zeros(n, device=dev)
    frac_cnt = torch.zeros(n, device=dev)
    for s in range(0, t_len, block):
        e = min(t_len, s + block)
        b = e - s
        logits = (q[:, :, s:e].reshape(hkv, g * b, d) @ kf).view(hkv, g, b, n) * scaling  # (Hkv, G, b, N)
        visible = kpos[None, :] <= qpos[s:e, None]  # (b, N)
        masked = logits.masked_fill(~visible, torch.finfo(torch.float32).min)
        if with_utility:
            raw = _top_mean_heads(masked, k_heads)  # (Hkv, b, N); invisible: very negative
            util = torch.maximum(util, raw.masked_fill(~visible, float("-inf")).amax((0, 1)))
        count = visible.sum(-1).clamp_min(1).float()  # |C_t| (b,)
        r = torch.logaddexp(masked.log_softmax(-1) + count.log()[:, None], torch.tensor(ADVANTAGE_FLOOR, device=dev))
        r = torch.where(visible, r, ADVANTAGE_FLOOR)
        big_r = _top_mean_heads(r, k_heads)  # (Hkv, b, N)
        big_r = torch.where(visible, big_r, ADVANTAGE_FLOOR)  # a mean of floors can round off the floor
        f1 = torch.maximum(f1, big_r.amax((0, 1)))
        flat = big_r.reshape(hkv * b, n)
        top2 = _merge_top(top2, flat, k2_max, 0)
        positive = big_r > 0
        pos_sum += (big_r * positive).sum((0, 1))
        pos_cnt += positive.sum((0, 1))
        if e > recent_from:
            rec = big_r[:, max(0, recent_from - s) :].reshape(-1, n)
            top4 = _merge_top(top4, rec, k4_max, 0)
        frac_cnt += ((big_r.amax(0) > 0) & visible).sum(0)
        staged.append(big_r)
        if sum(x.shape[1] for x in staged) >= merge_rows or e == t_len:
            top6 = _merge_top(top6, torch.cat(staged, 1), kf_max, 1)  # (Hkv, ≤kf_max, N)
            staged = []
    valid = _visible_counts(qpos, kpos).clamp_min(1)  # (N,)
    recent_valid = _visible_counts(qpos[recent_from:], kpos).clamp_min(1)
    k2 = (valid * hkv).clamp(1, k2_max)
    k4 = (recent_valid * hkv).clamp(1, k4_max)
    kfrac = torch.ceil(valid.float() * TOP_FRACTION).long().clamp_min(1)
    f2 = _mean_of_top(top2, k2)
    f4 = _mean_of_top(top4, k4)
    csum6 = top6.cumsum(1)  # (Hkv, kf, N)
    idx6 = (kfrac - 1).clamp(max=top6.shape[1] - 1).view(1, 1, n).expand(hkv, 1, n)
    group_mean = csum6.gather(1, idx6).squeeze(1) / kfrac.float()
    f6 = (group_mean > 0).float().mean(0)
    f3 = pos_sum / pos_cnt.clamp_min(1)
    f5 = frac_cnt / t_len
    feats = torch.stack([f1, f2, f3, f4, f5, f6], -1)
    if not torch.isfinite(feats).all():
        raise FloatingPointError("non-finite query-key features (feature spec v3)")
    return feats, util


@torch.no_grad()
def coverage_features(z: torch.Tensor, prototypes: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """Occupancy, prototype distance, prototype margin and the Hadamard-rotated deviation, (N, 4).

    Args:
        z: Projected, normalised keys of the candidates (N, d_z) (:meth:`KeyGeometry.project`).
        prototypes: Unit prototypes (M, d_z).
        rotation: The fixed rotation (d_z, d_z).
    """
    z = z.float()
    centred = z - z.mean(0, keepdim=True)
    norm = centred.norm(dim=-1, keepdim=True)
    reliable = norm.squeeze(-1) > RELIABLE
    direction = centred / norm.clamp_min(RELIABLE)
    cos = direction @ prototypes.float().T  # (N, M)
    top = cos.topk(min(2, cos.shape[1]), dim=-1)
    m1 = top.indices[:, 0]
    cos1 = top.values[:, 0]
    cos2 = top.values[:, 1] if cos.shape[1] > 1 else cos1
    counts = torch.zeros(cos.shape[1], device=z.device).index_add_(0, m1, reliable.float())
    occupancy = torch.where(reliable, torch.log1p(counts[m1]), 0.0)
    dist = torch.where(reliable, 1.0 - cos1, 1.0)
    margin = torch.where(reliable, cos1 - cos2, 0.0)
    zr = z @ rotation.float().T
    mu = zr.mean(0)
    var = (zr.pow(2).mean(0) - mu.pow(2)).clamp_min(0.0)
    var_eff = (1 - SHRINKAGE) * var + SHRINKAGE * var.mean() + 1e-8
    deviation = torch.log1p(((zr - mu).pow(2) / var_eff).mean(-1))
    return torch.stack([occupancy, dist, margin, deviation], -1)


@torch.no_grad()
def auxiliary_features(
    values: torch.Tensor,
    positions: torch.Tensor,
    seq_len: int,
    phase: int = 0,
    special: torch.Tensor | None = None,
) -> torch.Tensor:
    """Age, sink/special flag, value energy and phase, (N, 4).

    Args:
        values: Candidate values (Hkv, N, D).
        positions: Candidate positions (N,), each in ``[0, seq_len)``.
        seq_len: Tokens processed so far (the original, uncompressed length).
        phase: 0 for a prefill event, 1 for a decode event.
        special: Optional (N,) bool, True where the candidate's token is one of the tokenizer's special tokens.
    """
    pos = positions.to(values.device).float()
    if len(pos) and (pos.min() < 0 or pos.max() >= seq_len):
        raise ValueError(f"candidate positions must lie in [0, {seq_len}), got [{int(pos.min())}, {int(pos.max())}]")
    age = torch.log1p(seq_len - 1 - pos) / math.log1p(max(seq_len - 1, 1))
    sink = pos < SINK_TOKENS
    if special is not None:
        sink = sink | special.to(values.device).bool()
    energy = torch.log1p(values.float().pow(2).sum(-1).mean(0) / values.shape[-1])
    return torch.stack([age, sink.float(), energy, torch.full_like(age, float(phase))], -1)


@torch.no_grad()
def compute_features_v3(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    query_pos: torch.Tensor,
    key_pos: torch.Tensor,
    seq_len: int,
    geometry: KeyGeometry,
    layer: int,
    scaling: float,
    phase: int = 0,
    special: torch.Tensor | None = None,
    with_utility: bool = False,
    block: int = QUERY_BLOCK,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The 14 features of one layer at one event (arguments as :func:`qk_statistics`, :func:`coverage_features`,
    :func:`auxiliary_features`).

    Returns:
        ``(features (N, 14), z (N, d_z), utility (N,) or None)``: ``z`` and the utility are what the DRIVE teacher
        needs, so a training step computes the logits and the projection once.
    """
    qk, util = qk_statistics(queries, keys, query_pos, key_pos, scaling, block, with_utility)
    z = geometry.project(layer, keys)
    cov = coverage_features(z, geometry.prototypes.to(z.device), geometry.rotation.to(z.device))
    aux = auxiliary_features(values, key_pos, seq_len, phase, special)
    feats = torch.cat([qk, cov, aux], -1)
    if not torch.isfinite(feats).all():
        raise FloatingPointError(f"non-finite features (feature spec v3, layer {layer})")
    return feats, z, util


SPEC = {  # recorded in every released artifact (config.json feature_spec) and compared when one is loaded
    "version": 3,
    "names": list(FEATURE_NAMES_V3),
    "scores": "shared",
    "top_heads": TOP_HEADS,
    "recent_queries": RECENT_QUERIES,
    "query_block": QUERY_BLOCK,
    "top_fraction": TOP_FRACTION,
    "advantage_floor": "log(1e-8)",
    "shrinkage": SHRINKAGE,
    "sink_tokens": SINK_TOKENS,
}


def spec_problem(recorded: dict) -> str:
    """How a recorded feature spec differs from :data:`SPEC` (``""``: it does not), naming each differing constant."""
    if not isinstance(recorded, dict):
        return f"feature spec {recorded!r} is not a mapping"
    differ = sorted(k for k in set(recorded) | set(SPEC) if recorded.get(k) != SPEC.get(k))
    if not differ:
        return ""
    return "trained with " + ", ".join(f"{k}={recorded.get(k)!r} (code: {SPEC.get(k)!r})" for k in differ)


def special_mask(token_ids: torch.Tensor | None, special_ids) -> torch.Tensor | None:
    """``token_ids`` (N,) -> bool (N,): which are in ``special_ids`` (None when either is missing)."""
    if token_ids is None or not special_ids:
        return None
    return torch.isin(token_ids, torch.as_tensor(list(special_ids), device=token_ids.device))


__all__ = [
    "SPEC",
    "spec_problem",
    "FEATURE_GROUPS_V3",
    "FEATURE_NAMES_V3",
    "ablated_names",
    "QUERY_BLOCK",
    "RECENT_QUERIES",
    "TOP_HEADS",
    "auxiliary_features",
    "compute_features_v3",
    "coverage_features",
    "qk_statistics",
    "special_mask",
]
