"""Typed training configuration; YAML files in ``configs/train/`` only override these defaults.

The defaults are the shipped proxy recipe (``accelerate launch train.py`` with no arguments, into ``runs/core-proxy``): about 5.6 minutes on two
CPU cores including the teacher data. Batch arithmetic: documents per optimizer step =
``micro_batch × grad_accum × num_processes``.
"""

from __future__ import annotations

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
    policy: PolicyStageConfig = field(default_factory=PolicyStageConfig)

    def __post_init__(self) -> None:
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
