"""The released recipe's training options (``recipe: released``): the CORE authors' design, whose defaults are theirs.

Source: GitHub ``zhutizi23-coder/CORE`` ``core/config.py`` defaults (``core/train.py``, ``core/collector.py``,
``core/teacher.py``, ``core/indexer.py``); ``docs/method.md`` "The released recipe" lists what we keep different.
Feature spec v3 (:mod:`research.released.features`), the fixed key geometry (:mod:`research.released.geometry`), the
DRIVE teacher (:mod:`research.released.teacher`), head-shared scores and the fast memory
(:mod:`research.released.memory`) are what the recipe means; the groups below are their constants and the schedule.

A train config enables it with::

    plugins: [research.released]     # imported before the rest of the config is read (train.py)
    recipe: released
    released:                        # ReleasedOptions: geometry / teacher / losses / memory / schedule
      schedule: {total_steps: 160, ...}

Micro-batches per optimizer step are :attr:`~core_kv.distill.config.TrainConfig.grad_accum` (the release: 4 sequential
micro-batches, ``online_batch_size``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import ClassVar

from core_kv.config import ConfigError, non_empty, option
from core_kv.distill.config import TrainConfig
from core_kv.schedules import wsd_cosine
from research.released.features import ablated_names
from research.released.teacher import DriveConfig


@dataclass
class GeometryOptions:
    """The key geometry.

    Args:
        seed: Seed of the fixed projection, prototypes and rotation.
        kind: ``drawn`` (the release: fixed random maps) or ``fitted`` (projection by PCA and prototypes by spherical
            k-means on the keys of the first ``docs`` training documents, ``KeyGeometry.fit``; the one-choice
            ablation of core_kv's fitted geometry).
        docs: Calibration documents of the fitted geometry (``schedule.short_len`` tokens each).
        d_z, num_prototypes: Projected key width and prototype count (64, 64).
    """

    seed: int = option(42, ge=0)
    kind: str = option("drawn", choices=("drawn", "fitted"))
    docs: int = option(8, gt=0)
    d_z: int = option(64, gt=0)
    num_prototypes: int = option(64, gt=0)


@dataclass
class LossOptions:
    """The indexer's losses.

    Args:
        student_temperature: τ_m: the student's distribution is ``softmax(s / τ_m)`` (KL, hinge margin, memory writes).
        sinks: Protected first tokens, kept inside the budget and left out of the KL and the boundary ranking.
        lambda_cal, lambda_bd: Weights of the KL and of the boundary hinge (1, 4).
        boundary_delta, boundary_margin: Teacher ranks on each side of the cut (32) and the hinge margin (0.5).
        budgets: Compression ratios supervised by the boundary hinge (0.25, 0.5, 0.75, 0.9).
        all_budgets: Supervise every one of ``budgets`` at every step (the release); false: only the step's ratio,
            drawn from them.
    """

    student_temperature: float = option(1.0, gt=0)
    sinks: int = option(4, ge=0)
    lambda_cal: float = option(1.0, ge=0)
    lambda_bd: float = option(4.0, ge=0)
    boundary_delta: int = option(32, gt=0)
    boundary_margin: float = option(0.5, ge=0)
    budgets: list[float] = option(factory=lambda: [0.25, 0.5, 0.75, 0.9], gt=0, lt=1, check=non_empty)
    all_budgets: bool = True


@dataclass
class MemoryOptions:
    """The fast memory.

    Args:
        train: Train it in the joint stage (false: indexer-only for all steps; the artifact records no trained memory).
        dim, gate_hidden, decay, tail, weight: P, the gate width, γ, the supervised queries (the last 16) and the loss
            weight λ_mem (512, 64, 0.9, 16, 1).
        dtype: How the artifact stores the memory's weights (``float32``; ``float16`` halves the file).
        readout: ``residual`` (the release: ``o_R + g m``) or ``interpolate`` (the paper's ``o_R + g (m − o_R)``,
            exact with ``m = o_E``, ``g = α_E``; :mod:`research.released.memory`).
        kernel: ``released`` (the release's signed kernel ``(θq)·(θk)`` over ``sqrt((θq)²·b)``) or ``positive``
            (``φ = elu(θ·) + 1``, normalised by its mass: a convex combination of the evicted values).
        gate_weight: μ_g of a gate term ``μ_g · BCE(g(q), α_E(q))`` added to each layer's memory loss, with ``α_E`` the
            evicted share of the query's full-cache attention (mean over query heads). 0: the release (the gate
            learns from the output error alone). Not in the release: our CPU-scaled recipe's gate closes within its
            first joint steps without it (``docs/method.md`` "The released recipe").
    """

    train: bool = True
    dim: int = option(512, gt=0)
    gate_hidden: int = option(64, gt=0)
    decay: float = option(0.9, ge=0, le=1)
    tail: int = option(16, gt=0)
    weight: float = option(1.0, ge=0)
    dtype: str = option("float32", choices=("float32", "float16", "bfloat16"))
    readout: str = option("residual", choices=("residual", "interpolate"))
    kernel: str = option("released", choices=("released", "positive"))
    gate_weight: float = option(0.0, ge=0)


@dataclass
class ScheduleOptions:
    """The WSD schedule, the two stages and the training sequences.

    Args:
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

    def check(self, prefix: str = "schedule.") -> None:
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
        return wsd_cosine(step, self.lr_peak, self.lr_final, self.warmup, self.stable, self.decay)

    def seq_len(self, step: int) -> int:
        """The training length at global optimizer step ``step`` (1-based, as the release counts)."""
        return self.long_len if self.long_every > 0 and step % self.long_every == 0 else self.short_len

    def decode_at(self, step: int) -> bool:
        """Whether global optimizer step ``step`` (1-based) carries a decode-window batch."""
        return self.decode_every > 0 and step % self.decode_every == 0


def _feature_entries(value: list[str]) -> str | None:
    """An :func:`option` check: feature names or groups of spec v3."""
    try:
        ablated_names(list(value))
    except ValueError as e:
        return f"feature names of spec v3 or the groups qk / coverage / auxiliary ({e})"
    return None


@dataclass
class ReleasedOptions:
    """The released recipe's options, by part.

    Args:
        geometry: The key geometry (:class:`GeometryOptions`).
        teacher: The DRIVE teacher (:class:`~research.released.teacher.DriveConfig`: 128, 1, 8, 8, 1).
        losses: The indexer's losses (:class:`LossOptions`).
        memory: The fast memory (:class:`MemoryOptions`).
        schedule: The schedule and the training sequences (:class:`ScheduleOptions`).
        ablate_features: Features the indexer never sees, for one-choice ablations: names of
            :data:`~research.released.features.FEATURE_NAMES_V3` or groups ``qk`` / ``coverage`` / ``auxiliary``;
            zeroed at the indexer's input in training and, from the artifact's config, at inference. Empty: the
            release.
    """

    geometry: GeometryOptions = field(default_factory=GeometryOptions)
    teacher: DriveConfig = field(default_factory=DriveConfig)
    losses: LossOptions = field(default_factory=LossOptions)
    memory: MemoryOptions = field(default_factory=MemoryOptions)
    schedule: ScheduleOptions = field(default_factory=ScheduleOptions)
    ablate_features: list[str] = option(factory=list, check=_feature_entries)

    def ratio_at(self, seed: int, step: int) -> float:
        """The step's compression ratio (memory partition; the boundary budget without ``losses.all_budgets``): one
        of ``losses.budgets``, drawn by a generator seeded with ``seed`` and the global step (the same on resume)."""
        budgets = self.losses.budgets
        return budgets[random.Random(seed * 1_000_003 + step).randrange(len(budgets))]


@dataclass
class ReleasedTrainConfig(TrainConfig):
    """:class:`~core_kv.distill.config.TrainConfig` for ``recipe: released``: no teacher dataset (the teacher runs in
    the loop), so ``indexer`` / ``calibration`` / ``memory`` / ``write_rule`` / ``ratios`` are not read;
    ``teacher.model`` and ``teacher.data`` are (the base model and the documents).

    Args:
        released: The recipe's own options (:class:`ReleasedOptions`).
    """

    recipe: str = "released"
    released: ReleasedOptions = field(default_factory=ReleasedOptions)

    recipe_name: ClassVar[str] = "released"


__all__ = ["GeometryOptions", "LossOptions", "MemoryOptions", "ReleasedOptions", "ReleasedTrainConfig",
           "ScheduleOptions"]  # fmt: skip
