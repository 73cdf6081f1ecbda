"""``train(cfg)``: teacher data → indexer distillation → calibration → latent memory → ``final/`` artifact.

Accelerate owns distribution and precision (``accelerate launch``): DDP on GPUs, gloo processes on CPU (an explicit
``InitProcessGroupKwargs(backend="gloo")`` so DeepSpeed ZeRO-2 also sees the right world size on CPU,
``shared/research/env.md`` §2), gradient accumulation with ``accelerator.accumulate``, mixed precision for the
frozen base forward through ``accelerator.autocast()``, W&B through ``init_trackers``/``log``.

Run folder ``cfg.out_dir``::

    state/<stage>/step_000016/   resumable training state (accelerator.save_state), written to a temporary folder
                                 and renamed (atomic); the last ``keep_last`` are kept
    stages/<stage>.safetensors   weights of a finished stage (a rerun skips it)
    stages/calibration.json      temperatures and calibration errors
    run.json                     base-model fingerprint + config hash, and one hash per stage (its options and those
                                 of the stages before it)
    final/                       the artifact: config.json + model.safetensors (CoreModel.from_pretrained)
    summary.json, config.yaml    the final report and the resolved config

Resume: a rerun with the same config skips finished stages, loads the newest readable ``state/<stage>/step_*`` (an
unreadable one is skipped with a warning) and skips the micro-batches already consumed (``skip_first_batches``); the
data order is a fixed list, so the resumed run reaches the same weights as an uninterrupted one. A rerun with other
options keeps every finished stage whose own options (and those of the stages before it) are unchanged, and discards
the others: changing ``memory.*`` retrains the memory stage only. A folder holding a finished ``final/`` of another
config is never touched: the run refuses unless ``overwrite=true`` (or another ``out_dir``) is given.

Two kinds of checkpoints are never mixed: ``state/`` holds optimizer/RNG pickles written by Accelerate for
resuming only; ``final/`` holds only ``config.json`` and safetensors.

This module sets the run up and decides what a rerun keeps; the parts live beside it, one concern each:
:mod:`~core_kv.distill.loop` (the generic resumable stage loop), :mod:`~core_kv.distill.stages` (indexer,
calibration, memory), :mod:`~core_kv.distill.evaluate` (held-out evaluation), :mod:`~core_kv.distill.timing`
(step-time breakdown) and :mod:`~core_kv.distill.report` (console summary, ``report.md``).
"""

from __future__ import annotations

import json
import os
import shutil
import time
import warnings
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path

import torch

from core_kv.config import ConfigError, import_plugins, to_dict
from core_kv.core_model import CoreConfig, CoreModel
from core_kv.distill.config import TrainConfig
from core_kv.distill.context import RunContext
from core_kv.distill.evaluate import evaluate
from core_kv.distill.loop import Interrupted
from core_kv.distill.replay import ReplaySpec
from core_kv.distill.report import distill_report_markdown, format_summary
from core_kv.distill.stages import calibrate, train_indexer, train_memory
from core_kv.distill.timing import timing
from core_kv.files import atomic_write_json, atomic_write_text, read_json, swap_in, writing
from core_kv.geometry import Geometry
from core_kv.lock import main_process_lock
from core_kv.models.loading import check_lengths, check_vocabulary, load_from_spec
from core_kv.teacher.dataset import TeacherDataset, TeacherDatasetMismatch, config_hash
from core_kv.teacher.run import run_teacher

__all__ = ["RECIPES", "STAGES", "Interrupted", "Trainer", "recipe", "register_recipe", "train", "train_schema"]

STAGES = ("indexer_warmup", "indexer", "calibration", "memory")  # in order; each depends on the ones before it
# Options added after artifacts were shipped: left out of the run and stage hashes while at these defaults, so
# finished runs (checkpoints/core-*) stay recognised as the same config.
LATER_DEFAULTS = {("indexer", "cascade"): False, ("teacher", "features"): 1}


def _hashed(cfg) -> dict:
    """``to_dict(cfg)`` without the :data:`LATER_DEFAULTS` options that are at their default."""
    d = to_dict(cfg)
    d.pop("plugins", None)  # which modules were imported, not what is trained
    d.pop("search", None)  # which recipes a search compares: each contestant is a run of its own, without a search
    if d.get("recipe", "replay") == "replay":  # added after artifacts were shipped; the replay recipe's hashes omit it
        d.pop("recipe", None)
    for (section, name), default in LATER_DEFAULTS.items():
        if d[section].get(name, default) == default:
            d[section].pop(name, None)
    if d.get("selection", "per_head") == "per_head":  # added after artifacts were shipped (issue 56)
        d.pop("selection", None)
    return d


def _accelerator(cfg):
    from accelerate import Accelerator, DataLoaderConfiguration, InitProcessGroupKwargs

    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    handlers = [InitProcessGroupKwargs(backend="gloo")] if distributed and not torch.cuda.is_available() else []
    if cfg.wandb:
        os.environ.setdefault("WANDB_MODE", cfg.wandb_mode)
    return Accelerator(
        gradient_accumulation_steps=cfg.grad_accum,
        log_with="wandb" if cfg.wandb else None,
        project_dir=cfg.out_dir,
        kwargs_handlers=handlers,
        dataloader_config=DataLoaderConfiguration(even_batches=True),
        step_scheduler_with_optimizer=False,
    )


class Trainer(RunContext):
    """Sets a run up (base model, teacher data, CORE model, W&B) and decides what a rerun keeps; the stages of
    :mod:`~core_kv.distill.stages` read the shared objects through :class:`~core_kv.distill.context.RunContext`.

    The ``replay`` recipe. Another recipe subclasses it (its own ``config_class``, :meth:`setup`, :meth:`stage_keys`,
    :meth:`run_stages` and reports) and is registered with :func:`register_recipe` (:data:`RECIPES`).

    Attributes:
        config_class: The recipe's config schema (``TrainConfig`` or a subclass adding the recipe's own section).
        policy_candidate: How the policy stage builds a candidate composition on this recipe's artifact,
            ``(artifact, ratio, options) -> press or None`` (``None``: the candidate does not apply); ``None``:
            CORE's own composition (:func:`~core_kv.presses.core.compose`).
        unread: The options (dotted names) this recipe never reads; :func:`check_unread` refuses a run that sets one.
    """

    stages = STAGES
    config_class = TrainConfig
    policy_candidate = None
    unread: tuple[str, ...] = ()

    def __init__(self, cfg):
        out = Path(cfg.out_dir)
        acc = _accelerator(cfg)
        super().__init__(cfg=cfg, out=out, acc=acc, main=acc.is_main_process)

    def load_base(self) -> dict:
        """Load the frozen base model (and tokenizer); returns its fingerprint."""
        cfg, acc = self.cfg, self.acc
        if cfg.threads > 0:
            torch.set_num_threads(cfg.threads)
        from accelerate.utils import set_seed

        from core_kv.models.fingerprint import model_fingerprint

        set_seed(cfg.seed)
        spec = cfg.teacher.model
        if (
            not spec.random_init
            and spec.path.startswith(("checkpoints/", "runs/", ".", "/"))
            and not Path(spec.path).exists()
        ):
            raise FileNotFoundError(
                f"base model folder {spec.path!r} not found: build the proxy LM first "
                "(python -m core_kv.proxy.train --config configs/proxy/default.yaml, then mode=export) "
                "or pass teacher.model.path=<HF folder or hub id>"
            )
        self.model, self.tok = load_from_spec(spec, acc.device)
        if self.tok is not None:
            check_vocabulary(self.model, self.tok, f"teacher.model {spec.path} with teacher.model.tokenizer "
                                                   f"{spec.tokenizer or spec.path}")  # fmt: skip
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.fingerprint = model_fingerprint(self.model)
        # the options bounded by the base model, before the first stage builds anything with them
        check_lengths(self.model, self.lengths(), f"teacher.model {spec.path or '(random_init)'}")
        if cfg.policy.enabled and self.tok is not None:
            cfg.policy.check_layers(self.fingerprint["layers"])
        return self.fingerprint

    def lengths(self) -> dict[str, int]:
        """The token lengths this recipe feeds the base model, by option (checked against its context window)."""
        cfg = self.cfg
        out = {"teacher.data.max_len": cfg.teacher.data.max_len}
        policy = cfg.policy.enabled and self.tok is not None  # without a tokenizer the policy stage is skipped
        return out | ({f"policy.lengths[{i}]": n for i, n in enumerate(cfg.policy.lengths)} if policy else {})

    def run_key(self) -> dict:
        """What the run folder's contents depend on: base model + every training-relevant option."""
        skip = {"out_dir", "progress", "threads", "stop_after", "overwrite", "wandb", "wandb_project", "wandb_mode",
                "save_every", "keep_last", "build_teacher", "policy"}  # fmt: skip
        resolved = {k: v for k, v in _hashed(self.cfg).items() if k not in skip}
        resolved["teacher"] = self._teacher_key() | {"data": to_dict(self.cfg.teacher.data)}
        return {"fingerprint": self.fingerprint, "config_hash": config_hash(resolved), "stages": self.stage_keys()}

    def _teacher_key(self) -> dict:
        """The teacher parameters every stage depends on, with the feature spec when it is not v1 (v1 runs predate
        the option and keep their hashes)."""
        features = self.cfg.teacher.features
        return self.cfg.teacher.teacher_params() | ({"features": features} if features != 1 else {})

    def stage_keys(self) -> dict[str, str]:
        """One hash per stage: the options the stage reads, chained with the hash of the stage before it, so a change
        to a later stage's options leaves the earlier stages' hashes (and their finished weights) valid."""
        d = _hashed(self.cfg)
        chain = {"fingerprint": self.fingerprint, "seed": d["seed"], "grad_accum": d["grad_accum"],
                 "teacher": self._teacher_key() | {"data": d["teacher"]["data"]}}  # fmt: skip
        if "selection" in d:  # every stage replays (or trains on) the selection: one link at the chain's root
            chain["selection"] = d["selection"]
        docs = {k: d[k] for k in ("train_docs", "ratios", "micro_batch")}
        own = {
            "indexer_warmup": {"indexer": {k: v for k, v in d["indexer"].items() if k not in ("steps", "cascade")}},
            "indexer": {"indexer": d["indexer"], **docs},
            "calibration": {"calibration": d["calibration"], "calib_docs": d["calib_docs"]},
            "memory": {"memory": d["memory"], "write_rule": d["write_rule"]},
        }
        out = {}
        for name in STAGES:
            chain = {"previous": config_hash(chain), **own[name]}
            out[name] = config_hash(chain)
        return out

    def discard_stage(self, name: str) -> None:
        """Delete a stage's finished weights and resumable states (main process)."""
        for p in (self.out / "stages" / f"{name}.safetensors", self.out / "stages" / f"{name}.json"):
            p.unlink(missing_ok=True)
        shutil.rmtree(self.out / "state" / name, ignore_errors=True)

    def setup(self) -> None:
        cfg, acc = self.cfg, self.acc
        fp = self.fingerprint
        params = cfg.teacher.teacher_params()
        try:
            self.ds = TeacherDataset(
                cfg.teacher.out_dir, fingerprint=fp, teacher=params, feature_version=cfg.teacher.features
            )
        except (FileNotFoundError, TeacherDatasetMismatch) as e:
            if not cfg.build_teacher:
                raise
            if isinstance(e, TeacherDatasetMismatch) and not cfg.teacher.overwrite:
                raise TeacherDatasetMismatch(
                    f"{cfg.teacher.out_dir} holds a finished teacher dataset of another config ({e}), which a run "
                    "never replaces unasked: pass teacher.out_dir=<another folder> to build this one beside it, or "
                    "teacher.overwrite=true to replace it"
                ) from None
            self.print(f"teacher data: {e} -> building it (python -m core_kv.teacher equivalent)")
            run_teacher(replace(cfg.teacher, progress=cfg.progress and cfg.teacher.progress))
            acc.wait_for_everyone()
            self.ds = TeacherDataset(
                cfg.teacher.out_dir, fingerprint=fp, teacher=params, feature_version=cfg.teacher.features
            )
        self.print(f"teacher data: {self.ds.path} ({len(self.ds)} records)")
        geometry = Geometry.load(self.ds.geometry_path, self.ds.manifest["fingerprint"])
        t = self.ds.manifest["teacher"]
        self.core_config = CoreConfig.for_model(
            self.model, geometry, write_rule=cfg.write_rule, protected_sinks=t["protected_sinks"],
            protected_recent=t["protected_recent"], chunk_size=t["chunk_size"], teacher=t,
            feature_spec=self.ds.manifest["feature_spec"], trained_selection=cfg.selection,
        )  # fmt: skip
        torch.manual_seed(cfg.seed)
        self.core = CoreModel(self.core_config)
        self.core.memory.reset_parameters(cfg.seed)
        self.core.set_geometry(geometry)
        self.core.indexer.set_feature_stats(self.ds.feature_stats())
        self.core.to(acc.device)
        self.geometry = self.core.geometry()
        self.spec = ReplaySpec.from_teacher(
            t, features=self.ds.manifest["feature_spec"]["version"], selection=cfg.selection
        )
        self.autocast = acc.autocast() if acc.mixed_precision != "no" else None
        self.start_trackers()

    def start_trackers(self) -> None:
        """W&B through ``accelerator.init_trackers`` when ``wandb`` is on (the end of :meth:`setup`)."""
        cfg = self.cfg
        if cfg.wandb:
            # mode/dir passed explicitly: wandb caches its settings process-wide at first import, so an earlier
            # WANDB_MODE would otherwise win over this run's
            wandb_kwargs = {"mode": os.environ.get("WANDB_MODE", cfg.wandb_mode)}
            if os.environ.get("WANDB_DIR"):
                wandb_kwargs["dir"] = os.environ["WANDB_DIR"]
            self.acc.init_trackers(cfg.wandb_project, config=to_dict(cfg), init_kwargs={"wandb": wandb_kwargs})

    def save_final(self, summary: dict) -> Path:
        cfg, acc = self.cfg, self.acc
        final = self.out / "final"
        if self.main:
            tmp = self.out / ".tmp-final"
            if tmp.exists():
                shutil.rmtree(tmp)
            try:
                with writing(tmp, "CORE artifact"):
                    self.core.to("cpu").save_pretrained(str(tmp), save_function=acc.save)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            self.core.to(acc.device)
            swap_in(tmp, final)  # plain modes (safetensors' writer makes its files owner-only); never without final/
            from omegaconf import OmegaConf

            atomic_write_text(self.out / "config.yaml", OmegaConf.to_yaml(to_dict(cfg)))
            atomic_write_json(self.out / "summary.json", summary)
            atomic_write_text(self.out / "report.md", self.report_markdown(summary))
        acc.wait_for_everyone()
        return final

    def run_stages(self, t0: float) -> dict:
        """Train every stage (each resumable), evaluate, and return the run's summary (the caller writes the
        artifact)."""
        cfg = self.cfg
        train_indexer(self)
        calib = calibrate(self)
        train_memory(self)
        ev = evaluate(self)
        return {
            "eval": ev,
            "calibration": calib,
            "timing": timing(self.timers),
            "teacher_table7": _teacher_table7(self.ds),
            "parameters": self.core.num_parameters_by_part(),
            "memory_state_bytes": self.core.memory.state_bytes(),
            "num_processes": self.acc.num_processes,
            "distributed_type": str(self.acc.distributed_type),
            "docs_per_step": cfg.micro_batch * cfg.grad_accum * self.acc.num_processes,
            "artifact": str(self.out / "final"),
            "wall_s": time.perf_counter() - t0,
        }

    def format_summary(self, summary: dict) -> str:
        """The console summary of a finished run."""
        return format_summary(summary)

    def report_markdown(self, summary: dict) -> str:
        """``<out_dir>/report.md``."""
        return distill_report_markdown(summary)

    def close(self) -> None:
        if self.cfg.wandb:
            self.acc.end_training()
        self.acc.free_memory()
        if self.acc.num_processes > 1 and torch.distributed.is_initialized():
            self.acc.end_training()


def train(cfg, then: Callable[[dict], dict] | None = None) -> dict:
    """Run every stage (resuming where a previous run stopped) and write ``<out_dir>/final/``.

    Args:
        then: What every process runs next on the run folder, the main one still holding its lock (``train.py``'s
            policy stage), with the summary; it returns the summary. The trainer (its models) is released first.

    Returns the summary dict (also ``<out_dir>/summary.json``); raises :class:`Interrupted` when ``stop_after``
    stops the run early.
    """
    t0 = time.perf_counter()
    trainer = recipe(cfg.recipe)
    if not isinstance(cfg, trainer.config_class):
        raise ConfigError(f"recipe {cfg.recipe!r} trains from a {trainer.config_class.__name__}, got a "
                          f"{type(cfg).__name__}: load the config with train_schema (train.py does)")  # fmt: skip
    check_unread(cfg, trainer.unread)
    tr = trainer(cfg)
    with ExitStack() as locked:
        try:
            locked.enter_context(main_process_lock(cfg.out_dir, "training run", tr.acc))  # one writer per run folder
            summary = _train(tr, t0)
        finally:
            tr.close()
        tr = None  # the base model and CORE are freed before ``then`` loads what it needs
        return then(summary) if then is not None else summary


def check_unread(cfg, unread: tuple[str, ...]) -> None:
    """Refuse options the chosen recipe never reads (``unread``: dotted names) set away from their defaults: they
    would be ignored without a word."""
    default = to_dict(type(cfg)())
    given = to_dict(cfg)
    changed = []
    for name in unread:
        a, b = given, default
        for part in name.split("."):
            a, b = a[part], b[part]
        if isinstance(a, dict):
            changed += [f"{name}.{k}" for k in a if a[k] != b.get(k)]
        elif a != b:
            changed.append(name)
    if changed:
        raise ConfigError(f"recipe={cfg.recipe!r} never reads {', '.join(changed)}: remove "
                          f"{'it' if len(changed) == 1 else 'them'} (or choose the recipe that reads "
                          f"{'it' if len(changed) == 1 else 'them'})")  # fmt: skip


def _train(tr: Trainer, t0: float) -> dict:
    """:func:`train`'s body, with the run folder locked."""
    cfg = tr.cfg
    final = tr.out / "final"
    tr.print(f"run folder: {tr.out} (the artifact goes to {final})")
    tr.load_base()
    key, key_path = tr.run_key(), tr.out / "run.json"
    stored = _read_run_key(key_path)
    same_run = stored is not None and all(stored.get(k) == key[k] for k in ("fingerprint", "config_hash"))
    if same_run and (final / "config.json").is_file() and (tr.out / "summary.json").is_file():
        if not cfg.overwrite:
            summary = read_json(tr.out / "summary.json", "run summary")
            tr.print(f"{final} exists for this base model and config (overwrite=true to retrain)")
            tr.print(tr.format_summary(summary))
            return summary
    if final.exists() and not same_run and not cfg.overwrite:
        raise ValueError(
            f"{tr.out} holds a finished CORE artifact ({final}) of another base model or config, which a new run "
            f"never deletes: pass out_dir=<another folder> to train this config beside it, or overwrite=true to "
            f"replace it"
        )
    if tr.main and cfg.overwrite:
        tr.print(f"overwrite=true: deleting the run in {tr.out} and retraining")
        for sub in ("state", "stages", "final", "summary.json"):
            p = tr.out / sub
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    elif tr.main and not same_run:
        old = (stored or {}).get("stages") or {}
        for name in tr.stages:
            if old.get(name) != key["stages"][name] and (
                (tr.out / "state" / name).exists() or list((tr.out / "stages").glob(f"{name}.*"))
            ):
                tr.print(f"[{name}] {tr.out} holds this stage for other options: discarding it")
                tr.discard_stage(name)
    if tr.main:
        atomic_write_json(key_path, key)
    tr.acc.wait_for_everyone()
    tr.setup()
    summary = tr.run_stages(t0)
    tr.save_final(summary)
    tr.print(tr.format_summary(summary))
    return summary


def _read_run_key(path: Path) -> dict | None:
    """``run.json`` (None when absent; an unreadable one is reported and treated as absent)."""
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        warnings.warn(f"cannot read {path} ({e}): treating the run folder as holding another config", stacklevel=2)
        return None


def _teacher_table7(ds: TeacherDataset) -> dict | None:
    path = ds.path / ds.manifest.get("metrics", "metrics.json")
    if path.is_file():
        metrics = read_json(path, "teacher metrics")
        return metrics.get("table7") if isinstance(metrics, dict) else None
    return None


RECIPES: dict[str, type[Trainer]] = {"replay": Trainer}  # recipe name -> its trainer (register_recipe)


def register_recipe(name: str, trainer: type[Trainer]) -> type[Trainer]:
    """Make ``recipe: <name>`` train with ``trainer`` (a plugin calls this when imported)."""
    RECIPES[name] = trainer
    return trainer


def recipe(name: str) -> type[Trainer]:
    """The trainer of recipe ``name``; an unregistered one is refused naming the option and how to enable it."""
    if name not in RECIPES:
        raise ConfigError(
            f"recipe: {name!r} is not registered (registered: {', '.join(sorted(RECIPES))}); a plugin recipe is "
            "enabled by listing its module in the train config's plugins, imported before the rest of the config "
            "is read (e.g. `plugins: [research.released]` for recipe: released)"
        )
    return RECIPES[name]


def train_schema(raw) -> type[TrainConfig]:
    """The config schema of a train config's YAML and overrides ``raw`` (a mapping, before it is checked): import
    its ``plugins`` (each registers its recipes), then the ``recipe``'s ``config_class``
    (:func:`core_kv.config.load_config`'s ``resolve``)."""
    import_plugins(raw)
    return recipe(raw.get("recipe") or "replay").config_class
