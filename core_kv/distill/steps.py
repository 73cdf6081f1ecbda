"""The three trainable steps, each an ``nn.Module`` whose ``forward(batch)`` returns ``(loss, logs)``.

Accelerate wraps these modules (DDP / DeepSpeed), so the whole replay of a micro-batch runs inside ``forward`` —
the student's retention decisions at event e depend on its current weights, so they cannot be precomputed.
Frozen context (base model, geometry, frozen indexer; :class:`~core_kv.distill.context.StepContext`) is held outside
the module tree so the wrapper never
broadcasts or trains it.

- :class:`WarmupStep`: KL on the teacher dataset's records (teacher-forced, full-cache candidates).
- :class:`OnPolicyStep`: chunked-prefill replay with the student's own retained sets, teacher targets online.
- :class:`MemoryStep`: replay with the frozen indexer and temperatures, real evictions, memory writes and the
  gated readout against the full-cache attention output.

Every loss is a mean over documents (records) of a mean over that document's (event, layer, head) items, so a
micro-batch of 2 equals two accumulated micro-batches of 1 and one process with 2 equals two processes with 1.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from core_kv.budget import protected_mask
from core_kv.distill.context import DocItem, StepContext
from core_kv.distill.losses import (
    kl_to_teacher,
    memory_loss,
    relative_error,
    shared_view,
    topb_boundary_bce,
    topb_overlap,
)
from core_kv.distill.replay import replay_layer, segment_attention
from core_kv.indexer import CoreIndexer
from core_kv.memory import LatentMemory, write_weights
from core_kv.teacher.dataset import TeacherRecord


def _zero(module: nn.Module) -> torch.Tensor:
    """A zero that touches every parameter (keeps DDP's reducer happy when a batch has no items)."""
    return sum(p.sum() * 0.0 for p in module.parameters() if p.requires_grad)


class WarmupStep(nn.Module):
    """KL(p* ‖ softmax(s)) (+ Top-B boundary BCE) on teacher records."""

    def __init__(
        self, indexer: CoreIndexer, rank_weight: float, sinks: int, recent: int, ratio_index: int = 0,
        selection: str = "per_head",
    ):  # fmt: skip
        super().__init__()
        self.indexer = indexer
        self.rank_weight, self.sinks, self.recent, self.ratio_index = rank_weight, sinks, recent, ratio_index
        self.selection = selection

    def forward(self, records: list[TeacherRecord]):
        device = self.indexer.head_bias.device
        losses, kls, overlaps = [], [], []
        for j, r in enumerate(records):
            s = self.indexer.scores(r.layer, r.features.to(device))  # (Hkv, N)
            p = r.p_star.to(device)
            if self.selection == "shared":  # the pooled target and the pooled (served) score: (1, N)
                p, s = shared_view(p, s)
            kl = kl_to_teacher(p, s).mean()
            loss = kl
            n = p.shape[-1]
            b = int(r.budgets[(self.ratio_index + j) % r.budgets.numel()])
            sk = min(self.sinks, b)
            w = min(self.recent, b - sk)
            prot = protected_mask(n, sk, w, device=device)
            b_free = b - sk - w
            if 0 < b_free < n - sk - w:
                if self.rank_weight > 0:
                    loss = loss + self.rank_weight * topb_boundary_bce(p, s, prot, b_free).mean()
                overlaps.append(topb_overlap(s.detach(), p, prot, b_free).mean())
            losses.append(loss)
            kls.append(kl.detach())
        loss = torch.stack(losses).mean() + _zero(self)
        logs = {"kl": float(torch.stack(kls).mean())}
        if overlaps:
            logs["topb_recall"] = float(torch.stack(overlaps).mean())
        return loss, logs


class OnPolicyStep(nn.Module):
    """Replay with the student's own retained sets; KL to the teacher's p* computed on those candidates.

    With ``cascade`` the activations (and so the teacher's future queries) come from the compressed cascade
    (:meth:`StepContext.cascade_acts`, the student's current weights choosing every layer's evictions), not from the
    full-cache forward."""

    def __init__(self, indexer: CoreIndexer, ctx: StepContext, rank_weight: float, cascade: bool = False):
        super().__init__()
        self.indexer = indexer
        self.__dict__["ctx"] = ctx  # frozen: kept out of the module tree
        self.rank_weight = rank_weight
        self.cascade = cascade

    def forward(self, items: list[DocItem]):
        ctx = self.ctx
        doc_losses, kls, overlaps, tokens = [], [], [], 0
        for it in items:
            if self.cascade:  # cascade_capture runs without gradient
                acts = ctx.cascade_acts(it.doc, it.ratio, self.indexer.scores)
            else:
                acts = ctx.acts(it.doc)
            spec = replace(ctx.spec, ratio=it.ratio, policy="student", targets=True)
            terms = []
            for layer, a in enumerate(acts):
                events = replay_layer(
                    a, layer, ctx.times(it.doc), it.doc.qa_start, ctx.geometry, spec, self.indexer.scores, ctx.timer
                )
                with ctx.timer("indexer"):
                    for ev in events:
                        if ev.p_star is None:
                            continue
                        p, s = ev.p_star, ev.scores
                        if spec.selection == "shared":  # the pooled target and the pooled (served) score: (1, N)
                            p, s = shared_view(p, s)
                        kl = kl_to_teacher(p, s).mean()
                        term = kl
                        if ev.evicts and ev.b_free > 0:
                            if self.rank_weight > 0:
                                bce = topb_boundary_bce(p, s, ev.protected, ev.b_free).mean()
                                term = term + self.rank_weight * bce
                            overlaps.append(topb_overlap(s.detach(), p, ev.protected, ev.b_free).mean())
                        terms.append(term)
                        kls.append(kl.detach())
            tokens += len(it.doc.ids)
            if terms:
                doc_losses.append(torch.stack(terms).mean())
        loss = (torch.stack(doc_losses).mean() if doc_losses else 0.0) + _zero(self)
        logs = {"tokens": tokens}
        if kls:
            logs["kl"] = float(torch.stack(kls).mean())
        if overlaps:
            logs["topb_recall"] = float(torch.stack(overlaps).mean())
        return loss, logs


class MemoryStep(nn.Module):
    """Replay with real evictions by the frozen, calibrated indexer; train ``W_φ`` and the gate."""

    def __init__(
        self, memory: LatentMemory, indexer: CoreIndexer, ctx: StepContext, write_rule: str, gate_weight: float
    ):
        super().__init__()
        self.memory = memory
        self.__dict__["ctx"] = ctx
        self.__dict__["frozen_indexer"] = indexer
        self.write_rule, self.gate_weight = write_rule, gate_weight

    def doc_terms(self, it: DocItem) -> tuple[list[torch.Tensor], list[float], list[float], list[float]]:
        """Per (layer, event with memory): losses, relative errors with memory, without memory, gate − α."""
        ctx, idx = self.ctx, self.frozen_indexer
        acts = ctx.acts(it.doc)
        spec = replace(ctx.spec, ratio=it.ratio, policy="student", targets=False, utility=False)
        terms, rel_mem, rel_none, gate_gap = [], [], [], []
        for layer, a in enumerate(acts):
            with torch.no_grad():
                events = replay_layer(a, layer, ctx.times(it.doc), it.doc.qa_start, ctx.geometry, spec, idx.scores,
                                      ctx.timer, distribution_fn=idx.distribution)  # fmt: skip
            with ctx.timer("memory"):
                state = self.memory.empty_state(device=a.k_pre.device)
                for ev in events:
                    if ev.evicts:
                        with torch.no_grad():
                            p = idx.distribution(layer, ev.scores)
                        hkv = ev.cand.shape[0]
                        w = write_weights(p, ~ev.kept, self.write_rule)[~ev.kept].view(hkv, -1)  # (Hkv, E)
                        pos, heads = ev.evicted_positions(), torch.arange(hkv, device=ev.cand.device)[:, None]
                        state = self.memory.write(state, layer, a.k_pre[heads, pos], a.v[heads, pos], w)
                    if state.events == 0 or ev.end <= ev.t_e:
                        continue
                    seg = segment_attention(a, ev)
                    o_hat, g = self.memory.compensate(state, layer, seg["q_pre"], seg["o_ret"], seg["lse_ret"])
                    loss, rel = memory_loss(o_hat, seg["o_full"], g, seg["alpha"], self.gate_weight)
                    terms.append(loss)
                    rel_mem.append(float(rel))
                    rel_none.append(float(relative_error(seg["o_ret"], seg["o_full"])))
                    gate_gap.append(float((g.detach() - seg["alpha"]).abs().mean()))
        return terms, rel_mem, rel_none, gate_gap

    def forward(self, items: list[DocItem]):
        doc_losses, rel_mem, rel_none, tokens = [], [], [], 0
        for it in items:
            terms, rm, rn, _ = self.doc_terms(it)
            tokens += len(it.doc.ids)
            rel_mem += rm
            rel_none += rn
            if terms:
                doc_losses.append(torch.stack(terms).mean())
        loss = (torch.stack(doc_losses).mean() if doc_losses else 0.0) + _zero(self)
        logs = {"tokens": tokens}
        if rel_mem:
            logs["mem_rel_err"] = sum(rel_mem) / len(rel_mem)
            logs["ret_rel_err"] = sum(rel_none) / len(rel_none)
        return loss, logs
