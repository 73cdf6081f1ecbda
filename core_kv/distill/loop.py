"""The generic stage loop: optimise one trainable step over a fixed list of items, resumably.

One stage is ``total`` optimizer steps over ``items`` (already in the global data order), with Accelerate's gradient
accumulation, a linear-warm-up/cosine learning rate, gradient clipping, W&B logging and a resumable state every
``save_every`` steps (``state/<stage>/step_*``, written to a temporary folder and renamed; the last ``keep_last``
kept). A finished stage's weights go to ``stages/<stage>.safetensors`` and a rerun loads them instead of training.
"""

from __future__ import annotations

import copy
import shutil
import time
import warnings
from contextlib import nullcontext
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch.utils.data import DataLoader
from tqdm import tqdm

from core_kv.distill.context import RunContext
from core_kv.files import atomic_write, swap_in, writing
from core_kv.schedules import warmup_cosine


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


def run_stage(tr: RunContext, name: str, module, params_of, items: list, total: int, scfg, per_micro: int) -> None:
    """Optimise ``module`` for ``total`` optimizer steps over ``items`` (already in global order)."""
    cfg, acc = tr.cfg, tr.acc
    done = tr.stage_file(name)
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
            tr.print(f"[{name}] finished earlier: loaded {done}")
            tr.global_step += total
            return
    if total == 0:
        _save_stage(tr, name, target)
        return
    optimizer = torch.optim.AdamW(_param_groups(module, scfg), lr=scfg.lr, weight_decay=scfg.weight_decay)
    loader = DataLoader(_ListData(items), batch_size=per_micro, shuffle=False, collate_fn=_collate)
    module, optimizer, loader = acc.prepare(module, optimizer, loader)
    state_root = tr.out / "state" / name
    start = _load_latest_state(tr, name, state_root, module, optimizer)
    active = acc.skip_first_batches(loader, start * cfg.grad_accum) if start else loader
    step, t0, tokens, base = start, time.perf_counter(), 0, tr.global_step
    bar = tqdm(total=total, initial=start, desc=name, disable=not (cfg.progress and acc.is_local_main_process))
    stopped = False
    for batch in active:
        with acc.accumulate(module):
            base_lr = (
                scfg.lr_schedule(step)
                if hasattr(scfg, "lr_schedule")
                else warmup_cosine(step, total, scfg.lr, scfg.warmup_lr_steps)
            )
            for group in optimizer.param_groups:
                group["lr"] = base_lr * group["lr_scale"]
            loss, logs = module(batch)
            timer = tr.timers.get(name)
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
            _save_state(tr, state_root, step)
        tr.run_steps += 1
        if cfg.stop_after and tr.run_steps >= cfg.stop_after and step < total:
            stopped = True
            break
    bar.close()
    acc.wait_for_everyone()
    if stopped:
        if step % cfg.save_every:
            _save_state(tr, state_root, step)
        acc.free_memory(module, optimizer, loader)
        raise Interrupted(f"stopped after step {step} of stage {name} (stop_after={cfg.stop_after})")
    _save_stage(tr, name, target)
    acc.free_memory(module, optimizer, loader)
    tr.global_step = base + total


def _load_latest_state(tr: RunContext, name: str, root: Path, module, optimizer) -> int:
    """Load the newest readable ``root/step_*`` and return its step (0: none); unreadable ones are skipped with a
    warning naming them, and whatever a failed load had already set is restored first."""
    steps = _steps(root)
    if not steps:
        return 0
    acc = tr.acc
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
        tr.print(f"[{name}] resumed from step {step}")
        return step
    warnings.warn(f"[{name}] no readable training state in {root}: the stage starts from step 0", stacklevel=2)
    return 0


def _save_state(tr: RunContext, root: Path, step: int) -> None:
    acc = tr.acc
    tmp, final = root / f".tmp-step_{step:06d}", root / f"step_{step:06d}"
    if tr.main and tmp.exists():
        shutil.rmtree(tmp)
    acc.wait_for_everyone()
    try:
        with writing(tmp, "training state"):
            acc.save_state(str(tmp))
    except BaseException:
        if tr.main:
            shutil.rmtree(tmp, ignore_errors=True)  # a partial state frees its space; the older ones stay
        raise
    acc.wait_for_everyone()
    if tr.main:
        swap_in(tmp, final, old=root / f".old-{final.name}")  # plain modes; the aside name is outside step_*
        for old in sorted(root.glob("step_*"))[: -tr.cfg.keep_last]:
            shutil.rmtree(old)
    acc.wait_for_everyone()


def _save_stage(tr: RunContext, name: str, target: dict) -> None:
    if tr.main:
        tensors = {k: v.detach().cpu().contiguous() for k, v in target.items()}
        with writing(tr.stage_file(name), "finished stage"):
            atomic_write(tr.stage_file(name), lambda tmp: save_file(tensors, tmp))
    tr.acc.wait_for_everyone()


GATE_PARAMS = ("gate_w", "gate_b")


def _param_groups(module, scfg) -> list[dict]:
    """AdamW groups of a stage's trainable parameters, each with its ``lr_scale`` relative to ``scfg.lr``: the
    memory gate's scalars get ``scfg.gate_lr`` (``MemoryStage``), everything else ``scfg.lr``; a stage with
    ``group_scales`` ({name prefix: scale}, e.g. ``research.released``'s joint stage) scales each prefix's parameters."""
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    scales = getattr(scfg, "group_scales", None)
    if scales:
        groups = []
        for prefix, scale in scales.items():
            params = [p for n, p in named if n.startswith(prefix)]
            if params:
                groups.append({"params": params, "lr_scale": scale})
        if sum(len(g["params"]) for g in groups) != len(named):
            raise ValueError(f"group_scales {sorted(scales)} do not partition the stage's trainable parameters")
        return groups
    gate_lr = getattr(scfg, "gate_lr", None)
    if gate_lr is None:
        return [{"params": [p for _, p in named], "lr_scale": 1.0}]
    is_gate = lambda n: n.rsplit(".", 1)[-1] in GATE_PARAMS  # noqa: E731
    return [
        {"params": [p for n, p in named if not is_gate(n)], "lr_scale": 1.0},
        {"params": [p for n, p in named if is_gate(n)], "lr_scale": gate_lr / scfg.lr},
    ]


def _load_into(target: dict, tensors: dict) -> None:
    with torch.no_grad():
        for k, p in target.items():
            p.copy_(tensors[k].to(p.device))


def _steps(root: Path) -> list[int]:
    """Saved steps under ``root`` (``step_*`` folders), newest first."""
    return sorted((int(p.name.split("_")[1]) for p in root.glob("step_*") if p.is_dir()), reverse=True)
