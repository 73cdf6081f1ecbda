"""CORE's learned scorer: the indexer's calibrated distribution over the cached entries of every KV head.

Paper: Liu et al., 2026, "One Distribution, Two Channels: Coverage-Calibrated KV Retention and Compensation"
(``../shared/papers/002_8a6c3448532074fc.txt``); the method as this project builds it: ``../shared/design/CORE.md``
("Stage 2", "Stage 3", "Inference"). Per eviction event, per layer (every KV head at once)::

    candidates = cached entries (retained set of the last event + tokens since)
    features   = core_kv.features.compute_features(...)       # the same function the teacher and trainer call
    s, p       = indexer.scores(l, features), softmax(s / T_l)  # one calibrated distribution
    kept       = protected sinks + recent window + Top-(B − |P|) of s   (ScorerPress.compress)

This press is the *retention* channel alone. The paper's CORE is :class:`~core_kv.presses.latent_memory.
LatentMemoryPress` around it (the second channel writes the evicted entries with ``p``); head-wise budgets are
:class:`~core_kv.presses.adakv.AdaKVPress` around it (the heads compete on ``p``, :meth:`pooled_scores`); the
``core`` press (:mod:`core_kv.presses.core`) composes them from the artifact's inference policy.

It is :func:`core_kv.distill.replay.replay_layer` (``policy="student"``) run online: same event budgets ``B =
floor(t_e (1 − r))`` (``t_e`` = positions processed, not cache size), same protected sets, same features, same Top-B
rule; layer l+1 sees the compressed layer l (the real cascade). The cache holds post-RoPE keys; the features use
pre-RoPE keys, so the press tracks the original position of every cached entry and un-rotates them with the model's
own RoPE (exact: ``R(θ)⁻¹ = R(−θ)``), storing no extra keys.

When it evicts: the first forward on an empty cache (one-shot prefill), every forward inside
:meth:`~core_kv.presses.base.BasePress.chunked_prefill`, and with ``decoding=True`` whenever a layer holds more than
``B + decoding_slack`` tokens (repeated eviction, paper Table 2). A ragged cache (head-wise budgets of an AdaKV
wrapper) is re-scored head by head on its valid entries.

Shapes: H query heads, Hkv KV heads, G = H / Hkv, T tokens of the current forward, N candidates, D head dim, w
observation window, F = 14 features.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from core_kv.core_model import CoreModel
from core_kv.features import OBS_WINDOW, compute_features, observation_attention
from core_kv.models.attention import apply_rope, layer_rotary
from core_kv.models.cache import layer_lengths
from core_kv.presses.base import Kept, ScorerPress

ALLOCATIONS = ("indexer", "expected_attention", "keydiff")


@dataclass
class CoreEvent:
    """The candidates of the current eviction event of one layer, as the scorer saw them, published in the stack's
    per-layer state (``layer_state[layer]["event"]``) from :meth:`~CoreScorerPress.score` to the end of the
    :meth:`~CoreScorerPress.evicted` phase (the latent memory writes the evicted ones from it): ``p`` (Hkv, N) the
    distribution the memory writes with (0 on a ragged cache's padding), ``k_pre`` (Hkv, N, D) pre-RoPE keys,
    ``positions`` (Hkv, N) original positions, ``lengths`` (Hkv,)."""

    p: torch.Tensor
    k_pre: torch.Tensor
    positions: torch.Tensor
    lengths: torch.Tensor


@dataclass
class ScorerLayer:
    """Per-layer bookkeeping of the CORE scorer between events.

    Attributes:
        pos: Original position of every cached entry (Hkv, N), right-padded with -1 on a ragged layer.
        lengths: Valid entries per KV head (Hkv,).
        persist: Persistence EMA of every cached entry (Hkv, N) (feature 2), NaN for entries new since the last event.
        pending: Positions (t,) of the forwards since the last event, appended to ``pos``/``persist`` at the next event
            (or trim): a step without an event adds no tensor work.
        wq_pre, wpos: The observation window: pre-RoPE queries (H, w, D) of the last ``OBS_WINDOW`` positions and
            their positions (w,).
        next: 1 + the last position processed.
        fwd: The current forward: its positions.
        frozen: No event can follow in this context (:meth:`freeze`): forwards are no longer tracked.
    """

    pos: torch.Tensor
    lengths: torch.Tensor
    persist: torch.Tensor
    wpos: torch.Tensor
    pending: list = field(default_factory=list)
    n_pending: int = 0
    wq_pre: torch.Tensor | None = None
    next: int = 0
    fwd: dict | None = None
    frozen: bool = False

    @classmethod
    def empty(cls, kv_heads: int, device) -> ScorerLayer:
        return cls(
            pos=torch.empty(kv_heads, 0, dtype=torch.long, device=device),
            lengths=torch.zeros(kv_heads, dtype=torch.long, device=device),
            persist=torch.empty(kv_heads, 0, device=device),
            wpos=torch.empty(0, dtype=torch.long, device=device),
        )

    @property
    def ragged(self) -> bool:
        return bool((self.lengths != self.pos.shape[1]).any())

    def materialize(self) -> None:
        """Append the entries of the forwards since the last event (their positions; persistence NaN)."""
        if not self.n_pending:
            return
        new = torch.cat(self.pending) if len(self.pending) > 1 else self.pending[0]
        hkv, t = self.pos.shape[0], new.shape[0]
        if not self.ragged:
            self.pos = torch.cat([self.pos, new[None].expand(hkv, -1)], 1)
            self.persist = torch.cat([self.persist, self.persist.new_full((hkv, t), float("nan"))], 1)
        else:  # each head's new entries go right after its own valid ones
            width = int(self.lengths.max()) + t
            pos = self.pos.new_full((hkv, width), -1)
            persist = self.persist.new_full((hkv, width), float("nan"))
            for h, n in enumerate(self.lengths.tolist()):
                pos[h, :n], persist[h, :n] = self.pos[h, :n], self.persist[h, :n]
                pos[h, n : n + t] = new
            self.pos, self.persist = pos, persist
        self.lengths = self.lengths + t
        self.pending, self.n_pending = [], 0

    def freeze(self) -> None:
        """Free what only a later event would read — the observation window and the persistence — once none can
        follow in this context (a one-shot prefill's event without ``decoding``, the end of a chunked prefill); the
        retained positions stay, and later forwards are not tracked."""
        self.materialize()
        self.wq_pre, self.wpos = None, self.wpos.new_empty(0)
        self.persist, self.frozen = self.persist.new_empty(self.persist.shape[0], 0), True

    def trim(self, lengths: torch.Tensor) -> None:
        """Forget entries beyond each head's cached ``lengths`` (the pipeline dropped question/answer tokens)."""
        self.materialize()
        lengths = lengths.to(self.lengths)
        self.lengths = torch.minimum(self.lengths, lengths)
        width = int(self.lengths.max()) if self.lengths.numel() else 0
        self.pos, self.persist = self.pos[:, :width].clone(), self.persist[:, :width].clone()
        beyond = torch.arange(width, device=self.pos.device)[None] >= self.lengths[:, None]
        self.pos[beyond], self.persist[beyond] = -1, float("nan")

    def keep(self, kept: Kept) -> None:
        """Keep only the retained entries (sorted indices per head: ``(Hkv, k)`` or one tensor per head)."""
        if isinstance(kept, torch.Tensor):
            self.pos, self.persist = self.pos.gather(1, kept), self.persist.gather(1, kept)
            self.lengths = torch.full_like(self.lengths, kept.shape[1])
            return
        counts = [int(k.numel()) for k in kept]
        width = max(counts)
        pos = self.pos.new_full((len(kept), width), -1)
        persist = self.persist.new_full((len(kept), width), float("nan"))
        for h, idx in enumerate(kept):
            pos[h, : counts[h]], persist[h, : counts[h]] = self.pos[h, idx], self.persist[h, idx]
        self.pos, self.persist = pos, persist
        self.lengths = torch.tensor(counts, dtype=torch.long, device=self.pos.device)


@dataclass
class CoreScorerPress(ScorerPress, name="core_scorer"):
    """CORE's retention channel (paper 002; CORE.md "Inference"): Top-B of the indexer's scores, with the calibrated
    distribution ``p = softmax(s / T_l)`` kept for the memory and for head-wise pooling.

    Build from a trained artifact: ``build_press("core_scorer", checkpoint=..., compression_ratio=0.75)`` loads it;
    the ``core`` press loads it once and hands it in (``CoreScorerPress(core=..., checkpoint=...)``). Without an
    artifact only the no-op (ratio 0) is allowed; the artifact is checked against the model when the press is entered
    (refuses another base model). Most users want ``core`` (the artifact's policy, composed).

    Args:
        checkpoint: Folder of a :class:`~core_kv.core_model.CoreModel` artifact (``config.json`` + ``model.safetensors``),
            loaded unless ``core`` is given (then it names where ``core`` came from, for results folders).
        core: The artifact, already loaded (not an option of a results folder: ``checkpoint`` names it).
        protected_sinks: First positions always kept; ``None`` = the artifact's (what it was trained with; CORE.md: 4).
        protected_recent: Last positions always kept; ``None`` = the artifact's (32 for the shipped artifacts).
            An explicit value that differs from the artifact's is used, with a warning.
        calibrated: ``False`` = T = 1 for ``p`` (the "no calibration" ablation; Top-B is unchanged).
        allocation: ``indexer`` (CORE), or ``expected_attention`` / ``keydiff`` (paper Table 13, ``CORE_EA`` /
            ``CORE_KeyDiff``): that press's scores choose Top-B and ``p = softmax(standardise(score))`` is the
            distribution [choice: rank-preserving and scale-free; these scorers have no fitted temperature]; a
            head-wise wrapper then compares that press's raw scores (AdaKV over that press).

    Attributes:
        events: One dict per (layer, event) of the last context: ``t_e``, candidates, budget, kept per KV head and
            ``eps_hat`` (ε̂ = Σ_E p per KV head, the predicted evicted mass).
    """

    checkpoint: str | None = None
    protected_sinks: int | None = None
    protected_recent: int | None = None
    calibrated: bool = True
    allocation: str = "indexer"
    core: CoreModel | None = field(default=None, repr=False, compare=False)

    _layers: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _checked: set = field(default_factory=set, init=False, repr=False, compare=False)
    _inner: ScorerPress | None = field(default=None, init=False, repr=False, compare=False)
    _rotary: nn.Module | None = field(default=None, init=False, repr=False, compare=False)
    events: list = field(default_factory=list, init=False, repr=False, compare=False)

    def validate(self) -> None:
        self._trained_settings()
        super().validate()
        if self.allocation not in ALLOCATIONS:
            raise ValueError(f"allocation must be one of {ALLOCATIONS}, got {self.allocation!r}")
        if self.core is None and not self.is_noop:
            raise ValueError(
                f"{self.name} needs a trained artifact: pass checkpoint=<folder> (e.g. checkpoints/core-proxy/final)"
            )
        if self.allocation != "indexer":
            from core_kv.presses.expected_attention import ExpectedAttentionPress
            from core_kv.presses.keydiff import KeyDiffPress

            self._inner = ExpectedAttentionPress() if self.allocation == "expected_attention" else KeyDiffPress()

    def _trained_settings(self) -> None:
        """Load the artifact unless handed in; the protected positions it was trained with apply unless given (then
        warn if they differ). Without an artifact (the no-op press) the CORE.md defaults 4 / 32 fill in."""
        if self.checkpoint is not None and self.core is None:
            self.core = artifact_at(self.checkpoint, self.name)
        for name, default in (("protected_sinks", 4), ("protected_recent", 32)):
            trained = default if self.core is None else getattr(self.core.config, name)
            if getattr(self, name) is None:
                setattr(self, name, trained)
            elif self.core is not None and getattr(self, name) != trained:
                warnings.warn(
                    f"{self.name}: {name}={getattr(self, name)} overrides the artifact's setting ({self.checkpoint} "
                    f"was trained with {trained})",
                    stacklevel=5,
                )

    # ------------------------------------------------------------------------------------------------------------
    # Setup and per-forward bookkeeping

    def on_enter(self, model: nn.Module) -> None:
        if self.is_noop:
            return
        if id(model) not in self._checked:
            self.core.check_base_model(model)  # FingerprintMismatch (a ValueError) for another base model
            self._checked.add(id(model))
        self.core.to(next(model.parameters()).device)  # in place: the memory's weights (core.memory) move with it
        self._rotary = layer_rotary(model)  # (module, x, positions) -> cos, sin of that layer's RoPE
        if self._inner is not None:
            self._inner.on_enter(model)

    def captures_queries(self) -> bool:
        """The observation window is made of the queries of every forward (:meth:`BasePress.queries`)."""
        return not self.is_noop

    @property
    def evicts(self) -> bool:  # type: ignore[override]
        return not self.is_noop

    def before_forward(self, module: nn.Module, hs: torch.Tensor, cache, kwargs: dict) -> None:
        if self.is_noop:
            return
        idx = module.layer_idx
        if hs.shape[0] != 1:
            raise ValueError(f"{self.name} supports batch size 1 (the pipeline's protocol)")
        st = self._layers.get(idx)
        # an event can follow this forward only on an empty cache (one-shot prefill), in a chunked prefill or with
        # decode-time eviction; otherwise the layer's bookkeeping is freed (ScorerLayer.freeze), not maintained
        event_ahead = self.decoding or self._mode == "prefill" or self._state[idx]["empty_before"]
        if st is None or self._state[idx]["empty_before"]:
            st = self._layers[idx] = ScorerLayer.empty(module.config.num_key_value_heads, hs.device)
            if idx == 0:  # a new context: the log describes the last context only (bounded over an eval run)
                self.events.clear()
        elif st.frozen or not event_ahead:
            if event_ahead:
                raise RuntimeError(f"{self.name}: layer {idx} released its bookkeeping after the context's last event "
                                   "(no decoding=True); compress a continuation on a fresh cache or with decoding=True")  # fmt: skip
            if not st.frozen:
                st.freeze()
            st.fwd = None
            return
        else:
            cached = layer_lengths(cache.layers[idx]).to(st.lengths.device)
            if bool((st.lengths + st.n_pending > cached).any()):  # the pipeline trimmed question/answer tokens
                st.trim(cached)
        t = hs.shape[1]
        pid = kwargs.get("position_ids")
        new_pos = pid[0].to(hs.device) if pid is not None else torch.arange(st.next, st.next + t, device=hs.device)
        st.fwd = {"pos": new_pos}  # an event can follow: the forward's queries join the window

    def after_forward(self, module: nn.Module, hs: torch.Tensor, cache, kwargs: dict) -> None:
        st = self._layers[module.layer_idx]
        if st.frozen:
            return
        fwd, st.fwd = st.fwd, None
        q_pre = self.queries(module)  # (H, T, D): the forward's pre-RoPE queries join the window (the last OBS_WINDOW)
        wq_pre = q_pre if st.wq_pre is None else torch.cat([st.wq_pre, q_pre], 1)
        wpos = torch.cat([st.wpos, fwd["pos"]])
        st.wq_pre, st.wpos = wq_pre[:, -OBS_WINDOW:], wpos[-OBS_WINDOW:]  # post-RoPE recomputed at events
        st.pending.append(fwd["pos"])
        st.n_pending += hs.shape[1]
        st.next = max(st.next, int(fwd["pos"].max()) + 1)
        layer = cache.layers[module.layer_idx]
        cached = layer_lengths(layer).to(st.lengths.device)
        if not torch.equal(st.lengths + st.n_pending, cached):
            raise RuntimeError(
                f"layer {module.layer_idx}: tracked {(st.lengths + st.n_pending).tolist()} cached entries per KV "
                f"head, the cache holds {cached.tolist()}"
            )

    def eviction_target(self, module: nn.Module, seen: int, prefill: bool) -> int:
        """``B = target(t_e)`` with ``t_e`` the positions processed so far (replay's ``budget_split``), at prefill,
        chunk and decode-time events alike."""
        return self.target(self._layers[module.layer_idx].next)

    def aux_breakdown(self) -> dict:
        """Bookkeeping bytes held: ``{"positions", "persistence", "obs_window"}`` (entries appended since the last
        event count as held: they are, lazily)."""
        out = {"positions": 0, "persistence": 0, "obs_window": 0}
        for st in self._layers.values():
            hkv = st.pos.shape[0]
            out["positions"] += (st.pos.numel() + hkv * st.n_pending) * st.pos.element_size()
            out["persistence"] += (st.persist.numel() + hkv * st.n_pending) * st.persist.element_size()
            if st.wq_pre is not None:
                out["obs_window"] += st.wq_pre.numel() * st.wq_pre.element_size() + st.wpos.numel() * 8
        return out

    # ------------------------------------------------------------------------------------------------------------
    # The eviction event

    @torch.no_grad()
    def score(self, module, hidden_states, keys, values, attentions, kwargs) -> torch.Tensor:
        """The indexer's logits ``s`` (1, Hkv, N) (a ragged cache's padding: 0; ``ScorerPress.compress`` masks it);
        the calibrated ``p`` and the pre-RoPE keys are published as this event's :class:`CoreEvent` in the stack's
        per-layer state (``layer_state[layer]["event"]``), where the pooling and the memory read them."""
        idx = module.layer_idx
        st = self._layers[idx]
        st.materialize()
        k, v = keys[0], values[0]  # (Hkv, N, D)
        lengths = kwargs["kv_lengths"].to(st.lengths)
        if not torch.equal(lengths, st.lengths) or k.shape[1] != st.pos.shape[1]:
            raise RuntimeError(f"layer {idx}: tracked {st.lengths.tolist()} entries, the event has {lengths.tolist()}")
        valid = torch.arange(k.shape[1], device=k.device)[None] < lengths[:, None]  # (Hkv, N)
        k_pre = self.unrope(module, k, st.pos.clamp_min(0))  # (Hkv, N, D)
        if self._inner is None:
            feats = self._features(module, st, k.float(), v.float(), k_pre)
            scores = self.core.indexer.scores(idx, feats)
            p = self.core.indexer.distribution(idx, scores.masked_fill(~valid, float("-inf")), self.calibrated)
        else:
            scores = self._inner.score(module, hidden_states, keys, values, None, kwargs)[0].float()  # (Hkv, N)
            p = _standardised_softmax(scores, valid)
        self.layer_state[idx]["event"] = CoreEvent(p=p, k_pre=k_pre, positions=st.pos, lengths=st.lengths)
        return scores.masked_fill(~valid, 0.0)[None]

    def pooled_scores(self, module: nn.Module, scores: torch.Tensor) -> torch.Tensor:
        """What the KV heads of a layer compete on under head-wise budgets: the calibrated ``p`` (it sums to 1 per
        head); with another ``allocation``, that press's raw scores (AdaKV over that press)."""
        if self._inner is not None:
            return scores
        return self.layer_state[module.layer_idx]["event"].p[None]

    def evicted(self, module, keys, values, kept, lengths=None) -> None:
        """Log the event (ε̂ per head), keep the positions and persistence of the final retained entries and withdraw
        the published event (the wrappers' ``evicted`` phases, outside this one, have read it)."""
        st = self._layers[module.layer_idx]
        ev = self.layer_state[module.layer_idx].pop("event")
        hkv, n = ev.p.shape
        mask = torch.zeros(hkv, n, dtype=torch.bool, device=ev.p.device)
        heads = kept[0] if isinstance(kept, torch.Tensor) else kept
        for h in range(hkv):
            mask[h, heads[h]] = True
        eps_hat = (ev.p * ~mask).sum(-1)  # (Hkv,)
        self.events.append(
            {"layer": module.layer_idx, "t_e": st.next, "candidates": n, "budget": int(mask.sum()) // hkv,
             "kept_per_head": mask.sum(-1).tolist(), "eps_hat": eps_hat.tolist()}
        )  # fmt: skip
        st.keep(kept[0] if isinstance(kept, torch.Tensor) else kept)
        if not self.decoding and self._mode != "prefill":  # a one-shot prefill's event: the context's last
            st.freeze()

    @contextmanager
    def chunked_prefill(self, tokens: int | None = None):
        """The chunks' events; after the last one, without ``decoding``, every layer frees what no event reads."""
        with super().chunked_prefill(tokens):
            yield
        if not self.decoding:
            for st in self._layers.values():
                st.freeze()

    def unrope(self, module: nn.Module, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Pre-RoPE keys (Hkv, N, D) from cached post-RoPE ``keys`` at their original ``positions`` (Hkv, N).

        When every head holds the same positions (the first event of a context) cos/sin are computed once and
        broadcast over the heads (the same numbers, elementwise)."""
        x = keys.float()[:, None]  # (Hkv, 1, N, D): heads as the batch
        if positions.shape[0] > 1 and bool((positions == positions[:1]).all()):
            positions = positions[:1]
        cos, sin = self._rotary(module, x, positions)  # (Hkv or 1, N, r)
        return apply_rope(module, x, (cos.float(), -sin.float()))[:, 0]

    def _features(self, module, st: ScorerLayer, keys, values, k_pre) -> torch.Tensor:
        """The 14 features (Hkv, N, F) of every cached entry, as :func:`replay_layer` computes them per head (a ragged
        layer head by head on its valid entries; padding rows 0)."""
        idx = module.layer_idx
        geo = self.core.geometry()
        hkv, n, d = keys.shape
        g = st.wq_pre.shape[0] // hkv
        cos, sin = self._rotary(module, st.wq_pre, st.wpos[None])  # (1, w, r)
        wq_post = apply_rope(module, st.wq_pre[None], (cos.float(), sin.float()))[0].view(hkv, g, -1, d)  # (Hkv,G,w,D)
        wq_pre = st.wq_pre.reshape(hkv, -1, d)
        z = geo.project(idx, k_pre)  # (Hkv, N, d_z)
        phi = geo.nystrom(idx, z)  # (Hkv, N, M)
        protos = geo.prototypes[idx].to(z)
        scaling = float(getattr(module, "scaling", d**-0.5))
        version = self.core.config.feature_spec["version"]
        last = st.next - 1
        if not st.ragged:  # every KV head at once: the per-head computation of replay_layer, batched
            obs = observation_attention(wq_post, keys, st.wpos, st.pos, scaling)
            f, st.persist = compute_features(
                obs, wq_pre, k_pre, values, st.pos, last, z, phi, protos, st.persist, keys_post=keys, version=version
            )
            return f
        out = keys.new_zeros(hkv, n, 14)
        for h, m in enumerate(st.lengths.tolist()):
            hs = slice(h, h + 1)
            obs = observation_attention(wq_post[hs], keys[hs, :m], st.wpos, st.pos[hs, :m], scaling)
            f, ema = compute_features(
                obs, wq_pre[hs], k_pre[hs, :m], values[hs, :m], st.pos[hs, :m], last, z[hs, :m], phi[hs, :m],
                protos[hs], st.persist[hs, :m], keys_post=keys[hs, :m], version=version,
            )  # fmt: skip
            out[h, :m] = f[0]
            st.persist[h, :m] = ema[0]
        return out


def artifact_at(checkpoint: str | Path, where: str = "core") -> CoreModel:
    """The CORE artifact at ``checkpoint`` (offline); ``ValueError`` naming ``where`` and the folder when there is none
    (:meth:`CoreModel.from_pretrained` refuses invalid stored settings and tensors)."""
    path = Path(checkpoint)
    if not (path / "config.json").is_file():
        raise ValueError(f"{where}: no CORE artifact at {path} (expected config.json + model.safetensors)")
    return CoreModel.from_pretrained(path)


def _standardised_softmax(scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``softmax((s − mean) / std)`` per head over its valid entries (unbiased std, at least 1e-6) (Hkv, N)."""
    if bool(valid.all()):
        std = scores.std(-1, keepdim=True).clamp_min(1e-6)
        return ((scores - scores.mean(-1, keepdim=True)) / std).softmax(-1)
    out = torch.zeros_like(scores)
    for h, m in enumerate(valid.sum(-1).tolist()):
        out[h, :m] = _standardised_softmax(scores[h : h + 1, :m], valid[h : h + 1, :m])[0]
    return out


__all__ = ["ALLOCATIONS", "CoreEvent", "CoreScorerPress", "ScorerLayer", "artifact_at"]
