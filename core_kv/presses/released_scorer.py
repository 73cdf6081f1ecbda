"""CORE's retention channel for a feature-spec-v3 artifact (the authors' released design): one score per token.

Source: the CORE authors' release, GitHub ``zhutizi23-coder/CORE`` ``core/kvpress_adapter.py`` (``COREScorerPress``),
read for the specification; ``docs/method.md`` "The released recipe". At an eviction event of a layer::

    queries    = every query since the layer's last event (the whole prompt at a one-shot prefill; the chunk at a
                 chunked-prefill event; the queries of the last decode interval at a decode-time event)
    features   = core_kv.features_v3.compute_features_v3(queries, cached keys/values, ...)   # (N, 14), head-shared
    s          = indexer.scores(l, features)             # one score per cached token, broadcast to the KV heads
    kept       = protected sinks + Top-(B − |P|) of s    (ScorerPress.compress; the same set in every KV head)

The phase feature is 0 at the context's first event and at chunked-prefill events, 1 at decode-time events; the sink
feature also flags the tokenizer's special tokens (the token ids are read from the embedding's input). Every KV head
keeps the same set, so the cache stays aligned: head-wise budgets (AdaKV) and the repair pass, which give the heads
different sets, are refused (a spec-v3 score is defined on one candidate set per layer).

The latent memory of a v3 artifact is :class:`~core_kv.presses.fast_memory.FastMemoryPress` around this press.
Shapes: H query heads, Hkv KV heads, T queries, N candidates, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn

from core_kv.models.attention import apply_rope, attention_modules, prerope_queries_from_projection
from core_kv.models.cache import layer_lengths
from core_kv.presses.base import Kept
from core_kv.presses.core_scorer import CoreScorerPress


@dataclass
class ReleasedEvent:
    """The event in progress of one layer: ``scores`` (N,) the head-shared logits, ``p`` (N,) ``softmax(s / T_l)``."""

    scores: torch.Tensor
    p: torch.Tensor


@dataclass
class ReleasedLayer:
    """Per-layer bookkeeping between events: original position and token id (-1: unknown) of every cached entry
    (N,), the post-RoPE queries since the last event (H, Tq, D) and their positions, the events so far in this
    context, 1 + the last position processed, and the current forward."""

    pos: torch.Tensor
    ids: torch.Tensor
    q: torch.Tensor | None = None
    qpos: torch.Tensor | None = None
    events: int = 0
    next: int = 0
    element_size: int = 4
    pending: list = field(default_factory=list)
    fwd: dict | None = None
    event: ReleasedEvent | None = None

    @classmethod
    def empty(cls, device) -> ReleasedLayer:
        return cls(torch.empty(0, dtype=torch.long, device=device), torch.empty(0, dtype=torch.long, device=device))

    @property
    def n_pending(self) -> int:
        return sum(len(p) for p, _ in self.pending)

    def materialize(self) -> None:
        if self.pending:
            self.pos = torch.cat([self.pos, *(p for p, _ in self.pending)])
            self.ids = torch.cat([self.ids, *(i for _, i in self.pending)])
            self.pending = []


@dataclass
class CoreReleasedScorerPress(CoreScorerPress, name="core_released_scorer"):
    """Top-B of a spec-v3 artifact's head-shared scores (the released CORE's retention channel).

    ``build_press("core_released_scorer", checkpoint=..., compression_ratio=0.75)``; the ``core`` press composes it
    (with :class:`~core_kv.presses.fast_memory.FastMemoryPress` around it) for a v3 artifact. Options as
    :class:`~core_kv.presses.core_scorer.CoreScorerPress` (``allocation`` must stay ``indexer``).
    """

    _released: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _ids: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)

    def validate(self) -> None:
        super().validate()
        if self._core is not None and not self._core.config.shared_scores:
            raise ValueError(f"{self.name}: {self.checkpoint} is a feature spec "
                             f"v{self._core.config.feature_spec.get('version')} artifact; use core_scorer")  # fmt: skip
        if self.allocation != "indexer":
            raise ValueError(f"{self.name}: allocation must be 'indexer' (got {self.allocation!r})")

    # ------------------------------------------------------------------------------------------------------------
    # Hooks: token ids (embedding input) and the queries of every forward

    def install(self, model: nn.Module) -> list:
        if self.is_noop:
            return []
        body = getattr(model, "model", model)
        handles = [body.embed_tokens.register_forward_pre_hook(self._ids_hook)]
        for attn in attention_modules(model):
            proj = attn.qkv_proj if hasattr(attn, "qkv_proj") else attn.q_proj
            handles.append(proj.register_forward_hook(partial(self._q_hook, attn)))
        return handles

    def _ids_hook(self, module: nn.Module, args) -> None:
        ids = args[0] if args else None
        self._ids = ids[0].detach() if isinstance(ids, torch.Tensor) and ids.dim() == 2 else None

    def before_forward(self, module: nn.Module, hs: torch.Tensor, cache, kwargs: dict) -> None:
        if self.is_noop:
            return
        idx = module.layer_idx
        if hs.shape[0] != 1:
            raise ValueError(f"{self.name} supports batch size 1 (the pipeline's protocol)")
        st = self._released.get(idx)
        if st is None or self._state[idx]["empty_before"]:
            st = self._released[idx] = ReleasedLayer.empty(hs.device)
            if idx == 0:
                self.events.clear()
        else:
            cached = int(layer_lengths(cache.layers[idx]).max())
            if len(st.pos) + st.n_pending > cached:  # the pipeline trimmed question/answer tokens (the last ones)
                st.materialize()
                first_removed = int(st.pos[cached:].min())
                st.pos, st.ids = st.pos[:cached], st.ids[:cached]
                if st.q is not None:
                    keep = st.qpos < first_removed
                    st.q, st.qpos = st.q[:, keep], st.qpos[keep]
        t = hs.shape[1]
        pid = kwargs.get("position_ids")
        pos = pid[0].to(hs.device) if pid is not None else torch.arange(st.next, st.next + t, device=hs.device)
        ids = self._ids if self._ids is not None and len(self._ids) == t else torch.full_like(pos, -1)
        # queries only matter when an event can still happen in this context
        keep_q = self.decoding or self._mode == "prefill" or self._state[idx]["empty_before"]
        if not keep_q:
            st.q, st.qpos = None, None
        st.fwd = {"pos": pos, "ids": ids.to(hs.device), "keep_q": keep_q, "rope": kwargs["position_embeddings"]}

    def _q_hook(self, attn: nn.Module, proj: nn.Module, args, output: torch.Tensor) -> None:
        st = self._released.get(attn.layer_idx)
        if st is None or st.fwd is None or not st.fwd["keep_q"]:
            return
        q_pre = prerope_queries_from_projection(attn, output)
        q = apply_rope(attn, q_pre, st.fwd["rope"])[0].float()  # (H, T, D) post-RoPE, as the attention uses them
        st.q = q if st.q is None else torch.cat([st.q, q], 1)
        st.qpos = st.fwd["pos"] if st.qpos is None else torch.cat([st.qpos, st.fwd["pos"]])

    def after_forward(self, module: nn.Module, hs: torch.Tensor, cache, kwargs: dict) -> None:
        st = self._released[module.layer_idx]
        fwd, st.fwd = st.fwd, None
        st.pending.append((fwd["pos"], fwd["ids"]))
        st.next = max(st.next, int(fwd["pos"].max()) + 1)
        layer = cache.layers[module.layer_idx]
        cached = layer_lengths(layer)
        if bool((cached != len(st.pos) + st.n_pending).any()):
            raise RuntimeError(
                f"layer {module.layer_idx}: tracked {len(st.pos) + st.n_pending} cached entries, the cache holds "
                f"{cached.tolist()} per KV head ({self.name} keeps one set for every KV head)"
            )
        st.element_size = layer.dtype.itemsize if layer.keys is None else layer.keys.element_size()

    def eviction_target(self, module: nn.Module, seen: int, prefill: bool) -> int:
        return self.target(self._released[module.layer_idx].next)

    def aux_breakdown(self) -> dict:
        """Bookkeeping bytes held: positions and token ids of the cached entries, the buffered queries."""
        out = {"positions": 0, "token_ids": 0, "queries": 0}
        for st in self._released.values():
            out["positions"] += (len(st.pos) + st.n_pending) * 8
            out["token_ids"] += (len(st.ids) + st.n_pending) * 8
            if st.q is not None:
                out["queries"] += st.q.numel() * st.q.element_size()
        return out

    def element_size(self, layer: int) -> int:
        return self._released[layer].element_size

    # ------------------------------------------------------------------------------------------------------------
    # The event

    @torch.no_grad()
    def score(self, module, hidden_states, keys, values, attentions, kwargs) -> torch.Tensor:
        """The head-shared logits ``s`` broadcast to (1, Hkv, N)."""
        idx = module.layer_idx
        st = self._released[idx]
        st.materialize()
        lengths = kwargs["kv_lengths"]
        if bool((lengths != keys.shape[2]).any()) or keys.shape[2] != len(st.pos):
            raise ValueError(
                f"{self.name}: layer {idx} holds different entries per KV head (head-wise budgets or a repair pass "
                "around it): a spec-v3 artifact scores one candidate set per layer (policy head_budgets='uniform', "
                "repair=false)"
            )
        if st.q is None or st.q.shape[1] == 0:
            raise RuntimeError(f"{self.name}: layer {idx} has no queries since its last event")
        core = self.core
        scaling = float(getattr(module, "scaling", keys.shape[-1] ** -0.5))
        ids = st.ids if bool((st.ids >= 0).all()) else None
        s = core.released_scores(idx, st.q, keys[0], values[0], st.qpos, st.pos, st.next, scaling,
                                 phase=1 if st.events and self._mode != "prefill" else 0, token_ids=ids)  # fmt: skip
        p = core.indexer.distribution(idx, s[None], self.calibrated)[0]
        st.event = ReleasedEvent(scores=s, p=p)
        return s[None, None].expand(1, keys.shape[1], -1)

    def pooled_scores(self, module: nn.Module, scores: torch.Tensor) -> torch.Tensor:
        return self._released[module.layer_idx].event.p[None, None].expand_as(scores)

    def event(self, layer: int) -> ReleasedEvent:
        return self._released[layer].event

    def evicted(self, module, keys, values, kept: Kept, lengths=None) -> None:
        """Log the event (ε̂), keep the positions and ids of the retained entries, start a new query buffer."""
        st = self._released[module.layer_idx]
        if not isinstance(kept, torch.Tensor) or not bool((kept[0] == kept[0, :1]).all()):
            raise ValueError(f"{self.name}: every KV head must keep the same entries (layer {module.layer_idx})")
        keep = kept[0, 0]
        n = len(st.pos)
        mask = torch.zeros(n, dtype=torch.bool, device=keep.device)
        mask[keep] = True
        eps_hat = float((st.event.p * ~mask).sum())
        self.events.append({"layer": module.layer_idx, "t_e": st.next, "candidates": n, "budget": len(keep),
                            "kept_per_head": [len(keep)] * keys.shape[1], "eps_hat": [eps_hat] * keys.shape[1]})  # fmt: skip
        st.pos, st.ids = st.pos[keep], st.ids[keep]
        st.q, st.qpos, st.event = None, None, None
        st.events += 1


__all__ = ["CoreReleasedScorerPress", "ReleasedEvent", "ReleasedLayer"]
