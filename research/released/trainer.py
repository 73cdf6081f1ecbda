"""The released recipe (``recipe: released``): online distillation with the frozen model in the loop.

The CORE authors' training (GitHub ``zhutizi23-coder/CORE`` ``core/train.py`` ``train_indexer_online`` /
``train_joint_online``, ``core/collector.py`` ``collect_online_batch``), our own implementation. Each optimizer step
takes ``grad_accum`` sequences; for each one:

1. one forward of the frozen model captures every layer's post-RoPE queries and keys and its values
   (:func:`~core_kv.distill.replay.capture`); the *event* is the whole prompt: candidates are its ``n`` tokens
   (the tokens before the first answer token; for plain text the sequence minus the memory's 16-query tail in the
   joint stage), and its queries are the same ``n`` positions;
2. per layer: the 14 features of spec v3 over all ``n`` queries and, from the same logits, the raw-logit utility
   (:func:`~research.released.features.compute_features_v3`); the DRIVE teacher ``π_T`` (:mod:`research.released.teacher`);
   the student's one score per token ``s`` (head-shared); the loss
   ``λ_cal KL(π_T ‖ softmax(s/τ_m)) + λ_bd · mean_r hinge_r`` with the protected sinks left out of both, the hinge at
   every budget of ``budgets`` (:func:`~core_kv.distill.losses.multi_budget_hinge`);
3. every ``decode_every`` steps also a decode-window batch: the same candidates, the last ``decode_window`` prompt
   queries as the event's queries, phase 1, its own DRIVE target, the hinge at the step's ratio only;
4. in the joint stage, per layer: the prompt is compressed at the step's ratio by the student (sinks kept, scores
   detached), the evicted tokens are written to an empty fast memory with the conditional weights of
   ``softmax(s/τ_m)`` (:mod:`research.released.memory`), and the last ``memory_tail`` queries (answer tokens when the
   sequence has them) are reconstructed: ``‖o* − o_R − g(q) m(q)‖²``.

The step's loss is the layer mean of the indexer terms (the decode terms weighted by ``decode_weight`` in the same
mean) plus ``λ_mem`` times the layer mean of the memory terms; a micro-batch's loss is the mean over its sequences.

Stages (each resumable by :func:`~core_kv.distill.loop.run_stage`): ``online_indexer`` (``indexer_steps``, the
indexer alone) then ``online_joint`` (the rest of ``total_steps``; a fresh AdamW with the indexer at
``joint_indexer_lr_scale`` and the memory at ``joint_memory_lr_scale`` of the schedule's rate). One WSD schedule
spans both (:meth:`~research.released.config.ScheduleOptions.lr_at` of the global step).

Importing this module registers the recipe (:func:`core_kv.distill.trainer.register_recipe`): ``recipe: released``
with ``plugins: [research.released]`` in a train config.

Shapes: H query heads, Hkv KV heads, G = H / Hkv, D head dim, T tokens, n prompt tokens, W = H·D, V = Hkv·D.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, fields, replace

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from core_kv.budget import kept_tokens
from core_kv.config import to_dict
from core_kv.distill.loop import run_stage
from core_kv.distill.replay import Timer, capture
from core_kv.distill.timing import timing
from core_kv.distill.trainer import Trainer, register_recipe
from core_kv.documents import Doc, make_docs
from core_kv.models.attention import LayerQKV
from core_kv.teacher.config import TeacherConfig
from research.released.config import ReleasedOptions, ReleasedTrainConfig
from research.released.features import SPEC, ablated_names, compute_features_v3, special_mask
from research.released.geometry import KeyGeometry
from research.released.losses import boundary_windows, masked_kl, multi_budget_hinge, pairwise_hinge
from research.released.memory import memory_mse
from research.released.model import ReleasedConfig, ReleasedModel
from research.released.presses import policy_candidate
from research.released.report import format_summary, report_markdown
from research.released.teacher import DriveConfig, drive_teacher

STAGES = ("online_indexer", "online_joint")
LONG_OFFSET = 4_000_000  # document indices of the long-sequence pool (the short pool uses 0..)
EVAL_OFFSET = 2_100_000  # held-out documents (as the replay recipe's report)


@dataclass
class OnlineItem:
    """One training sequence and what its global optimizer step asks of it."""

    doc: Doc
    step: int  # global optimizer step, 1-based
    ratio: float
    decode: bool


@dataclass
class OnlineContext:
    """Frozen things a step needs (kept out of the trained module tree)."""

    model: nn.Module
    geometry: KeyGeometry
    drive: DriveConfig
    ocfg: ReleasedOptions
    special_ids: list[int]
    timer: Timer
    autocast: object = None


def prompt_split(doc: Doc, tail: int, memory: bool) -> tuple[int, int]:
    """``(n, q)``: the prompt length (the event's candidates and queries) and the number of supervised memory queries
    at the end of the sequence. With an answer: the prompt ends at its first token and ``q = min(answer, tail)``;
    plain text: the last ``tail`` tokens are held out of the prompt when the memory is trained."""
    t_len = len(doc.ids)
    if doc.answer_start is not None and 0 < doc.answer_start < t_len:
        return doc.answer_start, min(t_len - doc.answer_start, tail)
    held = min(tail, max(0, t_len - 2)) if memory else 0
    return t_len - held, max(held, 1) if memory else 0


def attention_rows(a: LayerQKV, qpos: torch.Tensor, allowed: torch.Tensor, share: torch.Tensor | None = None):
    """Attention outputs before ``o_proj`` of the queries at ``qpos`` over the keys ``allowed`` (Tq, K) (each query's
    own causal set already applied), concatenated over heads: (Tq, W). With ``share`` (K,) bool, also the attention
    mass each query puts on those keys, averaged over query heads (Tq,)."""
    hkv, _, d = a.k_post.shape
    g = a.groups
    k_len = allowed.shape[1]
    q = a.q_post[:, qpos].view(hkv, g, len(qpos), d)
    logits = (q @ a.k_post[:, None, :k_len].mT) * a.scaling  # (Hkv, G, Tq, K)
    probs = logits.masked_fill(~allowed, float("-inf")).softmax(-1)
    out = probs @ a.v[:, None, :k_len]  # (Hkv, G, Tq, D)
    out = out.reshape(hkv * g, len(qpos), d).transpose(0, 1).reshape(len(qpos), hkv * g * d)
    if share is None:
        return out
    return out, (probs * share.to(probs.dtype)).sum(-1).mean((0, 1))


def keep_mask(scores: torch.Tensor, ratio: float, sinks: int) -> torch.Tensor:
    """The prompt's retained set at ``ratio`` by the student's scores (N,): the first ``sinks`` plus the top others,
    ``max(kept_tokens, sinks)`` in all."""
    n = scores.shape[0]
    s = min(sinks, n)
    b = min(n, max(kept_tokens(n, ratio), s))
    ranked = scores.detach().clone()
    ranked[:s] = float("inf")
    keep = torch.zeros(n, dtype=torch.bool, device=scores.device)
    keep[ranked.topk(b).indices] = True
    return keep


def single_budget_hinge(scores, p_teacher, ratio: float, o) -> torch.Tensor:
    """The boundary hinge at one ratio (the decode batch; or every step without ``all_budgets``)."""
    n = scores.shape[0]
    s = min(o.losses.sinks, n)
    eligible = torch.ones(n, dtype=torch.bool, device=scores.device)
    eligible[:s] = False
    pos, neg = boundary_windows(p_teacher, max(s, kept_tokens(n, ratio)) - s, o.losses.boundary_delta, eligible)
    return pairwise_hinge(scores, pos, neg, o.losses.boundary_margin, o.losses.student_temperature)


def sequence_terms(ctx: OnlineContext, indexer, memory, item: OnlineItem, joint: bool) -> dict:
    """Every term of one sequence: ``core`` (scalar, the indexer loss's layer mean), ``mem`` (scalar or None) and
    the diagnostics (KL, hinge, memory gap and gate), differentiable where they are trained."""
    o = ctx.ocfg
    dev = next(indexer.parameters()).device
    ids = torch.tensor([item.doc.ids], device=dev)
    with ctx.timer("base_forward"):
        acts = capture(ctx.model, ids, ctx.autocast)
    n, tail = prompt_split(item.doc, o.memory.tail, joint and memory is not None)
    pos = torch.arange(n, device=dev)
    special = special_mask(ids[0, :n], ctx.special_ids)
    eligible = pos >= o.losses.sinks
    core, decode, mem, mses, kls, bds, gaps, gates, alphas, recalls = [], [], [], [], [], [], [], [], [], []
    per_layer: dict[int, tuple[float, float]] = {}  # memory layer -> (its error with memory, retained-only)
    for layer, a in enumerate(acts):
        k, v = a.k_post[:, :n], a.v[:, :n]
        with ctx.timer("features"):
            feats, z, util = compute_features_v3(a.q_post[:, :n], k, v, pos, pos, n, ctx.geometry, layer, a.scaling,
                                                 0, special, with_utility=True)  # fmt: skip
        with ctx.timer("teacher"):
            pi = drive_teacher(z, util, ctx.drive).float()
        with ctx.timer("indexer"):
            s = indexer.scores(layer, feats[None])[0]  # (n,) one score per token, shared by the KV heads
            kl = masked_kl(pi, s, eligible, o.losses.student_temperature)
            if o.losses.all_budgets:
                bd = multi_budget_hinge(s, pi, o.losses.budgets, o.losses.sinks, o.losses.boundary_delta, o.losses.boundary_margin,
                                        o.losses.student_temperature)  # fmt: skip
            else:
                bd = single_budget_hinge(s, pi, item.ratio, o)
            core.append(o.losses.lambda_cal * kl + o.losses.lambda_bd * bd)
            kls.append(float(kl.detach()))
            bds.append(float(bd.detach()))
            recalls.append(_topb_recall(s.detach(), pi, item.ratio, o.losses.sinks))
        if item.decode and o.schedule.decode_weight > 0:
            w = min(o.schedule.decode_window, n)
            with ctx.timer("features"):
                dfeats, _, dutil = compute_features_v3(a.q_post[:, n - w : n], k, v, pos[n - w :], pos, n, ctx.geometry,
                                                       layer, a.scaling, 1, special, with_utility=True)  # fmt: skip
            with ctx.timer("teacher"):
                dpi = drive_teacher(z, dutil, ctx.drive).float()
            with ctx.timer("indexer"):
                ds = indexer.scores(layer, dfeats[None])[0]
                dloss = o.losses.lambda_cal * masked_kl(dpi, ds, eligible, o.losses.student_temperature)
                decode.append(dloss + o.losses.lambda_bd * single_budget_hinge(ds, dpi, item.ratio, o))
        if joint and memory is not None and tail > 0:
            with ctx.timer("memory"):
                term, mse, gap, gate, alpha = _memory_term(a, memory, layer, s.detach(), n, tail, item.ratio, o)
                mem.append(term)
                mses.append(mse)
                per_layer[layer] = (mse, gap)
                gaps.append(gap)
                gates.append(gate)
                alphas.append(alpha)
    weight = len(core) + o.schedule.decode_weight * len(decode)
    out = {
        "core": (torch.stack(core).sum() + o.schedule.decode_weight * (torch.stack(decode).sum() if decode else 0.0))
        / weight,
        "mem": torch.stack(mem).mean() if mem else None,
        "kl": sum(kls) / len(kls),
        "bd": sum(bds) / len(bds),
        "topb_recall": sum(recalls) / len(recalls),
        "tokens": len(item.doc.ids),
    }
    if mem:
        out.update(
            mem_mse=sum(mses) / len(mses),
            mem_gap=sum(gaps) / len(gaps),
            mem_layers=per_layer,
            gate=sum(gates) / len(gates),
            alpha_e=sum(alphas) / len(alphas),
        )
    return out


def _topb_recall(s: torch.Tensor, pi: torch.Tensor, ratio: float, sinks: int) -> float:
    """Share of the teacher's non-sink Top-B that the student also keeps, at ``ratio``."""
    n = s.shape[0]
    b = max(sinks, kept_tokens(n, ratio)) - min(sinks, n)
    if b <= 0 or b >= n - sinks:
        return 1.0
    a = s[sinks:].topk(b).indices
    t = pi[sinks:].topk(b).indices
    return float(torch.isin(a, t).float().mean())


def _memory_term(a: LayerQKV, memory, layer: int, scores: torch.Tensor, n: int, tail: int, ratio: float, o):
    """The memory loss of one layer: compress the prompt at ``ratio``, write the evicted tokens, reconstruct the
    last ``tail`` queries (plus ``memory_gate_weight · BCE(g, α_E)``). Returns ``(loss, its reconstruction part
    ‖o* − ô‖² mean, ‖o* − o_R‖² mean, gate mean, α_E mean)``."""
    dev = scores.device
    t_len = a.k_post.shape[1]
    keep = keep_mask(scores, ratio, o.losses.sinks)  # (n,)
    evicted = ~keep
    qpos = torch.arange(t_len - tail, t_len, device=dev)
    kpos = torch.arange(t_len, device=dev)
    causal = kpos[None, :] <= qpos[:, None]  # (tail, T)
    readable = torch.cat([keep, torch.ones(t_len - n, dtype=torch.bool, device=dev)])
    with torch.no_grad():
        o_full, alpha = attention_rows(a, qpos, causal, share=~readable)
        o_ret = attention_rows(a, qpos, causal & readable[None, :])
    state = memory.write_event(memory.empty_state(dev), layer, scores, evicted, a.k_post[:, :n], a.v[:, :n],
                               o.losses.student_temperature, o.memory.decay)  # fmt: skip
    residual, gate = memory.readout_heads(state, layer, a.q_post[:, qpos], o_ret)
    gap = float((o_full - o_ret).pow(2).sum(-1).mean())
    mse = memory_mse(o_full, o_ret, residual)
    loss = mse
    if o.memory.gate_weight > 0:
        g = gate.float().clamp(1e-6, 1 - 1e-6)
        loss = mse + o.memory.gate_weight * F.binary_cross_entropy(g, alpha.float().clamp(0, 1))
    return loss, float(mse.detach()), gap, float(gate.detach().mean()), float(alpha.mean())


class OnlineStep(nn.Module):
    """One micro-batch of the released recipe: ``forward(items) -> (loss, logs)`` (the loop's step contract)."""

    def __init__(self, indexer, memory, ctx: OnlineContext, joint: bool):
        super().__init__()
        self.indexer = indexer
        self.memory = memory if joint else None
        self.__dict__["ctx"] = ctx
        self.__dict__["frozen_memory"] = memory
        self.joint = joint

    def forward(self, items: list[OnlineItem]):
        o = self.ctx.ocfg
        losses, logs = [], {"tokens": 0}
        rows = []
        for it in items:
            t = sequence_terms(self.ctx, self.indexer, self.memory, it, self.joint)
            loss = t["core"] + (o.memory.weight * t["mem"] if t["mem"] is not None else 0.0)
            losses.append(loss)
            logs["tokens"] += t["tokens"]
            rows.append(t)
        for key in ("kl", "bd", "topb_recall", "mem_mse", "mem_gap", "gate", "alpha_e"):
            vals = [r[key] for r in rows if key in r]
            if vals:
                logs[key] = sum(vals) / len(vals)
        mems = [float(r["mem"].detach()) for r in rows if r["mem"] is not None]
        if mems:
            logs["mem"] = sum(mems) / len(mems)
        zero = sum(p.sum() * 0.0 for p in self.parameters() if p.requires_grad)
        return torch.stack(losses).mean() + zero, logs


class _StageView:
    """What :func:`~core_kv.distill.loop.run_stage` reads of a stage's options, for one released stage."""

    def __init__(self, o, offset: int, scales: dict[str, float]):
        self.lr, self.weight_decay, self.grad_clip, self.warmup_lr_steps = o.lr_peak, o.weight_decay, o.grad_clip, 0
        self.gate_lr = None
        self._o, self._offset, self.group_scales = o, offset, scales

    def lr_schedule(self, step: int) -> float:
        """The WSD rate of this stage's ``step`` (0-based): the whole schedule's rate at ``offset + step``."""
        return self._o.lr_at(self._offset + step)


class ReleasedTrainer(Trainer):
    """:class:`~core_kv.distill.trainer.Trainer` for the released recipe: no teacher dataset, a released artifact
    (:class:`~research.released.model.ReleasedModel`)."""

    stages = STAGES
    unread = ("build_teacher", "indexer", "calibration", "memory", "write_rule", "selection", "calib_docs", "ratios",
              "eval_greedy",
              *(f"teacher.{f.name}" for f in fields(TeacherConfig) if f.name not in ("model", "data")),
              "teacher.data.min_len", "teacher.data.max_len")  # fmt: skip
    config_class = ReleasedTrainConfig
    policy_candidate = staticmethod(policy_candidate)

    def run_stages(self, t0: float) -> dict:
        """Train both stages, evaluate, and return the run's summary (the artifact is written by the caller)."""
        train_online(self)
        ev = evaluate_online(self)
        return {
            "recipe": "released",
            "eval": ev,
            "timing": timing(self.timers),
            "parameters": self.core.num_parameters_by_part(),
            "memory_state_bytes": self.core.memory.state_bytes(),
            "num_processes": self.acc.num_processes,
            "docs_per_step": self.cfg.micro_batch * self.cfg.grad_accum * self.acc.num_processes,
            "wall_s": time.perf_counter() - t0,
            "artifact": str(self.out / "final"),
        }

    def format_summary(self, summary: dict) -> str:
        return format_summary(summary)

    def report_markdown(self, summary: dict) -> str:
        return report_markdown(summary)

    def lengths(self) -> dict[str, int]:
        s = self.cfg.released.schedule
        return {"released.schedule.short_len": s.short_len, "released.schedule.long_len": s.long_len} | {
            k: v for k, v in super().lengths().items() if k != "teacher.data.max_len"
        }

    def run_key(self) -> dict:
        skip = {"out_dir", "progress", "threads", "stop_after", "overwrite", "wandb", "wandb_project", "wandb_mode",
                "save_every", "keep_last", "build_teacher", "indexer", "calibration", "memory", "write_rule",
                "calib_docs", "policy"}  # fmt: skip
        d = to_dict(self.cfg)
        resolved = {k: v for k, v in d.items() if k not in skip}
        resolved["teacher"] = {"model": d["teacher"]["model"], "data": d["teacher"]["data"]}
        from core_kv.teacher.dataset import config_hash

        return {"fingerprint": self.fingerprint, "config_hash": config_hash(resolved), "stages": self.stage_keys()}

    def stage_keys(self) -> dict[str, str]:
        from core_kv.teacher.dataset import config_hash

        d = to_dict(self.cfg)
        o = d["released"]
        base = {"fingerprint": self.fingerprint, "seed": d["seed"], "grad_accum": d["grad_accum"],
                "micro_batch": d["micro_batch"], "train_docs": d["train_docs"],
                "teacher": {"model": d["teacher"]["model"], "data": d["teacher"]["data"]}}  # fmt: skip
        schedule = {k: v for k, v in o["schedule"].items() if not k.startswith("joint_")}
        first = {"previous": config_hash(base), "released": {**o, "memory": None, "schedule": schedule}}
        k1 = config_hash(first)
        return {"online_indexer": k1, "online_joint": config_hash({"previous": k1, "released": o})}

    def setup(self) -> None:
        cfg, acc, o = self.cfg, self.acc, self.cfg.released
        fp = self.fingerprint
        self._docs = {}
        if o.geometry.kind == "fitted":
            docs = self.length_docs(o.schedule.short_len, list(range(o.geometry.docs)))
            keys: list[list[torch.Tensor]] = [[] for _ in range(fp["layers"])]
            for doc in docs:
                for layer, a in enumerate(capture(self.model, torch.tensor([doc.ids], device=acc.device))):
                    keys[layer].append(a.k_post.float().cpu())
            self.key_geo = KeyGeometry.fit(keys, o.geometry.d_z, o.geometry.num_prototypes, o.geometry.seed)
            self.print(
                f"key geometry fitted on {len(docs)} training documents ({sum(len(d.ids) for d in docs)} tokens)"
            )
        else:
            self.key_geo = KeyGeometry.draw(fp["layers"], fp["kv_heads"], fp["head_dim"], o.geometry.d_z,
                                            o.geometry.num_prototypes, o.geometry.seed)  # fmt: skip
        self.drive = o.teacher
        special = sorted(int(i) for i in (getattr(self.tok, "all_special_ids", None) or []))
        teacher = {"recipe": "released", "drive": to_dict(self.drive), "sinks": o.losses.sinks,
                   "budgets": list(o.losses.budgets), "student_temperature": o.losses.student_temperature,
                   "geometry": o.geometry.kind}  # fmt: skip
        m = o.memory
        self.core_config = ReleasedConfig(
            num_layers=fp["layers"], num_heads=fp["heads"], num_kv_heads=fp["kv_heads"], head_dim=fp["head_dim"],
            d_z=o.geometry.d_z, num_prototypes=o.geometry.num_prototypes, memory_dim=m.dim,
            protected_sinks=o.losses.sinks, protected_recent=0, chunk_size=o.schedule.long_len, fingerprint=fp,
            feature_spec=dict(SPEC), teacher=teacher, memory_gate_hidden=m.gate_hidden, memory_decay=m.decay,
            memory_dtype=m.dtype, memory_readout=m.readout, memory_kernel=m.kernel, special_token_ids=special,
            ablated_features=ablated_names(o.ablate_features),
            memory_trained=m.train and o.schedule.total_steps > o.schedule.indexer_steps,  # joint steps train it
        )  # fmt: skip
        torch.manual_seed(cfg.seed)
        self.core = ReleasedModel(self.core_config)
        self.core.memory.reset_parameters(cfg.seed)
        self.core.set_key_geometry(self.key_geo)
        self.core.indexer.temperature.fill_(o.losses.student_temperature)
        self.core.to(acc.device)
        self.autocast = acc.autocast() if acc.mixed_precision != "no" else None
        self.start_trackers()

    def online_context(self, name: str) -> OnlineContext:
        self.timers[name] = self.timers.get(name) or Timer(self.acc.device)
        return OnlineContext(self.model, self.key_geo.to(self.acc.device), self.drive, self.cfg.released,
                             list(self.core_config.special_token_ids), self.timers[name], self.autocast)  # fmt: skip

    def length_docs(self, length: int, indices: list[int]) -> list[Doc]:
        """Documents of ``⌈0.75·length⌉..length`` tokens by global index (cached)."""
        data = replace(self.cfg.teacher.data, min_len=math.ceil(0.75 * length), max_len=length)
        missing = [i for i in indices if (length, i) not in self._docs]
        if missing:
            for d in make_docs(data, missing, self.tok):
                self._docs[(length, d.index)] = d
        return [self._docs[(length, i)] for i in indices]

    def online_items(self, first_step: int, steps: int) -> list[OnlineItem]:
        """The fixed global data order of global steps ``first_step + 1 .. first_step + steps``."""
        cfg, o = self.cfg, self.cfg.released
        per = cfg.grad_accum * cfg.micro_batch * self.acc.num_processes
        items = []
        for step in range(first_step + 1, first_step + steps + 1):
            length = o.schedule.seq_len(step)
            base = LONG_OFFSET if length == o.schedule.long_len and o.schedule.long_len != o.schedule.short_len else 0
            idx = [base + ((step - 1) * per + j) % cfg.train_docs for j in range(per)]
            ratio, decode = o.ratio_at(cfg.seed, step), o.schedule.decode_at(step)
            items += [OnlineItem(d, step, ratio, decode) for d in self.length_docs(length, idx)]
        return items


def train_online(tr: ReleasedTrainer) -> None:
    """Stage ``online_indexer`` then ``online_joint`` (each resumable; a finished stage is loaded, not retrained)."""
    o = tr.cfg.released
    idx, mem = tr.core.indexer, tr.core.memory
    steps1 = o.schedule.indexer_steps if o.memory.train else o.schedule.total_steps
    done1 = tr.stage_file("online_indexer").is_file()
    items = [] if done1 else tr.online_items(0, steps1)
    step = OnlineStep(idx, mem, tr.online_context("online_indexer"), joint=False)
    run_stage(tr, "online_indexer", step, lambda: dict(idx.named_parameters()), items, steps1,
              _StageView(o.schedule, 0, {"": 1.0}), tr.cfg.micro_batch)  # fmt: skip
    if not o.memory.train:
        return
    steps2 = o.schedule.total_steps - steps1
    items = [] if tr.stage_file("online_joint").is_file() else tr.online_items(steps1, steps2)
    step = OnlineStep(idx, mem, tr.online_context("online_joint"), joint=True)
    scales = {"indexer.": o.schedule.joint_indexer_lr_scale, "memory.": o.schedule.joint_memory_lr_scale}
    params = lambda: {**{f"indexer.{k}": v for k, v in idx.named_parameters()},  # noqa: E731
                      **{f"memory.{k}": v for k, v in mem.named_parameters()}}  # fmt: skip
    run_stage(
        tr, "online_joint", step, params, items, steps2, _StageView(o.schedule, steps1, scales), tr.cfg.micro_batch
    )


@torch.no_grad()
def evaluate_online(tr: ReleasedTrainer) -> dict:
    """Held-out report per ratio: KL, hinge, Top-B recall of the teacher's set, and the memory's output error
    relative to the retained-only error (``mem / gap``; < 1: the memory helps) with its mean gate."""
    cfg, acc = tr.cfg, tr.acc
    ctx = tr.online_context("eval")
    mine = [i for i in range(cfg.eval_docs) if i % acc.num_processes == acc.process_index]
    docs = tr.length_docs(cfg.released.schedule.short_len, [EVAL_OFFSET + i for i in mine])
    rows = []
    memory = tr.core.memory if cfg.released.memory.train else None
    for doc in tqdm(docs, desc="eval", disable=not (cfg.progress and acc.is_local_main_process)):
        for ratio in cfg.eval_ratios:
            t = sequence_terms(ctx, tr.core.indexer, memory, OnlineItem(doc, 0, ratio, False), joint=True)
            row = {"ratio": ratio, "kl": t["kl"], "bd": t["bd"], "topb_recall": t["topb_recall"]}
            if t["mem"] is not None:
                row.update(
                    mem=t["mem_mse"], gap=t["mem_gap"], layers=t["mem_layers"], gate=t["gate"], alpha_e=t["alpha_e"]
                )
            rows.append(row)
    from accelerate.utils import gather_object

    rows = gather_object(rows) if acc.num_processes > 1 else rows
    out = {}
    for ratio in cfg.eval_ratios:
        rs = [r for r in rows if r["ratio"] == ratio]
        if not rs:
            continue
        tag = f"r{round(100 * ratio)}"
        mean = _column_mean(rs)
        out[tag] = {"docs": len(rs), "kl": mean("kl"), "hinge": mean("bd"), "topb_recall": mean("topb_recall")}
        if any("mem" in r for r in rs):
            out[tag].update(memory_mse=mean("mem"), retained_mse=mean("gap"), gate=mean("gate"), alpha_e=mean("alpha_e"),
                            memory_relative=mean("mem") / max(mean("gap"), 1e-12),
                            memory_relative_layers=_per_layer_relative(rs))  # fmt: skip
    return out


def _per_layer_relative(rows: list[dict]) -> dict[int, float]:
    """Per memory layer: its error with the memory over the retained-only error, summed over the held-out documents
    (< 1: the memory helps there; the per-layer gain is ``G_l = 1 − value``)."""
    docs = [r["layers"] for r in rows if "layers" in r]
    return {i: sum(d[i][0] for d in docs) / max(sum(d[i][1] for d in docs), 1e-12) for i in docs[0]} if docs else {}


def _column_mean(rows: list[dict]):
    def mean(key: str) -> float:
        vals = [r[key] for r in rows if key in r]
        return sum(vals) / max(1, len(vals))

    return mean


register_recipe("released", ReleasedTrainer)

__all__ = ["STAGES", "OnlineItem", "OnlineStep", "ReleasedTrainer", "evaluate_online", "train_online"]
