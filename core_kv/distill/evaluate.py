"""Held-out evaluation of a trained CORE model: KL, Top-B overlap, Table 7 rows, calibration and memory error.

Per held-out document and ratio, the eviction events are replayed twice, on the student's own retained sets and on
the full cache (the teacher's protocol), and the memory stage's output errors are measured; rows are gathered over
ranks and summarised per ratio (the ``eval`` part of ``summary.json``).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from tqdm import tqdm

from core_kv.budget import budget_split, protected_mask, top_free
from core_kv.distill.context import DocItem, RunContext
from core_kv.distill.losses import calibration_error, excluded_mass, kl_to_teacher, topb_overlap
from core_kv.distill.replay import replay_layer
from core_kv.distill.steps import MemoryStep
from core_kv.distill.timing import profile
from core_kv.nystrom import normalised_beta_b
from core_kv.teacher.metrics import greedy_select, set_quality

EVAL_OFFSET = 2_100_000  # held-out document indices, after the calibration documents' (stages.CALIB_OFFSET)


@torch.no_grad()
def evaluate(tr: RunContext) -> dict:
    """Held-out report: KL, Top-B overlap, Table 7 rows, calibration, memory error (gathered over ranks)."""
    cfg, acc = tr.cfg, tr.acc
    idx = tr.core.indexer
    ctx = tr.context("eval")
    mine = [i for i in range(cfg.eval_docs) if i % acc.num_processes == acc.process_index]
    rows = []
    mem_step = MemoryStep(tr.core.memory, idx, ctx, cfg.write_rule, cfg.memory.gate_weight)
    docs = tr.docs([EVAL_OFFSET + i for i in mine])
    for doc in tqdm(docs, desc="eval", disable=not (cfg.progress and acc.is_local_main_process)):
        acts = ctx.acts(doc)
        for ratio in cfg.eval_ratios:
            tag = f"r{round(100 * ratio)}"
            for policy in ("student", "full"):
                spec = replace(tr.spec, ratio=ratio, policy=policy, targets=True)
                for layer, a in enumerate(acts):
                    for ev in replay_layer(
                        a, layer, ctx.times(doc), doc.qa_start, tr.geometry, spec, idx.scores, ctx.timer
                    ):
                        if ev.p_star is None:
                            continue
                        rows.append(
                            _event_rows(tag, policy, layer, ev, tr.spec, ratio, tr.geometry, a, idx,
                                        cfg.eval_greedy)
                        )  # fmt: skip
            terms, rm, rn, gg = mem_step.doc_terms(DocItem(doc, ratio))
            rows.append({"kind": "memory", "tag": tag, "rel_mem": rm, "rel_none": rn, "gate_gap": gg})
        profile(tr, doc, cfg.eval_ratios[0])
    from accelerate.utils import gather_object

    rows = gather_object(rows) if acc.num_processes > 1 else rows
    return _summarise(rows, cfg.eval_ratios)


def _event_rows(tag, policy, layer, ev, spec, ratio, geometry, acts, idx, greedy: bool) -> dict:
    row = {"kind": "event", "tag": tag, "policy": policy, "layer": layer,
           "kl": float(kl_to_teacher(ev.p_star, ev.scores).mean())}  # fmt: skip
    if policy == "student":
        if ev.evicts and ev.b_free > 0:
            row["overlap"] = float(topb_overlap(ev.scores, ev.p_star, ev.protected, ev.b_free).mean())
            ev_mask = ~ev.kept
            row["alpha"] = (ev.mass * ev_mask).sum(-1).float().tolist()
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
