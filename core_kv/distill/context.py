"""The run context every distillation stage reads: the shared objects of one run and its folder layout.

:class:`RunContext` is what :mod:`~core_kv.distill.loop`, :mod:`~core_kv.distill.stages`,
:mod:`~core_kv.distill.evaluate` and :mod:`~core_kv.distill.timing` take; :class:`~core_kv.distill.trainer.Trainer`
fills it (base model, teacher data, CORE model) and decides what a rerun keeps. The stages import this module, never
the trainer, so imports inside ``distill/`` flow one way: context <- loop/stages/evaluate/timing <- trainer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from core_kv.distill.replay import ReplaySpec, Timer
from core_kv.distill.steps import DocItem, StepContext
from core_kv.documents import make_docs


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
