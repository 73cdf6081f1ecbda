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
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import time
import warnings
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch.utils.data import DataLoader
from tqdm import tqdm

from core_kv.budget import budget_split
from core_kv.config import to_dict
from core_kv.distill.losses import calibration_error, excluded_mass, fit_temperature, kl_to_teacher, topb_overlap
from core_kv.distill.replay import ReplaySpec, Timer, replay_layer, segment_attention
from core_kv.distill.steps import Context, DocItem, MemoryStep, OnPolicyStep, WarmupStep
from core_kv.indexer import CoreConfig, CoreModel
from core_kv.io import atomic_write, atomic_write_json, atomic_write_text
from core_kv.kernels import normalised_beta_b
from core_kv.memory import write_weights
from core_kv.teacher.dataset import TeacherDataset, TeacherDatasetMismatch, config_hash
from core_kv.teacher.docs import load_model, make_docs
from core_kv.teacher.metrics import greedy_select, protected_mask, set_quality, top_free
from core_kv.teacher.run import run_teacher

STAGES = ("indexer_warmup", "indexer", "calibration", "memory")  # in order; each depends on the ones before it
CALIB_OFFSET = 2_000_000  # held-out document indices (the teacher uses 0.. and 1_000_000.. for geometry)
EVAL_OFFSET = 2_100_000


class Interrupted(RuntimeError):
    """``stop_after`` reached: the run stopped after saving a resumable checkpoint."""


class _ListData(torch.utils.data.Dataset):
    def __init__(self, items: list):
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def _collate(batch: list) -> list:
    return list(batch)


def lr_at(step: int, total: int, base: float, warmup: int) -> float:
    """Linear warm-up, then cosine to 10% of ``base`` [choice]."""
    if total <= 0:
        return base
    warm = min(1.0, (step + 1) / max(warmup, 1))
    return base * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(step / total, 1.0))))


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


class Trainer:
    """Holds the run's shared objects; :meth:`run` executes the stages in order."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.out = Path(cfg.out_dir)
        self.acc = _accelerator(cfg)
        self.main = self.acc.is_main_process
        self.global_step = 0
        self.run_steps = 0  # optimizer steps taken by this invocation (for stop_after)
        self.timers: dict[str, Timer] = {}

    # ---------------------------------------------------------------------------------------------------------
    # Setup

    def print(self, *a) -> None:
        if self.main:
            tqdm.write(" ".join(str(x) for x in a))

    def load_base(self) -> dict:
        """Load the frozen base model (and tokenizer); returns its fingerprint."""
        cfg, acc = self.cfg, self.acc
        if cfg.threads > 0:
            torch.set_num_threads(cfg.threads)
        from accelerate.utils import set_seed

        from core_kv.teacher.geometry import model_fingerprint

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
        self.model, self.tok = load_model(spec, acc.device)
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.fingerprint = model_fingerprint(self.model)
        return self.fingerprint

    def run_key(self) -> dict:
        """What the run folder's contents depend on: base model + every training-relevant option."""
        skip = {"out_dir", "progress", "threads", "stop_after", "overwrite", "wandb", "wandb_project", "wandb_mode",
                "save_every", "keep_last", "build_teacher"}  # fmt: skip
        resolved = {k: v for k, v in to_dict(self.cfg).items() if k not in skip}
        resolved["teacher"] = self.cfg.teacher.teacher_params() | {"data": to_dict(self.cfg.teacher.data)}
        return {"fingerprint": self.fingerprint, "config_hash": config_hash(resolved), "stages": self.stage_keys()}

    def stage_keys(self) -> dict[str, str]:
        """One hash per stage: the options the stage reads, chained with the hash of the stage before it, so a change
        to a later stage's options leaves the earlier stages' hashes (and their finished weights) valid."""
        d = to_dict(self.cfg)
        chain = {"fingerprint": self.fingerprint, "seed": d["seed"], "grad_accum": d["grad_accum"],
                 "teacher": self.cfg.teacher.teacher_params() | {"data": d["teacher"]["data"]}}  # fmt: skip
        docs = {k: d[k] for k in ("train_docs", "ratios", "micro_batch")}
        own = {
            "indexer_warmup": {"indexer": {k: v for k, v in d["indexer"].items() if k != "steps"}},
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
            self.ds = TeacherDataset(cfg.teacher.out_dir, fingerprint=fp, teacher=params)
        except (FileNotFoundError, TeacherDatasetMismatch) as e:
            if not cfg.build_teacher:
                raise
            self.print(f"teacher data: {e} -> building it (python -m core_kv.teacher equivalent)")
            run_teacher(replace(cfg.teacher, progress=cfg.progress and cfg.teacher.progress))
            acc.wait_for_everyone()
            self.ds = TeacherDataset(cfg.teacher.out_dir, fingerprint=fp, teacher=params)
        self.print(f"teacher data: {self.ds.path} ({len(self.ds)} records)")
        geometry = self.ds.geometry()
        t = self.ds.manifest["teacher"]
        self.core_config = CoreConfig.for_model(
            self.model, geometry, write_rule=cfg.write_rule, protected_sinks=t["protected_sinks"],
            protected_recent=t["protected_recent"], chunk_size=t["chunk_size"], teacher=t,
            feature_spec=self.ds.manifest["feature_spec"],
        )  # fmt: skip
        torch.manual_seed(cfg.seed)
        self.core = CoreModel(self.core_config)
        self.core.memory.reset_parameters(cfg.seed)
        self.core.set_geometry(geometry)
        self.core.indexer.set_feature_stats(self.ds.feature_stats())
        self.core.to(acc.device)
        self.geometry = self.core.geometry()
        self.spec = ReplaySpec(
            chunk_size=t["chunk_size"], protected_sinks=t["protected_sinks"], protected_recent=t["protected_recent"],
            qa_weight=t["qa_weight"], lam=t["lam"], steps=t["steps"],
            eta=t["eta"] if t["eta"] == "auto" else float(t["eta"]),
        )  # fmt: skip
        self.autocast = acc.autocast() if acc.mixed_precision != "no" else None
        self._docs: dict[int, object] = {}
        if cfg.wandb:
            # mode/dir passed explicitly: wandb caches its settings process-wide at first import, so an earlier
            # WANDB_MODE would otherwise win over this run's
            wandb_kwargs = {"mode": os.environ.get("WANDB_MODE", cfg.wandb_mode)}
            if os.environ.get("WANDB_DIR"):
                wandb_kwargs["dir"] = os.environ["WANDB_DIR"]
            acc.init_trackers(cfg.wandb_project, config=to_dict(cfg), init_kwargs={"wandb": wandb_kwargs})

    def docs(self, indices: list[int]) -> list:
        missing = [i for i in indices if i not in self._docs]
        if missing:
            for d in make_docs(self.cfg.teacher.data, missing, self.tok):
                self._docs[d.index] = d
        return [self._docs[i] for i in indices]

    def context(self, name: str) -> Context:
        self.timers[name] = self.timers.get(name) or Timer(self.acc.device)
        return Context(self.model, self.geometry, self.spec, self.timers[name], self.autocast)

    def doc_items(self, steps: int) -> list[DocItem]:
        """The fixed, global data order of a document stage (cycled pool; ratio by position)."""
        cfg = self.cfg
        n = steps * cfg.grad_accum * cfg.micro_batch * self.acc.num_processes
        pool = self.docs(list(range(cfg.train_docs)))
        return [DocItem(pool[j % len(pool)], cfg.ratios[j % len(cfg.ratios)]) for j in range(n)]

    # ---------------------------------------------------------------------------------------------------------
    # Generic stage loop

    def stage_file(self, name: str) -> Path:
        return self.out / "stages" / f"{name}.safetensors"

    def run_stage(self, name: str, module, params_of, items: list, total: int, scfg, per_micro: int) -> None:
        """Optimise ``module`` for ``total`` optimizer steps over ``items`` (already in global order)."""
        cfg, acc = self.cfg, self.acc
        done = self.stage_file(name)
        target = params_of()
        if done.is_file():
            try:
                tensors = load_file(str(done))
            except Exception as e:  # a truncated file: retrain the stage rather than fail without a path
                warnings.warn(f"[{name}] cannot read {done} ({type(e).__name__}: {e}): retraining the stage",
                              stacklevel=2)  # fmt: skip
                tensors = None
            if tensors is not None:
                _load_into(target, tensors)
                self.print(f"[{name}] finished earlier: loaded {done}")
                self.global_step += total
                return
        if total == 0:
            self._save_stage(name, target)
            return
        optimizer = torch.optim.AdamW(_param_groups(module, scfg), lr=scfg.lr, weight_decay=scfg.weight_decay)
        loader = DataLoader(_ListData(items), batch_size=per_micro, shuffle=False, collate_fn=_collate)
        module, optimizer, loader = acc.prepare(module, optimizer, loader)
        state_root = self.out / "state" / name
        start = self._load_latest_state(name, state_root, module, optimizer)
        active = acc.skip_first_batches(loader, start * cfg.grad_accum) if start else loader
        step, t0, tokens, base = start, time.perf_counter(), 0, self.global_step
        bar = tqdm(total=total, initial=start, desc=name, disable=not (cfg.progress and acc.is_local_main_process))
        stopped = False
        for batch in active:
            with acc.accumulate(module):
                for group in optimizer.param_groups:
                    group["lr"] = lr_at(step, total, scfg.lr, scfg.warmup_lr_steps) * group["lr_scale"]
                loss, logs = module(batch)
                timer = self.timers.get(name)
                with timer("backward_optimizer") if timer else nullcontext():
                    acc.backward(loss)
                    if acc.sync_gradients and scfg.grad_clip > 0:
                        acc.clip_grad_norm_(module.parameters(), scfg.grad_clip)
                    optimizer.step()
                    optimizer.zero_grad()
            tokens += logs.pop("tokens", 0)
            if not acc.sync_gradients:
                continue
            step += 1
            elapsed = time.perf_counter() - t0
            record = {f"{name}/loss": float(loss.detach()), f"{name}/lr": optimizer.param_groups[0]["lr"]}
            record.update({f"{name}/{k}": v for k, v in logs.items()})
            if tokens:
                record[f"{name}/tokens_per_s"] = tokens * acc.num_processes / max(elapsed, 1e-9)
            acc.log(record, step=base + step)
            bar.update(1)
            bar.set_postfix({k.split("/")[1]: f"{v:.4g}" for k, v in record.items() if "lr" not in k})
            if step % cfg.save_every == 0 or step == total:
                self._save_state(state_root, step)
            self.run_steps += 1
            if cfg.stop_after and self.run_steps >= cfg.stop_after and step < total:
                stopped = True
                break
        bar.close()
        acc.wait_for_everyone()
        if stopped:
            if step % cfg.save_every:
                self._save_state(state_root, step)
            acc.free_memory(module, optimizer, loader)
            raise Interrupted(f"stopped after step {step} of stage {name} (stop_after={cfg.stop_after})")
        self._save_stage(name, target)
        acc.free_memory(module, optimizer, loader)
        self.global_step = base + total

    def _load_latest_state(self, name: str, root: Path, module, optimizer) -> int:
        """Load the newest readable ``root/step_*`` and return its step (0: none); unreadable ones are skipped with a
        warning naming them, and whatever a failed load had already set is restored first."""
        steps = _steps(root)
        if not steps:
            return 0
        acc = self.acc
        weights = {k: v.detach().clone() for k, v in acc.unwrap_model(module).state_dict().items()}
        opt_state = copy.deepcopy(optimizer.state_dict())
        for step in steps:
            path = root / f"step_{step:06d}"
            try:
                acc.load_state(str(path))
            except Exception as e:  # truncated/corrupt files: fall back to an older state, saying which was skipped
                warnings.warn(f"[{name}] skipped unreadable training state {path} ({type(e).__name__}: {e})",
                              stacklevel=2)  # fmt: skip
                acc.unwrap_model(module).load_state_dict(weights)
                optimizer.load_state_dict(opt_state)
                continue
            self.print(f"[{name}] resumed from step {step}")
            return step
        warnings.warn(f"[{name}] no readable training state in {root}: the stage starts from step 0", stacklevel=2)
        return 0

    def _save_state(self, root: Path, step: int) -> None:
        acc = self.acc
        tmp, final = root / f".tmp-step_{step:06d}", root / f"step_{step:06d}"
        if self.main and tmp.exists():
            shutil.rmtree(tmp)
        acc.wait_for_everyone()
        acc.save_state(str(tmp))
        acc.wait_for_everyone()
        if self.main:
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            for old in sorted(root.glob("step_*"))[: -self.cfg.keep_last]:
                shutil.rmtree(old)
        acc.wait_for_everyone()

    def _save_stage(self, name: str, target: dict) -> None:
        if self.main:
            tensors = {k: v.detach().cpu().contiguous() for k, v in target.items()}
            atomic_write(self.stage_file(name), lambda tmp: save_file(tensors, tmp))
        self.acc.wait_for_everyone()

    # ---------------------------------------------------------------------------------------------------------
    # Stages

    def stage_indexer(self) -> None:
        cfg, ic = self.cfg, self.cfg.indexer
        idx = self.core.indexer
        params = lambda: _params(idx)  # noqa: E731
        n_rec = ic.warmup_steps * cfg.grad_accum * ic.records_per_micro * self.acc.num_processes
        records = []
        if n_rec and not self.stage_file("indexer_warmup").is_file():
            pool = self.ds.records()
            records = [pool[j % len(pool)] for j in range(n_rec)]
        t = self.core_config
        warm = WarmupStep(idx, ic.rank_weight, t.protected_sinks, t.protected_recent)
        self.run_stage("indexer_warmup", warm, params, records, ic.warmup_steps, ic, ic.records_per_micro)
        items = [] if self.stage_file("indexer").is_file() else self.doc_items(ic.steps)
        step = OnPolicyStep(idx, self.context("indexer"), ic.rank_weight)
        self.run_stage("indexer", step, params, items, ic.steps, ic, cfg.micro_batch)

    def stage_calibration(self) -> dict:
        """Fit T_l on held-out documents so ε̂ matches the true evicted mass; returns the errors per layer."""
        cfg, acc = self.cfg, self.acc
        path = self.out / "stages" / "calibration.json"
        idx = self.core.indexer
        if path.is_file():
            try:
                res = json.loads(path.read_text())
                idx.temperature.copy_(torch.tensor(res["temperature"]))
                self.print(f"[calibration] finished earlier: T = {res['temperature']}")
                return res
            except (json.JSONDecodeError, KeyError, TypeError, RuntimeError) as e:
                warnings.warn(f"[calibration] cannot read {path} ({type(e).__name__}: {e}): refitting", stacklevel=2)
        ctx = self.context("calibration")
        mine = [i for i in range(cfg.calib_docs) if i % acc.num_processes == acc.process_index]
        data = []  # (layer, scores, evicted, alpha) on CPU
        with torch.no_grad():
            for i, doc in zip(mine, self.docs([CALIB_OFFSET + i for i in mine]), strict=True):
                ratio = cfg.ratios[i % len(cfg.ratios)]
                spec = replace(self.spec, ratio=ratio, policy="student", targets=False, utility=True)
                acts = ctx.acts(doc)
                for layer, a in enumerate(acts):
                    for ev in replay_layer(
                        a, layer, ctx.times(doc), doc.qa_start, self.geometry, spec, idx.scores, ctx.timer
                    ):
                        if ev.evicts and ev.pi_u is not None:
                            ev_mask = ~ev.kept
                            alpha = (ev.pi_u * ev_mask).sum(-1)
                            data.append((layer, ev.scores.cpu(), ev_mask.cpu(), alpha.float().cpu()))
        from accelerate.utils import gather_object

        data = gather_object(data) if acc.num_processes > 1 else data
        data.sort(key=lambda x: x[0])  # stable: same order on every rank
        temps, per_layer = [], []
        cc = cfg.calibration
        for layer in range(self.core_config.num_layers):
            rows = [d for d in data if d[0] == layer]
            t, stats = fit_temperature(
                [r[1] for r in rows], [r[2] for r in rows], [r[3] for r in rows],
                (cc.log_t_min, cc.log_t_max), cc.grid,
            )  # fmt: skip
            temps.append(t)
            per_layer.append(stats)
        idx.temperature.copy_(torch.tensor(temps))
        n = sum(s["n"] for s in per_layer)
        res = {
            "temperature": temps,
            "per_layer": per_layer,
            "before": sum(s["before"] * s["n"] for s in per_layer) / max(n, 1),
            "after": sum(s["after"] * s["n"] for s in per_layer) / max(n, 1),
            "docs": cfg.calib_docs,
        }
        if self.main:
            atomic_write_json(path, res)
        acc.wait_for_everyone()
        self.print(
            f"[calibration] T = {[round(x, 3) for x in temps]}; |α − ε̂| {res['before']:.4f} -> {res['after']:.4f}"
        )
        acc.log({"calibration/error_before": res["before"], "calibration/error_after": res["after"]},
                step=self.global_step)  # fmt: skip
        return res

    def stage_memory(self) -> None:
        cfg, mc = self.cfg, self.cfg.memory
        for p in self.core.indexer.parameters():
            p.requires_grad_(False)
        items = [] if self.stage_file("memory").is_file() else self.doc_items(mc.steps)
        step = MemoryStep(self.core.memory, self.core.indexer, self.context("memory"), cfg.write_rule, mc.gate_weight)
        self.run_stage("memory", step, lambda: _params(self.core.memory), items, mc.steps, mc, cfg.micro_batch)

    # ---------------------------------------------------------------------------------------------------------
    # Report

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Held-out report: KL, Top-B overlap, Table 7 rows, calibration, memory error (gathered over ranks)."""
        cfg, acc = self.cfg, self.acc
        idx = self.core.indexer
        ctx = self.context("eval")
        mine = [i for i in range(cfg.eval_docs) if i % acc.num_processes == acc.process_index]
        rows = []
        mem_step = MemoryStep(self.core.memory, idx, ctx, cfg.write_rule, cfg.memory.gate_weight)
        docs = self.docs([EVAL_OFFSET + i for i in mine])
        for doc in tqdm(docs, desc="eval", disable=not (cfg.progress and acc.is_local_main_process)):
            acts = ctx.acts(doc)
            for ratio in cfg.eval_ratios:
                tag = f"r{round(100 * ratio)}"
                for policy in ("student", "full"):
                    spec = replace(self.spec, ratio=ratio, policy=policy, targets=True)
                    for layer, a in enumerate(acts):
                        for ev in replay_layer(
                            a, layer, ctx.times(doc), doc.qa_start, self.geometry, spec, idx.scores, ctx.timer
                        ):
                            if ev.p_star is None:
                                continue
                            rows.append(
                                _event_rows(tag, policy, layer, ev, self.spec, ratio, self.geometry, a, idx,
                                            cfg.eval_greedy)
                            )  # fmt: skip
                terms, rm, rn, gg = mem_step.doc_terms(DocItem(doc, ratio))
                rows.append({"kind": "memory", "tag": tag, "rel_mem": rm, "rel_none": rn, "gate_gap": gg})
            self.profile(doc, cfg.eval_ratios[0])
        from accelerate.utils import gather_object

        rows = gather_object(rows) if acc.num_processes > 1 else rows
        return _summarise(rows, cfg.eval_ratios)

    @torch.no_grad()
    def profile(self, doc, ratio: float) -> None:
        """Time what the press does per document: base forward, features, indexer, memory writes + readout.

        Teacher targets and the reference attention outputs are not timed (training/evaluation only); the
        retained attention ``o_R``/``lse_R`` is computed outside the timer (the attention kernel gives it).
        """
        ctx = self.context("deploy")
        idx, mem = self.core.indexer, self.core.memory
        spec = replace(self.spec, ratio=ratio, policy="student", targets=False, utility=False)
        acts = ctx.acts(doc)
        for layer, a in enumerate(acts):
            events = replay_layer(a, layer, ctx.times(doc), doc.qa_start, self.geometry, spec, idx.scores, ctx.timer)
            state = mem.empty_state(device=a.k_pre.device)
            heads = torch.arange(a.k_pre.shape[0], device=a.k_pre.device)[:, None]
            for ev in events:
                if ev.end <= ev.t_e:
                    continue
                seg = segment_attention(a, ev)
                with ctx.timer("memory"):
                    if ev.evicts:
                        w = write_weights(idx.distribution(layer, ev.scores), ~ev.kept, self.cfg.write_rule)
                        pos = ev.evicted_positions()
                        state = mem.write(state, layer, a.k_pre[heads, pos], a.v[heads, pos], w[~ev.kept].view_as(pos))
                    mem.compensate(state, layer, seg["q_pre"], seg["o_ret"], seg["lse_ret"])

    def timing(self) -> dict:
        """Step-time breakdown (seconds and shares) of the on-policy indexer and memory stages, and deployment."""
        out = {}
        for name, t in self.timers.items():
            total = sum(t.seconds.values())
            if total:
                out[name] = {"seconds": dict(t.seconds), "share": {k: v / total for k, v in t.seconds.items()}}
        ev = self.timers.get("deploy")
        if ev:
            deploy = {k: ev.seconds.get(k, 0.0) for k in ("base_forward", "features", "indexer", "memory")}
            tot = sum(deploy.values())
            out["deployment_parts"] = {
                "seconds": deploy,
                "share": {k: v / tot for k, v in deploy.items()} if tot else {},
                "outside_base_forward": (tot - deploy["base_forward"]) / tot if tot else float("nan"),
                "note": "press-like pass per held-out document: frozen base forward vs features vs indexer vs memory",
            }
        return out

    def save_final(self, summary: dict) -> Path:
        cfg, acc = self.cfg, self.acc
        final = self.out / "final"
        if self.main:
            tmp = self.out / ".tmp-final"
            if tmp.exists():
                shutil.rmtree(tmp)
            self.core.to("cpu").save_pretrained(str(tmp), save_function=acc.save)
            self.core.to(acc.device)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            from omegaconf import OmegaConf

            atomic_write_text(self.out / "config.yaml", OmegaConf.to_yaml(to_dict(cfg)))
            atomic_write_json(self.out / "summary.json", summary)
            atomic_write_text(self.out / "report.md", distill_report_markdown(summary))
        acc.wait_for_everyone()
        return final

    def close(self) -> None:
        if self.cfg.wandb:
            self.acc.end_training()
        self.acc.free_memory()
        if self.acc.num_processes > 1 and torch.distributed.is_initialized():
            self.acc.end_training()


def _event_rows(tag, policy, layer, ev, spec, ratio, geometry, acts, idx, greedy: bool) -> dict:
    row = {"kind": "event", "tag": tag, "policy": policy, "layer": layer,
           "kl": float(kl_to_teacher(ev.p_star, ev.scores).mean())}  # fmt: skip
    if policy == "student":
        if ev.evicts and ev.b_free > 0:
            row["overlap"] = float(topb_overlap(ev.scores, ev.p_star, ev.protected, ev.b_free).mean())
            ev_mask = ~ev.kept
            row["alpha"] = (ev.pi_u * ev_mask).sum(-1).float().tolist()
            row["eps_cal"] = excluded_mass(ev.scores, ev_mask, idx.temperature[layer]).tolist()
            row["eps_raw"] = excluded_mass(ev.scores, ev_mask, 1.0).tolist()
        return row
    n = ev.cand.shape[1]
    b, s, w = budget_split(n, ratio, spec.protected_sinks, spec.protected_recent)
    b_free = b - s - w
    if not 0 < b_free < n - s - w:
        return row
    prot = protected_mask(n, s, w, device=ev.cand.device)
    row["overlap"] = float(topb_overlap(ev.scores, ev.p_star, prot, b_free).mean())
    heads = torch.arange(ev.cand.shape[0], device=ev.cand.device)[:, None]
    phi = geometry.nystrom(layer, geometry.project(layer, acts.k_pre))[heads, ev.cand].double()
    beta_b = normalised_beta_b(phi)
    sets = {
        "utility": top_free(ev.pi_u, prot, b_free),
        "teacher": top_free(ev.p_star, prot, b_free),
        "student": top_free(ev.scores.float(), prot, b_free),
    }
    if greedy:
        sets["greedy"] = greedy_select(ev.pi_u, phi, beta_b, prot, b_free)
    for name, mask in sets.items():
        u, c = set_quality(mask, ev.pi_u, phi, beta_b)
        row[f"U.{name}"], row[f"C.{name}"] = u.tolist(), c.tolist()
    return row


def _mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else float("nan")


def _summarise(rows: list[dict], ratios: list[float]) -> dict:
    out: dict = {}
    for r in ratios:
        tag = f"r{round(100 * r)}"
        ev = [x for x in rows if x["kind"] == "event" and x["tag"] == tag]
        res: dict = {}
        for policy in ("student", "full"):
            sel = [x for x in ev if x["policy"] == policy]
            res[f"kl_{policy}_candidates"] = _mean(x["kl"] for x in sel)
            res[f"topb_overlap_{policy}_candidates"] = _mean(x["overlap"] for x in sel if "overlap" in x)
        st = [x for x in ev if x["policy"] == "student" and "alpha" in x]
        alpha = torch.tensor([a for x in st for a in x["alpha"]])
        res["calibration_error_T1"] = calibration_error(torch.tensor([a for x in st for a in x["eps_raw"]]), alpha)
        res["calibration_error_T"] = calibration_error(torch.tensor([a for x in st for a in x["eps_cal"]]), alpha)
        res["mean_true_evicted_mass"] = float(alpha.mean()) if alpha.numel() else float("nan")
        full = [x for x in ev if x["policy"] == "full" and "U.student" in x]
        t7 = {}
        for name in ("utility", "teacher", "student", "greedy"):
            u = [v for x in full for v in x.get(f"U.{name}", [])]
            c = [v for x in full for v in x.get(f"C.{name}", [])]
            if u:
                t7[name] = {"U_B": _mean(u), "C_B": _mean(c), "J_B": _mean(a + b for a, b in zip(u, c, strict=True))}
        res["table7"] = t7
        if "student" in t7 and "teacher" in t7:
            res["student_J_over_teacher_J"] = t7["student"]["J_B"] / t7["teacher"]["J_B"]
        mem = [x for x in rows if x["kind"] == "memory" and x["tag"] == tag]
        res["memory_rel_err"] = _mean(v for x in mem for v in x["rel_mem"])
        res["retained_only_rel_err"] = _mean(v for x in mem for v in x["rel_none"])
        res["gate_abs_err_vs_alpha"] = _mean(v for x in mem for v in x["gate_gap"])
        res["events"] = len(st)
        out[tag] = res
    return out


GATE_PARAMS = ("gate_w", "gate_b")


def _param_groups(module, scfg) -> list[dict]:
    """AdamW groups of a stage's trainable parameters, each with its ``lr_scale`` relative to ``scfg.lr``: the
    memory gate's scalars get ``scfg.gate_lr`` (``MemoryStage``), everything else ``scfg.lr``."""
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    gate_lr = getattr(scfg, "gate_lr", None)
    if gate_lr is None:
        return [{"params": [p for _, p in named], "lr_scale": 1.0}]
    is_gate = lambda n: n.rsplit(".", 1)[-1] in GATE_PARAMS  # noqa: E731
    return [
        {"params": [p for n, p in named if not is_gate(n)], "lr_scale": 1.0},
        {"params": [p for n, p in named if is_gate(n)], "lr_scale": gate_lr / scfg.lr},
    ]


def _params(module) -> dict:
    return dict(module.named_parameters())


def _load_into(target: dict, tensors: dict) -> None:
    with torch.no_grad():
        for k, p in target.items():
            p.copy_(tensors[k].to(p.device))


def _steps(root: Path) -> list[int]:
    """Saved steps under ``root`` (``step_*`` folders), newest first."""
    return sorted((int(p.name.split("_")[1]) for p in root.glob("step_*") if p.is_dir()), reverse=True)


def format_summary(summary: dict) -> str:
    lines = ["CORE stage 2 — distillation, calibration, memory (held-out documents)"]
    for tag, r in summary["eval"].items():
        lines.append(
            f"  {tag}: KL {r['kl_student_candidates']:.4f} (student cands) / {r['kl_full_candidates']:.4f} (full); "
            f"Top-B overlap {100 * r['topb_overlap_student_candidates']:.1f}% / {100 * r['topb_overlap_full_candidates']:.1f}%"
        )
        lines.append(
            f"        |α − ε̂| {r['calibration_error_T1']:.4f} (T=1) -> {r['calibration_error_T']:.4f} (calibrated); "
            f"rel. err. retained-only {r['retained_only_rel_err']:.4f} -> with memory {r['memory_rel_err']:.4f}"
        )
        for name, v in r["table7"].items():
            lines.append(f"        Table 7 {name:>8}: U_B {v['U_B']:.4f}  C_B {v['C_B']:.4f}  J_B {v['J_B']:.4f}")
    dp = summary["timing"].get("deployment_parts")
    if dp:
        lines.append(
            "  time per document (press-like pass): "
            + ", ".join(f"{k} {100 * v:.1f}%" for k, v in dp["share"].items())
            + f"; outside the base forward {100 * dp['outside_base_forward']:.1f}%"
        )
    lines.append(f"  artifact: {summary['artifact']}  ({summary['wall_s']:.0f} s)")
    return "\n".join(lines)


def distill_report_markdown(summary: dict) -> str:
    """The summary as the markdown tables of ``docs/results.md`` (also written to ``<out_dir>/report.md``)."""
    ev, lines = summary["eval"], []
    lines += ["| ratio | candidates | KL(p* ‖ softmax s) | Top-B overlap (free picks) |", "|---|---|---|---|"]
    for tag, r in ev.items():
        for pol, name in (("student", "student's own retained sets"), ("full", "full cache (teacher protocol)")):
            lines.append(f"| {tag[1:]}% | {name} | {r[f'kl_{pol}_candidates']:.4f} | "
                         f"{100 * r[f'topb_overlap_{pol}_candidates']:.1f}% |")  # fmt: skip
    lines += ["", "| ratio | selector | U_B | C_B | J_B | J_B / teacher |", "|---|---|---|---|---|---|"]
    for tag, r in ev.items():
        t7 = r["table7"]
        ref = t7.get("teacher", {}).get("J_B", float("nan"))
        for name in ("utility", "student", "teacher", "greedy"):
            if name in t7:
                v = t7[name]
                lines.append(f"| {tag[1:]}% | {name} | {v['U_B']:.4f} | {v['C_B']:.4f} | {v['J_B']:.4f} | "
                             f"{100 * v['J_B'] / ref:.2f}% |")  # fmt: skip
    cal = summary["calibration"]
    lines += ["", f"Temperatures T_l: {', '.join(f'{t:.3f}' for t in cal['temperature'])} "
              f"(fit on {cal['docs']} held-out documents; mean |α − ε̂| {cal['before']:.4f} → {cal['after']:.4f}).", ""]  # fmt: skip
    lines += ["| ratio | mean α | \|α − ε̂\| at T = 1 | at T_l | rel. error retained-only | with memory | "
              "\|g − α\| |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for tag, r in ev.items():
        lines.append(f"| {tag[1:]}% | {r['mean_true_evicted_mass']:.4f} | {r['calibration_error_T1']:.4f} | "
                     f"{r['calibration_error_T']:.4f} | {r['retained_only_rel_err']:.4f} | {r['memory_rel_err']:.4f} | "
                     f"{r['gate_abs_err_vs_alpha']:.4f} |")  # fmt: skip
    lines += ["", "| pass | part | seconds | share |", "|---|---|---|---|"]
    tm = summary["timing"]
    for name in ("deployment_parts", "indexer", "memory"):
        if name in tm:
            for k, v in tm[name]["seconds"].items():
                lines.append(f"| {name} | {k} | {v:.2f} | {100 * tm[name]['share'][k]:.1f}% |")
    return "\n".join(lines) + "\n"


def train(cfg) -> dict:
    """Run every stage (resuming where a previous run stopped) and write ``<out_dir>/final/``.

    Returns the summary dict (also ``<out_dir>/summary.json``); raises :class:`Interrupted` when ``stop_after``
    stops the run early.
    """
    t0 = time.perf_counter()
    tr = Trainer(cfg)
    final = tr.out / "final"
    try:
        tr.print(f"run folder: {tr.out} (the artifact goes to {final})")
        tr.load_base()
        key, key_path = tr.run_key(), tr.out / "run.json"
        stored = _read_run_key(key_path)
        same_run = stored is not None and all(stored.get(k) == key[k] for k in ("fingerprint", "config_hash"))
        if same_run and (final / "config.json").is_file() and (tr.out / "summary.json").is_file():
            if not cfg.overwrite:
                summary = json.loads((tr.out / "summary.json").read_text())
                tr.print(f"{final} exists for this base model and config (overwrite=true to retrain)")
                tr.print(format_summary(summary))
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
            for name in STAGES:
                if old.get(name) != key["stages"][name] and (
                    (tr.out / "state" / name).exists() or list((tr.out / "stages").glob(f"{name}.*"))
                ):
                    tr.print(f"[{name}] {tr.out} holds this stage for other options: discarding it")
                    tr.discard_stage(name)
        if tr.main:
            atomic_write_json(key_path, key)
        tr.acc.wait_for_everyone()
        tr.setup()
        tr.stage_indexer()
        calib = tr.stage_calibration()
        tr.stage_memory()
        ev = tr.evaluate()
        summary = {
            "eval": ev,
            "calibration": calib,
            "timing": tr.timing(),
            "teacher_table7": _teacher_table7(tr.ds),
            "parameters": tr.core.num_parameters_by_part(),
            "memory_state_bytes": tr.core.memory.state_bytes(),
            "num_processes": tr.acc.num_processes,
            "distributed_type": str(tr.acc.distributed_type),
            "docs_per_step": cfg.micro_batch * cfg.grad_accum * tr.acc.num_processes,
            "artifact": str(final),
            "wall_s": time.perf_counter() - t0,
        }
        tr.save_final(summary)
        tr.print(format_summary(summary))
        return summary
    finally:
        tr.close()


def _read_run_key(path: Path) -> dict | None:
    """``run.json`` (None when absent; an unreadable one is reported and treated as absent)."""
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        warnings.warn(f"cannot read {path} ({e}): treating the run folder as holding another config", stacklevel=2)
        return None


def _teacher_table7(ds: TeacherDataset) -> dict | None:
    path = ds.path / ds.manifest.get("metrics", "metrics.json")
    if path.is_file():
        return json.loads(path.read_text()).get("table7")
    return None
