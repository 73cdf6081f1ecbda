"""The released CORE at inference: its scorer, its fast memory and their composition, registered as presses.

Source: the CORE authors' release, GitHub ``zhutizi23-coder/CORE`` ``core/kvpress_adapter.py`` (``COREScorerPress``,
``COREMemoryPress``), read for the specification; ``docs/method.md`` "The released recipe".

- ``core_released_scorer`` (:class:`ReleasedScorerPress`), the retention channel. At an eviction event of a layer::

    queries    = every query since the layer's last event (the whole prompt at a one-shot prefill; the chunk at a
                 chunked-prefill event; the queries of the last decode interval at a decode-time event)
    features   = research.released.features.compute_features_v3(queries, cached keys/values, ...)  # (N, 14), shared
    s          = indexer.scores(l, features)             # one score per cached token, broadcast to the KV heads
    kept       = protected sinks + Top-(B − |P|) of s    (ScorerPress.compress; the same set in every KV head)

  The phase feature is 0 at the context's first event and at chunked-prefill events, 1 at decode-time events; the
  sink feature also flags the tokenizer's special tokens (the token ids are read from the embedding's input). Every KV
  head keeps the same set, so the cache stays aligned: head-wise budgets (AdaKV) and the repair pass, which give the
  heads different sets, are refused (a spec-v3 score is defined on one candidate set per layer).
- ``fast_memory`` (:class:`FastMemoryPress`): at every eviction event of the wrapped press, with the *final* evicted
  set ``E``, ``p = softmax(s / T_l)`` over all the event's candidates and the decayed write of
  :meth:`~research.released.memory.FastMemory.write_event` (γ: the artifact's decay); every later query adds
  ``g(q) m(q)`` to its attention output before ``o_proj``, ``q`` its post-RoPE query heads concatenated.
- ``core_released`` (:class:`ReleasedCorePress`): the two composed as the artifact's inference policy says (the
  memory on, off or in some layers).

Shapes: H query heads, Hkv KV heads, T queries, N candidates, D head dim.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
from torch import nn

from core_kv.config import parse_layers
from core_kv.models.attention import apply_rope, attention_modules, prerope_queries_from_projection
from core_kv.models.cache import layer_lengths
from core_kv.policy import PAPER, PolicyOptions
from core_kv.presses.base import HELD, BasePress, Kept, ScorerPress, WrapperPress
from research.released.memory import FastState
from research.released.model import ReleasedModel


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
class ReleasedScorerPress(ScorerPress, name="core_released_scorer"):
    """Top-B of a released artifact's head-shared scores (the released CORE's retention channel).

    ``build_press("core_released_scorer", checkpoint=..., compression_ratio=0.75)``; ``core_released`` composes it
    (with :class:`FastMemoryPress` around it). Without a checkpoint only the no-op (ratio 0) is allowed; the artifact
    is checked against the model when the press is entered (refuses another base model).

    Args:
        checkpoint: Folder of a :class:`~research.released.model.ReleasedModel` artifact.
        protected_sinks, protected_recent: First / last positions always kept; ``None`` = the artifact's (an explicit
            value that differs is used, with a warning).
        calibrated: ``False`` = T = 1 for ``p`` (Top-B is unchanged).

    Attributes:
        events: One dict per (layer, event) of the last context: ``t_e``, candidates, budget, kept per KV head and
            ``eps_hat`` (ε̂ = Σ_E p, the predicted evicted mass).
    """

    checkpoint: str | None = None
    protected_sinks: int | None = None
    protected_recent: int | None = None
    calibrated: bool = True

    _core: ReleasedModel | None = field(default=None, init=False, repr=False, compare=False)
    _checked: set = field(default_factory=set, init=False, repr=False, compare=False)
    _released: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _ids: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)
    events: list = field(default_factory=list, init=False, repr=False, compare=False)

    def validate(self) -> None:
        if self.checkpoint is not None and self._core is None:
            path = Path(self.checkpoint)
            if not (path / "config.json").is_file():
                raise ValueError(f"{self.name}: no artifact at {path} (expected config.json + model.safetensors)")
            self._core = ReleasedModel.from_pretrained(path)  # refuses invalid stored settings and tensors
        for name in ("protected_sinks", "protected_recent"):  # the artifact's, unless given (then warn if they differ)
            trained = (
                (4 if name == "protected_sinks" else 0) if self._core is None else getattr(self._core.config, name)
            )
            if getattr(self, name) is None:
                setattr(self, name, trained)
            elif self._core is not None and getattr(self, name) != trained:
                warnings.warn(f"{self.name}: {name}={getattr(self, name)} overrides the artifact's setting "
                              f"({self.checkpoint} was trained with {trained})", stacklevel=5)  # fmt: skip
        super().validate()
        if self.checkpoint is None and not self.is_noop:
            raise ValueError(f"{self.name} needs a trained artifact: pass checkpoint=<folder>")

    @property
    def core(self) -> ReleasedModel:
        if self._core is None:
            raise ValueError(f"{self.name} has no checkpoint")
        return self._core

    @property
    def evicts(self) -> bool:  # type: ignore[override]
        return not self.is_noop

    def on_enter(self, model: nn.Module) -> None:
        if self.is_noop:
            return
        if id(model) not in self._checked:
            self.core.check_base_model(model)  # FingerprintMismatch (a ValueError) for another base model
            self._checked.add(id(model))
        self._core = self.core.to(next(model.parameters()).device)

    def aux_bytes(self) -> int:
        return sum(self.aux_breakdown().values())

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
        s = core.scores(idx, st.q, keys[0], values[0], st.qpos, st.pos, st.next, scaling,
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


@dataclass
class FastMemoryLayer:
    """One layer's fast state (``None`` before the first write) and the current forward's queries/RoPE tables."""

    state: FastState | None = None
    fwd: dict | None = None


@dataclass
class FastMemoryPress(WrapperPress, name="fast_memory"):
    """The released memory around a spec-v3 scorer (its stack must contain ``core_released_scorer``).

    Args:
        press: The wrapped press.
        layers: Layers that write and read the memory (``"0-5,8"``); ``""`` = every layer.
        decay: γ across events; ``None`` = the artifact's (the release: 0.9).
        gate: A fixed gate in [0, 1] instead of the learned one (the release's ``memory_gate_override`` ablation);
            ``None`` = learned.
    """

    press: WrapperPress | ReleasedScorerPress | str = "core_released_scorer"
    layers: str = ""
    decay: float | None = None
    gate: float | None = None

    _memory: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _layer_set: set = field(default_factory=set, init=False, repr=False, compare=False)

    def validate(self) -> None:
        super().validate()
        if self.scorer is None:
            raise ValueError(f"{self.name} needs core_released_scorer in the press it wraps, got {self.press!r}")
        if self.decay is not None and not 0 <= self.decay <= 1:
            raise ValueError(f"{self.name}: decay must be in [0, 1], got {self.decay!r}")
        if self.gate is not None and not 0 <= self.gate <= 1:
            raise ValueError(f"{self.name}: gate must be in [0, 1] or None, got {self.gate!r}")
        self._layer_set = set(parse_layers(self.layers, "layers"))

    @property
    def scorer(self) -> ReleasedScorerPress | None:
        return self.inner(ReleasedScorerPress)

    def active(self, layer: int) -> bool:
        return not self._layer_set or layer in self._layer_set

    def memory_state(self, layer: int) -> FastState | None:
        st = self._memory.get(layer)
        return None if st is None else st.state

    def aux_bytes(self) -> int:
        return sum(self.aux_breakdown().values())

    def aux_breakdown(self) -> dict:
        mem = sum(st.state.nbytes() for st in self._memory.values() if st.state is not None)
        return {"memory_state": mem, **self.scorer.aux_breakdown()}

    # ------------------------------------------------------------------------------------------------------------
    # Hooks

    def install(self, model: nn.Module) -> list:
        handles = super().install(model)
        if self.is_noop:
            return handles
        for attn in attention_modules(model):
            if self.active(attn.layer_idx):
                proj = attn.qkv_proj if hasattr(attn, "qkv_proj") else attn.q_proj
                handles.append(proj.register_forward_hook(partial(self._q_hook, attn)))
        return handles

    def before_forward(self, module: nn.Module, hs: torch.Tensor, cache, kwargs: dict) -> None:
        super().before_forward(module, hs, cache, kwargs)
        idx = module.layer_idx
        if self.is_noop or not self.active(idx):
            return
        st = self._memory.get(idx)
        if st is None or self._state[idx]["empty_before"]:
            st = self._memory[idx] = FastMemoryLayer()
        st.fwd = {"rope": kwargs["position_embeddings"]}

    def _q_hook(self, attn: nn.Module, proj: nn.Module, args, output: torch.Tensor) -> None:
        st = self._memory.get(attn.layer_idx)
        if st is not None and st.fwd is not None and st.state is not None:
            q_pre = prerope_queries_from_projection(attn, output)
            st.fwd["q"] = apply_rope(attn, q_pre, st.fwd["rope"])[0].float()  # (H, T, D)

    def after_forward(self, module: nn.Module, hs: torch.Tensor, cache, kwargs: dict) -> None:
        st = self._memory.get(module.layer_idx)
        if st is not None:
            st.fwd = None
        super().after_forward(module, hs, cache, kwargs)

    # ------------------------------------------------------------------------------------------------------------
    # Writes and the readout

    @torch.no_grad()
    def evicted(self, module, keys, values, kept, lengths=None) -> None:
        idx = module.layer_idx
        st = self._memory.get(idx)
        if st is not None and isinstance(kept, torch.Tensor):
            core = self.scorer.core
            n = keys.shape[2]
            evicted = torch.ones(n, dtype=torch.bool, device=keys.device)
            evicted[kept[0, 0]] = False
            if bool(evicted.any()):
                state = st.state if st.state is not None else core.memory.empty_state(keys.device)
                decay = core.config.memory_decay if self.decay is None else self.decay
                temp = float(core.indexer.temperature[idx]) if self.scorer.calibrated else 1.0
                st.state = core.memory.write_event(state, idx, self.scorer.event(idx).scores, evicted, keys[0].float(),
                                                   values[0].float(), temp, decay)  # fmt: skip
        super().evicted(module, keys, values, kept, lengths)

    @torch.no_grad()
    def readout(self, module: nn.Module, attn_output: torch.Tensor) -> torch.Tensor | None:
        """``o + g(q) m(q)`` (or ``o + g(q) (m(q) − o)``, the ``interpolate`` readout) before ``o_proj`` once this
        layer's memory holds writes."""
        out = self.press.readout(module, attn_output)
        attn_output = attn_output if out is None else out
        st = self._memory.get(module.layer_idx)
        if self.is_noop or st is None or st.state is None or st.fwd is None or "q" not in st.fwd:
            return out
        mem = self.scorer.core.memory
        q = st.fwd["q"]
        retained = attn_output[0].float()
        if self.gate is None:
            residual, _ = mem.readout_heads(st.state, module.layer_idx, q, retained)
        else:
            h, t, d = q.shape
            residual = self.gate * mem.correction(st.state, module.layer_idx, q.transpose(0, 1).reshape(t, h * d),
                                                  retained)  # fmt: skip
        return (attn_output.float() + residual[None]).to(attn_output.dtype)


POLICIES = ("artifact", "paper")


@dataclass(repr=False)
class ReleasedCorePress(WrapperPress, name="core_released"):
    """The released CORE from a trained artifact, composed as its inference policy says for the compression ratio:
    ``FastMemoryPress(ReleasedScorerPress(checkpoint))``, or the scorer alone where the policy switches the memory off.

    ``build_press("core_released", checkpoint="runs/released-proxy/final", compression_ratio=0.75)`` (after
    ``import research.released``).

    Args:
        checkpoint: Folder of a :class:`~research.released.model.ReleasedModel` artifact.
        policy: ``artifact`` (the recorded policy's band for ``compression_ratio``) or ``paper`` (memory everywhere).
        memory: Override the policy's memory: ``True``, ``False`` or a layer list (``"0-5,8"``); ``None``: the policy's.
        protected_sinks, protected_recent, calibrated: The scorer's (:class:`ReleasedScorerPress`), which holds them
            and the budget (a wrapper holds none: :class:`~core_kv.presses.base.WrapperPress`).
    """

    checkpoint: str | None = None
    policy: str = "artifact"
    memory: bool | str | None = None
    calibrated: bool = True
    press: BasePress | None = field(default=None, init=False)

    options: PolicyOptions = field(default=PAPER, init=False, compare=False)

    def validate(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"{self.name}: policy must be one of {POLICIES}, got {self.policy!r}")
        held = {n: getattr(self, n) for n in HELD if getattr(self, n) is not None}  # given here, held by the scorer
        scorer = ReleasedScorerPress(checkpoint=self.checkpoint, calibrated=self.calibrated, **held)
        base = PAPER
        if self.policy == "artifact" and scorer._core is not None:
            base = scorer.core.policy().for_ratio(scorer.compression_ratio if scorer.budget is None else None)
        given = {} if self.memory is None else {"memory": self.memory}
        try:
            self.options = PolicyOptions.from_dict({**base.to_dict(), **given}, self.name)
        except ValueError as e:
            raise ValueError(f"{e} (policy {base.describe()!r} with overrides {given})") from None
        if (
            scorer._core is not None
            and not scorer.core.config.memory_trained
            and self.options.memory_layers is not None
        ):
            raise ValueError(f"{self.name}: {self.checkpoint} has no trained memory (released.memory.train=false), "
                             f"but the composition ({self.options.describe()}) runs it; pass memory=false")  # fmt: skip
        self.press = compose(scorer, self.options, f"{self.name}: {self.checkpoint}")
        super().validate()

    @property
    def scorer(self) -> ReleasedScorerPress:
        return self.inner(ReleasedScorerPress)

    @property
    def memory_press(self) -> FastMemoryPress | None:
        return self.inner(FastMemoryPress)

    @property
    def core(self) -> ReleasedModel:
        return self.scorer.core

    @property
    def events(self) -> list:
        return self.scorer.events

    def memory_state(self, layer: int) -> FastState | None:
        m = self.memory_press
        return None if m is None else m.memory_state(layer)

    def aux_breakdown(self) -> dict:
        m = self.memory_press
        return m.aux_breakdown() if m is not None else {"memory_state": 0, **self.scorer.aux_breakdown()}

    def config_dict(self) -> dict:
        out = super().config_dict()
        out.update(applied=self.options.to_dict(), applied_label=self.options.describe())
        return out

    def __repr__(self) -> str:
        ratio = f"budget={self.budget}" if self.budget is not None else f"compression_ratio={self.compression_ratio}"
        over = "" if self.memory is None else f", memory={self.memory!r}"
        return (f"ReleasedCorePress(checkpoint={self.checkpoint!r}, {ratio}, policy={self.policy!r}: "
                f"{self.options.describe()}{over})")  # fmt: skip


def compose(scorer: ReleasedScorerPress, options: PolicyOptions, where: str = "core_released") -> BasePress:
    """The stack for ``options`` around the scorer: the fast memory (outermost) unless the options switch it off.
    Head-wise budgets and the repair pass are refused: a v3 score is defined on one candidate set per layer."""
    if not applies(options):
        raise ValueError(f"{where} is a released artifact (one score per token, the same kept set in every KV head): "
                         f"head_budgets must be 'uniform' and repair false, got {options.describe()!r}")  # fmt: skip
    if options.memory_layers is None or scorer.is_noop:
        return scorer
    return FastMemoryPress(press=scorer, layers=options.memory_layers)


def applies(options: PolicyOptions) -> bool:
    """Whether a composition applies to a released artifact (uniform budgets, no repair pass)."""
    return options.head_budgets == "uniform" and not options.repair


def policy_candidate(artifact: Path, ratio: float, options: PolicyOptions) -> BasePress | None:
    """A policy-stage candidate on a released artifact (``None`` where it does not apply: head-wise budgets, the
    repair pass, or the memory of an artifact whose memory was never trained)."""
    if not applies(options):
        return None
    scorer = ReleasedScorerPress(checkpoint=str(artifact), compression_ratio=ratio)
    if options.memory_layers is not None and not scorer.core.config.memory_trained:
        return None
    return compose(scorer, options)


__all__ = ["FastMemoryLayer", "FastMemoryPress", "ReleasedCorePress", "ReleasedEvent", "ReleasedLayer",
           "ReleasedScorerPress", "applies", "compose", "policy_candidate"]  # fmt: skip
