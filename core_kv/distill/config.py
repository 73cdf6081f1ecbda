"""Typed training configuration; YAML files in ``configs/train/`` only override these defaults.

The defaults are the shipped proxy recipe (``accelerate launch train.py`` with no arguments, into ``runs/core-proxy``): about 5.6 minutes on two
CPU cores including the teacher data. Batch arithmetic: documents per optimizer step =
``micro_batch × grad_accum × num_processes``.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from pathlib import Path

from core_kv.config import ConfigError, check_on_init, folder, non_empty, option
from core_kv.distill.replay import SELECTIONS
from core_kv.features_v3 import ablated_names
from core_kv.memory import WRITE_RULES
from core_kv.policy import PolicyStageConfig
from core_kv.teacher.config import DataSpec, ModelSpec, TeacherConfig


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


RECIPES = ("replay", "released")


def _feature_entries(value: list[str]) -> str | None:
    """An :func:`option` check: feature names or groups of spec v3."""
    try:
        ablated_names(list(value))
    except ValueError as e:
        return f"feature names of spec v3 or the groups qk / coverage / auxiliary ({e})"
    return None


@dataclass
class OnlineConfig:
    """The released recipe (``recipe: released``): the CORE authors' design as options whose defaults are theirs.

    Source: GitHub ``zhutizi23-coder/CORE`` ``core/config.py`` defaults (``core/train.py``, ``core/collector.py``,
    ``core/teacher.py``, ``core/indexer.py``); ``docs/method.md`` "The released recipe" lists what we keep different.
    Feature spec v3 (:mod:`core_kv.features_v3`), the fixed key geometry (:mod:`core_kv.key_geometry`), the DRIVE
    teacher (:mod:`core_kv.teacher.drive`), head-shared scores and the fast memory (:mod:`core_kv.fast_memory`) are
    what the recipe means; the options below are their constants and the schedule. Micro-batches per optimizer step
    are :attr:`TrainConfig.grad_accum` (the release: 4 sequential micro-batches, ``online_batch_size``).

    Args:
        geometry_seed: Seed of the fixed projection, prototypes and rotation.
        geometry: ``drawn`` (the release: fixed random maps) or ``fitted`` (projection by PCA and prototypes by
            spherical k-means on the keys of the first ``geometry_docs`` training documents,
            :meth:`~core_kv.key_geometry.KeyGeometry.fit`; the one-choice ablation of core_kv's fitted geometry).
        geometry_docs: Calibration documents of the fitted geometry (``short_len`` tokens each).
        d_z, num_prototypes: Projected key width and prototype count (64, 64).
        drive_beta, drive_alpha, drive_tau, drive_steps, teacher_temperature: The DRIVE teacher (128, 1, 8, 8, 1).
        student_temperature: τ_m: the student's distribution is ``softmax(s / τ_m)`` (KL, hinge margin, memory writes).
        sinks: Protected first tokens, kept inside the budget and left out of the KL and the boundary ranking.
        lambda_cal, lambda_bd: Weights of the KL and of the boundary hinge (1, 4).
        boundary_delta, boundary_margin: Teacher ranks on each side of the cut (32) and the hinge margin (0.5).
        budgets: Compression ratios supervised by the boundary hinge (0.25, 0.5, 0.75, 0.9).
        all_budgets: Supervise every one of ``budgets`` at every step (the release); false: only the step's ratio,
            drawn from them.
        memory: Train the fast memory in the joint stage (False: indexer-only for all steps).
        memory_dim, memory_gate_hidden, memory_decay, memory_tail, lambda_mem: The memory (512, 64, 0.9; MSE on the
            last 16 queries; weight 1).
        memory_dtype: How the artifact stores the memory's weights (``float32``; ``float16`` halves the file).
        memory_readout: ``residual`` (the release: ``o_R + g m``) or ``interpolate`` (the paper's ``o_R + g (m − o_R)``,
            exact with ``m = o_E``, ``g = α_E``; :mod:`core_kv.fast_memory`).
        memory_kernel: ``released`` (the release's signed kernel ``(θq)·(θk)`` over ``sqrt((θq)²·b)``) or
            ``positive`` (``φ = elu(θ·) + 1``, normalised by its mass: a convex combination of the evicted values).
        memory_gate_weight: μ_g of a gate term ``μ_g · BCE(g(q), α_E(q))`` added to each layer's memory loss, with
            ``α_E`` the evicted share of the query's full-cache attention (mean over query heads). 0: the release
            (the gate learns from the output error alone). Not in the release: our CPU-scaled recipe's gate closes
            within its first joint steps without it (``docs/method.md`` "The released recipe").
        ablate_features: Features the indexer never sees, for one-choice ablations: names of
            :data:`~core_kv.features_v3.FEATURE_NAMES_V3` or groups ``qk`` / ``coverage`` / ``auxiliary``; zeroed at
            the indexer's input in training and, from the artifact's config, at inference. Empty: the release.
        total_steps: Optimizer steps of the whole WSD schedule (both stages).
        indexer_steps: Indexer-only steps before the joint stage (1000 of 5400).
        warmup, stable, decay: WSD phases in optimizer steps (100 / 3100 / 2200).
        lr_peak, lr_final: Peak learning rate and the end of the cosine decay (5e-4, 7.5e-6).
        joint_indexer_lr_scale, joint_memory_lr_scale: Learning-rate multipliers in the joint stage (0.1, 1).
        weight_decay, grad_clip: AdamW weight decay (torch's default 0.01) and the gradient-norm clip (1.0).
        short_len, long_len, long_every: Training sequence lengths: ``long_len`` every ``long_every`` optimizer
            steps, ``short_len`` otherwise (2048, 4096, 8).
        decode_every, decode_window, decode_weight: A decode-window batch (the last 128 prefix queries as the event's
            queries, phase 1) every 4 optimizer steps, loss weight 1 (0 disables).
    """

    geometry_seed: int = option(42, ge=0)
    geometry: str = option("drawn", choices=("drawn", "fitted"))
    geometry_docs: int = option(8, gt=0)
    d_z: int = option(64, gt=0)
    num_prototypes: int = option(64, gt=0)
    drive_beta: float = option(128.0, ge=0)
    drive_alpha: float = option(1.0, gt=0)
    drive_tau: float = option(8.0, gt=0)
    drive_steps: int = option(8, gt=0)
    teacher_temperature: float = option(1.0, gt=0)
    student_temperature: float = option(1.0, gt=0)
    sinks: int = option(4, ge=0)
    lambda_cal: float = option(1.0, ge=0)
    lambda_bd: float = option(4.0, ge=0)
    boundary_delta: int = option(32, gt=0)
    boundary_margin: float = option(0.5, ge=0)
    budgets: list[float] = option(factory=lambda: [0.25, 0.5, 0.75, 0.9], gt=0, lt=1, check=non_empty)
    all_budgets: bool = True
    memory: bool = True
    memory_dim: int = option(512, gt=0)
    memory_gate_hidden: int = option(64, gt=0)
    memory_decay: float = option(0.9, ge=0, le=1)
    memory_tail: int = option(16, gt=0)
    lambda_mem: float = option(1.0, ge=0)
    memory_dtype: str = option("float32", choices=("float32", "float16", "bfloat16"))
    memory_readout: str = option("residual", choices=("residual", "interpolate"))
    memory_kernel: str = option("released", choices=("released", "positive"))
    memory_gate_weight: float = option(0.0, ge=0)
    ablate_features: list[str] = option(factory=list, check=_feature_entries)
    total_steps: int = option(5400, gt=0)
    indexer_steps: int = option(1000, ge=0)
    warmup: int = option(100, ge=0)
    stable: int = option(3100, ge=0)
    decay: int = option(2200, ge=0)
    lr_peak: float = option(5.0e-4, gt=0)
    lr_final: float = option(7.5e-6, ge=0)
    joint_indexer_lr_scale: float = option(0.1, gt=0)
    joint_memory_lr_scale: float = option(1.0, gt=0)
    weight_decay: float = option(0.01, ge=0)
    grad_clip: float = option(1.0, ge=0)
    short_len: int = option(2048, gt=0)
    long_len: int = option(4096, gt=0)
    long_every: int = option(8, ge=0)
    decode_every: int = option(4, ge=0)
    decode_window: int = option(128, gt=0)
    decode_weight: float = option(1.0, ge=0)

    def check(self, prefix: str = "online.") -> None:
        if self.indexer_steps > self.total_steps:
            raise ConfigError(f"{prefix}indexer_steps ({self.indexer_steps}) exceeds {prefix}total_steps "
                              f"({self.total_steps})")  # fmt: skip
        if self.warmup + self.stable + self.decay < 1:
            raise ConfigError(f"{prefix}warmup + stable + decay must be >= 1 (the WSD schedule)")
        if self.lr_final > self.lr_peak:
            raise ConfigError(f"{prefix}lr_final ({self.lr_final}) exceeds {prefix}lr_peak ({self.lr_peak})")

    def lr_at(self, step: int) -> float:
        """The WSD learning rate after ``step`` optimizer steps of the whole schedule: linear warm-up from 0, constant
        ``lr_peak``, cosine decay to ``lr_final`` (held there after the schedule's end)."""
        if step < self.warmup:
            return self.lr_peak * step / max(1, self.warmup)
        if step < self.warmup + self.stable:
            return self.lr_peak
        d = min(1.0, max(0.0, (step - self.warmup - self.stable) / max(1, self.decay)))
        ratio = self.lr_final / self.lr_peak
        return self.lr_peak * (ratio + (1 - ratio) * 0.5 * (1 + math.cos(math.pi * d)))

    def seq_len(self, step: int) -> int:
        """The training length at global optimizer step ``step`` (1-based, as the release counts)."""
        return self.long_len if self.long_every > 0 and step % self.long_every == 0 else self.short_len

    def decode_at(self, step: int) -> bool:
        """Whether global optimizer step ``step`` (1-based) carries a decode-window batch."""
        return self.decode_every > 0 and step % self.decode_every == 0

    def ratio_at(self, seed: int, step: int) -> float:
        """The step's compression ratio (memory partition; the boundary budget without ``all_budgets``): one of
        ``budgets``, drawn by a generator seeded with ``seed`` and the global step (the same on resume)."""
        return self.budgets[random.Random(seed * 1_000_003 + step).randrange(len(self.budgets))]


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
        recipe: ``replay`` (the teacher dataset, on-policy replay, calibration and latent-memory stages of
            CORE.md) or ``released`` (the CORE authors' design: online distillation with the frozen model in the loop,
            :class:`OnlineConfig`).
        online: The released recipe's options (read only when ``recipe: released``).
        policy: The last stage: the inference policy chosen on the pipeline's own validation prompts and recorded in
            the artifact (:class:`~core_kv.policy.PolicyStageConfig`; ``policy.enabled=false`` skips it).
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
    recipe: str = option("replay", choices=RECIPES)
    online: OnlineConfig = field(default_factory=OnlineConfig)
    policy: PolicyStageConfig = field(default_factory=PolicyStageConfig)

    def __post_init__(self) -> None:
        check_on_init(self)  # every stage's options, before the first stage runs

    def check(self, prefix: str = "") -> None:
        if Path(self.out_dir).resolve() == Path(self.teacher.out_dir).resolve():
            raise ConfigError(
                f"{prefix}teacher.out_dir must differ from {prefix}out_dir (both are {self.out_dir!r}): the teacher "
                "dataset and the CORE run write files of the same names"
            )
