"""The 14 indexer features: one definition for the teacher writer, the trainer and the press (CORE.md stage 2).

Every feature is computable at inference for every candidate ``i`` of an eviction event, from the candidates' keys
and values, the last ``w = 32`` queries (the observation window, all G query heads of the KV head) and the frozen
geometry (:mod:`core_kv.teacher.geometry`). "attn" is the softmax over the candidate set, causal by position.
All choices below are [choice] (the paper gives only the count, 14); indexmem_core.md §3.3 is the source.

| #  | name            | definition                                                                    |
|----|-----------------|-------------------------------------------------------------------------------|
| 0  | obs_mean_log    | log(ā_i + 1e-6), ā_i = mean of attn over the window × G                        |
| 1  | obs_max_log     | log(max of attn over the window × G + 1e-6)                                   |
| 2  | persistence_log | log(EMA_i + 1e-6), EMA_i ← ½ EMA_i + ½ ā_i across events (new tokens: ā_i)    |
| 3  | key_norm        | ‖k̃_i‖ (pre-RoPE)                                                              |
| 4  | value_norm      | ‖v_i‖                                                                         |
| 5  | age_log         | log(1 + t − i), t the position of the last processed token                   |
| 6  | rel_pos         | i / t                                                                         |
| 7  | sink            | 1[i < 4]                                                                      |
| 8  | local           | 1[t − i < 64]                                                                 |
| 9  | proto_fit       | max_j ⟨z_i, c_j⟩                                                               |
| 10 | proto_entropy   | entropy of ψ_i = softmax_j(⟨z_i, c_j⟩ / 0.1)                                    |
| 11 | redundancy      | −log(⟨ψ_i, mean_j ψ_j⟩) (crowding of i's prototype cells)                       |
| 12 | novelty         | ridge leverage ℓ_i(uniform p), same normalised βB as the teacher               |
| 13 | query_cos       | cos(k̃_i, q̄), q̄ the mean pre-RoPE query of the window × G                       |

**Spec v2** (``features: 2`` in a teacher config) keeps the count (14, the paper's indexer shape) and replaces the
two flags that the protected positions and ``age_log`` already carry with the two key-distinctiveness signals of the
training-free presses that keep needles on SmolLM2 (docs/method.md, "Feature spec v2"), both on post-RoPE keys ``k_i``
over the event's candidates:

| #  | name          | definition                                                                              |
|----|---------------|-----------------------------------------------------------------------------------------|
| 7  | key_distinct  | −cos(k_i, mean_j k̂_j), k̂ = k/‖k‖ (KeyDiff's score, Park et al. 2025)                      |
| 8  | twin_rarity   | log((N+1)/(c_i+1)), c_i = #{j : |i−j| > 32, k̂_i·k̂_j > 0.85} (TwinKV's frequency term, paper 000 §3.2) |

Spec v3, the CORE authors' released feature set (one vector per token per layer, shared by the KV heads), is a
research line outside this package: ``research/released/features.py``, recorded by its own artifact class.

Changing any definition must add a version to :data:`FEATURE_SPECS`: teacher datasets and indexer checkpoints record
theirs, and every recorded version stays computable, so artifacts trained on an older spec keep loading.

Shapes: Hkv KV heads, G query heads per KV head, w window queries, N candidates, D head dim, d_z projected dim,
M prototypes, F = 14 features, L layers.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from core_kv.files import atomic_write
from core_kv.nystrom import leverage, normalised_beta_b

FEATURE_SPEC_VERSION = 1  # the default for new teacher runs (TeacherConfig.features)
FEATURE_NAMES = (
    "obs_mean_log",
    "obs_max_log",
    "persistence_log",
    "key_norm",
    "value_norm",
    "age_log",
    "rel_pos",
    "sink",
    "local",
    "proto_fit",
    "proto_entropy",
    "redundancy",
    "novelty",
    "query_cos",
)
NUM_FEATURES = len(FEATURE_NAMES)
FEATURE_SPECS = {  # version -> names; every version keeps NUM_FEATURES columns (the indexer's input width)
    1: FEATURE_NAMES,
    2: FEATURE_NAMES[:7] + ("key_distinct", "twin_rarity") + FEATURE_NAMES[9:],
}
TWIN_LOCAL = 32  # TwinKV's nonlocal band and similarity threshold (paper 000 §3.2), for twin_rarity
TWIN_THRESHOLD = 0.85
OBS_WINDOW = 32
SINK_TOKENS = 4
LOCAL_WINDOW = 64
PERSISTENCE_DECAY = 0.5
PSI_TEMPERATURE = 0.1
EPS = 1e-6


def check_version(version, where: str = "features") -> int:
    """``version`` if it is one of :data:`FEATURE_SPECS`, else a ValueError naming ``where``."""
    if isinstance(version, bool) or version not in FEATURE_SPECS:
        raise ValueError(f"{where}: feature spec v{version} is not one this code computes ({sorted(FEATURE_SPECS)})")
    return int(version)


def feature_names(version: int = FEATURE_SPEC_VERSION) -> tuple[str, ...]:
    return FEATURE_SPECS[check_version(version)]


def spec(version: int = FEATURE_SPEC_VERSION) -> dict:
    """The feature specification recorded beside every dataset and checkpoint that uses these features."""
    check_version(version)
    out = {
        "version": version,
        "names": list(FEATURE_SPECS[version]),
        "obs_window": OBS_WINDOW,
        "sink_tokens": SINK_TOKENS,
        "local_window": LOCAL_WINDOW,
        "persistence_decay": PERSISTENCE_DECAY,
        "psi_temperature": PSI_TEMPERATURE,
    }
    if version >= 2:
        out.update(twin_local=TWIN_LOCAL, twin_threshold=TWIN_THRESHOLD)
    return out


def spec_differences(recorded: dict) -> str:
    """How a recorded feature spec differs from what this code computes for its version; ``""`` when it does not.

    Compares every recorded constant (window lengths, decays, thresholds) as well as the version and names, so a
    dataset or artifact built with other constants (e.g. a diagnostic's observation window) is refused by name."""
    try:
        version = check_version(recorded.get("version") if isinstance(recorded, dict) else None, "recorded")
    except ValueError as e:
        return str(e)
    expected = spec(version)
    differ = sorted(k for k in set(recorded) | set(expected) if recorded.get(k) != expected.get(k))
    if "names" in differ:
        return (
            f"feature spec v{version} names {list(recorded.get('names') or [])[:3]}..., this code's v{version} differs"
        )
    return ", ".join(f"{k}={recorded.get(k)!r} (code: {expected.get(k)!r})" for k in differ)


def key_distinctiveness(keys: torch.Tensor) -> torch.Tensor:
    """KeyDiff's score ``−cos(k_i, mean_j k̂_j)`` over the candidates, (Hkv, N) from keys (Hkv, N, D)."""
    k = keys.float()
    anchor = torch.nn.functional.normalize(k, dim=-1).mean(1, keepdim=True)  # (Hkv, 1, D)
    return -torch.nn.functional.cosine_similarity(k, anchor, dim=-1)


def twin_rarity(keys: torch.Tensor, positions: torch.Tensor, block: int = 128) -> torch.Tensor:
    """TwinKV's ``log((N+1)/(c_i+1))`` with nonlocal twin counts ``c_i`` among the candidates, (Hkv, N).

    ``c_i = #{j : |pos_i − pos_j| > 32, k̂_i·k̂_j > 0.85}`` over candidate positions (Hkv, N) or (N,), computed over
    ``block`` rows at a time so the workspace is (Hkv, block, N), never N × N (128 rows: 5-20% faster than 512 on
    SmolLM2's and Llama-3.1-8B's key shapes, the same counts; issue 61).

    With increasing integer positions (candidates in cache order) the count is every twin of ``i`` minus its twins
    in the local band ``|pos_i − pos_j| ≤ 32``, over the upper triangle of the similarity matrix
    (:func:`_twin_counts_banded`): the counts of masking the band over all N pairs (the same dot products, integer
    arithmetic; tested equal) at about half the matrix products and a fraction of the elementwise work. Other
    positions take the masked form."""
    khat = torch.nn.functional.normalize(keys.float(), dim=-1)  # (Hkv, N, D)
    hkv, n = khat.shape[:2]
    pos = positions.to(khat.device)
    pos = pos[None].expand(hkv, n) if pos.dim() == 1 else pos
    if n > 1 and bool((pos[:, 1:] > pos[:, :-1]).all()) and bool((pos == pos.round()).all()):
        return torch.log((n + 1) / (_twin_counts_banded(khat, pos.contiguous(), block) + 1))
    counts = torch.empty(hkv, n, device=khat.device)
    for s in range(0, n, block):
        hits = (khat[:, s : s + block] @ khat.mT).gt_(TWIN_THRESHOLD)  # (Hkv, b, N)
        far = (pos[:, s : s + block, None] - pos[:, None, :]).abs() > TWIN_LOCAL
        counts[:, s : s + block] = (hits * far).sum(-1)
    return torch.log((n + 1) / (counts + 1))


def _twin_counts_banded(khat: torch.Tensor, pos: torch.Tensor, block: int) -> torch.Tensor:
    """Nonlocal twin counts (Hkv, N) for increasing integer positions ``pos`` (Hkv, N), over the upper triangle of
    the similarity matrix: block rows ``I`` against columns ``≥ I`` give each pair once, counted for both ends (a
    pair's two dot products are the same numbers); the local band is subtracted from the same blocks — a row's
    forward band ``i < j ≤ i + 32`` (an index window of at most 33) is read from its row block and each hit is
    charged to both ``i`` and ``j``."""
    hkv, n = khat.shape[:2]
    dev = khat.device
    counts = torch.zeros(hkv, n, device=dev)
    hi = torch.searchsorted(pos, pos + TWIN_LOCAL, right=True)  # (Hkv, N) one past i's forward band
    ahead = torch.arange(TWIN_LOCAL + 1, device=dev)  # 0 = i itself
    rows = torch.arange(hkv, device=dev)[:, None, None] * n
    for s in range(0, n, block):
        e = min(s + block, n)
        hits = (khat[:, s:e] @ khat[:, s:].mT).gt_(TWIN_THRESHOLD)  # (Hkv, b, N − s): columns j ≥ s
        counts[:, s:e] += hits.sum(-1)
        counts[:, e:] += hits[:, :, e - s :].sum(1)  # pairs (i < j) seen from the j side
        j = torch.arange(s, e, device=dev)[None, :, None] + ahead  # (1, b, 33) forward band of each row
        local = (j < hi[:, s:e, None]).float() * hits.gather(-1, (j - s).clamp_max(n - 1 - s).expand(hkv, -1, -1))
        counts[:, s:e] -= local.sum(-1)  # i's own band hits (i itself included)
        # the same pairs seen from j's side, j ≠ i
        counts.view(-1).index_add_(0, (rows + j.clamp_max(n - 1))[:, :, 1:].flatten(), -local[:, :, 1:].flatten())
    return counts


def observation_attention(
    queries: torch.Tensor, keys: torch.Tensor, query_pos: torch.Tensor, key_pos: torch.Tensor, scaling: float
) -> torch.Tensor:
    """Causal softmax attention of window queries over the candidates.

    Args:
        queries: Post-RoPE window queries (Hkv, G, w, D).
        keys: Post-RoPE candidate keys (Hkv, N, D).
        query_pos: Absolute positions of the queries (w,).
        key_pos: Absolute positions of the candidates (N,), or per KV head (Hkv, N).
        scaling: The attention module's score scale (``1/√D`` for Llama).

    Returns:
        Probabilities (Hkv, G·w, N); candidate i is masked for a query earlier than it.
    """
    h, g, w, d = queries.shape
    logits = (queries.reshape(h, g * w, d).float() @ keys.float().mT) * scaling  # (Hkv, G·w, N)
    if key_pos.dim() == 1:
        visible = key_pos[None, :] <= query_pos[:, None]  # (w, N)
        logits = logits.masked_fill(~visible.repeat(g, 1)[None], float("-inf"))
    else:  # per-head candidate positions (Hkv, N): one call for every KV head of a layer
        visible = key_pos[:, None, :] <= query_pos[None, :, None]  # (Hkv, w, N)
        logits = logits.masked_fill(~visible.repeat(1, g, 1), float("-inf"))
    return logits.softmax(-1)


def update_persistence(previous: torch.Tensor | None, obs_mean: torch.Tensor) -> torch.Tensor:
    """EMA of the window-mean attention across events; ``NaN`` in ``previous`` marks tokens new at this event."""
    if previous is None:
        return obs_mean.clone()
    prev = previous.to(obs_mean)
    return torch.where(prev.isnan(), obs_mean, PERSISTENCE_DECAY * prev + (1 - PERSISTENCE_DECAY) * obs_mean)


def compute_features(
    obs_attn: torch.Tensor,
    obs_queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    last_pos: int,
    z: torch.Tensor,
    phi: torch.Tensor,
    prototypes: torch.Tensor,
    persistence: torch.Tensor | None = None,
    keys_post: torch.Tensor | None = None,
    version: int = FEATURE_SPEC_VERSION,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The 14 features of spec ``version`` of every candidate at one event, for one layer.

    Args:
        obs_attn: Window attention over the candidates (Hkv, G·w, N), from :func:`observation_attention`.
        obs_queries: Pre-RoPE window queries (Hkv, G·w, D).
        keys: Pre-RoPE candidate keys (Hkv, N, D).
        values: Candidate values (Hkv, N, D).
        positions: Absolute candidate positions (N,), or per KV head (Hkv, N).
        last_pos: Position ``t`` of the last processed token (the event time).
        z: Projected keys (Hkv, N, d_z) (:meth:`Geometry.project`).
        phi: Nyström coverage features (Hkv, N, M) (:meth:`Geometry.nystrom`).
        prototypes: Coverage prototypes (Hkv, M, d_z).
        persistence: The EMA state of these candidates from the previous event (Hkv, N), NaN for new tokens,
            or ``None`` at the first event.
        keys_post: Post-RoPE candidate keys (Hkv, N, D), as cached; spec v2 needs them.
        version: The feature spec (:data:`FEATURE_SPECS`).

    Returns:
        ``(features (Hkv, N, 14) float32, persistence (Hkv, N))``; pass the latter to the next event.
    """
    hkv, n = keys.shape[0], keys.shape[1]
    obs_attn = obs_attn.float()
    obs_mean = obs_attn.mean(1)  # (Hkv, N)
    obs_max = obs_attn.amax(1)
    ema = update_persistence(persistence, obs_mean)
    pos = positions.to(keys.device).float()
    pos = pos[None].expand(hkv, n) if pos.dim() == 1 else pos
    dist = float(last_pos) - pos
    sim = z.float() @ prototypes.float().mT  # (Hkv, N, M)
    psi = (sim / PSI_TEMPERATURE).softmax(-1)
    entropy = -(psi * psi.clamp_min(1e-12).log()).sum(-1)
    crowd = (psi * psi.mean(1, keepdim=True)).sum(-1)
    # float32 is enough here: under uniform p, A = I + βB Φᵀ diag(p) Φ has trace(A − I) = βB · mean‖Φ‖² = 1, so its
    # eigenvalues lie in [1, 2] (condition number ≤ 2) and the Cholesky solve loses no digits to conditioning
    # (measured against float64 on SmolLM2 keys at 2k: max relative error 6e-7, no Top-25% set changed)
    phi32 = phi.float()
    novelty = leverage(torch.full((hkv, n), 1.0 / n, device=phi.device), phi32, normalised_beta_b(phi32))
    q_bar = obs_queries.float().mean(1, keepdim=True)  # (Hkv, 1, D)
    if check_version(version) == 2:
        if keys_post is None:
            raise ValueError("feature spec v2 needs the post-RoPE candidate keys (keys_post)")
        flags = [key_distinctiveness(keys_post), twin_rarity(keys_post, pos)]
    else:
        flags = [(pos < SINK_TOKENS).float(), (dist < LOCAL_WINDOW).float()]
    cols = [
        (obs_mean + EPS).log(),
        (obs_max + EPS).log(),
        (ema + EPS).log(),
        keys.float().norm(dim=-1),
        values.float().norm(dim=-1),
        torch.log1p(dist.clamp_min(0)),
        pos / max(float(last_pos), 1.0),
        *flags,
        sim.amax(-1),
        entropy,
        -(crowd + 1e-12).log(),
        novelty.float(),
        torch.nn.functional.cosine_similarity(keys.float(), q_bar, dim=-1),
    ]
    return torch.stack(cols, -1), ema


@dataclass
class FeatureStats:
    """Standardisation statistics per (layer, KV head, feature), measured on teacher data."""

    mean: torch.Tensor  # (L, Hkv, F)
    std: torch.Tensor  # (L, Hkv, F)
    version: int = FEATURE_SPEC_VERSION

    @classmethod
    def from_moments(cls, count: torch.Tensor, total: torch.Tensor, total_sq: torch.Tensor) -> FeatureStats:
        """From sums over candidates: ``count`` (L, Hkv), ``total``/``total_sq`` (L, Hkv, F), float64."""
        c = count.double().clamp_min(1)[..., None]
        mean = total.double() / c
        var = (total_sq.double() / c - mean.pow(2)).clamp_min(0)
        std = var.sqrt()
        std = torch.where(std < 1e-6, torch.ones_like(std), std)  # constant features (flags) pass through centred
        return cls(mean.float(), std.float())

    def standardize(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        """``(x − μ) / σ`` for features (Hkv, N, F) of ``layer``."""
        return (x - self.mean[layer, :, None].to(x)) / self.std[layer, :, None].to(x)

    def save(self, path: str | Path) -> Path:
        meta = {"feature_spec": json.dumps(spec(self.version), sort_keys=True), "version": str(self.version)}
        t = {"mean": self.mean.contiguous(), "std": self.std.contiguous()}
        return atomic_write(path, lambda tmp: save_file(t, tmp, metadata=meta))

    @classmethod
    def load(cls, path: str | Path) -> FeatureStats:
        from safetensors import safe_open

        try:
            with safe_open(str(path), "pt") as f:
                version = int((f.metadata() or {}).get("version", -1))
            t = load_file(str(path))
        except Exception as e:  # safetensors' errors (a truncated file) name no path
            raise ValueError(f"{path}: unreadable feature statistics ({type(e).__name__}: {e})") from e
        check_version(version, f"{path}: feature statistics")
        return cls(t["mean"], t["std"], version)


def moments(features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-head ``(count (Hkv,), sum (Hkv, F), sum of squares (Hkv, F))`` of features (Hkv, N, F), float64."""
    f = features.double()
    assert math.isfinite(float(f.sum())), "non-finite feature"
    return torch.full((f.shape[0],), f.shape[1], dtype=torch.float64), f.sum(1), f.pow(2).sum(1)
