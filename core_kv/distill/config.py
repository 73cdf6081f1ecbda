"""Typed training configuration; YAML files in ``configs/train/`` only override these defaults.

The defaults are the shipped proxy recipe, ``configs/train/default.yaml`` written out (``accelerate launch train.py``
with no arguments, into ``runs/core-proxy``; its time on two CPU cores is in ``docs/measured.json``). Batch
arithmetic: documents per optimizer step = ``micro_batch × grad_accum × num_processes``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from core_kv.config import ConfigError, built, check_on_init, field_types, folder, non_empty, option
from core_kv.distill.replay import SELECTIONS
from core_kv.documents import DataSpec
from core_kv.memory import WRITE_RULES
from core_kv.models.loading import ModelSpec
from core_kv.policy import PolicyStageConfig
from core_kv.teacher.config import TeacherConfig


def _proxy_teacher() -> TeacherConfig:
    """The proxy teacher run the default training builds or reuses: the values of ``configs/teacher/default.yaml``
    (32 documents of 1.5–2k tokens, chunk 512, λ = 2, R0 = 8, ratios 0.75/0.9), so both entry points share data."""
    return TeacherConfig(
        out_dir="runs/teacher/proxy",
        model=ModelSpec(path="checkpoints/proxy-lm"),
        data=DataSpec(source="proxy", num_docs=32, calib_docs=8, min_len=1536, max_len=2048),
        chunk_size=512,
        lam=2.0,
        steps=8,
        ref_steps=16,
        eta="auto",
        ratios=[0.75, 0.9],
        progress=True,
    )


def _proxy_policy() -> PolicyStageConfig:
    """The proxy's policy stage, kept small for ``make train``: 4 compositions x 3 ratios x 8 prompts of 512 tokens
    (the full grid at 2,048 tokens, :class:`~core_kv.policy.PolicyStageConfig`'s own defaults, is a recipe's choice:
    ``configs/train/smollm2.yaml``). The proxy answers no reworded needle (accuracy 0 for every candidate), so its
    choice rests on the answer log-prob."""
    return PolicyStageConfig(
        lengths=[512],
        per_task=2,
        candidates=[
            {},  # the paper's press
            {"memory": False},
            {"head_budgets": "adaptive", "memory": False},
            {"head_budgets": "adaptive", "head_pool": "output", "memory": False},
        ],
    )


@dataclass
class IndexerStage:
    """Stage 2: distillation. ``warmup_steps`` on the teacher dataset's records (teacher-forced candidates: the
    full cache at each event), then ``steps`` on-policy steps replaying documents with the student's own retained
    sets (CORE.md stage 2).

    Args:
        warmup_steps: optimizer steps on teacher records (cheap: no base-model forward).
        steps: on-policy optimizer steps, each replaying ``micro_batch × grad_accum`` documents through the frozen
            base model with the student's own evictions and the teacher solved on them (the expensive part).
        lr / weight_decay: AdamW learning rate and weight decay of the indexer.
        warmup_lr_steps: linear learning-rate warm-up steps.
        grad_clip: gradient-norm clip.
    """

    warmup_steps: int = option(300, ge=0)
    records_per_micro: int = option(16, ge=1)  # teacher records (event × layer) per micro-batch in the warm-up
    steps: int = option(80, ge=0)
    lr: float = option(1.0e-3, gt=0)
    weight_decay: float = option(0.01, ge=0)
    warmup_lr_steps: int = option(8, ge=0)
    grad_clip: float = option(1.0, ge=0)
    rank_weight: float = option(0.1, ge=0)  # μ_rank of the Top-B boundary BCE (0 disables it)
    # On-policy replay on the compressed cascade's activations (layer l+1's inputs from a forward in which the
    # student's retained sets replace every cache; the teacher's future queries are the cascade's) instead of the
    # full-cache forward's. A deviation from CORE.md stage 2 (docs/method.md, "Cascade-aware on-policy replay").
    cascade: bool = False


@dataclass
class CalibrationStage:
    """Stage 3: one temperature per layer on held-out documents (golden-section on log T); how many documents is
    :attr:`TrainConfig.calib_docs`.

    Args:
        log_t_min / log_t_max: the search interval of log T (T = the softmax temperature that makes the estimated
            evicted mass ε̂ match the true evicted attention mass α).
        grid: points of the log T grid scanned before the golden-section refinement.
    """

    log_t_min: float = -4.0
    log_t_max: float = 4.0
    grid: int = option(161, ge=2)  # points of the log T grid

    def check(self, prefix: str = "calibration.") -> None:
        if not self.log_t_min < self.log_t_max:
            raise ConfigError(
                f"{prefix}log_t_min must be < {prefix}log_t_max, got {self.log_t_min} >= {self.log_t_max}"
            )


@dataclass
class MemoryStage:
    """Stage 4: ``W_φ`` and the gate, base model / indexer / temperatures frozen.

    Args:
        steps: optimizer steps, each replaying ``micro_batch × grad_accum`` documents with real evictions and memory
            writes.
        lr / weight_decay: AdamW learning rate and weight decay of ``W_φ``.
        warmup_lr_steps: linear learning-rate warm-up steps.
        grad_clip: gradient-norm clip.
    """

    steps: int = option(64, ge=0)
    lr: float = option(2.0e-3, gt=0)
    weight_decay: float = option(0.0, ge=0)
    warmup_lr_steps: int = option(8, ge=0)
    grad_clip: float = option(1.0, ge=0)
    gate_weight: float = option(0.1, ge=0)  # μ_g of BCE(g, α_E)
    # The gate's scalars (gate_w, gate_b) need moves of several units, which Adam at ``lr`` cannot make in a few
    # dozen steps (at most ~lr per step); their own learning rate [choice]. None: ``lr``.
    gate_lr: float | None = option(5.0e-2, gt=0)


# What a search never varies: where and how the run writes (not what it trains), the search itself, and the policy
# stage whose validation prompts decide the contest (every contestant must be scored on the same ones).
NOT_SEARCHED = ("out_dir", "search", "policy", "threads", "progress", "wandb", "wandb_project", "wandb_mode", "plugins",
                "recipe", "stop_after", "overwrite", "save_every", "keep_last", "build_teacher")  # fmt: skip


@dataclass
class SearchConfig:
    """A staged search over training recipes, decided on the pipeline's own validation prompts (``train.py`` runs it
    when ``variants`` is not empty; :mod:`core_kv.search`). The base config is always a contestant (``base``); each
    variant is another, the base with its overrides. Round 1 trains every contestant with ``short`` applied into
    ``<out_dir>/search/<label>/`` and runs its policy stage; the ``keep`` best go on to the full schedule
    (``<out_dir>/search/<label>-full/``), decided again when ``keep`` > 1; the winner's full run becomes
    ``<out_dir>/final``. With ``short`` empty there is one round, at the full schedule.

    Args:
        variants: Contestants besides the base, each a mapping of dotted train options to values
            (``{teacher.lam: 4.0}``, ``{selection: shared}``); empty: no search (one run, as before).
        short: Overrides of round 1 only, bounding its cost (``{indexer.steps: 16, memory.steps: 0}``).
        keep: Contestants of round 1 that go on to the full schedule (1: the winner only).
        ratios: Validation ratios the contest is decided on (each among ``policy.ratios``): the chosen composition's
            accuracy averaged over them (and the validation lengths), then its answer log-prob.
        only: Labels of round-1 contestants to train in this process, then stop (empty: the whole search). One
            process per label trains round 1 side by side (other cores or GPUs); the search launched without
            ``only`` then finds them finished and decides. Contestants of equal teacher options share one teacher
            dataset, which one process writes at a time (the other is refused, naming the writer).
    """

    variants: list[dict] = option(factory=list)
    short: dict = option(factory=dict)
    keep: int = option(1, ge=1)
    ratios: list[float] = option(factory=lambda: [0.75, 0.9], gt=0, lt=1, check=non_empty)
    only: list[str] = option(factory=list)

    @property
    def enabled(self) -> bool:
        return bool(self.variants)

    def contestants(self) -> list[tuple[str, dict]]:
        """``(label, overrides)`` of every contestant, the base (``base``, no override) first."""
        return [("base", {})] + [(override_label(v), dict(v)) for v in self.variants]


def override_label(overrides: dict) -> str:
    """A readable folder name for a contestant: ``teacher.lam=4``, ``selection=shared,teacher.features=2``,
    ``teacher.lam_layers=17_32`` (characters outside ``A-Za-z0-9._=,+-`` become ``_``)."""

    def value(v: Any) -> str:
        if isinstance(v, dict):
            return "+".join(f"{k}_{value(x)}" for k, x in v.items())
        if isinstance(v, (list, tuple)):
            return "+".join(map(value, v))
        if isinstance(v, float) and v.is_integer():
            return str(int(v))
        return str(v).lower() if isinstance(v, bool) else str(v)

    text = ",".join(f"{k}={value(v)}" for k, v in overrides.items())
    return re.sub(r"[^A-Za-z0-9._=,+-]", "_", text)


def overridden(cfg, overrides: dict, where: str):
    """``cfg`` (a :class:`TrainConfig` or a recipe's subclass) with the dotted ``overrides`` applied and no search,
    checked as a loaded config is; a key that is no option of the schema, or one a search never varies
    (:data:`NOT_SEARCHED`), or a bad value raises :class:`ConfigError` naming ``where`` and the key."""
    for key in overrides:
        if not isinstance(key, str) or not key:
            raise ConfigError(f"{where}: keys must be dotted option names (teacher.lam), got {key!r}")
        parts = key.split(".")
        if parts[0] in NOT_SEARCHED or parts[0].startswith("wandb"):
            raise ConfigError(f"{where}: {key!r} is not an option a search varies (it sets where or how the run "
                              f"writes, the search, or the policy stage that scores every contestant alike; never "
                              f"varied: {', '.join(NOT_SEARCHED)})")  # fmt: skip
        cls = type(cfg)
        for i, part in enumerate(parts):
            names = {f.name for f in fields(cls) if f.init}
            if part not in names:
                section = ".".join(parts[:i]) or type(cfg).__name__
                raise ConfigError(f"{where}: {key!r} is not an option: {section} has no {part!r} (options: "
                                  f"{', '.join(sorted(names))})")  # fmt: skip
            cls = field_types(cls).get(part)
            section = is_dataclass(cls) and isinstance(cls, type)
            if i < len(parts) - 1 and not section:
                raise ConfigError(f"{where}: {key!r} is not an option: {'.'.join(parts[: i + 1])} is a value, not a "
                                  "section")  # fmt: skip
            if i == len(parts) - 1 and section:
                raise ConfigError(f"{where}: {key!r} is a section: give its options by dotted name "
                                  f"({key}.{fields(cls)[0].name}: ...)")  # fmt: skip
    try:
        conf = OmegaConf.structured(replace(cfg, search=SearchConfig()))
        for key, v in overrides.items():  # replaced whole (a mapping too: never merged with the base's)
            OmegaConf.update(conf, key, v, merge=False)
        return built(conf)
    except (OmegaConfBaseException, ValueError, TypeError) as e:
        text = (str(e).strip().splitlines() or [type(e).__name__])[0]
        key = getattr(e, "full_key", None)
        raise ConfigError(f"{where}: {f'{key}: ' if key and key not in text else ''}{text}") from None


@dataclass
class TrainConfig:
    """Everything ``train(cfg)`` depends on.

    Args:
        out_dir: Run folder: ``state/`` (resumable, ``accelerator.save_state``), ``stages/`` (finished stage
            weights), ``final/`` (the artifact), ``summary.json``. Default ``runs/core-proxy``; shipping an artifact
            is a deliberate ``out_dir=checkpoints/<name>``. A folder holding a finished artifact of another config is
            refused unless ``overwrite``.
        teacher: The teacher run to reuse (or build, when ``build_teacher``) — its model is the base model.
        build_teacher: Build the teacher dataset when ``teacher.out_dir`` holds none for this model and these teacher
            options (false: refuse instead).
        train_docs: Pool of on-policy documents (indices 0.., cycled).
        calib_docs / eval_docs: Held-out documents (disjoint index ranges) for calibration and the final report.
        ratios: Compression ratios cycled over training documents (position j gets ``ratios[j % len]``).
        eval_ratios: Ratios of the final report.
        eval_greedy: Also compute Table 7's greedy J_B maximiser (slow: one Sherman–Morrison pick per free token).
        write_rule: ``mass`` (CORE) | ``equal_event`` | ``uniform_token``.
        selection: Which retained sets the indexer and the memory are trained under: ``per_head`` (each KV head its
            own Top-B, CORE.md) or ``shared`` (one set per layer shared by the KV heads, the Top-B of the per-head
            distributions averaged over the heads: what ``head_shared`` serves). ``shared`` trains the indexer on the
            pooled target ``p̄* = mean_h p*_h`` against the pooled score (:func:`core_kv.distill.losses.shared_view`)
            and replays shared evictions in the on-policy, calibration and memory stages. The artifact records it.
        micro_batch: Documents per process per micro-step (records: ``indexer.records_per_micro``).
        grad_accum: Micro-steps per optimizer step (``accelerator.accumulate``).
        save_every: Optimizer steps between resumable checkpoints; ``keep_last`` are kept.
        stop_after: Stop this invocation after that many optimizer steps in all (0 = run to the end), as an
            interruption would (a resumable checkpoint is saved first).
        overwrite: Retrain from scratch: delete the folder's stages, states and ``final/`` first (the only way a run
            replaces a finished artifact).
        seed: the run's random seed (indexer and memory initialisation, sampling).
        keep_last: resumable checkpoints kept (older ones are deleted).
        wandb: Log through ``accelerator.init_trackers``/``log`` (``wandb_mode`` offline works without login).
        wandb_project: W&B project name.
        wandb_mode: ``offline`` (no login; ``wandb sync`` later), ``online`` or ``disabled``.
        progress: show progress bars.
        threads: torch intra-op threads per process (0 = leave torch's setting; 1 is fastest on a shared CPU).
        plugins: Modules imported before the rest of the config is read (``train.py``,
            :func:`~core_kv.distill.trainer.train_schema`); a plugin registers its recipes (e.g. ``research.released``
            registers ``released``, whose config adds its own section).
        recipe: ``replay``: the teacher dataset, on-policy replay, calibration and latent-memory stages of CORE.md;
            another name is a plugin's recipe (:data:`~core_kv.distill.trainer.RECIPES`).
        policy: The last stage: the inference policy chosen on the pipeline's own validation prompts and recorded in
            the artifact (:class:`~core_kv.policy.PolicyStageConfig`; ``policy.enabled=false`` skips it).
        search: A staged recipe search decided on the policy stage's validation scores (:class:`SearchConfig`;
            default: none, one run).
    """

    out_dir: str = option("runs/core-proxy", check=folder)
    teacher: TeacherConfig = field(default_factory=_proxy_teacher)
    build_teacher: bool = True
    train_docs: int = option(32, ge=1)
    calib_docs: int = option(6, ge=1)
    eval_docs: int = option(6, ge=1)
    ratios: list[float] = option(factory=lambda: [0.75, 0.9, 0.5], gt=0, lt=1, check=non_empty)
    eval_ratios: list[float] = option(factory=lambda: [0.75, 0.9], gt=0, lt=1, check=non_empty)
    eval_greedy: bool = False
    write_rule: str = option("mass", choices=WRITE_RULES)
    selection: str = option("per_head", choices=SELECTIONS)
    indexer: IndexerStage = field(default_factory=IndexerStage)
    calibration: CalibrationStage = field(default_factory=CalibrationStage)
    memory: MemoryStage = field(default_factory=MemoryStage)
    micro_batch: int = option(1, ge=1)
    grad_accum: int = option(1, ge=1)
    seed: int = option(0, ge=0)
    save_every: int = option(16, ge=1)
    keep_last: int = option(2, ge=1)
    stop_after: int = option(0, ge=0)
    overwrite: bool = False
    wandb: bool = False
    wandb_project: str = option("core_kv", check=non_empty)
    wandb_mode: str = option("offline", choices=("offline", "online", "disabled"))
    progress: bool = True
    threads: int = option(0, ge=0)  # >0: torch.set_num_threads (0 = leave it)
    plugins: list[str] = option(factory=list)
    recipe: str = "replay"
    policy: PolicyStageConfig = field(default_factory=_proxy_policy)
    search: SearchConfig = field(default_factory=SearchConfig)

    def __post_init__(self) -> None:
        check_on_init(self)  # every stage's options, before the first stage runs

    recipe_name: ClassVar[str] = "replay"  # the recipe this schema describes (a plugin's subclass sets its own)

    def check(self, prefix: str = "") -> None:
        if self.recipe != self.recipe_name:
            raise ConfigError(
                f"{prefix}recipe: {self.recipe!r} is not the recipe of this config schema ({type(self).__name__}: "
                f"{self.recipe_name!r}); a plugin recipe is enabled by listing its module in plugins, which train.py "
                "imports before reading the rest of the config (e.g. `plugins: [research.released]`)"
            )
        if Path(self.out_dir).resolve() == Path(self.teacher.out_dir).resolve():
            raise ConfigError(
                f"{prefix}teacher.out_dir must differ from {prefix}out_dir (both are {self.out_dir!r}): the teacher "
                "dataset and the CORE run write files of the same names"
            )
        if self.search.enabled:
            self.check_search(prefix)
        elif self.search.only:
            raise ConfigError(f"{prefix}search.only names contestants of a recipe search: set {prefix}search.variants")

    def check_search(self, prefix: str = "") -> None:
        """Every contestant is a valid config (its overrides, then ``short`` on top), the labels differ, and the
        contest can be decided (the policy stage runs, at ``search.ratios``)."""
        s, at = self.search, f"{prefix}search."
        if not self.policy.enabled:
            raise ConfigError(f"{at}variants: the contest is decided on the policy stage's validation scores: set "
                              f"{prefix}policy.enabled=true")  # fmt: skip
        missing = [r for r in s.ratios if not any(abs(r - x) < 1e-9 for x in self.policy.ratios)]
        if missing:
            raise ConfigError(f"{at}ratios {missing} are not validation ratios of the policy stage "
                              f"({prefix}policy.ratios={self.policy.ratios})")  # fmt: skip
        overridden(self, s.short, f"{at}short")
        labels: dict[str, int] = {}
        for i, v in enumerate(s.variants):
            where = f"{at}variants[{i}]"
            if not v:
                raise ConfigError(f"{where}: empty; the base config is always a contestant")
            overridden(self, v, where)
            overridden(self, {**v, **s.short}, f"{where} with {at}short")
            label = override_label(v)
            if label in labels:
                raise ConfigError(f"{where} repeats {at}variants[{labels.get(label)}] ({label}): each contestant once")
            labels[label] = i
        known = ["base", *labels]  # the contestants' labels (SearchConfig.contestants), checked distinct above
        unknown = [label for label in s.only if label not in known]
        if unknown:
            raise ConfigError(f"{at}only: {', '.join(map(repr, unknown))} is no contestant of this search (its "
                              f"contestants: {', '.join(known)})")  # fmt: skip
