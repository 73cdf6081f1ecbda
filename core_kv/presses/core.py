"""CORE at inference: one calibrated distribution drives retention (Top-B) and compensation (latent-memory writes).

Paper: Liu et al., 2026, "One Distribution, Two Channels: Coverage-Calibrated KV Retention and Compensation"
(``../shared/papers/002_8a6c3448532074fc.txt``); the method as this project builds it: ``../shared/design/CORE.md``
("Inference", "Certificate", "Ablations", "Costs"), ``../shared/research/indexmem_core.md`` §3.5–3.9.

Per eviction event, per layer (every KV head at once)::

    candidates = cached entries (retained set of the last event + tokens since)
    features   = core_kv.features.compute_features(...)       # the same function the teacher and trainer call
    s, p       = indexer.scores(l, features), softmax(s / T_l)  # one calibrated distribution
    R          = protected sinks + recent window + Top-(B − |P|) of s   (teacher.metrics.top_free, as replay)
    E          = candidates \\ R;  ε̂ = Σ_E p_i;  w = write_weights(p, E, rule)
    memory     ← write(memory, φ⁺(k̃_E), v_E, w);  E dropped from the cache

and before ``o_proj`` of every later query (chunk queries, question and generated tokens) the gated readout
``ô = o_R + g(q)(m(q) − o_R)`` (:func:`core_kv.memory.compensate`) replaces the retained-cache output. The memory
uses pre-RoPE keys; the cache holds post-RoPE keys, so the press tracks the original position of every cached
entry and un-rotates evicted keys with the model's own RoPE (exact: ``R(θ)⁻¹ = R(−θ)``), storing no extra keys.

This is :func:`core_kv.distill.replay.replay_layer` (``policy="student"``) + the memory step of
:class:`core_kv.distill.steps.MemoryStep`, run online: same event budgets ``B = floor(t_e (1 − r))`` (``t_e`` =
tokens processed, not cache size), same protected sets, same features, same Top-B rule. One difference is by
design: here layer l+1 sees the compressed (and compensated) layer l (the real cascade); training is
teacher-forced across layers (replay.py's docstring). ``tests/test_core_press.py`` checks the layer-0 retained
sets equal the replay's.

When it evicts: the first forward on an empty cache (one-shot prefill), every forward inside
:meth:`~core_kv.presses.base.BasePress.chunked_prefill` (chunked prefill, ``pipeline.prefill(chunk_size=...)``), and
with ``decoding=True`` whenever a layer holds more than ``B + decoding_slack`` tokens (repeated eviction, paper
Table 2).

Shapes: H query heads, Hkv KV heads, G = H / Hkv, T tokens of the current forward, N candidates (cached entries),
D head dim, w observation window, E evicted, P = 512 memory features.
"""

from __future__ import annotations

import math
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
from torch import nn

from core_kv.budget import protected_mask, top_free
from core_kv.config import parse_layers
from core_kv.core_model import CoreModel
from core_kv.features import FEATURE_NAMES, OBS_WINDOW, compute_features, observation_attention
from core_kv.memory import WRITE_RULES, MemoryState, compensate_fused, write_fused, write_weights
from core_kv.models.attention import LSE_SINK, apply_rope, attention_modules, layer_rotary
from core_kv.models.cache import RaggedLayer
from core_kv.presses.adakv import adaptive_keep, keep_top_per_head
from core_kv.presses.base import BasePress
from core_kv.presses.twin_repair import repair

ALLOCATIONS = ("indexer", "expected_attention", "keydiff")
HEAD_BUDGETS = ("uniform", "adaptive")
HEAD_POOLS = ("mass", "output", "split")
REPAIR_DONORS = ("twin", "mass")
NOVELTY = FEATURE_NAMES.index("novelty")  # ridge leverage under uniform p (core_kv.features)


# ----------------------------------------------------------------------------------------------------------------
# The certificate (CORE.md "Certificate"; indexmem_core.md §3.9)


def certificate_terms(
    eps_hat: torch.Tensor, delta: torch.Tensor | float, centroid: torch.Tensor, radius: torch.Tensor, o_r: torch.Tensor
) -> torch.Tensor:
    """The four-term pre-compensation bound ``‖o* − o_R‖ ≤ ε̂‖c_E − o_R‖ + ε̂ r_E + δ‖c_E − o_R‖ + δ r_E``.

    From the exact identity ``o* − o_R = α_E (o_E − o_R)`` [paper]: ``‖o_E − o_R‖ ≤ ‖c_E − o_R‖ + r_E`` whenever
    ``r_E ≥ ‖o_E − c_E‖`` (true for ``r_E = max_{i∈E} ‖v_i − c_E‖``: ``o_E`` is a convex combination of evicted
    values) and ``α_E ≤ ε̂ + δ`` whenever ``δ ≥ |α_E − ε̂|``. The terms are our reconstruction (CORE.md).

    Args:
        eps_hat: Predicted evicted mass ε̂ (...).
        delta: Calibration error bound δ (... or scalar).
        centroid: Write-weighted evicted centroid c_E (..., D).
        radius: r_E (...).
        o_r: Retained output o_R (..., D).

    Returns:
        The four terms stacked on the last dim (..., 4); their sum is the bound.
    """
    gap = (centroid.float() - o_r.float()).norm(dim=-1)
    delta = torch.as_tensor(delta, dtype=gap.dtype, device=gap.device)
    eps_hat, radius = eps_hat.to(gap), radius.to(gap)
    return torch.stack(torch.broadcast_tensors(eps_hat * gap, eps_hat * radius, delta * gap, delta * radius), -1)


# ----------------------------------------------------------------------------------------------------------------
# The press


@dataclass
class CorePress(BasePress, name="core"):
    """CORE (paper 002; CORE.md "Inference"): learned coverage-calibrated retention + mass-weighted latent memory.

    Build from a trained artifact: ``CorePress.from_pretrained("checkpoints/core-proxy/final", compression_ratio=0.75)``
    or ``build_press("core", checkpoint=..., compression_ratio=0.75)``. Without a checkpoint only the no-op (ratio 0)
    is allowed. The artifact is checked against the model when the press is entered (refuses another base model).

    Args:
        checkpoint: Folder of a :class:`~core_kv.core_model.CoreModel` artifact (``config.json`` + ``model.safetensors``).
        protected_sinks: First positions always kept; ``None`` = the artifact's (what it was trained with; CORE.md: 4).
        protected_recent: Last positions always kept; ``None`` = the artifact's (32 for the shipped proxy artifact).
            An explicit value that differs from the artifact's is used, with a warning.
        write_rule: ``mass`` (CORE), ``equal_event`` or ``uniform_token`` (paper Tables 3, 8); ``None`` = the
            artifact's rule.
        memory: ``False`` = retention only (no writes, no readout): the "no memory" ablation.
        calibrated: ``False`` = T = 1 for the mass channel (the "no calibration" ablation; Top-B is unchanged).
        allocation: ``indexer`` (CORE), or ``expected_attention`` / ``keydiff`` (paper Table 13, ``CORE_EA`` /
            ``CORE_KeyDiff``): that press's scores choose Top-B and ``p = softmax(standardise(score))`` drives the
            writes [choice: rank-preserving and scale-free; these scorers have no fitted temperature]. With
            ``head_budgets="adaptive"`` the heads compete on that press's raw scores (AdaKV over the press, as
            ``adakv_expected_attention`` is AdaKV over ExpectedAttention).
        allocation_layers: Layers (``"10-19"``) where ``allocation`` chooses the retained set; the indexer chooses
            it (and drives ε̂ and the writes) everywhere else. ``""`` = every layer (paper Table 13). A per-layer
            split is a diagnostic [deviation; docs/results.md "Where the learned allocation loses essay needles"].
        allocation_options: Options of the ``allocation`` press, e.g. ``{"epsilon": 0.01}`` for ExpectedAttention
            as kvpress's leaderboard entry runs it (``{}`` = that press's defaults).
        budget_matched: Reduce B by the memory state's token-equivalent (state bytes per KV head / bytes of one
            cached token), so CORE's total bytes match a baseline at the same nominal ratio (CORE.md "Inference").
        log_certificate: Keep a shadow copy of every evicted K/V (debug; not counted in ``aux_bytes``) and log per
            (layer, query head) the certificate terms, the true retention error and the compensated error
            (:attr:`certificates`; paper Tables 6, 8).
        certificate_delta: δ of the online certificate (paper Table 8 uses δ = 0.05).
        write_noise: Perturb each event's write weights by ``(1 + write_noise · ξ_e)``, ``ξ_e = ±1`` seeded per
            (layer, event): the mass perturbation of paper Table 8's ``G^(δ)`` (0 = off).
        coverage_layers: Layers (``"18-21"``) whose Top-B ranks candidates by the coverage term alone — the ridge
            leverage of their Nyström features under uniform p, the indexer's ``novelty`` input, i.e. the teacher's
            objective as λ_l → ∞ — while the indexer's calibrated distribution still drives ε̂ and the writes
            [deviation from the paper's single λ; docs/method.md "CORE on SmolLM2-135M"]. ``""`` = none.
        memory_dtype: Storage dtype of the memory's ``[M | b]`` (``"bfloat16"``, ``"float16"``, ``"float32"``;
            ``None`` = the cache's: fp32 for an fp32 model, bf16 for a 2-byte one); writes and reads compute in fp32
            (``Z``, ``s_v``, the radius stay fp32).
        head_budgets: ``uniform`` (the paper: B per (layer, KV head)) or ``adaptive``: AdaKV's head-wise
            allocation (https://arxiv.org/abs/2407.11550; :func:`~core_kv.presses.adakv.adaptive_keep`) over the
            calibrated distribution p of every KV head of the layer — the layer keeps ``Hkv · B`` entries in all,
            each head at least ``alpha_safeguard · B`` (its top by p) plus its protected positions, the rest by
            the globally largest p; every head's evicted entries are written with the same rule [deviation from
            the paper; docs/method.md "Head-wise budgets"]. p ranks a head's candidates as its scores do, so with
            ``alpha_safeguard=1`` it is the uniform press exactly. One event per context (one-shot prefill): the
            cache becomes ragged, so chunked prefill and ``decoding`` are refused (``log_certificate`` pads each
            head's evicted entries to the longest head's and masks the padding).
        alpha_safeguard: AdaKV's per-head floor (kvpress 0.5.5 default 0.2), with ``head_budgets="adaptive"``.
        head_pool: What the heads compete on with ``head_budgets="adaptive"``: ``mass`` = the calibrated p;
            ``output`` = ``(p_i + pool_epsilon) · ‖v_i‖``, ExpectedAttention's scoring formula
            (https://arxiv.org/abs/2510.00636, kvpress: ``(attention + ε) · ‖v‖``) with CORE's calibrated
            distribution in place of the expected attention: the output an entry carries, so heads whose values
            are larger keep more; ``split`` = the heads' budgets are their counts under ``output``, and each head
            keeps its top by p up to its count (the value scale sizes the heads, the learned ranking fills them)
            [deviation from the paper; docs/method.md "Value-aware head pooling"].
        pool_epsilon: ε of ``head_pool="output"`` / ``"split"`` (kvpress's leaderboard AdaKV(ExpectedAttention)
            uses 1e-2).
        pool_layers: Layers (``"15-19"``) where ``head_pool`` applies; ``""`` = every layer; the others pool p.
        repair: Run the TwinKV repair pass (``../shared/papers/001_e5fc3a72c13765dd.txt`` §3.2-3.4;
            :func:`~core_kv.presses.twin_repair.repair`) on every head's retained set before the writes: evicted
            entries with no retained key twin (cosine < ``repair_threshold`` beyond 32 positions) replace retained
            entries that have one, so each head's budget is unchanged; CORE's protected positions never donate; the
            memory writes the repaired evicted set [a composition the repair paper proposes for any press; not in
            the CORE paper; docs/method.md "CORE with the repair pass"].
        repair_threshold: τ of the repair pass (the ``twin_repair`` press's default, the paper's Qwen3-4B 0.85).
        repair_donors: Which retained entries with a twin give up their slots first: ``twin`` (the paper: the most
            redundant, highest b) or ``mass`` (the lowest calibrated p: the learned ranking decides which twins go)
            [a variant; docs/method.md "CORE with the repair pass"].

    Attributes:
        events: One dict per (layer, event) of the last context: ``t_e``, candidates, budget, evicted count, and per
            KV head ``eps_hat`` (ε̂) and the memory's ``Z`` after the write.
        certificates: With ``log_certificate``, one dict per (layer, forward after its first event) of the last
            context, per query head: ε̂, α_E, gate, RetErr, compensated error, the four terms, bounds, hold rates.
    """

    checkpoint: str | None = None
    protected_sinks: int | None = None
    protected_recent: int | None = None
    write_rule: str | None = None
    memory: bool = True
    calibrated: bool = True
    allocation: str = "indexer"
    allocation_layers: str = ""
    allocation_options: dict = field(default_factory=dict)
    budget_matched: bool = False
    log_certificate: bool = False
    certificate_delta: float = 0.05
    write_noise: float = 0.0
    memory_dtype: str | None = None
    coverage_layers: str = ""
    head_budgets: str = "uniform"
    alpha_safeguard: float = 0.2
    head_pool: str = "mass"
    pool_epsilon: float = 0.01
    pool_layers: str = ""
    repair: bool = False
    repair_threshold: float = 0.85
    repair_donors: str = "twin"

    _core: CoreModel | None = field(default=None, init=False, repr=False, compare=False)
    _layers: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _checked: set = field(default_factory=set, init=False, repr=False, compare=False)
    _inner: BasePress | None = field(default=None, init=False, repr=False, compare=False)
    _coverage: set = field(default_factory=set, init=False, repr=False, compare=False)
    _alloc_layers: set = field(default_factory=set, init=False, repr=False, compare=False)
    _pool_layers: set = field(default_factory=set, init=False, repr=False, compare=False)
    _rotary: nn.Module | None = field(default=None, init=False, repr=False, compare=False)
    events: list = field(default_factory=list, init=False, repr=False, compare=False)
    certificates: list = field(default_factory=list, init=False, repr=False, compare=False)

    def validate(self) -> None:
        self._trained_settings()
        super().validate()
        if self.allocation not in ALLOCATIONS:
            raise ValueError(f"allocation must be one of {ALLOCATIONS}, got {self.allocation!r}")
        if self.write_rule is not None and self.write_rule not in WRITE_RULES:
            raise ValueError(f"write_rule must be one of {WRITE_RULES} or None, got {self.write_rule!r}")
        if not (isinstance(self.certificate_delta, (int, float)) and self.certificate_delta >= 0):
            raise ValueError(f"certificate_delta must be >= 0, got {self.certificate_delta!r}")
        if not (isinstance(self.write_noise, (int, float)) and 0 <= self.write_noise < 1):
            raise ValueError(f"write_noise must be in [0, 1), got {self.write_noise!r}")
        self._coverage = set(parse_layers(self.coverage_layers, "coverage_layers"))
        if self._coverage and self.allocation != "indexer":
            raise ValueError(f"coverage_layers applies to allocation='indexer', got allocation={self.allocation!r}")
        self._alloc_layers = set(parse_layers(self.allocation_layers, "allocation_layers"))
        if not isinstance(self.allocation_options, dict):
            raise ValueError(f"allocation_options must be a dict of the allocation press's options, got "
                             f"{self.allocation_options!r}")  # fmt: skip
        for option, value in (
            ("allocation_layers", self._alloc_layers),
            ("allocation_options", self.allocation_options),
        ):
            if value and self.allocation == "indexer":
                raise ValueError(f"{option} needs allocation='expected_attention' or 'keydiff', got 'indexer'")
        if self.head_pool not in HEAD_POOLS:
            raise ValueError(f"head_pool must be one of {HEAD_POOLS}, got {self.head_pool!r}")
        e = self.pool_epsilon
        if isinstance(e, bool) or not isinstance(e, (int, float)) or not e >= 0:
            raise ValueError(f"pool_epsilon must be >= 0, got {e!r}")
        self._pool_layers = set(parse_layers(self.pool_layers, "pool_layers"))
        if self.head_pool != "mass" and (self.head_budgets != "adaptive" or self.allocation != "indexer"):
            raise ValueError(
                f"head_pool={self.head_pool!r} pools CORE's distribution across heads: it needs "
                f"head_budgets='adaptive' and allocation='indexer'"
            )
        if self._pool_layers and self.head_pool == "mass":
            raise ValueError("pool_layers needs head_pool='output' or 'split' (the layers where it applies)")
        if self.head_budgets not in HEAD_BUDGETS:
            raise ValueError(f"head_budgets must be one of {HEAD_BUDGETS}, got {self.head_budgets!r}")
        a = self.alpha_safeguard
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0.0 <= a <= 1.0:
            raise ValueError(f"alpha_safeguard must be in [0, 1], got {a!r}")
        t = self.repair_threshold
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not -1.0 <= t <= 1.0:
            raise ValueError(f"repair_threshold must be a cosine in [-1, 1], got {t!r}")
        if self.repair_donors not in REPAIR_DONORS:
            raise ValueError(f"repair_donors must be one of {REPAIR_DONORS}, got {self.repair_donors!r}")
        if self.head_budgets == "adaptive":
            for option, bad in (("decoding", self.decoding), ("coverage_layers", bool(self._coverage))):
                if bad:
                    raise ValueError(
                        f"head_budgets='adaptive' evicts once per context (a ragged cache); it does not combine "
                        f"with {option}"
                    )
        if self.memory_dtype not in (None, "float32", "bfloat16", "float16"):
            raise ValueError(f"memory_dtype must be None, float32, bfloat16 or float16, got {self.memory_dtype!r}")
        if self.checkpoint is None:
            if not self.is_noop:
                raise ValueError(
                    f"{self.name} needs a trained artifact: pass checkpoint=<folder> (e.g. checkpoints/core-proxy/final) "
                    "or use CorePress.from_pretrained(path, compression_ratio=...)"
                )
        if self.allocation != "indexer":
            from core_kv.presses.expected_attention import ExpectedAttentionPress
            from core_kv.presses.keydiff import KeyDiffPress

            cls = ExpectedAttentionPress if self.allocation == "expected_attention" else KeyDiffPress
            try:
                self._inner = cls(**self.allocation_options)
            except (TypeError, ValueError) as e:
                raise ValueError(f"allocation_options {self.allocation_options!r} for {self.allocation}: {e}") from None

    def _trained_settings(self) -> None:
        """Load the artifact; the protected positions it was trained with apply unless given (then warn if they
        differ). Without a checkpoint (the no-op press) the CORE.md defaults 4 / 32 fill in."""
        if self.checkpoint is not None and self._core is None:
            path = Path(self.checkpoint)
            if not (path / "config.json").is_file():
                raise ValueError(f"{self.name}: no CORE artifact at {path} (expected config.json + model.safetensors)")
            self._core = CoreModel.from_pretrained(path)  # refuses invalid stored settings and tensors
        for name, default in (("protected_sinks", 4), ("protected_recent", 32)):
            trained = default if self._core is None else getattr(self._core.config, name)
            if getattr(self, name) is None:
                setattr(self, name, trained)
            elif self._core is not None and getattr(self, name) != trained:
                warnings.warn(
                    f"{self.name}: {name}={getattr(self, name)} overrides the artifact's setting ({self.checkpoint} "
                    f"was trained with {trained})",
                    stacklevel=4,
                )

    @classmethod
    def from_pretrained(cls, path: str | Path, **options) -> CorePress:
        """Load the artifact at ``path`` (offline) into a press; ``options`` are the press's other fields."""
        return cls(checkpoint=str(path), **options)

    @contextmanager
    def chunked_prefill(self):
        """:meth:`BasePress.chunked_prefill`; refused with ``head_budgets="adaptive"`` (one event per context)."""
        if self.head_budgets == "adaptive":
            raise ValueError(
                "head_budgets='adaptive' evicts once per context: use a one-shot prefill (chunk_size=None)"
            )
        with super().chunked_prefill():
            yield

    @property
    def core(self) -> CoreModel:
        if self._core is None:
            raise ValueError(f"{self.name} has no checkpoint")
        return self._core

    @property
    def rule(self) -> str:
        return self.write_rule or self.core.config.write_rule

    # ------------------------------------------------------------------------------------------------------------
    # Setup

    def on_enter(self, model: nn.Module) -> None:
        if self.is_noop:
            return
        if id(model) not in self._checked:
            self.core.check_base_model(model)  # FingerprintMismatch (a ValueError) for another base model
            self._checked.add(id(model))
        device = next(model.parameters()).device
        self._core = self.core.to(device)
        self._rotary = layer_rotary(model)  # (module, x, positions) -> cos, sin of that layer's RoPE
        if self._inner is not None:
            self._inner.on_enter(model)

    # ------------------------------------------------------------------------------------------------------------
    # Budget accounting

    def token_equivalent(self, cache_element_size: int) -> int:
        """Cached tokens one KV head's memory state is worth: ``ceil(state bytes / (2 · D · bytes(dtype)))``."""
        if not self.memory or self._core is None:
            return 0
        c = self.core.config
        mb = self._memory_dtype(cache_element_size).itemsize  # [M | b] in the storage dtype, Z/s_v/radius fp32
        per_head = c.memory_dim * (c.head_dim + 1) * mb + (c.head_dim + 2) * 4
        return math.ceil(per_head / (2 * c.head_dim * cache_element_size))

    def _memory_dtype(self, cache_element_size: int) -> torch.dtype:
        """Storage dtype of ``[M | b]``: ``memory_dtype``, else the cache's (fp32 cache: fp32; 2-byte cache: bf16)."""
        if self.memory_dtype:
            return getattr(torch, self.memory_dtype)
        return torch.float32 if cache_element_size >= 4 else torch.bfloat16

    def event_budget(self, seen: int, cache_element_size: int) -> int:
        """B at an event after ``seen`` tokens: ``target(seen)`` (replay's ``budget_split``), budget-matched if asked."""
        b = self.target(seen)
        if self.budget_matched:
            b = max(1, b - self.token_equivalent(cache_element_size))
        return b

    def aux_bytes(self) -> int:
        """Memory state (fp32, every layer and KV head) + per-entry bookkeeping (positions, persistence, window)."""
        return sum(self.aux_breakdown().values())

    def aux_breakdown(self) -> dict:
        """``{"memory_state", "positions", "persistence", "obs_window"}`` bytes currently held."""
        out = {"memory_state": 0, "positions": 0, "persistence": 0, "obs_window": 0}
        for st in self._layers.values():
            if st.get("mem") is not None:
                out["memory_state"] += st["mem"].nbytes()
            hkv = st["pos"].shape[0]  # entries appended since the last event count as held (they are, lazily)
            out["positions"] += (st["pos"].numel() + hkv * st["n_pending"]) * st["pos"].element_size()
            out["persistence"] += (st["persist"].numel() + hkv * st["n_pending"]) * st["persist"].element_size()
            if st.get("wq_pre") is not None:
                out["obs_window"] += st["wq_pre"].numel() * st["wq_pre"].element_size() + st["wpos"].numel() * 8
        return out

    def memory_state(self, layer: int) -> MemoryState | None:
        """The latent memory of ``layer`` after the last event (``None`` before any write)."""
        return self._layers.get(layer, {}).get("mem")

    # ------------------------------------------------------------------------------------------------------------
    # Hooks

    def before_forward(self, module: nn.Module, hs: torch.Tensor, cache, kwargs: dict) -> None:
        if self.is_noop:
            return
        idx = module.layer_idx
        if hs.shape[0] != 1:
            raise ValueError(f"{self.name} supports batch size 1 (the pipeline's protocol)")
        layer = cache.layers[idx] if idx < len(cache.layers) else None
        st = self._layers.get(idx)
        if st is None or self._state[idx]["empty_before"]:
            st = self._layers[idx] = self._fresh(module, hs.device)
            if idx == 0:  # a new context: the logs describe the last context only (bounded over an eval run)
                self.events.clear()
                self.certificates.clear()
        elif st["frozen"]:
            pass  # after an adaptive (ragged) event no event follows: positions are no longer tracked
        else:
            if isinstance(layer, RaggedLayer):
                raise ValueError(f"{self.name} keeps uniform per-head budgets; got a ragged cache layer")
            n = layer.keys.shape[2]
            if st["pos"].shape[1] + st["n_pending"] > n:  # the pipeline trimmed question/answer tokens: forget them
                self._materialize(st)
                st["pos"], st["persist"] = st["pos"][:, :n], st["persist"][:, :n]
        t = hs.shape[1]
        pid = kwargs.get("position_ids")
        new_pos = (
            pid[0].to(hs.device) if pid is not None else torch.arange(st["next"], st["next"] + t, device=hs.device)
        )
        # the queries themselves come from the model's own q projection (_q_hook), not a second projection
        st["fwd"] = {"pos": new_pos, "cache": cache, "position_embeddings": kwargs["position_embeddings"]}
        # the observation window only matters if an event can still happen in this context (an event needs an empty
        # cache before, chunked prefill or decode-time eviction): otherwise it is dropped, not maintained
        st["fwd"]["window"] = self.decoding or self._mode == "prefill" or self._state[idx]["empty_before"]
        if not st["fwd"]["window"]:
            st["wq_pre"], st["wpos"] = None, st["wpos"][:0]
        # a decode step that will read the memory: let the attention return its log-partition (no q·K recompute)
        if self.memory and st["mem"] is not None and t == 1 and not self.log_certificate:
            module.__dict__[LSE_SINK] = st["fwd"]
        else:
            module.__dict__.pop(LSE_SINK, None)

    def _q_hook(self, attn: nn.Module, proj: nn.Module, args, output: torch.Tensor) -> None:
        """Pre-/post-RoPE queries of the current forward from the output of ``q_proj`` (``qkv_proj`` for Phi3)."""
        st = self._layers.get(attn.layer_idx)
        if st is None or "fwd" not in st:
            return
        fwd = st["fwd"]
        b, t, _ = output.shape
        q = output[..., : attn.config.num_attention_heads * attn.head_dim].view(b, t, -1, attn.head_dim)
        if hasattr(attn, "q_norm"):
            q = attn.q_norm(q)
        q_pre = q.transpose(1, 2)  # (1, H, T, D), as prerope_queries
        fwd["q_pre"] = q_pre[0].float()  # post-RoPE queries are made by the readout, only if the memory is read
        if not fwd["window"]:
            return
        # observation window: the last OBS_WINDOW queries, across forwards (decode steps included)
        wq_pre = fwd["q_pre"] if st["wq_pre"] is None else torch.cat([st["wq_pre"], fwd["q_pre"]], 1)
        wpos = torch.cat([st["wpos"], fwd["pos"]])
        st["wq_pre"], st["wpos"] = wq_pre[:, -OBS_WINDOW:], wpos[-OBS_WINDOW:]  # post-RoPE recomputed at events

    def install(self, model: nn.Module) -> list:
        """A forward hook on every ``q_proj`` (``qkv_proj`` for Phi3): the queries of each forward."""
        if self.is_noop:
            return []
        handles = []
        for attn in attention_modules(model):
            proj = attn.qkv_proj if hasattr(attn, "qkv_proj") else attn.q_proj
            handles.append(proj.register_forward_hook(partial(self._q_hook, attn)))
        return handles

    def uninstall(self, model: nn.Module) -> None:
        for attn in attention_modules(model):
            attn.__dict__.pop(LSE_SINK, None)

    def _fresh(self, module: nn.Module, device) -> dict:
        hkv = module.config.num_key_value_heads
        return {
            "pos": torch.empty(hkv, 0, dtype=torch.long, device=device),  # original position of every cached entry
            "persist": torch.empty(hkv, 0, device=device),  # persistence EMA (feature 2), NaN = new
            "pending": [],  # positions (t,) of forwards since the last event, appended to pos/persist lazily
            "n_pending": 0,
            "wq_pre": None,
            "wpos": torch.empty(0, dtype=torch.long, device=device),
            "next": 0,  # 1 + the last position processed
            "mem": None,
            "survive": torch.ones(hkv, device=device),  # Π_e (1 − ε̂_e): 1 − it is the predicted evicted mass
            "shadow": None,  # (keys, values, valid) of every evicted entry (right-padded per head), log_certificate
            "frozen": False,  # an adaptive (head-wise) event happened: no further event in this context
        }

    @property
    def evicts(self) -> bool:  # type: ignore[override]
        return not self.is_noop

    def after_forward(self, module: nn.Module, hs: torch.Tensor, cache, kwargs: dict) -> None:
        """Bookkeeping of the new entries, deferred to the next event (or trim): a step without an event adds no
        tensor work beyond this (decode-time eviction costs nothing on the steps where nothing is evicted)."""
        idx = module.layer_idx
        st = self._layers[idx]
        fwd = st.pop("fwd")
        layer = cache.layers[idx]
        if st["frozen"]:
            st["next"] = max(st["next"], int(fwd["pos"].max()) + 1)
            return
        if isinstance(layer, RaggedLayer):
            raise ValueError(f"{self.name} keeps uniform per-head budgets; got a ragged cache layer")
        st["pending"].append(fwd["pos"])
        st["n_pending"] += hs.shape[1]
        st["next"] = max(st["next"], int(fwd["pos"].max()) + 1)
        tracked = st["pos"].shape[1] + st["n_pending"]
        if tracked != layer.keys.shape[2]:
            raise RuntimeError(f"layer {idx}: tracked {tracked} cached entries, the cache holds {layer.keys.shape[2]}")
        st["element_size"] = layer.keys.element_size()

    def eviction_target(self, module: nn.Module, seen: int, prefill: bool) -> int:
        """:meth:`event_budget` of the positions processed so far, at prefill/chunk and decode-time events alike."""
        st = self._layers[module.layer_idx]
        return self.event_budget(st["next"], st["element_size"])

    def compress(self, module, hidden_states, keys, values, attentions, kwargs, n_kept, lengths=None):
        """Features -> p -> Top-B (protected positions in) -> write the evicted entries -> kept indices (1, Hkv, B),
        or per-head index lists with ``head_budgets="adaptive"``."""
        if lengths is not None:
            raise ValueError(f"{self.name} evicts from a rectangular cache; got a ragged cache layer")
        st = self._layers[module.layer_idx]
        self._materialize(st)
        kept = self._event(module, st, keys, values, hidden_states, kwargs, n_kept)
        return kept[None] if isinstance(kept, torch.Tensor) else kept

    @staticmethod
    def _materialize(st: dict) -> None:
        """Append the entries of the forwards since the last event to ``pos`` (their positions) and ``persist`` (NaN)."""
        if not st["n_pending"]:
            return
        hkv = st["pos"].shape[0]
        new = torch.cat(st["pending"]) if len(st["pending"]) > 1 else st["pending"][0]
        st["pos"] = torch.cat([st["pos"], new[None].expand(hkv, -1)], 1)
        st["persist"] = torch.cat([st["persist"], st["persist"].new_full((hkv, new.shape[0]), float("nan"))], 1)
        st["pending"], st["n_pending"] = [], 0

    # ------------------------------------------------------------------------------------------------------------
    # The eviction event

    def unrope(self, module: nn.Module, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Pre-RoPE keys (Hkv, N, D) from cached post-RoPE ``keys`` at their original ``positions`` (Hkv, N).

        When every head holds the same positions (the first event of a context) cos/sin are computed once and
        broadcast over the heads (the same numbers, elementwise)."""
        x = keys.float()[:, None]  # (Hkv, 1, N, D): heads as the batch
        if positions.shape[0] > 1 and bool((positions == positions[:1]).all()):
            positions = positions[:1]
        cos, sin = self._rotary(module, x, positions)  # (Hkv or 1, N, r)
        return apply_rope(module, x, (cos.float(), -sin.float()))[:, 0]

    def _features(self, module, st, keys, values, k_pre) -> torch.Tensor:
        """The 14 features (Hkv, N, F) of every cached entry, as :func:`replay_layer` computes them per head."""
        idx = module.layer_idx
        geo = self.core.geometry()
        hkv, n, d = keys.shape
        g = st["wq_pre"].shape[0] // hkv
        cos, sin = self._rotary(module, st["wq_pre"], st["wpos"][None])  # (1, w, r)
        wq_post = apply_rope(module, st["wq_pre"][None], (cos.float(), sin.float()))[0]  # (H, w, D)
        z = geo.project(idx, k_pre)  # (Hkv, N, d_z)
        phi = geo.nystrom(idx, z)  # (Hkv, N, M)
        protos = geo.prototypes[idx].to(z)
        scaling = float(getattr(module, "scaling", d**-0.5))
        # every KV head at once (per-head candidate positions): the per-head computation of replay_layer, batched
        obs = observation_attention(wq_post.view(hkv, g, -1, d), keys, st["wpos"], st["pos"], scaling)
        f, ema = compute_features(
            obs, st["wq_pre"].reshape(hkv, -1, d), k_pre, values, st["pos"], st["next"] - 1, z, phi, protos,
            st["persist"], keys_post=keys, version=self.core.config.feature_spec["version"],
        )  # fmt: skip
        st["persist"] = ema
        return f

    @torch.no_grad()
    def _event(self, module, st, keys, values, hidden_states, kwargs, b: int) -> torch.Tensor:
        """Score, Top-B, write the evicted entries into the memory; returns kept indices (Hkv, B), sorted."""
        idx = module.layer_idx
        k, v = keys[0], values[0]  # (Hkv, N, D)
        hkv, n, _ = k.shape
        s = min(self.protected_sinks, b)
        w = min(self.protected_recent, b - s)
        prot = protected_mask(n, min(s, n), min(w, max(n - s, 0)), device=k.device)
        k_pre = self.unrope(module, k, st["pos"])  # (Hkv, N, D)
        inner = self.allocation != "indexer" and (not self._alloc_layers or idx in self._alloc_layers)
        if not inner:
            feats = self._features(module, st, k.float(), v.float(), k_pre)
            scores = self.core.indexer.scores(idx, feats)
            p = self.core.indexer.distribution(idx, scores, calibrated=self.calibrated)
            if idx in self._coverage:
                scores = feats[..., NOVELTY]  # Top-B by coverage; p (ε̂, writes) stays the indexer's
        else:
            scores = self._inner.score(module, hidden_states, keys, values, None, kwargs)[0].float()  # (Hkv, N)
            std = scores.std(-1, keepdim=True).clamp_min(1e-6)
            p = ((scores - scores.mean(-1, keepdim=True)) / std).softmax(-1)
        if self.head_budgets == "adaptive":  # heads compete on p (head_pool="mass"), (p + ε)·‖v‖ or raw scores
            pooled = scores if inner else p  # another press's raw scores: AdaKV over that press
            pool_here = self.head_pool != "mass" and (not self._pool_layers or idx in self._pool_layers)
            if pool_here:
                pooled = (p.float() + self.pool_epsilon) * v.float().norm(dim=-1)  # EA's formula over CORE's p
            kept = adaptive_keep(pooled.float().masked_fill(prot, float("inf")), b, self.alpha_safeguard)
            if pool_here and self.head_pool == "split":  # (p + ε)·‖v‖ sized the heads; each keeps its top by p
                kept = keep_top_per_head(p.float().masked_fill(prot, float("inf")), kept.sum(-1))
        else:
            kept = top_free(scores.float(), prot, b - int(prot.sum()))  # (Hkv, N)
        if self.repair:  # TwinKV's repair pass on each head's set; budgets and protected positions unchanged
            kept = self._repaired(k, kept, s, w, p if self.repair_donors == "mass" else None)
        evicted = ~kept
        eps_hat = (p * evicted).sum(-1)  # (Hkv,)
        n_ev_head = evicted.sum(-1)  # (Hkv,): n - b for every head unless adaptive
        n_ev = int(n_ev_head.max())
        # each head's evicted indices in position order, right-padded (weight 0) to the longest head's
        order = (torch.arange(n, device=k.device) + n * kept.long()).argsort(-1)
        ev_idx = order[:, :n_ev]
        valid = torch.arange(n_ev, device=k.device)[None] < n_ev_head[:, None]  # (Hkv, E)
        gather = ev_idx[..., None].expand(-1, -1, k.shape[-1])
        if self.memory and n_ev > 0:
            wts = write_weights(p, evicted, self.rule).gather(1, ev_idx) * valid  # (Hkv, E); padding writes nothing
            mem = st["mem"] if st["mem"] is not None else self.core.memory.empty_state(device=k.device)
            if self.write_noise:
                sign = (
                    1.0
                    if torch.rand((), generator=torch.Generator().manual_seed(1000 * idx + mem.events)) < 0.5
                    else -1.0
                )
                wts = wts * (1 + self.write_noise * sign)
            st["mem"] = self._write(mem, idx, k_pre.gather(1, gather), v.float().gather(1, gather), wts, keys.dtype)
        st["survive"] = st["survive"] * (1 - eps_hat)
        if self.log_certificate and n_ev > 0:
            new = (k.gather(1, gather), v.gather(1, gather), valid)  # head-wise budgets: padding where valid is False
            old = st["shadow"]
            st["shadow"] = new if old is None else tuple(torch.cat([a, b], 1) for a, b in zip(old, new, strict=True))
        self.events.append(
            {"layer": idx, "t_e": st["next"], "candidates": n, "budget": b, "evicted": n - b,
             "kept_per_head": (n - n_ev_head).tolist(), "eps_hat": eps_hat.tolist(),
             "Z": None if st["mem"] is None else st["mem"].Z.tolist()}
        )  # fmt: skip
        if self.head_budgets == "adaptive":  # a ragged layer from here on: no positions to track, no later event
            st["frozen"] = True
            st["pos"], st["persist"] = st["pos"][:, :0], st["persist"][:, :0]
            st["wq_pre"], st["wpos"] = None, st["wpos"][:0]
            return [kept[h].nonzero().flatten() for h in range(hkv)]
        kept_idx = torch.arange(n, device=k.device).expand(hkv, n)[kept].view(hkv, b)
        st["pos"] = st["pos"].gather(1, kept_idx)
        st["persist"] = st["persist"].gather(1, kept_idx)
        return kept_idx

    def _repaired(self, k, kept: torch.Tensor, sinks: int, recent: int, donor_scores=None) -> torch.Tensor:
        """The kept mask (Hkv, N) after the TwinKV repair pass of each head's retained set (post-RoPE keys, as the
        ``twin_repair`` press compares them); ``donor_scores`` (Hkv, N) orders the donors (``repair_donors``)."""
        out = torch.zeros_like(kept)
        for h in range(kept.shape[0]):
            idx = repair(k[h], kept[h].nonzero().flatten(), self.repair_threshold, sinks=sinks, recent=recent,
                         donor_scores=None if donor_scores is None else donor_scores[h])  # fmt: skip
            out[h, idx] = True
        return out

    # ------------------------------------------------------------------------------------------------------------
    # The readout

    def _retained_lse(self, module, q_post: torch.Tensor, layer) -> torch.Tensor:
        """Log-partition of each query (H, T) over the layer's cached keys, the T new ones causally; a ragged
        layer (``head_budgets="adaptive"``) group by group."""
        if not isinstance(layer, RaggedLayer):
            return self._lse(module, q_post, layer.keys[0])
        h = q_post.shape[0]
        g = h // layer.num_heads
        out = q_post.new_empty(h, q_post.shape[1])
        for grp in layer.groups:
            qh = (grp.heads[:, None] * g + torch.arange(g, device=grp.heads.device)[None]).reshape(-1)
            out[qh] = self._lse(module, q_post[qh], grp.keys[0])
        return out

    @staticmethod
    def _lse(module, q_post: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """Log-partition of queries (h, T) over keys (h_kv, S, D) of their KV heads, the T new ones causally."""
        h, t, d = q_post.shape
        hkv, s, _ = keys.shape
        scaling = float(getattr(module, "scaling", d**-0.5))
        logits = (q_post.reshape(hkv, h // hkv * t, d) @ keys.float().mT) * scaling  # (Hkv, G·T, S), row g·T + t
        if t > 1:
            visible = (
                torch.arange(s, device=keys.device)[None] <= (s - t + torch.arange(t, device=keys.device))[:, None]
            )
            logits = logits.masked_fill(~visible.repeat(h // hkv, 1), float("-inf"))
        return logits.logsumexp(-1).reshape(h, t)

    @torch.no_grad()
    def readout(self, module: nn.Module, attn_output: torch.Tensor) -> torch.Tensor | None:
        """``ô = o_R + g (m − o_R)`` per query head before ``o_proj`` once this layer's memory holds writes."""
        if self.is_noop or not self.memory:
            return None
        st = self._layers.get(module.layer_idx)
        if st is None or st.get("mem") is None or "fwd" not in st:
            return None
        fwd = st["fwd"]
        idx = module.layer_idx
        layer = fwd["cache"].layers[idx]
        q_pre = fwd["q_pre"]  # (H, T, D)
        h, t, d = q_pre.shape
        o_r = attn_output[0].view(t, h, d).transpose(0, 1).float()  # (H, T, D)
        lse = fwd.get("lse")  # from the attention kernel (decode steps, see _pre_hook), else computed here
        q_post = None
        if lse is None or self.log_certificate:
            q_post = apply_rope(module, q_pre[None], fwd["position_embeddings"])[0].float()
            lse = self._retained_lse(module, q_post, layer)
        lse = lse.float()
        o_hat, g = self._compensate(st["mem"], idx, q_pre, o_r, lse)
        if self.log_certificate and st["shadow"] is not None:
            self._log_certificate(module, st, layer, q_post, o_r, o_hat, g, lse)
        return o_hat.transpose(0, 1).reshape(1, t, h * d).to(attn_output.dtype)

    def _write(self, mem: MemoryState, idx: int, keys, values, weights, cache_dtype=torch.float32) -> MemoryState:
        """One event's write (:func:`core_kv.memory.write_fused`; :func:`~core_kv.memory.write` up to rounding)."""
        dtype = self._memory_dtype(cache_dtype.itemsize)
        return write_fused(mem, self.core.memory.w_phi[idx].detach(), keys, values, weights, dtype=dtype)

    def _compensate(self, mem: MemoryState, idx: int, q_pre, o_r, lse):
        """``(ô, g)`` (:func:`core_kv.memory.compensate_fused`; :func:`~core_kv.memory.compensate` up to rounding)."""
        m = self.core.memory
        if mem.Mb is None:  # a state written by memory.write (not by this press)
            return m.compensate(mem, idx, q_pre, o_r, lse)
        w_phi_t = m.w_phi[idx].detach().mT  # a transposed view: the matmul reads it in place
        return compensate_fused(mem, w_phi_t, m.gate_w[idx], m.gate_b[idx], q_pre, o_r, lse)

    def _log_certificate(self, module, st, layer, q_post, o_r, o_hat, g, lse_r) -> None:
        """True retention error vs the four-term bound, per query head (averaged over this forward's queries)."""
        h, t, d = q_post.shape
        ek, ev, valid = st["shadow"]  # (Hkv, E, D) post-RoPE keys and values of every evicted entry; (Hkv, E) mask
        hkv = ek.shape[0]
        gq = h // hkv
        scaling = float(getattr(module, "scaling", d**-0.5))
        logits_e = (q_post.view(hkv, gq, t, d) @ ek.float()[:, None].mT) * scaling  # (Hkv, G, T, E)
        logits_e = logits_e.masked_fill(~valid[:, None, None], float("-inf"))  # a head's padding (head-wise budgets)
        lse_e = logits_e.logsumexp(-1).reshape(h, t)  # -inf for a head that evicted nothing: α = 0 below
        lse_all = torch.logaddexp(lse_r, lse_e)
        alpha = (lse_e - lse_all).exp()  # true evicted mass α_E(q)
        o_e = (logits_e.softmax(-1).nan_to_num(0.0) @ ev.float()[:, None]).reshape(h, t, d)
        o_star = o_r + alpha[..., None] * (o_e - o_r)  # the identity, exact: o* = (S_R o_R + S_E o_E) / S
        mem = st["mem"]
        rep = lambda x: x.repeat_interleave(gq, 0)  # noqa: E731  (KV head -> its query heads)
        eps_hat = rep(1 - st["survive"])[:, None].expand(h, t)
        c_e = rep(mem.centroid)[:, None].expand(h, t, d)
        r_exact = rep((ev.float() - mem.centroid[:, None]).norm(dim=-1).masked_fill(~valid, 0).amax(-1))
        r_exact = r_exact[:, None].expand(h, t)
        ret_err = (o_star - o_r).norm(dim=-1)
        online = certificate_terms(eps_hat, self.certificate_delta, c_e, rep(mem.radius)[:, None].expand(h, t), o_r)
        exact = certificate_terms(eps_hat, (alpha - eps_hat).abs(), c_e, r_exact, o_r)
        o_norm = o_star.norm(dim=-1).clamp_min(1e-12)
        mean = lambda x: x.mean(-1).tolist()  # noqa: E731  (over queries, per head)
        self.certificates.append({
            "layer": module.layer_idx, "queries": t, "events": mem.events,
            "eps_hat": mean(eps_hat), "alpha": mean(alpha), "gate": mean(g),
            "ret_err": mean(ret_err), "comp_err": mean((o_star - o_hat).norm(dim=-1)),
            "ret_err_rel": mean(ret_err / o_norm),
            "terms": online.mean(1).tolist(), "bound": mean(online.sum(-1)), "bound_rel": mean(online.sum(-1) / o_norm),
            "comp_gain": mean(1 - (o_star - o_hat).norm(dim=-1) / ret_err.clamp_min(1e-12)),
            "bound_exact": mean(exact.sum(-1)), "holds_exact": mean((ret_err <= exact.sum(-1) + 1e-5).float()),
            "holds": mean((ret_err <= online.sum(-1)).float()),
        })  # fmt: skip


@dataclass
class CoreEAPress(CorePress, name="core_ea"):
    """``CORE_EA`` (paper Table 13): ExpectedAttention scores replace the indexer's allocation; memory unchanged."""

    allocation: str = "expected_attention"


@dataclass
class CoreKeyDiffPress(CorePress, name="core_keydiff"):
    """``CORE_KeyDiff`` (paper Table 13): KeyDiff scores replace the indexer's allocation; memory unchanged."""

    allocation: str = "keydiff"


def core_parameter_counts(core: CoreModel) -> dict:
    """Added parameters (paper Table 18): indexer, memory + gate, and the frozen geometry buffers."""
    parts = core.num_parameters_by_part()
    geo = sum(getattr(core, f"geo_{k}").numel() for k in ("mean", "proj", "prototypes", "gamma", "kmm_inv_sqrt"))
    return {**parts, "geometry_buffers": geo, "total": parts["indexer"] + parts["memory"] + geo}


__all__ = [
    "ALLOCATIONS",
    "HEAD_BUDGETS",
    "CoreEAPress",
    "CoreKeyDiffPress",
    "CorePress",
    "certificate_terms",
    "core_parameter_counts",
]
