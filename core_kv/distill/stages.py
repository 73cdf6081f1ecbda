"""The four stages of ``train(cfg)``, in order: indexer warm-up + on-policy indexer, calibration, latent memory.

Each takes the run's :class:`~core_kv.distill.context.RunContext` (base model, teacher data, CORE model, documents) and
trains or fits one part of ``tr.core``; the optimised ones run through :func:`~core_kv.distill.loop.run_stage`.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import replace

import torch

from core_kv.distill.context import RunContext
from core_kv.distill.loop import run_stage
from core_kv.distill.losses import fit_temperature
from core_kv.distill.replay import replay_layer
from core_kv.distill.steps import MemoryStep, OnPolicyStep, WarmupStep
from core_kv.files import atomic_write_json

CALIB_OFFSET = 2_000_000  # held-out document indices (the teacher uses 0.. and 1_000_000.. for geometry)


def train_indexer(tr: RunContext) -> None:
    """Stages ``indexer_warmup`` (teacher records) and ``indexer`` (on-policy replay of training documents)."""
    cfg, ic = tr.cfg, tr.cfg.indexer
    idx = tr.core.indexer
    params = lambda: dict(idx.named_parameters())  # noqa: E731
    n_rec = ic.warmup_steps * cfg.grad_accum * ic.records_per_micro * tr.acc.num_processes
    records = []
    if n_rec and not tr.stage_file("indexer_warmup").is_file():
        pool = tr.ds.records()
        records = [pool[j % len(pool)] for j in range(n_rec)]
    t = tr.core_config
    warm = WarmupStep(idx, ic.rank_weight, t.protected_sinks, t.protected_recent, selection=cfg.selection)
    run_stage(tr, "indexer_warmup", warm, params, records, ic.warmup_steps, ic, ic.records_per_micro)
    items = [] if tr.stage_file("indexer").is_file() else tr.doc_items(ic.steps)
    step = OnPolicyStep(idx, tr.context("indexer"), ic.rank_weight, cascade=ic.cascade)
    run_stage(tr, "indexer", step, params, items, ic.steps, ic, cfg.micro_batch)


def calibrate(tr: RunContext) -> dict:
    """Fit T_l on held-out documents so ε̂ matches the true evicted mass; returns the errors per layer."""
    cfg, acc = tr.cfg, tr.acc
    path = tr.out / "stages" / "calibration.json"
    idx = tr.core.indexer
    if path.is_file():
        try:
            res = json.loads(path.read_text())
            idx.temperature.copy_(torch.tensor(res["temperature"]))
            tr.print(f"[calibration] finished earlier: T = {res['temperature']}")
            return res
        except (ValueError, KeyError, TypeError, RuntimeError) as e:  # JSON/UTF-8 errors are ValueErrors
            warnings.warn(f"[calibration] cannot read {path} ({type(e).__name__}: {e}): refitting", stacklevel=2)
    ctx = tr.context("calibration")
    mine = [i for i in range(cfg.calib_docs) if i % acc.num_processes == acc.process_index]
    data = []  # (layer, scores, evicted, alpha) on CPU
    with torch.no_grad():
        for i, doc in zip(mine, tr.docs([CALIB_OFFSET + i for i in mine]), strict=True):
            ratio = cfg.ratios[i % len(cfg.ratios)]
            # α is the evicted attention mass of the future queries: always the mean pool, whatever the teacher's
            spec = replace(tr.spec, ratio=ratio, policy="student", targets=False, utility=True, utility_pool="mean")
            acts = ctx.acts(doc)
            for layer, a in enumerate(acts):
                for ev in replay_layer(
                    a, layer, ctx.times(doc), doc.qa_start, tr.geometry, spec, idx.scores, ctx.timer
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
    for layer in range(tr.core_config.num_layers):
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
        "before": sum(s["before"] * s["n"] for s in per_layer if s["n"]) / max(n, 1),  # n = 0: a window layer
        "after": sum(s["after"] * s["n"] for s in per_layer if s["n"]) / max(n, 1),
        "docs": cfg.calib_docs,
    }
    if tr.main:
        atomic_write_json(path, res)
    acc.wait_for_everyone()
    tr.print(f"[calibration] T = {[round(x, 3) for x in temps]}; |α − ε̂| {res['before']:.4f} -> {res['after']:.4f}")
    acc.log({"calibration/error_before": res["before"], "calibration/error_after": res["after"]},
            step=tr.global_step)  # fmt: skip
    return res


def train_memory(tr: RunContext) -> None:
    """Stage ``memory``: the latent memory on the frozen, calibrated indexer's evictions."""
    cfg, mc = tr.cfg, tr.cfg.memory
    for p in tr.core.indexer.parameters():
        p.requires_grad_(False)
    items = [] if tr.stage_file("memory").is_file() else tr.doc_items(mc.steps)
    step = MemoryStep(tr.core.memory, tr.core.indexer, tr.context("memory"), cfg.write_rule, mc.gate_weight)
    run_stage(tr, "memory", step, lambda: dict(tr.core.memory.named_parameters()), items, mc.steps, mc, cfg.micro_batch)
