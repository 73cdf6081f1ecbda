"""The inference policy a CORE artifact carries: how its pieces are composed at each compression ratio.

CORE's retention channel (the scorer), head-wise budgets (AdaKV around it, pooled over ``p`` or over ``(p + ε)·‖v‖``),
TwinKV's repair pass and the latent memory (outermost) compose as presses (:mod:`core_kv.presses.core`). Which
composition measures best depends on the ratio and the model, so ``train.py``'s last stage (the policy stage,
:mod:`core_kv.eval.policy_stage`) chooses one per compression-ratio band on validation prompts it generates itself
and records it in the artifact's ``config.json`` (``inference_policy``), with every candidate's validation score and
how the validation set was made. ``build_press("core", checkpoint=..., compression_ratio=r)`` applies the band of r.

A band covers the ratios ``(previous upto, upto]``; the last band covers everything above. An artifact without a
recorded policy runs the paper's press (:data:`PAPER`: uniform per-head budgets, memory in every layer).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields

from core_kv.config import parse_layers

POLICY_VERSION = 1
HEAD_BUDGETS = ("uniform", "adaptive", "shared")
HEAD_POOLS = ("score", "output")


@dataclass(frozen=True)
class PolicyOptions:
    """One composition of CORE's pieces.

    Args:
        head_budgets: ``uniform`` (the paper: B per (layer, KV head)), ``adaptive`` (AdaKV's head-wise budgets,
            https://arxiv.org/abs/2407.11550, around the scorer) or ``shared`` (B per layer, the same positions in
            every KV head: the Top-B of ``p`` averaged over the heads, the release's head-shared scores applied to a
            per-head scorer; :mod:`core_kv.presses.head_shared`, docs/method.md "Which released choices carry the
            quality").
        head_pool: With ``adaptive``: what the heads compete on, ``score`` (the calibrated ``p``) or ``output``
            (``(p + pool_epsilon)·‖v‖``, ExpectedAttention's formula over CORE's ``p``).
        repair: TwinKV's repair pass (``../shared/papers/001_e5fc3a72c13765dd.txt`` §3.2-3.4) on the retained sets.
        memory: The latent memory: ``True`` (every layer), ``False`` (none) or the layers that keep it (``"0-5,8"``).
        alpha_safeguard: AdaKV's per-head floor (kvpress's 0.2).
        pool_epsilon: ε of ``head_pool="output"`` (kvpress's leaderboard AdaKV(ExpectedAttention): 1e-2).
        repair_threshold: τ of the repair pass (the paper's Qwen3-4B setting 0.85).
    """

    head_budgets: str = "uniform"
    head_pool: str = "score"
    repair: bool = False
    memory: bool | str = True
    alpha_safeguard: float = 0.2
    pool_epsilon: float = 0.01
    repair_threshold: float = 0.85

    def __post_init__(self):
        if self.head_budgets not in HEAD_BUDGETS:
            raise ValueError(f"head_budgets must be one of {HEAD_BUDGETS}, got {self.head_budgets!r}")
        if self.head_pool not in HEAD_POOLS:
            raise ValueError(f"head_pool must be one of {HEAD_POOLS}, got {self.head_pool!r}")
        if self.head_pool != "score" and self.head_budgets != "adaptive":
            raise ValueError(f"head_pool={self.head_pool!r} pools across heads: it needs head_budgets='adaptive'")
        if not isinstance(self.repair, bool):
            raise ValueError(f"repair must be true or false, got {self.repair!r}")
        if self.head_budgets == "shared" and self.repair:
            raise ValueError("head_budgets='shared' keeps one set for every KV head; the repair pass swaps per head: "
                             "set repair=false")  # fmt: skip
        if isinstance(self.memory, str):
            if self.memory.strip().lower() in ("true", "false", "yes", "no", "on", "off", "0", "1", "none", ""):
                raise ValueError(f"memory must be true or false (a boolean) or a layer list like '0-5,8', got the "
                                 f"string {self.memory!r}")  # fmt: skip
            if not parse_layers(self.memory, "memory"):  # raises naming the option for a malformed list
                raise ValueError("memory: give true, false or a non-empty layer list like '0-5,8'")
        elif not isinstance(self.memory, bool):
            raise ValueError(f"memory must be true, false or a layer list like '0-5,8', got {self.memory!r}")
        for name, low, high in (("alpha_safeguard", 0, 1), ("pool_epsilon", 0, math.inf), ("repair_threshold", -1, 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not low <= v <= high:
                raise ValueError(f"{name} must be a number in [{low}, {high}], got {v!r}")

    def check_layers(self, num_layers: int, where: str = "policy") -> None:
        """Raise ``ValueError`` naming ``where`` when ``memory`` lists layers a model of ``num_layers`` lacks."""
        if isinstance(self.memory, str):
            beyond = [i for i in parse_layers(self.memory, f"{where}: memory") if i >= num_layers]
            if beyond:
                raise ValueError(f"{where}: memory {self.memory!r} names layers {beyond} but the model has "
                                 f"{num_layers} layers (0-{num_layers - 1})")  # fmt: skip

    @property
    def memory_layers(self) -> str | None:
        """``None`` without memory, ``""`` for every layer, else the layer list."""
        if self.memory is False:
            return None
        return "" if self.memory is True else self.memory

    def describe(self) -> str:
        """A short label, e.g. ``adaptive/output + repair, memory off``."""
        head = f"adaptive/{self.head_pool}" if self.head_budgets == "adaptive" else self.head_budgets
        mem = {True: "memory", False: "memory off"}.get(self.memory, f"memory in {self.memory}")
        return f"{head}{' + repair' if self.repair else ''}, {mem}"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict, where: str = "policy") -> PolicyOptions:
        if not isinstance(d, dict):
            raise ValueError(f"{where}: policy options must be a mapping of option names to values, got {d!r}")
        names = {f.name for f in fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"{where}: unknown policy option(s) {sorted(unknown)}; options: {sorted(names)}")
        try:
            return cls(**d)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None


PAPER = PolicyOptions()  # the paper's press: uniform budgets, mass-weighted memory in every layer
RECORD_FIELDS = {"version", "bands", "default_band", "candidates", "validation"}  # of a recorded policy


def _finite(v, name: str) -> float:
    """``v`` when it is a finite number (not a string or a boolean), else ``ValueError`` naming ``name``."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"{name} must be a finite number, got {v!r}")
    return float(v)


def _between(v, name: str, interval: str) -> float:
    """``v`` when it is a finite number in ``interval`` (``"(0, 1]"``, ``"(0, 1)"`` or ``"[0, 1]"``)."""
    x = _finite(v, name)
    low_ok = x >= 0 if interval[0] == "[" else x > 0
    high_ok = x <= 1 if interval[-1] == "]" else x < 1
    if not (low_ok and high_ok):
        raise ValueError(f"{name} must be in {interval}, got {v!r}")
    return x


@dataclass(frozen=True)
class Band:
    """The options for ratios up to ``upto`` (above the previous band's), chosen at the validation ratio
    ``validated_at``."""

    upto: float
    options: PolicyOptions
    validated_at: float


@dataclass
class InferencePolicy:
    """Bands of compression ratios, each with its options, and the record of how they were chosen.

    Attributes:
        bands: Ascending by ``upto``; the last band also covers every ratio above its ``upto``.
        default_band: The band an absolute ``budget`` (no ratio) uses.
        candidates: Per validation ratio (``"0.75"``), every candidate's options and validation scores.
        validation: How the validation set was made (generator, seeds, wording, length, counts) and the rule that
            chose among the candidates.
    """

    bands: list[Band]
    default_band: int = 0
    candidates: dict = field(default_factory=dict)
    validation: dict = field(default_factory=dict)

    def __post_init__(self):
        if not self.bands:
            raise ValueError("bands: an inference policy needs at least one band")
        for i, b in enumerate(self.bands):
            _between(b.upto, f"bands[{i}].upto (a compression ratio)", "(0, 1]")
            _between(b.validated_at, f"bands[{i}].validated_at (a compression ratio)", "(0, 1)")
        uptos = [b.upto for b in self.bands]
        if uptos != sorted(uptos) or len(set(uptos)) != len(uptos):
            raise ValueError(f"bands: must be in ascending order of 'upto', got {uptos}")
        if isinstance(self.default_band, bool) or not isinstance(self.default_band, int):
            raise ValueError(f"default_band must be the index of a band (an integer), got {self.default_band!r}")
        if not 0 <= self.default_band < len(self.bands):
            raise ValueError(f"default_band {self.default_band} is not one of the {len(self.bands)} bands "
                             f"(0-{len(self.bands) - 1})")  # fmt: skip
        if not isinstance(self.candidates, dict):
            raise ValueError(f"candidates must be a mapping of ratios to scored candidates, got {self.candidates!r}")
        for r, rows in self.candidates.items():
            try:
                _between(float(r), "", "(0, 1)")
            except (TypeError, ValueError):
                raise ValueError(f"candidates: key {r!r} is not a compression ratio in (0, 1)") from None
            if not isinstance(rows, list):
                raise ValueError(f"candidates[{r!r}] must be a list of scored candidates, got {rows!r}")
            for j, row in enumerate(rows):
                at = f"candidates[{r!r}][{j}]"
                if not isinstance(row, dict):
                    raise ValueError(f"{at} must be a mapping (label, options, accuracy, logprob), got {row!r}")
                for name in ("label", "options", "accuracy", "logprob"):
                    if name not in row:
                        raise ValueError(f"{at}: no {name!r} field")
                PolicyOptions.from_dict(row["options"], f"{at}.options")
                _between(row["accuracy"], f"{at}.accuracy", "[0, 1]")
                _finite(row["logprob"], f"{at}.logprob")
        if not isinstance(self.validation, dict):
            raise ValueError(f"validation must be a mapping (how the validation set was made), got {self.validation!r}")

    def check_layers(self, num_layers: int, where: str = "inference_policy") -> None:
        """Every band's (and recorded candidate's) memory layers exist in a model of ``num_layers`` layers."""
        for i, b in enumerate(self.bands):
            b.options.check_layers(num_layers, f"{where}: bands[{i}].options")
        for r, rows in self.candidates.items():
            for j, row in enumerate(rows):
                PolicyOptions.from_dict(row["options"]).check_layers(
                    num_layers, f"{where}: candidates[{r!r}][{j}].options"
                )

    def band(self, ratio: float | None) -> Band:
        """The band of ``ratio`` (``None``: the default band)."""
        if ratio is None:
            return self.bands[self.default_band]
        for b in self.bands:
            if ratio <= b.upto + 1e-12:
                return b
        return self.bands[-1]

    def for_ratio(self, ratio: float | None) -> PolicyOptions:
        return self.band(ratio).options

    def to_dict(self) -> dict:
        return {
            "version": POLICY_VERSION,
            "bands": [
                {"upto": b.upto, "validated_at": b.validated_at, "options": b.options.to_dict()} for b in self.bands
            ],
            "default_band": self.default_band,
            "candidates": self.candidates,
            "validation": self.validation,
        }

    @classmethod
    def from_dict(cls, d: dict, where: str = "inference_policy") -> InferencePolicy:
        """The policy of a recorded dict; every field is checked, a bad one raises ``ValueError`` naming ``where`` (the
        file) and the field."""
        if not isinstance(d, dict):
            raise ValueError(f"{where}: an inference policy is a JSON object, got {d!r}")
        if d.get("version") != POLICY_VERSION:
            raise ValueError(f"{where}: version {d.get('version')!r}, this code reads v{POLICY_VERSION}")
        unknown = sorted(set(d) - RECORD_FIELDS)
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {unknown}; a policy records {sorted(RECORD_FIELDS)}")
        if "bands" not in d:
            raise ValueError(f"{where}: no 'bands' field")
        if not isinstance(d["bands"], list):
            raise ValueError(f"{where}: bands must be a list of bands, got {d['bands']!r}")
        bands = []
        for i, b in enumerate(d["bands"]):
            if not isinstance(b, dict):
                raise ValueError(f"{where}: bands[{i}] must be a mapping (upto, validated_at, options), got {b!r}")
            missing = sorted({"upto", "validated_at", "options"} - set(b))
            extra = sorted(set(b) - {"upto", "validated_at", "options"})
            if missing or extra:
                raise ValueError(f"{where}: bands[{i}] " + (f"has no {missing} field(s)" if missing else
                                 f"has unknown field(s) {extra}") + "; a band records upto, validated_at, options")  # fmt: skip
            options = PolicyOptions.from_dict(b["options"], f"{where}: bands[{i}].options")
            bands.append(Band(b["upto"], options, b["validated_at"]))
        try:
            return cls(bands, d.get("default_band", 0), d.get("candidates", {}), d.get("validation", {}))
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None

    @classmethod
    def single(cls, options: PolicyOptions, **record) -> InferencePolicy:
        """One band for every ratio."""
        return cls([Band(1.0, options, 0.75)], **record)


# The validation prompts' tasks (built by core_kv.eval.validation, which the policy stage runs; named here, below both)
VALIDATION_TASKS = ("single_noise", "single_prose", "multikey_prose", "multivalue_noise")
MIN_SEED = 1000  # validation seeds start here; evaluation seeds (RULER 42-46, held-out needles 7...) lie below


def candidate_grid() -> list[PolicyOptions]:
    """The compositions the policy stage compares by default: {uniform, adaptive/score, adaptive/output} x
    {repair off, on} x {memory on, off}, then shared (no repair) x {memory on, off} (14; the paper's press first)."""
    heads = [("uniform", "score"), ("adaptive", "score"), ("adaptive", "output")]
    grid = [
        PolicyOptions(head_budgets=h, head_pool=pool, repair=r, memory=m)
        for m in (True, False) for h, pool in heads for r in (False, True)
    ]  # fmt: skip
    return grid + [PolicyOptions(head_budgets="shared", memory=m) for m in (True, False)]


@dataclass
class PolicyStageConfig:
    """The last stage of ``train.py``: choose the artifact's inference policy on validation prompts the pipeline
    generates itself (:mod:`core_kv.eval.validation`; its own wording, keys, haystacks and seeds, disjoint from every
    evaluation set) and record it in ``final/config.json``.

    Args:
        enabled: Run the stage (``false``: the artifact keeps no policy, i.e. runs the paper's press).
        ratios: Validation ratios; each gets its band (edges halfway between them, :func:`bands_from_choices`).
        tasks: Validation tasks (:data:`VALIDATION_TASKS`).
        length: Context tokens per validation prompt.
        per_task: Prompts per task (the same prompts for every candidate and ratio).
        seed: Validation seed (>= :data:`MIN_SEED`).
        candidates: Compositions to compare, each a mapping of :class:`PolicyOptions` fields; empty = the 14 of
            :func:`candidate_grid`.
    """

    enabled: bool = True
    ratios: list[float] = field(default_factory=lambda: [0.5, 0.75, 0.9])
    tasks: list[str] = field(default_factory=lambda: list(VALIDATION_TASKS))
    length: int = 2048
    per_task: int = 5
    seed: int = MIN_SEED
    candidates: list[dict] = field(default_factory=list)

    def check(self, prefix: str = "policy.") -> None:
        if not self.ratios or any(isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 < r < 1
                                  for r in self.ratios):  # fmt: skip
            raise ValueError(
                f"{prefix}ratios must be a non-empty list of compression ratios in (0, 1), got {self.ratios}"
            )
        if len(set(self.ratios)) != len(self.ratios):
            raise ValueError(f"{prefix}ratios has duplicates: {self.ratios}")
        bad = [t for t in self.tasks if t not in VALIDATION_TASKS]
        if not self.tasks or bad:
            raise ValueError(f"{prefix}tasks must be a non-empty subset of {list(VALIDATION_TASKS)}, got {self.tasks}")
        for name, low in (("length", 64), ("per_task", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"{prefix}{name} must be an integer >= {low}, got {v!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < MIN_SEED:
            raise ValueError(f"{prefix}seed must be an integer >= {MIN_SEED} (lower seeds are evaluation draws), "
                             f"got {self.seed!r}")  # fmt: skip
        seen: dict[PolicyOptions, int] = {}
        for i, c in enumerate(self.candidates):
            if not isinstance(c, dict):
                raise ValueError(f"{prefix}candidates[{i}] must be a mapping of policy options, got {c!r}")
            options = PolicyOptions.from_dict(dict(c), f"{prefix}candidates[{i}]")
            if options in seen:
                raise ValueError(f"{prefix}candidates[{i}] repeats candidates[{seen[options]}] "
                                 f"({options.describe()}): each candidate is scored once; remove one")  # fmt: skip
            seen[options] = i

    def check_layers(self, num_layers: int, prefix: str = "policy.") -> None:
        """The candidates' memory layer lists name layers of a model of ``num_layers`` layers."""
        for i, c in enumerate(self.candidate_options()):
            c.check_layers(num_layers, f"{prefix}candidates[{i}]")

    def candidate_options(self) -> list[PolicyOptions]:
        if not self.candidates:
            return candidate_grid()
        return [PolicyOptions.from_dict(dict(c), f"policy.candidates[{i}]") for i, c in enumerate(self.candidates)]


def complexity(options: PolicyOptions) -> int:
    """How many of the paper's choices a composition changes (the tie-break prefers fewer)."""
    return sum((options.head_budgets != "uniform", options.head_pool != "score", options.repair,
                options.memory is not True))  # fmt: skip


def bands_from_choices(choices: dict[float, PolicyOptions]) -> list[Band]:
    """Bands from the options chosen at each validation ratio: a band's edge is halfway between two validation
    ratios (0.5, 0.75, 0.9 give ``(0, 0.625]``, ``(0.625, 0.825]``, ``(0.825, 1)``)."""
    ratios = sorted(choices)
    edges = [(a + b) / 2 for a, b in zip(ratios, ratios[1:], strict=False)] + [1.0]
    return [Band(round(e, 6), choices[r], r) for e, r in zip(edges, ratios, strict=True)]


__all__ = [
    "HEAD_BUDGETS", "HEAD_POOLS", "MIN_SEED", "PAPER", "VALIDATION_TASKS", "Band", "InferencePolicy", "PolicyOptions",
    "PolicyStageConfig", "bands_from_choices", "candidate_grid", "complexity",
]  # fmt: skip
