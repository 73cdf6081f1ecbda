"""The contexts distillation reads: the shared objects of one run and its folder layout (:class:`RunContext`), and
the frozen things a trainable step needs (:class:`StepContext`) with the items it is fed (:class:`DocItem`).

:class:`RunContext` is what :mod:`~core_kv.distill.loop`, :mod:`~core_kv.distill.stages`,
:mod:`~core_kv.distill.evaluate` and :mod:`~core_kv.distill.timing` take; :class:`~core_kv.distill.trainer.Trainer`
fills it (base model, teacher data, CORE model) and decides what a rerun keeps. The stages import this module, never
the trainer, so imports inside ``distill/`` flow one way: context <- steps/loop <- stages/evaluate/timing <- trainer.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from core_kv.distill.replay import ReplaySpec, Timer, capture, cascade_capture, replay_layer
from core_kv.documents import Doc, make_docs
from core_kv.geometry import Geometry
from core_kv.teacher.config import event_times


@dataclass
class DocItem:
    """A document and the compression ratio it is replayed at."""

    doc: Doc
    ratio: float


@dataclass
class StepContext:
    """Frozen things a step needs (not part of the trained module)."""

    model: nn.Module
    geometry: Geometry
    spec: ReplaySpec
    timer: Timer
    autocast: object = None

    def acts(self, doc: Doc):
        device = next(self.model.parameters()).device
        with self.timer("base_forward"):
            return capture(self.model, torch.tensor([doc.ids], device=device), self.autocast)

    def cascade_acts(self, doc: Doc, ratio: float, score_fn) -> list:
        """Activations of the compressed cascade at ``ratio``: the student's (``score_fn``) retained sets replace
        the cache in every layer (:func:`~core_kv.distill.replay.cascade_capture`)."""
        device = next(self.model.parameters()).device
        spec = replace(self.spec, ratio=ratio, policy="student", targets=False, utility=False)
        times = self.times(doc)

        def replay(layer, acts):
            return replay_layer(acts, layer, times, doc.qa_start, self.geometry, spec, score_fn, self.timer)

        with self.timer("base_forward"):
            return cascade_capture(self.model, torch.tensor([doc.ids], device=device), replay, self.autocast)

    def times(self, doc: Doc) -> list[int]:
        return event_times(len(doc.ids), doc.qa_start, self.spec.chunk_size)


@dataclass(eq=False)
class RunContext:
    """One run's shared objects.

    Attributes:
        cfg: The resolved :class:`~core_kv.distill.config.TrainConfig`.
        out: The run folder (``cfg.out_dir``).
        acc: The ``accelerate.Accelerator``.
        main: Whether this is the main process (it alone writes files).
        global_step: Optimizer steps over every stage so far (finished stages count in full).
        run_steps: Optimizer steps taken by this invocation (for ``stop_after``).
        timers: One :class:`~core_kv.distill.replay.Timer` per stage.
        model, tok: The frozen base model and its tokenizer (set by the trainer).
        core, core_config: The CORE artifact being trained and its config.
        ds: The teacher dataset; ``geometry`` its key geometry; ``spec`` the replay settings; ``autocast`` the
            mixed-precision context of the base forward (``None`` in fp32).
    """

    cfg: Any
    out: Path
    acc: Any
    main: bool = True
    global_step: int = 0
    run_steps: int = 0
    timers: dict[str, Timer] = field(default_factory=dict)
    model: Any = None
    tok: Any = None
    core: Any = None
    core_config: Any = None
    ds: Any = None
    geometry: Any = None
    spec: ReplaySpec | None = None
    autocast: Any = None
    _docs: dict = field(default_factory=dict, repr=False)

    def print(self, *a) -> None:
        if self.main:
            tqdm.write(" ".join(str(x) for x in a))

    def docs(self, indices: list[int]) -> list:
        missing = [i for i in indices if i not in self._docs]
        if missing:
            for d in make_docs(self.cfg.teacher.data, missing, self.tok):
                self._docs[d.index] = d
        return [self._docs[i] for i in indices]

    def context(self, name: str) -> StepContext:
        self.timers[name] = self.timers.get(name) or Timer(self.acc.device)
        return StepContext(self.model, self.geometry, self.spec, self.timers[name], self.autocast)

    def doc_items(self, steps: int) -> list[DocItem]:
        """The fixed, global data order of a document stage (cycled pool; ratio by position)."""
        cfg = self.cfg
        n = steps * cfg.grad_accum * cfg.micro_batch * self.acc.num_processes
        pool = self.docs(list(range(cfg.train_docs)))
        return [DocItem(pool[j % len(pool)], cfg.ratios[j % len(cfg.ratios)]) for j in range(n)]

    def stage_file(self, name: str) -> Path:
        """A finished stage's weights (``stages/<name>.safetensors``)."""
        return self.out / "stages" / f"{name}.safetensors"
