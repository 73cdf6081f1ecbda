"""The inference policy a CORE artifact carries: how its pieces are composed at each compression ratio and length.

CORE's retention channel (the scorer), head-wise budgets (AdaKV around it, pooled over ``p`` or over ``(p + ε)·‖v‖``),
TwinKV's repair pass and the latent memory (outermost) compose as presses (:mod:`core_kv.presses.core`). Which
composition measures best depends on the ratio, the context length and the model, so ``train.py``'s last stage (the
policy stage, :mod:`core_kv.eval.policy_stage`) chooses one per (context length, compression-ratio band) on
validation prompts it generates itself and records it in the artifact's ``config.json`` (``inference_policy``), with
every candidate's validation score and how the validation set was made. ``build_press("core", checkpoint=...,
compression_ratio=r)`` applies, at each prefill, the band of r at the validated length nearest to the context's.

A length band (:class:`LengthBand`) holds the ratio bands chosen at one validation length; a ratio band covers the
ratios ``(previous upto, upto]``, the last one everything above. An artifact without a recorded policy runs the
paper's press (:data:`PAPER`: uniform per-head budgets, memory in every layer). An artifact that won ``train.py``'s
recipe search also records the search (``recipe_search``, checked at load by :func:`check_recipe_search`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from core_kv.config import parse_layers
from core_kv.files import read_json

POLICY_VERSION = 2
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
V1_FIELDS = {"version", "bands", "default_band", "candidates", "validation"}  # of a version-1 policy (one length)
LENGTH_FIELDS = {"length", "bands", "default_band", "candidates", "validation"}  # of a recorded length band
RECORD_FIELDS = {"version", "lengths"}  # of a recorded policy


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


def _mappings(d: dict, name: str, where: str, at: str, fields: str) -> list[dict]:
    """``d[name]`` when it is a list of mappings (each of ``fields``), else ``ValueError`` naming ``where`` (the file)
    and ``at`` + ``name``."""
    if name not in d:
        raise ValueError(f"{where}: no '{at}{name}' field")
    items = d[name]
    if not isinstance(items, list):
        raise ValueError(f"{where}: {at}{name} must be a list of {'length bands' if name == 'lengths' else name}, "
                         f"got {items!r}")  # fmt: skip
    for i, x in enumerate(items):
        if not isinstance(x, dict):
            raise ValueError(f"{where}: {at}{name}[{i}] must be a mapping {fields}, got {x!r}")
    return items


@dataclass(frozen=True)
class Band:
    """The options for ratios up to ``upto`` (above the previous band's), chosen at the validation ratio
    ``validated_at``."""

    upto: float
    options: PolicyOptions
    validated_at: float


@dataclass
class LengthBand:
    """The ratio bands chosen at one validation length, and the record of how they were chosen there.

    Attributes:
        length: Context tokens of the validation prompts the bands were chosen on; ``None``: not recorded (the
            paper's press of an artifact without a policy, or a version-1 record without
            ``validation.context_tokens``), allowed for a policy of one length band only.
        bands: Ascending by ``upto``; the last band also covers every ratio above its ``upto``.
        default_band: The band an absolute ``budget`` (no ratio) uses.
        candidates: Per validation ratio (``"0.75"``), every candidate's options and validation scores.
        validation: How the validation set was made (generator, seeds, wording, length, counts) and the rule that
            chose among the candidates.
    """

    length: int | None
    bands: list[Band]
    default_band: int = 0
    candidates: dict = field(default_factory=dict)
    validation: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.length is not None and (isinstance(self.length, bool) or not isinstance(self.length, int)
                                        or self.length < 1):  # fmt: skip
            raise ValueError(f"length must be a positive number of context tokens, got {self.length!r}")
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
            b.options.check_layers(num_layers, f"{where}bands[{i}].options")
        for r, rows in self.candidates.items():
            for j, row in enumerate(rows):
                PolicyOptions.from_dict(row["options"]).check_layers(
                    num_layers, f"{where}candidates[{r!r}][{j}].options"
                )

    def band(self, ratio: float | None) -> Band:
        """The band of ``ratio`` (``None``: the default band)."""
        if ratio is None:
            return self.bands[self.default_band]
        for b in self.bands:
            if ratio <= b.upto + 1e-12:
                return b
        return self.bands[-1]

    def to_dict(self) -> dict:
        return {
            "length": self.length,
            "bands": [
                {"upto": b.upto, "validated_at": b.validated_at, "options": b.options.to_dict()} for b in self.bands
            ],
            "default_band": self.default_band,
            "candidates": self.candidates,
            "validation": self.validation,
        }

    @classmethod
    def from_dict(cls, d: dict, where: str, at: str = "") -> LengthBand:
        """The length band of a recorded dict (``length`` read from ``d``; for a version-1 record ``d`` has none and
        the caller passes ``validation.context_tokens``); a bad field raises ``ValueError`` naming ``where`` (the
        file) and ``at`` + the field (``lengths[1].bands[0].upto``)."""
        bands = []
        for i, b in enumerate(_mappings(d, "bands", where, at, "(upto, validated_at, options)")):
            missing = sorted({"upto", "validated_at", "options"} - set(b))
            extra = sorted(set(b) - {"upto", "validated_at", "options"})
            if missing or extra:
                raise ValueError(f"{where}: {at}bands[{i}] " + (f"has no {missing} field(s)" if missing else
                                 f"has unknown field(s) {extra}") + "; a band records upto, validated_at, options")  # fmt: skip
            options = PolicyOptions.from_dict(b["options"], f"{where}: {at}bands[{i}].options")
            bands.append(Band(b["upto"], options, b["validated_at"]))
        try:
            return cls(d.get("length"), bands, d.get("default_band", 0), d.get("candidates", {}),
                       d.get("validation", {}))  # fmt: skip
        except ValueError as e:
            raise ValueError(f"{where}: {at}{e}") from None


OUTSIDE = 2.0
"""A context is outside a policy's validated lengths when it is more than this factor shorter than the shortest or
longer than the longest (:meth:`InferencePolicy.outside`)."""


@dataclass
class InferencePolicy:
    """The ratio bands of every validated context length (:class:`LengthBand`), and how they were chosen.

    Lookup (:meth:`band`): the length band of the validated length nearest to the context's on a log scale (edges at
    the geometric means of neighbouring lengths, a context on an edge going to the shorter band: validated at 1024,
    2048, 4096 and 8192 the bands cover ``[1, 1448]``, ``(1448, 2896]``, ``(2896, 5793]``, ``(5793, ∞)``), then the
    ratio band of that length as :meth:`LengthBand.band` says. A context more than a factor :data:`OUTSIDE` (2)
    shorter than the shortest validated length or longer than the longest is *outside* the validated lengths
    (:meth:`outside`): it still gets the nearest band, and the ``core`` press warns once per length band.

    Attributes:
        lengths: Ascending by ``length``, no two equal; a policy written before lengths were recorded (version 1)
            loads as one length band at its ``validation.context_tokens``.
    """

    lengths: list[LengthBand]
    v1: bool = field(default=False, repr=False, compare=False)  # read from a version-1 record: fields at the top

    def __post_init__(self):
        if not self.lengths:
            raise ValueError("lengths: an inference policy needs at least one length band")
        known = [lb.length for lb in self.lengths]
        if None in known and len(known) > 1:
            raise ValueError(f"lengths: a policy of several length bands records each one's length, got {known}")
        if None not in known and (known != sorted(known) or len(set(known)) != len(known)):
            raise ValueError(f"lengths: must be in ascending order of 'length', no two equal, got {known}")

    @property
    def validated_lengths(self) -> list[int | None]:
        return [lb.length for lb in self.lengths]

    def length_band(self, tokens: int | None) -> LengthBand:
        """The length band of a context of ``tokens`` tokens: the nearest validated length on a log scale (``None``:
        the shortest band)."""
        if tokens is None:
            return self.lengths[0]
        for a, b in zip(self.lengths, self.lengths[1:], strict=False):
            if tokens <= math.sqrt(a.length * b.length):
                return a
        return self.lengths[-1]

    def outside(self, tokens: int) -> bool:
        """Whether ``tokens`` is more than a factor :data:`OUTSIDE` beyond the shortest or the longest validated
        length (never for a policy whose length is not recorded)."""
        low, high = self.lengths[0].length, self.lengths[-1].length
        return low is not None and (tokens * OUTSIDE < low or tokens > high * OUTSIDE)

    def band(self, ratio: float | None, tokens: int | None = None) -> Band:
        """The band of ``ratio`` (``None``: the default band) at a context of ``tokens`` (``None``: the shortest
        validated length)."""
        return self.length_band(tokens).band(ratio)

    def for_ratio(self, ratio: float | None, tokens: int | None = None) -> PolicyOptions:
        return self.band(ratio, tokens).options

    def check_layers(self, num_layers: int, where: str = "inference_policy") -> None:
        """Every band's (and recorded candidate's) memory layers exist in a model of ``num_layers`` layers."""
        for i, lb in enumerate(self.lengths):
            lb.check_layers(num_layers, f"{where}: " + ("" if self.v1 else f"lengths[{i}]."))

    def to_dict(self) -> dict:
        return {"version": POLICY_VERSION, "lengths": [lb.to_dict() for lb in self.lengths]}

    @classmethod
    def from_dict(cls, d: dict, where: str = "inference_policy") -> InferencePolicy:
        """The policy of a recorded dict; every field is checked, a bad one raises ``ValueError`` naming ``where`` (the
        file) and the field. A version-1 record (one length: ``bands``, ``default_band``, ``candidates``,
        ``validation`` at the top) becomes one length band at ``validation.context_tokens``."""
        if not isinstance(d, dict):
            raise ValueError(f"{where}: an inference policy is a JSON object, got {d!r}")
        version = d.get("version")
        if version not in (1, POLICY_VERSION):
            raise ValueError(f"{where}: version {version!r}, this code reads v1 and v{POLICY_VERSION}")
        allowed = V1_FIELDS if version == 1 else RECORD_FIELDS
        unknown = sorted(set(d) - allowed)
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {unknown}; a v{version} policy records {sorted(allowed)}")
        if version == 1:
            validation = d.get("validation", {})
            length = validation.get("context_tokens") if isinstance(validation, dict) else None
            if length is not None and (isinstance(length, bool) or not isinstance(length, int) or length < 1):
                raise ValueError(f"{where}: validation.context_tokens must be a positive number of tokens, got "
                                 f"{length!r}")  # fmt: skip
            return cls([LengthBand.from_dict({**d, "length": length}, where)], v1=True)
        bands = []
        for i, lb in enumerate(
            _mappings(d, "lengths", where, "", "(length, bands, default_band, candidates, validation)")
        ):
            if "length" not in lb:
                raise ValueError(f"{where}: lengths[{i}] has no 'length' field")
            extra = sorted(set(lb) - LENGTH_FIELDS)
            if extra:
                raise ValueError(f"{where}: lengths[{i}] has unknown field(s) {extra}; a length band records "
                                 f"{sorted(LENGTH_FIELDS)}")  # fmt: skip
            bands.append(LengthBand.from_dict(lb, where, f"lengths[{i}]."))
        try:
            return cls(bands)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None

    @classmethod
    def single(cls, options: PolicyOptions, length: int | None = None, **record) -> InferencePolicy:
        """One band for every ratio, at one length (``None``: not recorded)."""
        return cls([LengthBand(length, [Band(1.0, options, 0.75)], **record)])


SEARCH_FIELDS = {"version", "rule", "ratios", "short", "keep", "contestants", "rounds", "winner"}  # a recipe_search


def check_recipe_search(d, where: str) -> None:
    """Check the ``recipe_search`` record of an artifact's ``config.json`` (``train.py``'s recipe search,
    :mod:`core_kv.search`): the contestants and their overrides, each round's scores (mean and per validated (length,
    ratio)) and the winner, one of the last round's contestants. A bad field raises ``ValueError`` naming ``where``
    (the file) and the field (``rounds[0].scores['base'].accuracy``)."""
    if not isinstance(d, dict):
        raise ValueError(f"{where}: a recipe search record is a JSON object, got {d!r}")
    if d.get("version") != 1:
        raise ValueError(f"{where}: version {d.get('version')!r}, this code reads v1")
    unknown, missing = sorted(set(d) - SEARCH_FIELDS), sorted(SEARCH_FIELDS - set(d))
    if unknown or missing:
        raise ValueError(f"{where}: " + (f"unknown field(s) {unknown}" if unknown else f"no {missing} field(s)")
                         + f"; a recipe search records {sorted(SEARCH_FIELDS)}")  # fmt: skip
    for i, r in enumerate(d["ratios"] if isinstance(d["ratios"], list) else [None]):
        _between(r, f"{where}: ratios[{i}] (a compression ratio)", "(0, 1)")
    if not isinstance(d["short"], dict):
        raise ValueError(f"{where}: short must be a mapping of options to values, got {d['short']!r}")
    if isinstance(d["keep"], bool) or not isinstance(d["keep"], int) or d["keep"] < 1:
        raise ValueError(f"{where}: keep must be an integer >= 1, got {d['keep']!r}")
    labels = []
    for i, c in enumerate(_mappings(d, "contestants", where, "", "(label, overrides)")):
        if not isinstance(c.get("label"), str) or not isinstance(c.get("overrides"), dict):
            raise ValueError(f"{where}: contestants[{i}] must record a label (string) and overrides (a mapping), "
                             f"got {c!r}")  # fmt: skip
        labels.append(c["label"])
    if len(set(labels)) != len(labels) or not labels:
        raise ValueError(f"{where}: contestants must be one or more, each label once, got {labels}")
    rounds = _mappings(d, "rounds", where, "", "(name, overrides, scores, ranking)")
    if not rounds:
        raise ValueError(f"{where}: rounds: a search records at least one round")
    for i, rd in enumerate(rounds):
        at = f"{where}: rounds[{i}]"
        scores, ranking = rd.get("scores"), rd.get("ranking")
        if not isinstance(scores, dict) or not scores or not set(scores) <= set(labels):
            raise ValueError(f"{at}.scores must map contestants ({labels}) to their scores, got {scores!r}")
        if not isinstance(ranking, list) or sorted(ranking) != sorted(scores):
            raise ValueError(f"{at}.ranking must list the round's contestants {sorted(scores)}, got {ranking!r}")
        for label, sc in scores.items():
            if not isinstance(sc, dict):
                raise ValueError(f"{at}.scores[{label!r}] must be a mapping (accuracy, logprob, per_ratio), got {sc!r}")
            _between(sc.get("accuracy"), f"{at}.scores[{label!r}].accuracy", "[0, 1]")
            _finite(sc.get("logprob"), f"{at}.scores[{label!r}].logprob")
            for j, row in enumerate(_mappings(sc, "per_ratio", at, f"scores[{label!r}].", "(length, ratio, ...)")):
                _between(row.get("ratio"), f"{at}.scores[{label!r}].per_ratio[{j}].ratio", "(0, 1)")
                _between(row.get("accuracy"), f"{at}.scores[{label!r}].per_ratio[{j}].accuracy", "[0, 1]")
                _finite(row.get("logprob"), f"{at}.scores[{label!r}].per_ratio[{j}].logprob")
    if d["winner"] not in rounds[-1]["scores"]:
        raise ValueError(f"{where}: winner {d['winner']!r} is not a contestant of the last round "
                         f"({sorted(rounds[-1]['scores'])})")  # fmt: skip


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


def recorded_policy(artifact: str | Path) -> InferencePolicy | None:
    """The inference policy an artifact's ``config.json`` records (checked field by field, errors naming the file),
    or ``None`` where its policy stage did not run."""
    cfg_file = Path(artifact) / "config.json"
    record = read_json(cfg_file, "CORE config").get("inference_policy")
    return None if record is None else InferencePolicy.from_dict(record, f"{cfg_file}: inference_policy")


@dataclass
class PolicyStageConfig:
    """The last stage of ``train.py``: choose the artifact's inference policy on validation prompts the pipeline
    generates itself (:mod:`core_kv.eval.validation`; its own wording, keys, haystacks and seeds, disjoint from every
    evaluation set) and record it in ``final/config.json``.

    Args:
        enabled: Run the stage (``false``: the artifact keeps no policy, i.e. runs the paper's press).
        ratios: Validation ratios; each gets its band (edges halfway between them, :func:`bands_from_choices`).
        tasks: Validation tasks (:data:`VALIDATION_TASKS`).
        lengths: Context tokens of the validation prompts: the policy gets a length band per entry (ascending), chosen
            on prompts of that length (``[1024, 2048, 4096, 8192]``: one per served length).
        per_task: Prompts per task: one number for every length, or one per entry of ``lengths`` (fewer at long
            lengths: ``[5, 5, 3, 2]``); the same prompts for every candidate and ratio of a length.
        seed: Validation seed (>= :data:`MIN_SEED`).
        candidates: Compositions to compare, each a mapping of :class:`PolicyOptions` fields; empty = the 14 of
            :func:`candidate_grid`.
    """

    enabled: bool = True
    ratios: list[float] = field(default_factory=lambda: [0.5, 0.75, 0.9])
    tasks: list[str] = field(default_factory=lambda: list(VALIDATION_TASKS))
    lengths: list[int] = field(default_factory=lambda: [2048])
    per_task: int | list[int] = 5
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
        if (
            not isinstance(self.lengths, list)
            or not self.lengths
            or any(isinstance(n, bool) or not isinstance(n, int) or n < 64 for n in self.lengths)
        ):
            raise ValueError(f"{prefix}lengths must be a non-empty list of integers >= 64, got {self.lengths!r}")
        if self.lengths != sorted(set(self.lengths)):
            raise ValueError(f"{prefix}lengths must be ascending without repeats, got {self.lengths}")
        counts = self.per_task if isinstance(self.per_task, list) else [self.per_task]
        if not counts or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in counts):
            raise ValueError(f"{prefix}per_task must be an integer >= 1 or a list of them (one per entry of "
                             f"{prefix}lengths), got {self.per_task!r}")  # fmt: skip
        if isinstance(self.per_task, list) and len(self.per_task) != len(self.lengths):
            raise ValueError(f"{prefix}per_task lists {len(self.per_task)} counts for {len(self.lengths)} lengths "
                             f"({prefix}lengths={self.lengths}): give one per length, or one number for all")  # fmt: skip
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

    def per_length(self) -> list[tuple[int, int]]:
        """``(length, prompts per task)`` for every validation length."""
        counts = self.per_task if isinstance(self.per_task, list) else [self.per_task] * len(self.lengths)
        return list(zip(self.lengths, counts, strict=True))

    def candidate_options(self) -> list[PolicyOptions]:
        if not self.candidates:
            return candidate_grid()
        return [PolicyOptions.from_dict(dict(c), f"policy.candidates[{i}]") for i, c in enumerate(self.candidates)]


def complexity(options: PolicyOptions) -> int:
    """How many of the paper's choices a composition changes (the tie-break prefers fewer)."""
    return sum((options.head_budgets != "uniform", options.head_pool != "score", options.repair,
                options.memory is not True))  # fmt: skip


def serving_cost(options: PolicyOptions) -> int:
    """What a composition adds to serving beyond one dense cache of the kept entries, in the units the policy stage's
    rule compares (:func:`core_kv.eval.policy_stage.choose` prefers the cheapest of the candidates it cannot separate):
    head-wise budgets 1 (a ragged cache: one attention call per KV head group), the repair pass 1 (a second scoring
    pass at each event), the memory 2 (its readout in every decode step and its state beside the kept KV). Measured
    on SmolLM2 at 2k / 50% (``benchmarks.core_profile``, results.md section 5): the readout 12.9 ms and the ragged
    attention 10.8 ms of a 98.4 ms decode step, the memory state 28% of the kept KV."""
    return int(options.head_budgets == "adaptive") + int(options.repair) + 2 * int(options.memory is not False)


def bands_from_choices(choices: dict[float, PolicyOptions]) -> list[Band]:
    """Bands from the options chosen at each validation ratio: a band's edge is halfway between two validation
    ratios (0.5, 0.75, 0.9 give ``(0, 0.625]``, ``(0.625, 0.825]``, ``(0.825, 1)``)."""
    ratios = sorted(choices)
    edges = [(a + b) / 2 for a, b in zip(ratios, ratios[1:], strict=False)] + [1.0]
    return [Band(round(e, 6), choices[r], r) for e, r in zip(edges, ratios, strict=True)]


__all__ = [
    "HEAD_BUDGETS", "HEAD_POOLS", "MIN_SEED", "OUTSIDE", "PAPER", "VALIDATION_TASKS", "Band", "InferencePolicy",
    "LengthBand", "PolicyOptions", "PolicyStageConfig", "bands_from_choices", "candidate_grid", "check_recipe_search",
    "complexity", "serving_cost",
]  # fmt: skip
