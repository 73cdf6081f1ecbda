"""``core``: a CORE artifact run as its inference policy says — the composition of CORE's pieces for the ratio.

Paper: Liu et al., 2026, "One Distribution, Two Channels: Coverage-Calibrated KV Retention and Compensation"
(``../shared/papers/002_8a6c3448532074fc.txt``); as this project builds it: ``../shared/design/CORE.md``.

The pieces are presses, composed by wrapping (kvpress's ``AdaKVPress(press)`` pattern)::

    press = CoreScorerPress(checkpoint)                          # retention: Top-B of the indexer's scores
    press = AdaKVPress(press, pool="score" | "output")           # policy head_budgets="adaptive" (head_pool)
    press = HeadSharedPress(press)                               # or head_budgets="shared": one set for every head
    press = TwinRepairPress(press)                               # policy repair=True
    press = LatentMemoryPress(press)                             # policy memory (outermost: it writes the final
                                                                 # evicted set, after AdaKV and the repair)

The paper's press is the scorer inside the memory (:data:`~core_kv.policy.PAPER`). An artifact records which
composition to run per (validated context length, compression-ratio band) (:class:`~core_kv.policy.InferencePolicy`),
chosen by ``train.py``'s policy stage on validation prompts the pipeline generates itself; ``build_press("core",
checkpoint=..., compression_ratio=r)`` applies, at each prefill, the band of r at the validated length nearest to the
context's, ``policy="paper"`` the paper's press, and an explicit option
(``head_budgets``, ``head_pool``, ``repair``, ``memory``) overrides the policy — the override shows in the press's repr
and in its :meth:`config_dict` (results folders).

Deviations from the paper, each measured (docs/method.md): head-wise budgets and value-aware head pooling, the repair
pass on CORE's retained sets, and the memory switched off (or kept in some layers) where the validation data says it
does not help.
"""

from __future__ import annotations

import warnings
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from core_kv.core_model import CoreModel
from core_kv.policy import PAPER, InferencePolicy, PolicyOptions
from core_kv.presses.adakv import AdaKVPress
from core_kv.presses.base import HELD, BasePress, WrapperPress
from core_kv.presses.core_scorer import CoreScorerPress, artifact_at
from core_kv.presses.head_shared import HeadSharedPress
from core_kv.presses.latent_memory import LatentMemoryPress
from core_kv.presses.twin_repair import TwinRepairPress

POLICIES = ("artifact", "paper")
OVERRIDES = ("head_budgets", "head_pool", "repair", "memory")


@dataclass(repr=False)
class CorePress(WrapperPress, name="core"):
    """CORE from a trained artifact, composed as the artifact's inference policy says for the compression ratio and
    the context's length.

    ``build_press("core", checkpoint="checkpoints/core-smollm2/final", compression_ratio=0.75)``. The press is the
    factory of its stacks: it loads the artifact once, chooses the composition of every length band the policy was
    validated at (the band of the ratio there, with the overrides) and builds each stack once around one scorer,
    handing each piece what it needs (:func:`compose`: the scorer the artifact, the memory ``core.memory``); equal
    compositions share a stack. A context's length is known at its prefill: the first forward on an empty cache (or
    the length a chunked prefill declares, :meth:`chunked_prefill`) selects the stack of the validated length nearest
    to it (:meth:`~core_kv.policy.InferencePolicy.length_band`), and the press runs that stack (``press``) until the
    next context, so a prefill and the decode that follows it run one composition. A context outside the validated
    lengths (:meth:`~core_kv.policy.InferencePolicy.outside`: more than a factor 2 shorter than the shortest or longer
    than the longest, for a one-length policy too) runs the nearest band with one warning per press and length band.
    The ratio, budget, protected positions and ``decoding`` are the scorer's, shared by the stacks (a
    :class:`~core_kv.presses.base.WrapperPress` holds none). Without a checkpoint only the no-op (ratio 0) is allowed;
    the artifact is checked against the model when the press is entered (refuses another base model).

    Args:
        checkpoint: Folder of a :class:`~core_kv.core_model.CoreModel` artifact (``config.json`` + ``model.safetensors``).
        policy: ``artifact`` (the recorded policy's band for ``compression_ratio`` at the context's length; the
            paper's press if the artifact records none) or ``paper`` (uniform budgets, memory in every layer).
        head_budgets, head_pool, repair, memory: Override the policy at every length (``None`` = the policy's): see
            :class:`~core_kv.policy.PolicyOptions`.
        protected_sinks, protected_recent, calibrated, allocation: The scorer's
            (:class:`~core_kv.presses.core_scorer.CoreScorerPress`; ``None`` protection = the artifact's).
        write_rule, budget_matched, memory_dtype: The memory's
            (:class:`~core_kv.presses.latent_memory.LatentMemoryPress`), where a composition has one
            (``write_rule=None``: the artifact's).

    Attributes:
        served: The composition applied per validated length (``{2048: options}``; ``{None: options}`` for the
            paper's press or a policy that records no length).
        length: The validated length whose composition runs now (the shortest before the first prefill).
        options: The composition that runs now (``served[length]``: the policy's band with the overrides).
        core: The artifact, loaded once (``None`` without a checkpoint).
        scorer: The CORE scorer at the bottom of every stack (its ``events`` log the last context's eviction events).
        memory_press: The memory at the top of the stack that runs now, or ``None``.
    """

    checkpoint: str | None = None
    policy: str = "artifact"
    head_budgets: str | None = None
    head_pool: str | None = None
    repair: bool | None = None
    memory: bool | str | None = None
    calibrated: bool = True
    allocation: str = "indexer"
    write_rule: str | None = None
    budget_matched: bool = False
    memory_dtype: str | None = None
    press: BasePress | None = field(default=None, init=False)
    press_options: dict = field(default_factory=dict, init=False)

    served: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    length: int | None = field(default=None, init=False, repr=False, compare=False)
    core: CoreModel | None = field(default=None, init=False, repr=False, compare=False)
    scorer: CoreScorerPress | None = field(default=None, init=False, repr=False, compare=False)
    _lookup: InferencePolicy | None = field(default=None, init=False, repr=False, compare=False)
    _stacks: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _warned: set = field(default_factory=set, init=False, repr=False, compare=False)
    _declared: int | None = field(default=None, init=False, repr=False, compare=False)

    def validate(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"{self.name}: policy must be one of {POLICIES}, got {self.policy!r}")
        if self.core is None and self.checkpoint is not None:
            self.core = artifact_at(self.checkpoint, self.name)  # the one load of the stack
        core = self.core
        held = {n: getattr(self, n) for n in HELD if getattr(self, n) is not None}  # given here, held by the scorer
        self.scorer = CoreScorerPress(core=core, checkpoint=self.checkpoint, calibrated=self.calibrated,
                                      allocation=self.allocation, **held)  # fmt: skip
        ratio = self.scorer.compression_ratio if self.scorer.budget is None else None
        self._lookup = core.policy() if self.policy == "artifact" and core is not None else None
        bases = {None: PAPER} if self._lookup is None else {lb.length: lb.band(ratio).options
                                                             for lb in self._lookup.lengths}  # fmt: skip
        given = self.overrides()
        if given.get("head_budgets") in ("uniform", "shared") and "head_pool" not in given:
            given["head_pool"] = "score"  # uniform and shared budgets pool nothing across heads
        self.served = {}
        for length, base in bases.items():
            try:
                options = PolicyOptions.from_dict({**base.to_dict(), **given}, f"{self.name}")
            except ValueError as e:
                raise ValueError(f"{e} (policy {base.describe()!r} with overrides {given})") from None
            if core is not None:  # a memory layer list names layers of the artifact's base model
                options.check_layers(core.config.num_layers, f"{self.name}: {self.checkpoint}")
            self.served[length] = options
        memory_options = (self.write_rule, self.budget_matched, self.memory_dtype)
        if all(o.memory is False for o in self.served.values()) and memory_options != (None, False, None):
            raise ValueError(f"{self.name}: write_rule, budget_matched and memory_dtype apply to the memory, which "
                             f"this composition ({self.options_label()}) does not run")  # fmt: skip
        self._stacks = {}
        for options in self.served.values():
            if options not in self._stacks:
                self._stacks[options] = compose(self.scorer, options, *memory_options)
        self._use(next(iter(self.served)))
        super().validate()

    # ------------------------------------------------------------------------------------------------------------
    # The composition of the context's length band

    def _use(self, length: int | None) -> None:
        self.length = length
        self.press = self._stacks[self.served[length]]

    def composition(self, tokens: int) -> PolicyOptions:
        """The composition a context of ``tokens`` tokens runs (a lookup: nothing is selected, nothing warned)."""
        return self.options if self._lookup is None else self.served[self._lookup.length_band(tokens).length]

    def at_length(self, tokens: int) -> BasePress:
        """Select (and return) the stack for a context of ``tokens`` tokens: the composition of the nearest validated
        length; outside the validated lengths, warn once per length band."""
        if self._lookup is None:
            return self.press
        band = self._lookup.length_band(tokens)
        if self._lookup.outside(tokens) and band.length not in self._warned:
            self._warned.add(band.length)
            lengths = ", ".join(f"{n:,}" for n in self._lookup.validated_lengths)
            warnings.warn(
                f"{self.name}: a context of {tokens:,} tokens is outside the lengths the inference policy of "
                f"{self.checkpoint} was validated at ({lengths} tokens): it runs the band validated at {band.length:,} "
                f"tokens ({self.served[band.length].describe()}); validate at this length to serve it "
                "(train.py policy.lengths)",
                stacklevel=2,
            )
        self._use(band.length)
        return self.press

    def before_forward(self, module: nn.Module, hidden_states: torch.Tensor, cache, kwargs: dict) -> None:
        if self._state[module.layer_idx]["empty_before"]:  # a new context: every layer of its first forward agrees
            self.at_length(self._declared if self._declared is not None else hidden_states.shape[1])
        super().before_forward(module, hidden_states, cache, kwargs)

    @contextmanager
    def chunked_prefill(self, tokens: int | None = None):
        """Compress after every chunk; ``tokens`` (the context's length, which :func:`core_kv.pipeline.prefill`
        declares) chooses the length band at the first chunk (without it: the first chunk's length)."""
        self._declared = tokens
        try:
            with BasePress.chunked_prefill(self, tokens), ExitStack() as stack:
                for s in self._stacks.values():
                    stack.enter_context(s.chunked_prefill(tokens))
                yield
        finally:
            self._declared = None

    # every stack's hooks are installed (a later context may run another one); today's pieces install none of their own
    def install(self, model: nn.Module) -> list:
        return [h for s in self._stacks.values() for h in s.install(model)]

    def uninstall(self, model: nn.Module) -> None:
        for s in self._stacks.values():
            s.uninstall(model)

    def captures_queries(self) -> bool:
        return any(s.captures_queries() for s in self._stacks.values())

    def reads_out(self) -> bool:
        return any(s.reads_out() for s in self._stacks.values())

    def on_enter(self, model: nn.Module) -> None:
        for s in self._stacks.values():
            s.share_state(self.layer_state)  # every stack sees this press's per-layer bookkeeping
            s.on_enter(model)

    # ------------------------------------------------------------------------------------------------------------

    @property
    def options(self) -> PolicyOptions:
        """The composition that runs now."""
        return self.served[self.length]

    @property
    def memory_press(self) -> LatentMemoryPress | None:
        """The memory at the top of the stack that runs now, or ``None``."""
        return self.press if isinstance(self.press, LatentMemoryPress) else None

    @property
    def events(self) -> list:
        return self.scorer.events

    def memory_state(self, layer: int):
        m = self.memory_press
        return None if m is None else m.memory_state(layer)

    def aux_breakdown(self) -> dict:
        return {"memory_state": 0, **self.press.aux_breakdown()}

    def overrides(self) -> dict:
        """The options given explicitly over the policy."""
        return {k: getattr(self, k) for k in OVERRIDES if getattr(self, k) is not None}

    def selection_mismatch(self) -> str | None:
        """``"trained per_head, served shared"`` when the composition serves another selection than the one the
        artifact's indexer and memory were trained under (``train.py``'s ``selection``), else ``None``."""
        if self.core is None:
            return None
        trained = self.core.config.trained_selection
        served = "shared" if self.options.head_budgets == "shared" else "per_head"
        return None if trained == served else f"trained {trained}, served {served}"

    def options_label(self) -> str:
        """The compositions served: ``shared, memory off (validated at 2048 tokens)``, or per validated length
        (``1024 tokens: ...; 4096 tokens: ... (running)``) when they are several."""
        if len(self.served) == 1:
            ((length, options),) = self.served.items()
            return options.describe() + ("" if length is None else f" (validated at {length} tokens)")
        return "; ".join(f"{n} tokens: {o.describe()}" + (" (running)" if n == self.length else "")
                         for n, o in self.served.items())  # fmt: skip

    def config_dict(self) -> dict:
        """The options, the composition running now (``applied``) and, with several length bands, each one's
        (``served``: a results folder's cell runs every context at one length band per context)."""
        out = super().config_dict()
        out.update(applied=self.options.to_dict(), applied_label=self.options.describe(), overrides=self.overrides())
        if len(self.served) > 1:  # one length band: the dict of before lengths (results folders stay matched)
            out["served"] = [{"length": n, "applied": o.to_dict(), "applied_label": o.describe()}
                             for n, o in self.served.items()]  # fmt: skip
        if self.core is not None:
            out["trained_selection"] = self.core.config.trained_selection
        return out

    def __repr__(self) -> str:
        over = self.overrides()
        ratio = f"budget={self.budget}" if self.budget is not None else f"compression_ratio={self.compression_ratio}"
        mismatch = self.selection_mismatch()
        return (
            f"CorePress(checkpoint={self.checkpoint!r}, {ratio}, policy={self.policy!r}: {self.options_label()}"
            + (f" ({mismatch})" if mismatch else "")
            + (f", overrides={over}" if over else "")
            + f"; {stack_shape(self.press)})"
        )

    @classmethod
    def from_pretrained(cls, path, **options) -> CorePress:
        """Load the artifact at ``path`` (offline) into a press; ``options`` are the press's other fields."""
        return cls(checkpoint=str(path), **options)


def stack_shape(press: BasePress) -> str:
    """The classes of a stack, outermost first: ``LatentMemoryPress(TwinRepairPress(CoreScorerPress))``."""
    inner = press.press if isinstance(press, WrapperPress) else None
    return type(press).__name__ + ("" if inner is None else f"({stack_shape(inner)})")


def compose(
    scorer: CoreScorerPress,
    options: PolicyOptions,
    write_rule: str | None = None,
    budget_matched: bool = False,
    memory_dtype: str | None = None,
) -> BasePress:
    """The stack for ``options`` around ``scorer`` (which holds the artifact, the budget and the protected
    positions): AdaKV (or the head-shared selection), then the repair pass, then the memory (outermost), handed the
    artifact's memory and (``write_rule=None``) its write rule."""
    press: BasePress = scorer
    if options.head_budgets == "shared":
        press = HeadSharedPress(press=press)
    if options.head_budgets == "adaptive":
        press = AdaKVPress(
            press=press,
            alpha_safeguard=options.alpha_safeguard,
            pool=options.head_pool,
            pool_epsilon=options.pool_epsilon,
        )
    if options.repair:  # donors: CORE's own protected positions (the scorer's), not the pass's defaults
        press = TwinRepairPress(press=press, protected_sinks=scorer.protected_sinks,
                                protected_recent=scorer.protected_recent, threshold=options.repair_threshold)  # fmt: skip
    if options.memory_layers is not None and not scorer.is_noop:
        core = scorer.core
        press = LatentMemoryPress(press=press, memory=core.memory, write_rule=write_rule or core.config.write_rule,
                                  layers=options.memory_layers, budget_matched=budget_matched,
                                  memory_dtype=memory_dtype)  # fmt: skip
    return press


@dataclass(repr=False)
class CoreEAPress(CorePress, name="core_ea"):
    """``CORE_EA`` (paper Table 13): ExpectedAttention scores replace the indexer's allocation; the paper's press."""

    policy: str = "paper"
    allocation: str = "expected_attention"


@dataclass(repr=False)
class CoreKeyDiffPress(CorePress, name="core_keydiff"):
    """``CORE_KeyDiff`` (paper Table 13): KeyDiff scores replace the indexer's allocation; the paper's press."""

    policy: str = "paper"
    allocation: str = "keydiff"


def core_parameter_counts(core) -> dict:
    """Added parameters (paper Table 18): indexer, memory + gate, and the frozen geometry buffers."""
    parts = core.num_parameters_by_part()
    geo = sum(getattr(core, f"geo_{k}").numel() for k in ("mean", "proj", "prototypes", "gamma", "kmm_inv_sqrt"))
    return {**parts, "geometry_buffers": geo, "total": parts["indexer"] + parts["memory"] + geo}


__all__ = ["OVERRIDES", "POLICIES", "CoreEAPress", "CoreKeyDiffPress", "CorePress", "compose",
           "core_parameter_counts"]  # fmt: skip
