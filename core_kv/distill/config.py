"""Typed training configuration; YAML files in ``configs/train/`` only override these defaults.

The defaults are the shipped proxy recipe (``accelerate launch train.py`` with no arguments, into ``runs/core-proxy``): about 5.6 minutes on two
CPU cores including the teacher data. Batch arithmetic: documents per optimizer step =
``micro_batch × grad_accum × num_processes``.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

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


def check_options(obj, prefix: str, positive: tuple = (), non_negative: tuple = ()) -> None:
    """Raise ``ValueError`` naming ``<prefix><field>`` for a field that is not > 0 (``positive``; ``None`` passes)
    or not >= 0 (``non_negative``)."""
    for names, ok, what in ((positive, lambda v: v > 0, "> 0"), (non_negative, lambda v: v >= 0, ">= 0")):
        for name in names:
            v = getattr(obj, name)
            if v is not None and (isinstance(v, bool) or not ok(v)):
                raise ValueError(f"{prefix}{name} must be {what}, got {v!r}")


@dataclass
class IndexerStage:
    """Stage 2: distillation. ``warmup_steps`` on the teacher dataset's records (teacher-forced candidates: the
    full cache at each event), then ``steps`` on-policy steps replaying documents with the student's own retained
    sets (CORE.md stage 2)."""

    warmup_steps: int = 300
    records_per_micro: int = 16  # teacher records (event × layer) per micro-batch in the warm-up
    steps: int = 80
    lr: float = 1.0e-3
    weight_decay: float = 0.01
    warmup_lr_steps: int = 8
    grad_clip: float = 1.0
    rank_weight: float = 0.1  # μ_rank of the Top-B boundary BCE (0 disables it)
    # On-policy replay on the compressed cascade's activations (layer l+1's inputs from a forward in which the
    # student's retained sets replace every cache; the teacher's future queries are the cascade's) instead of the
    # full-cache forward's. A deviation from CORE.md stage 2 (docs/method.md, "Cascade-aware on-policy replay").
    cascade: bool = False

    def check(self, prefix: str = "indexer.") -> None:
        check_options(self, prefix, ("records_per_micro", "lr"),
                      ("warmup_steps", "steps", "weight_decay", "warmup_lr_steps", "grad_clip", "rank_weight"))  # fmt: skip


@dataclass
class CalibrationStage:
    """Stage 3: one temperature per layer on held-out documents (golden-section on log T); how many documents is
    :attr:`TrainConfig.calib_docs`."""

    log_t_min: float = -4.0
    log_t_max: float = 4.0
    grid: int = 161

    def check(self, prefix: str = "calibration.") -> None:
        if self.grid < 2:
            raise ValueError(f"{prefix}grid must be >= 2 (points of the log T grid), got {self.grid}")
        if not self.log_t_min < self.log_t_max:
            raise ValueError(f"{prefix}log_t_min must be < {prefix}log_t_max, got {self.log_t_min} >= {self.log_t_max}")


@dataclass
class MemoryStage:
    """Stage 4: ``W_φ`` and the gate, base model / indexer / temperatures frozen."""

    steps: int = 64
    lr: float = 2.0e-3
    weight_decay: float = 0.0
    warmup_lr_steps: int = 8
    grad_clip: float = 1.0
    gate_weight: float = 0.1  # μ_g of BCE(g, α_E)
    # The gate's scalars (gate_w, gate_b) need moves of several units, which Adam at ``lr`` cannot make in a few
    # dozen steps (at most ~lr per step); their own learning rate [choice]. None: ``lr``.
    gate_lr: float | None = 5.0e-2

    def check(self, prefix: str = "memory.") -> None:
        check_options(self, prefix, ("lr", "gate_lr"),
                      ("steps", "weight_decay", "warmup_lr_steps", "grad_clip", "gate_weight"))  # fmt: skip


RECIPES = ("replay", "released")


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
        d_z, num_prototypes: Projected key width and prototype count (64, 64).
        drive_beta, drive_alpha, drive_tau, drive_steps, teacher_temperature: The DRIVE teacher (128, 1, 8, 8, 1).
        student_temperature: τ_m: the student's distribution is ``softmax(s / τ_m)`` (KL, hinge margin, memory writes).
        sinks: Protected first tokens, kept inside the budget and left out of the KL and the boundary ranking.
        lambda_cal, lambda_bd: Weights of the KL and of the boundary hinge (1, 4).
        boundary_delta, boundary_margin: Teacher ranks on each side of the cut (32) and the hinge margin (0.5).
        budgets: Compression ratios supervised by the boundary hinge; with ``all_budgets`` every one of them at
            every step (else only the step's ratio, drawn from them).
        memory: Train the fast memory in the joint stage (False: indexer-only for all steps).
        memory_dim, memory_gate_hidden, memory_decay, memory_tail, lambda_mem: The memory (512, 64, 0.9; MSE on the
            last 16 queries; weight 1).
        memory_dtype: How the artifact stores the memory's weights (``float32``; ``float16`` halves the file).
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

    geometry_seed: int = 42
    d_z: int = 64
    num_prototypes: int = 64
    drive_beta: float = 128.0
    drive_alpha: float = 1.0
    drive_tau: float = 8.0
    drive_steps: int = 8
    teacher_temperature: float = 1.0
    student_temperature: float = 1.0
    sinks: int = 4
    lambda_cal: float = 1.0
    lambda_bd: float = 4.0
    boundary_delta: int = 32
    boundary_margin: float = 0.5
    budgets: list[float] = field(default_factory=lambda: [0.25, 0.5, 0.75, 0.9])
    all_budgets: bool = True
    memory: bool = True
    memory_dim: int = 512
    memory_gate_hidden: int = 64
    memory_decay: float = 0.9
    memory_tail: int = 16
    lambda_mem: float = 1.0
    memory_dtype: str = "float32"
    total_steps: int = 5400
    indexer_steps: int = 1000
    warmup: int = 100
    stable: int = 3100
    decay: int = 2200
    lr_peak: float = 5.0e-4
    lr_final: float = 7.5e-6
    joint_indexer_lr_scale: float = 0.1
    joint_memory_lr_scale: float = 1.0
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    short_len: int = 2048
    long_len: int = 4096
    long_every: int = 8
    decode_every: int = 4
    decode_window: int = 128
    decode_weight: float = 1.0

    def check(self, prefix: str = "online.") -> None:
        check_options(self, prefix, ("d_z", "num_prototypes", "drive_alpha", "drive_tau", "drive_steps",
                                     "teacher_temperature", "student_temperature", "boundary_delta", "memory_dim",
                                     "memory_gate_hidden", "memory_tail", "total_steps", "lr_peak", "short_len",
                                     "long_len", "decode_window", "joint_indexer_lr_scale", "joint_memory_lr_scale"),
                      ("drive_beta", "sinks", "lambda_cal", "lambda_bd", "boundary_margin", "lambda_mem",
                       "indexer_steps", "warmup", "stable", "decay", "lr_final", "weight_decay", "grad_clip",
                       "long_every", "decode_every", "decode_weight"))  # fmt: skip
        if not self.budgets or any(not 0 < r < 1 for r in self.budgets):
            raise ValueError(f"{prefix}budgets must be compression ratios in (0, 1), got {self.budgets}")
        if self.indexer_steps > self.total_steps:
            raise ValueError(f"{prefix}indexer_steps ({self.indexer_steps}) exceeds total_steps ({self.total_steps})")
        if self.warmup + self.stable + self.decay < 1:
            raise ValueError(f"{prefix}warmup + stable + decay must be >= 1 (the WSD schedule)")
        if not 0 <= self.memory_decay <= 1:
            raise ValueError(f"{prefix}memory_decay must be in [0, 1], got {self.memory_decay}")
        if self.memory_dtype not in ("float32", "float16", "bfloat16"):
            raise ValueError(f"{prefix}memory_dtype must be float32, float16 or bfloat16, got {self.memory_dtype!r}")
        if self.lr_final > self.lr_peak:
            raise ValueError(f"{prefix}lr_final ({self.lr_final}) exceeds lr_peak ({self.lr_peak})")

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
        train_docs: Pool of on-policy documents (indices 0.., cycled).
        calib_docs / eval_docs: Held-out documents (disjoint index ranges) for calibration and the final report.
        ratios: Compression ratios cycled over training documents (position j gets ``ratios[j % len]``).
        eval_ratios: Ratios of the final report.
        eval_greedy: Also compute Table 7's greedy J_B maximiser (slow: one Sherman–Morrison pick per free token).
        write_rule: ``mass`` (CORE) | ``equal_event`` | ``uniform_token``.
        micro_batch: Documents per process per micro-step (records: ``indexer.records_per_micro``).
        grad_accum: Micro-steps per optimizer step (``accelerator.accumulate``).
        save_every: Optimizer steps between resumable checkpoints; ``keep_last`` are kept.
        stop_after: Stop this invocation after that many optimizer steps in all (0 = run to the end), as an
            interruption would (a resumable checkpoint is saved first).
        overwrite: Retrain from scratch: delete the folder's stages, states and ``final/`` first (the only way a run
            replaces a finished artifact).
        wandb: Log through ``accelerator.init_trackers``/``log`` (``wandb_mode`` offline works without login).
        recipe: ``replay`` (the teacher dataset, on-policy replay, calibration and latent-memory stages of
            CORE.md) or ``released`` (the CORE authors' design: online distillation with the frozen model in the loop,
            :class:`OnlineConfig`).
        online: The released recipe's options (read only when ``recipe: released``).
        policy: The last stage: the inference policy chosen on the pipeline's own validation prompts and recorded in
            the artifact (:class:`~core_kv.policy.PolicyStageConfig`; ``policy.enabled=false`` skips it).
    """

    out_dir: str = "runs/core-proxy"
    teacher: TeacherConfig = field(default_factory=_proxy_teacher)
    build_teacher: bool = True
    train_docs: int = 32
    calib_docs: int = 6
    eval_docs: int = 6
    ratios: list[float] = field(default_factory=lambda: [0.75, 0.9, 0.5])
    eval_ratios: list[float] = field(default_factory=lambda: [0.75, 0.9])
    eval_greedy: bool = False
    write_rule: str = "mass"
    indexer: IndexerStage = field(default_factory=IndexerStage)
    calibration: CalibrationStage = field(default_factory=CalibrationStage)
    memory: MemoryStage = field(default_factory=MemoryStage)
    micro_batch: int = 1
    grad_accum: int = 1
    seed: int = 0
    save_every: int = 16
    keep_last: int = 2
    stop_after: int = 0
    overwrite: bool = False
    wandb: bool = False
    wandb_project: str = "core_kv"
    wandb_mode: str = "offline"
    progress: bool = True
    threads: int = 0
    recipe: str = "replay"
    online: OnlineConfig = field(default_factory=OnlineConfig)
    policy: PolicyStageConfig = field(default_factory=PolicyStageConfig)

    def __post_init__(self) -> None:
        if self.recipe not in RECIPES:
            raise ValueError(f"recipe must be one of {RECIPES}, got {self.recipe!r}")
        self.online.check()
        if self.write_rule not in WRITE_RULES:
            raise ValueError(f"write_rule must be one of {WRITE_RULES}, got {self.write_rule!r}")
        for name in ("micro_batch", "grad_accum", "save_every", "keep_last"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("train_docs", "calib_docs", "eval_docs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("ratios", "eval_ratios"):
            rs = getattr(self, name)
            if not rs or any(not 0 < r < 1 for r in rs):
                raise ValueError(f"{name} must be a non-empty list of compression ratios in (0, 1), got {rs}")
        # every stage's options are checked here, before the first stage runs (a bad memory.lr must not wait for
        # the warm-up, indexer and calibration stages)
        self.indexer.check()
        self.calibration.check()
        self.memory.check()
        self.policy.check()
        if self.wandb_mode not in ("offline", "online", "disabled"):
            raise ValueError("wandb_mode must be offline, online or disabled")
        if self.stop_after < 0:
            raise ValueError("stop_after must be >= 0")
