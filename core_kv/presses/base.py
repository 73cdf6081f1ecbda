"""The press contract: score -> select -> physically evict, installed by a context manager that always unhooks.

A press keeps kvpress's scoring contract so methods port both ways (``../shared/research/kvpress.md`` §1.1)::

    score(module, hidden_states, keys, values, attentions, kwargs) -> (B, Hkv, S)   # higher = keep

and goes beyond it where kvpress users complain (§6 there):

- **Exact per-head budgets with real savings.** :meth:`BasePress.compress` (for a scorer, :meth:`ScorerPress.select`)
  may return a different number of kept positions per KV head; the cache layer is then replaced by a
  :class:`~core_kv.models.cache.RaggedLayer` (each head's tokens contiguous, nothing padded) read by an exact
  per-head attention path, not by fake-key masking.
- **Budgets** as a ``compression_ratio`` in [0, 1) (fraction removed) or an absolute ``budget`` of tokens per head;
  ``protected_sinks`` first and ``protected_recent`` last positions always kept; a budget >= the context is a no-op.
- **When to evict.** By default the first forward on an empty cache (prefill) is compressed and later forwards
  (questions, generated tokens) are not, exactly as kvpress. ``decoding=True`` adds repeated eviction: whenever a
  layer holds more than ``target + decoding_slack`` tokens after a forward it is evicted back to ``target``.
  :meth:`BasePress.chunked_prefill` compresses after every forward (the chunked-prefill driver in
  :mod:`core_kv.pipeline` uses it), so later chunks attend to the compressed past.
- **Readout before W_O.** A press that overrides :meth:`BasePress.readout` gets a forward pre-hook on every
  ``o_proj`` and may add to the concatenated per-head attention output ``(B, T, H*D)`` (CORE's latent memory).
- **Stateful presses** use public extension points, not the private hooks: :meth:`BasePress.install` /
  :meth:`BasePress.uninstall` (extra hooks), :meth:`BasePress.captures_queries` / :meth:`BasePress.queries` (the
  queries of the current forward: one ``q_proj`` capture per forward for the whole stack),
  :meth:`BasePress.before_forward` / :meth:`BasePress.after_forward` (per-forward bookkeeping),
  :attr:`BasePress.evicts`, :meth:`BasePress.eviction_target` and :meth:`BasePress.decode_event` (when and to what
  size to evict), :meth:`BasePress.compress` (what to keep), :meth:`BasePress.evicted` (the phase after selection:
  the final kept set of an event, before the cache is rewritten) and :meth:`BasePress.readout`.
- **Composition by wrapping** (kvpress's ``AdaKVPress(press)``): a :class:`WrapperPress` holds an inner press and
  forwards every extension point to it, so scoring, head-wise allocation (``adakv``), the repair pass
  (``twin_repair``) and compensation (``latent_memory``) stack in any order that makes sense. Only the outermost
  press's hooks run; :meth:`BasePress.evicted` reaches every press of the stack with the *final* kept set, so a
  compensation wrapper outside a repair wrapper writes exactly the entries that leave the cache. The presses of a
  stack share one per-layer state (:attr:`BasePress.layer_state`), through which one piece hands another data (CORE's
  scorer its event to the memory); the budget, protection and decoding are held once, by the innermost press.

Two levels, as kvpress's ``base_press.py`` / ``scorer_press.py``: :class:`BasePress` decides *when* to evict (the
hooks, the budget, the finite-input check, the physical eviction) and asks :meth:`BasePress.compress` *which*
positions to keep; :class:`ScorerPress` answers that from :meth:`ScorerPress.score` (score -> protect -> select), so
most methods override ``score`` alone. Presses register by class statement:
``class SnapKVPress(ScorerPress, name="snapkv")``.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from functools import partial
from typing import ClassVar

import torch
from torch import nn

from core_kv.budget import kept_tokens, protected_split
from core_kv.models.attention import prerope_queries_from_projection, press_layers, ragged_attention
from core_kv.models.cache import RaggedLayer, cache_from_kwargs, check_cache_supported, layer_lengths
from core_kv.presses.install import claim, release
from core_kv.presses.options import check_press_options

PRESSES: dict[str, type[BasePress]] = {}

Kept = torch.Tensor | list[torch.Tensor]
"""Retained cache indices: ``(B, Hkv, k)`` sorted (same count per head) or one sorted 1-D tensor per KV head."""


@dataclass
class BasePress:
    """Base of every press.

    Args:
        compression_ratio: fraction of the KV cache removed, in [0, 1). ``0`` leaves the cache untouched.
        budget: tokens kept per KV head (on average, for per-head methods); overrides ``compression_ratio``.
        protected_sinks: first positions always kept (inside the budget).
        protected_recent: last positions always kept (inside the budget).
        decoding: also evict during decoding/question tokens, whenever a layer exceeds ``target + decoding_slack``.
        decoding_slack: tokens allowed above the target before a decode-time eviction.
    """

    compression_ratio: float = 0.0
    budget: int | None = None
    protected_sinks: int = 0
    protected_recent: int = 0
    decoding: bool = False
    decoding_slack: int = 64

    name: ClassVar[str] = ""
    needs_attentions: ClassVar[bool] = False  # True: requires attn_implementation="eager" (observed attention)

    _mode: str = field(default="auto", init=False, repr=False, compare=False)
    _state: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __init_subclass__(cls, name: str | None = None, **kwargs):
        super().__init_subclass__(**kwargs)
        if name is not None:
            if name in PRESSES:
                raise ValueError(f"press name {name!r} registered twice ({PRESSES[name].__name__}, {cls.__name__})")
            cls.name = name
            PRESSES[name] = cls

    def __post_init__(self):
        check_press_options(self)  # every option's type, from its annotation (core_kv/presses/options.py)
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the bad option."""
        r = self.compression_ratio
        if not isinstance(r, (int, float)) or isinstance(r, bool) or math.isnan(r) or not 0.0 <= r < 1.0:
            raise ValueError(f"compression_ratio must be a fraction removed in [0, 1), got {r!r}")
        if self.budget is not None:
            if isinstance(self.budget, bool) or not isinstance(self.budget, int) or self.budget < 1:
                raise ValueError(f"budget must be a positive number of tokens per head, got {self.budget!r}")
            if r > 0:
                raise ValueError("give either compression_ratio or budget, not both")
        for name in ("protected_sinks", "protected_recent", "decoding_slack"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {v!r}")

    # ------------------------------------------------------------------------------------------------------------
    # What a method overrides

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
        """The positions each KV head keeps at this eviction event (abstract): ``n_kept`` per head (on average, for
        per-head methods), sorted, protected positions included. ``lengths`` ``(Hkv,)`` marks the valid prefixes of a
        right-padded ragged cache (``None``: every head holds all ``S``). :class:`ScorerPress` implements it as
        score -> protect -> select; a press that composes its own selection (TwinKV, TwinRepair) overrides it."""
        raise NotImplementedError(f"{type(self).__name__} must implement compress() (or derive from ScorerPress)")

    def layer_target(self, module: nn.Module, n: int) -> int:
        """Tokens each KV head of this layer keeps (on average) out of ``n``; PyramidKV overrides it per layer."""
        return self.target(n)

    def evicted(
        self,
        module: nn.Module,
        keys: torch.Tensor,
        values: torch.Tensor,
        kept: Kept,
        lengths: torch.Tensor | None = None,
    ) -> None:
        """The phase after selection: called once per eviction event with the *final* kept set (after every wrapper
        of a stack has had its say), before the cache is rewritten. ``keys``/``values`` ``(B, Hkv, S, D)`` are the
        candidates (right-padded when ``lengths`` ``(Hkv,)`` is given); the positions not in ``kept`` are leaving.
        Stateful presses update their bookkeeping here (CORE's scorer its positions, the latent memory its writes)."""

    def readout(self, module: nn.Module, attn_output: torch.Tensor) -> torch.Tensor | None:
        """Optionally replace the pre-W_O attention output ``(B, T, H*D)``; ``None`` leaves it unchanged."""
        return None

    def reads_out(self) -> bool:
        """Whether :meth:`readout` can change anything (then a pre-hook on every ``o_proj`` is installed)."""
        return type(self).readout is not BasePress.readout

    def aux_bytes(self) -> int:
        """Bytes of auxiliary state the method keeps beside the KV payload (e.g. CORE's memory), summed over a wrapped
        stack; read after the prefill (docs/presses.md: eval reports, ``answer_questions`` and the cost benchmarks)."""
        return sum(self.aux_breakdown().values())

    def aux_breakdown(self) -> dict:
        """:meth:`aux_bytes` by part, ``{part: bytes}`` (CORE: the memory state, the scorer's bookkeeping); none by
        default. A wrapper adds its parts to its inner press's."""
        return {}

    # ------------------------------------------------------------------------------------------------------------
    # Extension points for stateful presses (CORE uses them as any press would)

    def install(self, model: nn.Module) -> list:
        """Extra hooks the press needs beyond the attention hooks; returns their handles, which :meth:`__call__`
        removes on exit, whatever happens."""
        return []

    def captures_queries(self) -> bool:
        """Whether a press of the stack reads :meth:`queries` (then one forward hook on every ``q_proj`` captures the
        projection of each forward, for every piece)."""
        return False

    def queries(self, module: nn.Module) -> torch.Tensor:
        """The pre-RoPE queries ``(H, T, D)`` (fp32) of ``module``'s current forward, from the model's own ``q_proj``
        output (q_norm applied as the model applies it; not projected again). One capture per forward serves every
        press of the stack: the projection is kept in the shared per-layer state, converted on the first read and
        dropped when the forward ends. Only while the press is entered, for a press whose :meth:`captures_queries`."""
        st = self._state[module.layer_idx]
        if "queries" not in st:
            st["queries"] = prerope_queries_from_projection(module, st["q_proj"])[0].float()
        return st["queries"]

    def uninstall(self, model: nn.Module) -> None:
        """Undo per-model side effects of :meth:`install` other than the hooks (called on exit, whatever happens)."""

    def before_forward(self, module: nn.Module, hidden_states: torch.Tensor, cache, kwargs: dict) -> None:
        """Called before every attention forward, after the per-layer bookkeeping: ``layer_state[idx]["empty_before"]``
        says whether the layer's cache was empty (a new context)."""

    def after_forward(self, module: nn.Module, hidden_states: torch.Tensor, cache, kwargs: dict) -> None:
        """Called after every attention forward of a press that :attr:`evicts`, before the eviction decision."""

    @property
    def evicts(self) -> bool:
        """Whether the press can evict at all in this configuration (the no-op press without decoding cannot)."""
        return not (self.is_noop and not self.decoding)

    def eviction_target(self, module: nn.Module, seen: int, prefill: bool) -> int:
        """Tokens per KV head an event keeps after a forward: :meth:`layer_target` of the ``seen`` tokens at a
        prefill/chunk event; ``budget`` or :meth:`target` of them for a decode-time event (``decoding=True``), which
        triggers once the layer holds more than this + ``decoding_slack``."""
        if prefill:
            return self.layer_target(module, seen)
        return self.budget if self.budget is not None else self.target(seen)

    def decode_event(self, module: nn.Module, seen: int, lengths: torch.Tensor) -> int | None:
        """With ``decoding=True``, after a forward that is not a prefill: the tokens per KV head a decode-time event
        keeps now, or ``None`` for no event. ``lengths`` ``(Hkv,)`` are the layer's cached entries per KV head.
        Default: :meth:`eviction_target` once the layer holds more than that + ``decoding_slack`` (the average head:
        per-head allocation routinely puts the longest head above it, which would re-evict on every step). The CORE
        paper's protocol (:mod:`~core_kv.presses.paper_protocol`) overrides it: every 128 forwards, to the prefill
        budget."""
        base = self.eviction_target(module, seen, prefill=False)
        if int(lengths.sum()) <= lengths.numel() * (base + self.decoding_slack):
            return None
        return base

    # ------------------------------------------------------------------------------------------------------------
    # Budget arithmetic

    def target(self, n: int) -> int:
        """Tokens kept per head out of ``n``: ``min(budget, n)`` or ``floor(n (1 - ratio))``, at least 1."""
        if n <= 0:
            raise ValueError("cannot compress an empty context")
        if self.budget is not None:
            return min(self.budget, n)
        return kept_tokens(n, self.compression_ratio)

    def protected(self, n_kept: int) -> tuple[int, int]:
        """``(s, w)``: protected sinks and recent positions inside a budget of ``n_kept``."""
        return protected_split(n_kept, self.protected_sinks, self.protected_recent)

    @property
    def is_noop(self) -> bool:
        return self.budget is None and self.compression_ratio == 0.0

    # ------------------------------------------------------------------------------------------------------------
    # The eviction event

    def check_inputs(self, module: nn.Module, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Raise ``ValueError`` naming the press and layer when the cache about to be compressed is not finite.

        Every eviction event checks it, so NaN/Inf never pass silently through a press whose selection ignores the
        tensors (``streaming_llm``, ``random``) or that selects by its own rules (``twinkv``)."""
        for what, t in (("keys", keys), ("values", values)):
            if not torch.isfinite(t).all():
                raise ValueError(
                    f"{type(self).__name__} received NaN/Inf cached {what} to compress (layer {module.layer_idx}): "
                    "the model's hidden states are not finite; check the model's weights, dtype and inputs"
                )

    # ------------------------------------------------------------------------------------------------------------
    # Hooks

    def _pre_hook(self, module: nn.Module, args, kwargs):
        cache = cache_from_kwargs(kwargs)
        if cache is None:
            raise ValueError("press hooks need a KV cache: call the model with use_cache=True / past_key_values")
        idx = module.layer_idx
        layer = cache.layers[idx] if idx < len(cache.layers) else None
        empty = (
            layer is None
            or not layer.is_initialized
            or (not isinstance(layer, RaggedLayer) and layer.get_seq_length() == 0)
        )
        st = self._state.setdefault(idx, {"seen": 0})
        if empty:
            st["seen"] = 0
        st["empty_before"] = empty
        self.before_forward(module, kwargs.get("hidden_states", args[0] if args else None), cache, kwargs)

    def _post_hook(self, module: nn.Module, args, kwargs, output):
        try:
            return self._evict_if_due(module, args, kwargs, output)
        finally:  # the forward's query capture is not kept beyond it
            st = self._state.get(module.layer_idx, {})
            st.pop("q_proj", None)
            st.pop("queries", None)

    def _query_hook(self, attn: nn.Module, proj: nn.Module, args, output: torch.Tensor) -> None:
        st = self._state.get(attn.layer_idx)
        if st is not None:  # the raw projection; :meth:`queries` converts it once, on the first read
            st["q_proj"] = output
            st.pop("queries", None)

    def _evict_if_due(self, module: nn.Module, args, kwargs, output):
        hidden_states = kwargs.get("hidden_states", args[0] if args else None)
        cache = cache_from_kwargs(kwargs)
        idx = module.layer_idx
        st = self._state[idx]
        st["seen"] += hidden_states.shape[1]
        if not self.evicts:
            return output
        self.after_forward(module, hidden_states, cache, kwargs)
        layer = cache.layers[idx]
        lengths = layer_lengths(layer)
        size = int(lengths.max())
        if self._mode == "prefill" or st["empty_before"]:
            # the budget is a share of every token this layer has seen (chunked prefill: of the context so far),
            # not of the already-compressed cache plus the new chunk
            n_kept = min(self.eviction_target(module, st["seen"], prefill=True), size)
            if n_kept >= size and int(lengths.min()) == size:
                return output
        elif self.decoding:
            base = self.decode_event(module, st["seen"], lengths)
            if base is None:
                return output
            n_kept = min(base, size)
        else:
            return output
        check_cache_supported(cache, idx)
        if isinstance(layer, RaggedLayer):
            keys, values, _ = layer.padded()
            self.check_inputs(module, keys, values)  # padding is zeros
            kept = self.compress(module, hidden_states, keys, values, None, kwargs, n_kept, lengths=lengths)
        else:
            keys, values = layer.keys, layer.values
            attentions = output[1] if isinstance(output, tuple) and len(output) > 1 else None
            self.check_inputs(module, keys, values)
            kept = self.compress(module, hidden_states, keys, values, attentions, kwargs, n_kept)
            lengths = None
        self.evicted(module, keys, values, kept, lengths)
        self._apply(cache, idx, keys, values, kept)
        return output

    @staticmethod
    def _apply(cache, idx: int, keys: torch.Tensor, values: torch.Tensor, kept: Kept) -> None:
        if isinstance(kept, torch.Tensor):
            gather = kept[..., None].expand(-1, -1, -1, keys.shape[-1])
            new = (keys.gather(2, gather).contiguous(), values.gather(2, gather).contiguous())
        else:
            if keys.shape[0] != 1:
                raise ValueError("per-head budgets need batch size 1")
            new = RaggedLayer.from_kept(keys, values, kept)
        if isinstance(new, RaggedLayer):
            cache.layers[idx] = new
        else:
            layer = cache.layers[idx]
            if isinstance(layer, RaggedLayer):  # back to rectangular
                from transformers.cache_utils import DynamicLayer

                layer = DynamicLayer()
                layer.lazy_initialization(*new)
                cache.layers[idx] = layer
            layer.keys, layer.values = new

    def _readout_hook(self, module: nn.Module, args):
        out = self.readout(module.__dict__["_core_kv_attn"], args[0])
        return None if out is None else (out, *args[1:])

    @contextmanager
    def __call__(self, model: nn.Module):
        """Install the hooks on every attention layer of ``model``; they are removed on exit, whatever happens.

        Sliding-window layers of a hybrid model (Gemma 2/3) get no hooks: they keep their window (the rule lives in
        :func:`~core_kv.models.attention.press_layers`; ``docs/presses.md`` "Sliding-window layers")."""
        layers = press_layers(model)
        if self.needs_attentions and model.config._attn_implementation != "eager":
            raise ValueError(
                f"{type(self).__name__} scores from observed attention weights: load the model with "
                "attn_implementation='eager'"
            )
        claim(self, [layer.self_attn for layer in layers])  # refuses a second press on this model
        handles = []
        # per-layer state (tokens seen) survives re-entry: the pipeline re-enters the press to answer questions on
        # the cache it compressed; it is reset by the first forward on an empty cache
        self._mode = "auto"
        overrides_readout = self.reads_out()
        try:
            handles += self.install(model)
            captures = self.captures_queries()
            for layer in layers:
                attn = layer.self_attn
                handles.append(attn.register_forward_pre_hook(self._pre_hook, with_kwargs=True))
                handles.append(attn.register_forward_hook(self._post_hook, with_kwargs=True))
                if captures:  # one capture of the queries per forward, for every press of the stack
                    proj = attn.qkv_proj if hasattr(attn, "qkv_proj") else attn.q_proj
                    handles.append(proj.register_forward_hook(partial(self._query_hook, attn)))
                if overrides_readout:
                    attn.o_proj.__dict__["_core_kv_attn"] = attn
                    handles.append(attn.o_proj.register_forward_pre_hook(self._readout_hook))
            self.on_enter(model)
            with ragged_attention(model):
                yield self
        finally:
            for h in handles:
                h.remove()
            for layer in layers:
                layer.self_attn.o_proj.__dict__.pop("_core_kv_attn", None)
            self.uninstall(model)
            self._mode = "auto"
            release(self, [layer.self_attn for layer in layers])

    def on_enter(self, model: nn.Module) -> None:
        """Per-model setup when the press is entered (e.g. checking a checkpoint matches the model)."""

    def share_state(self, state: dict | None = None) -> None:
        """Keep the per-layer bookkeeping (tokens seen, per-press extras) in ``state``; ``None`` starts it afresh.

        A wrapper press that runs an inner press on its own hooks (AdaKV, TwinRepair) calls
        ``inner.share_state(self_state)`` or ``inner.share_state()`` in its :meth:`on_enter`, instead of writing the
        inner press's private fields.
        """
        self._state = {} if state is None else state

    @property
    def layer_state(self) -> dict:
        """The per-layer bookkeeping, ``{layer_idx: {"seen": tokens, ...}}`` (read it, share it with
        :meth:`share_state`)."""
        return self._state

    @contextmanager
    def chunked_prefill(self, tokens: int | None = None):
        """Compress after every forward in this block (each chunk of a chunked prefill). ``tokens``: the context's
        length when known (:func:`core_kv.pipeline.prefill` declares it), for a press whose composition depends on it
        (``core``: its length band); the others ignore it."""
        previous, self._mode = self._mode, "prefill"
        try:
            yield
        finally:
            self._mode = previous

    def config_dict(self) -> dict:
        """The press's options, for results folders (an option hidden from the repr is an object handed in, such as
        CORE's loaded artifact, named by another option: left out)."""
        out = {"name": self.name}
        for f in fields(self):
            if f.init and f.repr:
                v = getattr(self, f.name)
                out[f.name] = v.config_dict() if isinstance(v, BasePress) else v
        return out


HELD = ("compression_ratio", "budget", "protected_sinks", "protected_recent", "decoding", "decoding_slack")
"""The values a stack holds once, on its innermost press: a :class:`WrapperPress` reads and writes them there."""


@dataclass
class WrapperPress(BasePress):
    """A press around an inner press (kvpress's ``AdaKVPress(press)`` pattern): the stack's hooks are this press's,
    and every extension point the wrapper does not change is forwarded to the inner press (which shares this press's
    per-layer bookkeeping), so wrappers stack. Subclasses override what they change: :meth:`compress` (what to keep),
    :meth:`evicted` (call ``super().evicted(...)`` to pass the final kept set on), :meth:`readout`,
    :meth:`eviction_target`.

    The budget, the protected positions and the decoding schedule (:data:`HELD`) are held once, by the innermost
    press: a wrapper's ``compression_ratio`` etc. are properties that read and write the inner press's (kvpress's
    ``AdaKVPress.compression_ratio``). A value given to the wrapper (``None`` = not given) is handed to the inner
    press: to its constructor when ``press`` is a registered name (with ``press_options``), written into an instance
    that holds its default, and refused when the instance holds another. A wrapper that keeps a value of its own
    (TwinRepair's donor protection) declares it as a field again.

    Args:
        press: The inner press, an instance or a registered name.
        press_options: Options of a press given by name.
    """

    compression_ratio: float | None = None
    protected_sinks: int | None = None
    protected_recent: int | None = None
    decoding: bool | None = None
    decoding_slack: int | None = None
    press: BasePress | str = "knorm"
    press_options: dict = field(default_factory=dict)

    def held(self) -> tuple[str, ...]:
        """The :data:`HELD` values this wrapper delegates (those it does not redeclare as its own fields)."""
        return tuple(n for n in HELD if isinstance(getattr(type(self), n, None), property))

    def validate(self) -> None:
        given = {k: v for k, v in (self.__dict__.get("_given") or {}).items() if v is not None and k in self.held()}
        if isinstance(self.press, str):
            if self.press == self.name:
                raise ValueError(f"{self.name} cannot wrap itself")
            if not isinstance(self.press_options, dict):
                raise ValueError(f"{self.name}: press_options must be a mapping, got {self.press_options!r}")
            both = {k for k in set(given) & set(self.press_options) if given[k] != self.press_options[k]}
            if both:
                raise ValueError(f"{self.name}: {sorted(both)} given both to the wrapper and in press_options "
                                 "(differently); set them once")  # fmt: skip
            self.press = build_press(self.press, **{**given, **self.press_options})
        elif isinstance(self.press, BasePress):
            if self.press_options:
                raise ValueError(f"{self.name}: press_options only apply to a press given by name")
            if type(self.press) is type(self):
                raise ValueError(f"{self.name} cannot wrap itself (another {self.name})")
            _hand_down(self.name, self.press, given)
        else:
            raise ValueError(
                f"{self.name}: press must be a registered name or a press, got {type(self.press).__name__}"
            )
        self.__dict__["_given"] = None  # from now on the held values are the inner press's
        super().validate()

    def inner(self, cls: type[BasePress]) -> BasePress | None:
        """The first press of the stack (this one included) that is a ``cls``, else ``None``."""
        press = self
        while press is not None:
            if isinstance(press, cls):
                return press
            press = press.press if isinstance(press, WrapperPress) else None
        return None

    @property
    def needs_attentions(self) -> bool:  # type: ignore[override]
        return self.press.needs_attentions

    # budgets and schedule: the inner press's
    def layer_target(self, module: nn.Module, n: int) -> int:
        return self.press.layer_target(module, n)

    def eviction_target(self, module: nn.Module, seen: int, prefill: bool) -> int:
        return self.press.eviction_target(module, seen, prefill)

    def protected(self, n_kept: int) -> tuple[int, int]:
        return self.press.protected(n_kept)

    @property
    def evicts(self) -> bool:
        return self.press.evicts or BasePress.evicts.fget(self)

    def compress(self, module, hidden_states, keys, values, attentions, kwargs, n_kept, lengths=None) -> Kept:
        return self.press.compress(module, hidden_states, keys, values, attentions, kwargs, n_kept, lengths=lengths)

    # the rest of the contract, forwarded
    def evicted(self, module, keys, values, kept, lengths=None) -> None:
        self.press.evicted(module, keys, values, kept, lengths)

    def readout(self, module: nn.Module, attn_output: torch.Tensor) -> torch.Tensor | None:
        return self.press.readout(module, attn_output)

    def reads_out(self) -> bool:
        return type(self).readout is not WrapperPress.readout or self.press.reads_out()

    def aux_breakdown(self) -> dict:
        return self.press.aux_breakdown()

    def install(self, model: nn.Module) -> list:
        return self.press.install(model)

    def captures_queries(self) -> bool:
        return self.press.captures_queries()

    def uninstall(self, model: nn.Module) -> None:
        self.press.uninstall(model)

    def before_forward(self, module, hidden_states, cache, kwargs) -> None:
        self.press.before_forward(module, hidden_states, cache, kwargs)

    def after_forward(self, module, hidden_states, cache, kwargs) -> None:
        self.press.after_forward(module, hidden_states, cache, kwargs)

    def on_enter(self, model: nn.Module) -> None:
        self.press.share_state(self.layer_state)  # the inner press sees the wrapper's per-layer bookkeeping
        self.press.on_enter(model)

    @contextmanager
    def chunked_prefill(self, tokens: int | None = None):
        with super().chunked_prefill(tokens), self.press.chunked_prefill(tokens):
            yield


def _held_property(name: str) -> property:
    def get(self):
        given = self.__dict__.get("_given", {})
        if given is not None:  # being built: the value given to this wrapper (None = not given)
            return given.get(name)
        return getattr(self.press, name)

    def put(self, value):
        given = self.__dict__.get("_given", {})
        if given is not None:
            self.__dict__["_given"] = {**given, name: value}
        elif value is None and name != "budget":
            raise ValueError(f"{self.name}: {name} cannot be unset (it is the wrapped press's)")
        else:
            setattr(self.press, name, value)

    return property(get, put, doc=f"The wrapped press's ``{name}`` (held once, by the innermost press).")


for _name in HELD:
    setattr(WrapperPress, _name, _held_property(_name))


def _holds_default(press: BasePress, name: str) -> bool:
    """Whether the press that holds ``name`` for ``press`` (the innermost, through delegating wrappers) holds the
    default of its option."""
    while isinstance(press, WrapperPress) and name in press.held():
        press = press.press
    default = {f.name: f.default for f in fields(press)}[name]
    return getattr(press, name) == default


def _hand_down(where: str, inner: BasePress, given: dict) -> None:
    """Write the values ``given`` to a wrapper into the wrapped press ``inner``, which holds them; refuse a value that
    contradicts one ``inner`` was given. A no-op budget and ``decoding=False`` count as not given."""
    ratio, budget = given.get("compression_ratio", 0.0), given.get("budget")
    if ratio or budget is not None:
        if inner.is_noop:
            inner.compression_ratio, inner.budget = ratio, budget
        elif (inner.compression_ratio, inner.budget) != (ratio, budget):
            raise ValueError(
                f"{where} budget (ratio={ratio}, budget={budget}) differs from the wrapped press's "
                f"(ratio={inner.compression_ratio}, budget={inner.budget}); set one of them"
            )
    for name in ("decoding", "decoding_slack", "protected_sinks", "protected_recent"):
        value = given.get(name)
        if value is None or value is False or value == getattr(inner, name):
            continue
        if not _holds_default(inner, name):
            raise ValueError(f"{where}: {name}={value!r} differs from the wrapped press's ({getattr(inner, name)!r}); "
                             "set it on one of them")  # fmt: skip
        setattr(inner, name, value)


@dataclass
class ScorerPress(BasePress):
    """A press defined by its :meth:`score` (kvpress's ``ScorerPress``): at an eviction event :meth:`compress` scores
    every cached position, forces the protected sinks/recent positions in (and a ragged cache's padding out) and
    keeps what :meth:`select` picks, per-head top-``n_kept`` by default (AdaKV overrides it for per-head budgets)."""

    def score(
        self,
        module: nn.Module,
        hidden_states: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        attentions: torch.Tensor | None,
        kwargs: dict,
    ) -> torch.Tensor:
        """Importance of every cached position, ``(B, Hkv, S)``, higher = keep (abstract)."""
        raise NotImplementedError(f"{type(self).__name__} must implement score() (abstract)")

    def pooled_scores(self, module: nn.Module, scores: torch.Tensor) -> torch.Tensor:
        """The scores ``(B, Hkv, S)`` on one scale across the KV heads of a layer, for a head-wise allocation (AdaKV)
        to compare; the scores themselves by default (CORE's scorer: its calibrated distribution)."""
        return scores

    def select(self, scores: torch.Tensor, n_kept: int, module: nn.Module, kwargs: dict) -> Kept:
        """Turn scores ``(B, Hkv, S)`` into retained indices; per-head top-``n_kept`` by default."""
        idx = scores.topk(n_kept, dim=-1).indices
        return idx.sort(dim=-1).values

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
        """Score, protect, select. ``lengths`` ``(Hkv,)`` marks valid prefixes of a right-padded ragged cache.

        Scorers find the valid length of every head in ``kwargs["kv_lengths"]`` ``(Hkv,)`` (all ``S`` for a
        rectangular cache), so statistics over the cache (means, windows) can ignore the padding.
        """
        s = keys.shape[2]
        lens = torch.full((keys.shape[1],), s, device=keys.device) if lengths is None else lengths.to(keys.device)
        kwargs = {**kwargs, "kv_lengths": lens}
        scores = self.score(module, hidden_states, keys, values, attentions, kwargs).float()
        if scores.shape != keys.shape[:3]:
            raise ValueError(
                f"{type(self).__name__}.score returned {tuple(scores.shape)}, expected {tuple(keys.shape[:3])}"
            )
        if torch.isnan(scores).any():
            raise ValueError(f"{type(self).__name__}.score produced NaN scores (layer {module.layer_idx})")
        pos = torch.arange(s, device=scores.device)
        sinks, recent = self.protected(n_kept)
        invalid = pos[None, :] >= lens[:, None]  # (Hkv, S)
        prot = (pos[None, :] < sinks) | ((pos[None, :] >= lens[:, None] - recent) & ~invalid)
        scores = scores.masked_fill(prot[None], float("inf")).masked_fill(invalid[None], float("-inf"))
        return self.select(scores, n_kept, module, kwargs)


def build_press(name: str, **kwargs) -> BasePress:
    """Instantiate a registered press by name; unknown names and options raise ``ValueError``. Every built-in press is
    registered: importing this module runs the package's ``__init__`` first, which imports each press's file."""
    if name not in PRESSES:
        raise ValueError(f"unknown press {name!r}; registered: {', '.join(sorted(PRESSES))}")
    cls = PRESSES[name]
    valid = {f.name for f in fields(cls) if f.init}
    unknown = set(kwargs) - valid
    if unknown:
        raise ValueError(f"press {name!r} has no option(s) {sorted(unknown)}; options: {sorted(valid)}")
    return cls(**kwargs)
