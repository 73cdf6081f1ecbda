"""Train the proxy LM: a few-million-parameter Llama (GQA) that solves RULER needle tasks, on 2 CPU cores.

Usage::

    python -m core_kv.proxy.train --config configs/proxy/default.yaml [a.b=v ...]
    python -m core_kv.proxy.train --config configs/proxy/default.yaml mode=export   # run dir -> checkpoints/

The recipe is the measured one of ``shared/research/proxy_feasibility.md``: single-digit tokens, a very short dense
first phase, answer loss x3, random needle digits masked from the LM loss, accuracy-driven phase advance, lr 2e-3,
bf16 autocast, a length-proportional batch of 4-8k tokens per step. The schedule is step-based and every random draw
is seeded, so a run is reproducible up to float non-associativity across thread counts. Checkpoints (model,
optimizer, RNG, step, curriculum state) are written atomically every ``ckpt_every_s`` seconds and a rerun resumes
from the last one. Loss curves go to ``<out_dir>/log.jsonl``; ``mode=export`` writes the Hugging Face folder
(``config.json``, ``model.safetensors``, tokenizer files, ``loss_curve.png``).

Shapes: B batch, T sequence length, H hidden size, V vocabulary, N selected loss positions.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import sys
import time
import warnings
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from core_kv.config import ConfigError, check_on_init, folder, load_config, non_empty, option, to_dict
from core_kv.documents import DOC_TASKS, Generator
from core_kv.files import atomic_write_json, read_jsonl, save_figure, swap_in
from core_kv.proxy.tokenizer import build_proxy_tokenizer
from core_kv.schedules import wsd_linear

FULL_MIX = {
    "niah_single_1": 0.14,
    "niah_single_2": 0.12,
    "niah_single_3": 0.06,
    "niah_multikey_1": 0.12,
    "niah_multikey_2": 0.14,
    "niah_multikey_3": 0.04,
    "niah_multivalue": 0.08,
    "niah_multiquery": 0.08,
    "mk_noise": 0.10,
    "vt": 0.04,
    "lm": 0.04,
}


@dataclass
class ProxyModelConfig:
    """Llama shape; ``vocab_size`` comes from the tokenizer.

    Args:
        hidden_size / num_hidden_layers / num_attention_heads / num_key_value_heads / intermediate_size: the
            transformers ``LlamaConfig`` fields of the same names.
        rope_theta: RoPE base.
        max_position_embeddings: the longest context the model is built for.
        tie_word_embeddings: share the input embedding with the LM head.
    """

    hidden_size: int = option(192, ge=1)
    num_hidden_layers: int = option(4, ge=1)
    num_attention_heads: int = option(8, ge=1)
    num_key_value_heads: int = option(2, ge=1)
    intermediate_size: int = option(576, ge=1)
    rope_theta: float = option(10000.0, gt=0)
    max_position_embeddings: int = option(8192, ge=1)
    tie_word_embeddings: bool = True

    def check(self, prefix: str = "model.") -> None:
        if self.num_attention_heads % self.num_key_value_heads or self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"{prefix}num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"{prefix}num_key_value_heads ({self.num_key_value_heads}) and divide {prefix}hidden_size "
                f"({self.hidden_size})"
            )


def _task_weights_ok(mix: dict) -> str | None:
    unknown = sorted(set(mix) - set(DOC_TASKS))
    if unknown:
        return f"a mapping of proxy tasks ({', '.join(DOC_TASKS)}) to weights; unknown: {unknown}"
    if any(w < 0 for w in mix.values()) or (mix and not sum(mix.values()) > 0):
        return "task weights >= 0 with a positive sum"
    return None


def _tasks_ok(tasks: list) -> str | None:
    unknown = sorted(set(tasks) - set(DOC_TASKS))
    return f"proxy tasks ({', '.join(DOC_TASKS)}); unknown: {unknown}" if unknown else None


@dataclass
class Phase:
    """One curriculum phase: lengths drawn uniformly from ``[min_len, max_len]`` tokens.

    The phase ends when the running exact match of ``ProxyTrainConfig.advance_tasks`` reaches ``advance_em`` after
    ``min_steps`` steps, or after ``max_steps`` steps; the last phase runs to ``ProxyTrainConfig.total_steps``.
    """

    min_len: int = option(48, ge=1)
    max_len: int = option(160, ge=1)
    tokens_per_step: int = option(4096, ge=1)
    min_steps: int = option(0, ge=0)
    max_steps: int = option(1_000_000, ge=0)
    advance_em: float = option(0.8, ge=0, le=1)
    # >0: key-gather head losses in this phase (RetrievalHead targets qsrc, nsrc)
    gather_weight: float = option(0.0, ge=0)
    # Task weights; empty means FULL_MIX. (A non-empty default would be merged with, not replaced by, a YAML mix.)
    mix: dict[str, float] = option(factory=dict, check=_task_weights_ok)

    def check(self, prefix: str = "") -> None:
        if self.max_len < self.min_len:
            raise ConfigError(f"{prefix}max_len ({self.max_len}) must be >= {prefix}min_len ({self.min_len})")


def _not_ruler_seed(seed: int) -> str | None:
    return "another seed than 42 (RULER's evaluation seed)" if seed == 42 else None


@dataclass
class ProxyTrainConfig:
    """Everything a run depends on; ``configs/proxy/default.yaml`` overrides these defaults.

    Args:
        out_dir: run folder (resumable checkpoints, ``log.jsonl``).
        export_dir: where ``mode=export`` writes the Hugging Face folder.
        phases: the length curriculum, one :class:`Phase` after the other.
        total_steps: optimizer steps in all phases.
        lr: peak learning rate (warmup-stable-decay schedule).
        min_lr_ratio: the learning rate at the end, as a share of ``lr``.
        decay_fraction: share of ``total_steps`` over which the rate decays linearly at the end.
        warmup_steps: linear warm-up steps.
        weight_decay / betas / grad_clip: AdamW weight decay and betas, gradient-norm clip.
        answer_weight: weight of the answer tokens' loss against the LM loss.
        attn_layer / attn_head: the head trained by the retrieval-head loss (``attn_weight``).
        gather_heads: the two key-gather heads of ``gather_layer`` (question side, needle side).
        advance_tasks: tasks whose running exact match advances the curriculum.
        threads: torch threads.
        bf16: bf16 autocast (CPU and CUDA).
        ckpt_every_s: seconds between resumable checkpoints.
        log_every: steps between ``log.jsonl`` lines.
        probe_every: steps between probe evaluations (exact match on fixed prompts).
        probe_tasks / probe_lengths / probe_n: the probe's tasks, context lengths and prompts per (task, length).
    """

    mode: str = option("train", choices=("train", "export"))  # train | export
    out_dir: str = option("runs/proxy", check=folder)
    export_dir: str = option("checkpoints/proxy-lm", check=folder)
    seed: int = option(1234, ge=0)  # model init and loss-position sampling
    # training sequences (never 42, RULER's evaluation seed)
    data_seed: int = option(20261129, ge=0, check=_not_ruler_seed)
    probe_seed: int = option(777, ge=0, check=_not_ruler_seed)  # fixed probe prompts for the periodic evaluation
    base_vocab: int = option(4096, ge=1)  # BPE size before the key-word merges
    key_word_tokens: bool = True  # False: plain BPE of base_vocab tokens (feasibility recipe), keys split into pieces
    uuid_chars: bool = False  # one token per UUID character (core_kv.proxy.tokenizer)
    key_sentences: int | None = option(None, ge=0)  # needle sentences in the BPE corpus; None = one per noun
    model: ProxyModelConfig = field(default_factory=ProxyModelConfig)
    phases: list[Phase] = option(factory=lambda: [Phase()], check=non_empty)
    total_steps: int = option(3000, ge=0)
    lr: float = option(2e-3, gt=0)
    min_lr_ratio: float = option(0.1, ge=0, le=1)
    decay_fraction: float = option(0.2, ge=0, le=1)
    warmup_steps: int = option(40, ge=0)
    weight_decay: float = option(0.1, ge=0)
    betas: list[float] = option(
        factory=lambda: [0.9, 0.95], ge=0, lt=1, check=lambda b: None if len(b) == 2 else "two numbers [beta1, beta2]"
    )
    grad_clip: float = option(1.0, ge=0)
    answer_weight: float = option(3.0, ge=0)
    extra_questions: int = option(2, ge=0)  # at most this many extra questions on a needle haystack's distractor lines
    # >0: retrieval-head loss on head attn_head of layer attn_layer (RetrievalHead)
    attn_weight: float = option(0.0, ge=0)
    attn_layer: int = -1
    attn_head: int = option(0, ge=0)
    gather_layer: int = 1  # key-gather heads (Phase.gather_weight): question side, needle side
    gather_heads: list[int] = option(
        factory=lambda: [0, 1], ge=0, check=lambda h: None if len(h) == 2 else "two heads [question side, needle side]"
    )
    # share of LM-loss positions scored per step (the vocabulary-wide head is costly)
    lm_fraction: float = option(0.25, gt=0, le=1)
    # padded tokens per forward pass (length-bucketed; at least 2 x the max_len)
    micro_batch_tokens: int = option(2048, ge=1)
    advance_tasks: list[str] = option(
        factory=lambda: ["niah_single_1", "niah_single_2", "niah_multikey_1", "niah_multikey_2", "mk_noise"],
        check=_tasks_ok,
    )
    em_window: int = option(40, ge=1)  # steps in the running exact match that drives phase advance
    threads: int = option(2, ge=0)
    device: str = "cpu"  # or "cuda" (bf16 autocast there too)
    bf16: bool = True
    ckpt_every_s: float = option(240.0, gt=0)
    log_every: int = option(10, ge=1)
    probe_every: int = option(200, ge=1)
    probe_tasks: list[str] = option(
        factory=lambda: ["niah_single_1", "niah_single_2", "niah_multikey_1", "niah_multikey_2"], check=_tasks_ok
    )
    probe_lengths: list[int] = option(factory=lambda: [1024, 2048, 4096], ge=1)
    probe_n: int = option(10, ge=1)
    max_wall_s: float = option(0.0, ge=0)  # >0: stop (and checkpoint) after this much wall time in this process
    init_from: str = ""  # exported proxy folder to warm-start from (weights + tokenizer; fresh optimizer and steps)
    # storage dtype of the exported weights (float32 | bfloat16); always loads as fp32
    export_dtype: str = option("float32", choices=("float32", "bfloat16"))

    def __post_init__(self) -> None:
        check_on_init(self)


# ---- tokenizer and model ---------------------------------------------------------------------------------------
def build_model(cfg: ProxyModelConfig, tokenizer):
    """A random-init Llama of ``cfg``'s shape (every field is a ``LlamaConfig`` field), its vocabulary the tokenizer's
    rounded up to a multiple of 64, drawn from the RNG as it stands."""
    from dataclasses import asdict

    from core_kv.models.tiny import tiny_lm

    return tiny_lm(
        seed=None,
        attn_implementation="sdpa",
        vocab_size=64 * math.ceil(len(tokenizer) / 64),
        **asdict(cfg),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


# ---- loss ------------------------------------------------------------------------------------------------------
ATTN_TARGETS = ("src", "qsrc", "nsrc")  # Sequence fields: retrieval, question-key gather, needle-key gather


def collate(seqs, pad_id: int, keeps: list[torch.Tensor] | None = None):
    """Right-pad to the longest sequence; padding is causal-safe (it only follows real tokens) and never scored.

    Returns:
        ``(ids, keep, ans, targets)``: (B, T) token ids, LM-loss selection of the target at ``t`` (``keeps[b]``,
        else every position flagged in ``Sequence.lm``), answer index of the target at ``t`` (0 = none), and
        ``{"src", "qsrc", "nsrc"}`` (B, T) attention targets of the auxiliary heads (``Sequence``; -1 = none).
    """
    T = max(len(s.ids) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)  # (B, T)
    keep = torch.zeros((len(seqs), T), dtype=torch.bool)
    ans = torch.zeros((len(seqs), T), dtype=torch.long)
    targets = {name: torch.full((len(seqs), T), -1, dtype=torch.long) for name in ATTN_TARGETS}
    for b, s in enumerate(seqs):
        n = len(s.ids)
        ids[b, :n] = torch.tensor(s.ids)
        keep[b, :n] = keeps[b] if keeps is not None else torch.tensor(s.lm) > 0
        ans[b, :n] = torch.tensor(s.ans)
        for name, t in targets.items():
            if getattr(s, name):
                t[b, :n] = torch.tensor(getattr(s, name))
    return ids, keep, ans, targets


def lm_selection(seqs, lm_fraction: float, gen: torch.Generator | None) -> list[torch.Tensor]:
    """Per sequence, the targets in the LM loss: every one flagged 2 (the question after the context) and a random
    ``lm_fraction`` of those flagged 1 (the output head over the whole vocabulary is the costly part)."""
    out = []
    for s in seqs:
        lm = torch.tensor(s.lm)
        draw = torch.rand(lm.shape, generator=gen)
        out.append((lm == 2) | ((lm == 1) & (draw < lm_fraction)))
    return out


def micro_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Group sequence indices by length so padding stays small: longest first, a group grows while
    ``rows * longest <= max_tokens`` (a single longer sequence is a group of its own)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


class RetrievalHead:
    """Captures one attention head's inputs during the forward pass, to score where it attends.

    An auxiliary head loss: the cross-entropy of head ``head`` of layer ``layer``'s attention distribution (causal
    softmax of its post-RoPE ``q.k * scaling``, exactly what SDPA computes) with a target position per supervised
    query, from the ``Sequence`` field ``target``:

    - ``src`` (the retrieval head, ``ProxyTrainConfig.attn_weight``): at every answer token that copies a needle value,
      the copied context token. Real LMs retrieve through such heads (sparse "retrieval heads" that attend to the
      token being copied); supervising one makes the circuit appear without a long plateau.
    - ``qsrc`` / ``nsrc`` (key gathering, ``Phase.gather_weight``): at an answer token, the last token of its key in
      the question; at a needle's value token, the last token of that needle's key. Together they put the key on
      both sides of the retrieval head's match.

    The model stays a plain Llama: nothing of this is in the checkpoint.
    """

    def __init__(self, model, layer: int, head: int, target: str = "src"):
        from core_kv.models.attention import attention_modules

        if target not in ATTN_TARGETS:
            raise ValueError(f"unknown attention target {target!r}; choose from {ATTN_TARGETS}")
        self.attn = attention_modules(model)[layer]
        self.target = target
        self.head = head
        self.kv_head = head // self.attn.num_key_value_groups
        self.inputs: dict = {}
        self.handle = self.attn.register_forward_hook(self._capture, with_kwargs=True)

    def _capture(self, module, args, kwargs, output) -> None:
        self.inputs = {"hidden": kwargs["hidden_states"], "pos": kwargs["position_embeddings"]}

    def loss_sum(self, src: torch.Tensor) -> torch.Tensor:
        """Summed cross-entropy over the queries ``t`` with ``src[:, t+1] >= 0`` (the attention target of query
        ``t`` is ``src[:, t+1]``); the caller divides by the whole batch's count of such queries."""
        from core_kv.models.attention import apply_rope, prerope_keys, prerope_queries

        x, pos = self.inputs["hidden"], self.inputs["pos"]
        q = apply_rope(self.attn, prerope_queries(self.attn, x)[:, self.head : self.head + 1], pos)[:, 0]  # (B, T, D)
        k = apply_rope(self.attn, prerope_keys(self.attn, x)[:, self.kv_head : self.kv_head + 1], pos)[:, 0]
        target = src[:, 1:]  # (B, T-1): query t predicts token t+1
        total = q.new_zeros((), dtype=torch.float32)
        for b in range(x.shape[0]):
            rows = (target[b] >= 0).nonzero().flatten()  # (N,)
            if not len(rows):
                continue
            logits = (q[b, rows].float() @ k[b].float().T) * self.attn.scaling  # (N, T)
            future = torch.arange(k.shape[1], device=k.device)[None, :] > rows[:, None]
            logits = logits.masked_fill(future, float("-inf"))
            total = total + F.cross_entropy(logits, target[b, rows], reduction="sum")
        return total

    def remove(self) -> None:
        self.handle.remove()


def loss_sums(model, ids, keep, ans, bf16: bool, targets: dict | None = None, heads: tuple = ()):
    """Summed LM and answer cross-entropies of one padded batch, per-answer exact match, and the summed loss of each
    auxiliary head in ``heads`` (:class:`RetrievalHead`, scored against ``targets[head.target]``).

    Returns:
        ``(lm_sum, ans_sum, em, head_sums)`` with ``em = [(row, answer_id, correct)]`` (teacher-forced argmax of
        every token of the answer, which equals greedy exact match) and ``head_sums`` one tensor per head.
    """
    with (
        torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16 and ids.device.type == "cpu"),
        torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16 and ids.device.type == "cuda"),
    ):
        hidden = model.model(input_ids=ids).last_hidden_state  # (B, T, H)
        tgt, keep_t, ans_t = ids[:, 1:], keep[:, 1:], ans[:, 1:]  # target t+1 is predicted at position t
        h = hidden[:, :-1]
        sel_lm = keep_t.nonzero(as_tuple=True)
        sel_ans = (ans_t > 0).nonzero(as_tuple=True)
        logits_lm = model.lm_head(h[sel_lm]).float()  # (N, V)
        logits_ans = model.lm_head(h[sel_ans]).float()  # (N, V)
        head_sums = [head.loss_sum(targets[head.target]) for head in heads]
    lm_sum = F.cross_entropy(logits_lm, tgt[sel_lm], reduction="sum")
    ans_sum = F.cross_entropy(logits_ans, tgt[sel_ans], reduction="sum")
    correct = (logits_ans.argmax(-1) == tgt[sel_ans]).tolist()
    rows, qa = sel_ans[0].tolist(), ans_t[sel_ans].tolist()
    per: dict[tuple[int, int], bool] = {}
    for r, q, c in zip(rows, qa, correct, strict=True):
        per[(r, q)] = per.get((r, q), True) and c
    return lm_sum, ans_sum, [(r, q, c) for (r, q), c in per.items()], head_sums


def train_step_loss(
    model, seqs, pad_id: int, cfg: ProxyTrainConfig, gen: torch.Generator, max_tokens: int, heads: tuple = ()
):
    """Forward and backward of one step in length-bucketed micro-batches (gradients accumulate in ``.grad``).

    ``heads`` are ``(RetrievalHead, weight)`` pairs. The loss is the batch's ``mean LM CE + answer_weight * mean
    answer CE + sum of weight * mean head CE``, exactly as one padded batch would give: every micro-batch's sums are
    divided by the whole batch's counts.

    Returns:
        ``(lm_loss, answer_loss, head_losses, em)``: floats, one mean CE per head, and
        ``[(sequence index, answer_id, correct)]``.
    """
    keeps = lm_selection(seqs, cfg.lm_fraction, gen)
    n_lm = max(1, sum(int(k[1:].sum()) for k in keeps))
    n_ans = max(1, sum(sum(a > 0 for a in s.ans[1:]) for s in seqs))
    n_head = [max(1, sum(sum(x >= 0 for x in getattr(s, h.target)[1:]) for s in seqs)) for h, _ in heads]
    lm_tot, ans_tot, head_tot, em = 0.0, 0.0, [0.0] * len(heads), []
    for group in micro_batches([len(s.ids) for s in seqs], max_tokens):
        ids, keep, ans, targets = collate([seqs[i] for i in group], pad_id, [keeps[i] for i in group])
        ids, keep, ans = ids.to(cfg.device), keep.to(cfg.device), ans.to(cfg.device)
        targets = {k: v.to(cfg.device) for k, v in targets.items()}
        lm_sum, ans_sum, em_g, head_sums = loss_sums(model, ids, keep, ans, cfg.bf16, targets, [h for h, _ in heads])
        loss = lm_sum / n_lm + cfg.answer_weight * ans_sum / n_ans
        for i, ((_, weight), total) in enumerate(zip(heads, head_sums, strict=True)):
            loss = loss + weight * total / n_head[i]
            head_tot[i] += total.item() / n_head[i]
        loss.backward()
        lm_tot += lm_sum.item() / n_lm
        ans_tot += ans_sum.item() / n_ans
        em += [(group[r], q, c) for r, q, c in em_g]
    return lm_tot, ans_tot, head_tot, em


# ---- probes ----------------------------------------------------------------------------------------------------
@torch.no_grad()
def probe(model, probes: dict[str, list], bf16: bool) -> dict[str, float]:
    """Teacher-forced exact match of the first answer on fixed prompts (equals greedy exact match for it)."""
    model.eval()
    out = {}
    for name, seqs in probes.items():
        hits = 0
        for s in seqs:
            ids, keep, ans, _ = collate([s], 0)
            ids, keep, ans = ids.to(model.device), keep.to(model.device), ans.to(model.device)
            ans = torch.where(ans == 1, ans, torch.zeros_like(ans))
            em = loss_sums(model, ids, keep, ans, bf16)[2]
            hits += int(all(c for _, _, c in em))
        out[name] = hits / len(seqs)
    model.train()
    return out


def make_probes(tokenizer, cfg: ProxyTrainConfig) -> dict[str, list]:
    gen = Generator(tokenizer, seed=cfg.probe_seed, kvpress_newline=0.0)
    return {
        f"{task}@{length}": [gen.sample(task, length - 128) for _ in range(cfg.probe_n)]
        for length in cfg.probe_lengths
        for task in cfg.probe_tasks
    }


# ---- checkpoints -----------------------------------------------------------------------------------------------
def save_checkpoint(out: Path, model, opt, state: dict, gen_state, torch_gen: torch.Generator) -> None:
    """Write ``ckpt.tmp`` fully, then swap it in for ``ckpt`` (the old one is kept as ``ckpt.old`` until then).

    The training state is stored without pickle: its tensors (optimizer moments, both torch RNG states) in
    ``train_state.safetensors``, the rest (optimizer hyperparameters, the data generator's Python RNG) in
    ``train_state.json``.
    """
    tmp, final = out / "ckpt.tmp", out / "ckpt"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    save_train_state(tmp, opt.state_dict(), gen_state, torch.get_rng_state(), torch_gen.get_state())
    atomic_write_json(tmp / "state.json", state)
    swap_in(tmp, final)


def save_train_state(folder: Path, optimizer: dict, data_rng: tuple, torch_rng: torch.Tensor, loss_rng: torch.Tensor):
    """``optimizer`` (a ``state_dict``) and the three RNG states as safetensors + JSON (no pickle)."""
    from safetensors.torch import save_file

    tensors = {"torch_rng": torch_rng, "loss_rng": loss_rng}
    per_param: dict[str, dict] = {}
    for idx, slots in optimizer["state"].items():
        per_param[str(idx)] = {}
        for name, value in slots.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optimizer.{idx}.{name}"] = value.contiguous()
                per_param[str(idx)][name] = None  # stored as a tensor
            else:
                per_param[str(idx)][name] = value
    save_file(tensors, str(folder / "train_state.safetensors"))
    version, internal, gauss = data_rng
    meta = {"param_groups": optimizer["param_groups"], "state": per_param, "data_rng": [version, list(internal), gauss]}
    atomic_write_json(folder / "train_state.json", meta)


def load_train_state(folder: Path) -> dict:
    """Inverse of :func:`save_train_state`: ``{"optimizer", "data_rng", "torch_rng", "loss_rng"}``.

    A checkpoint written before the pickle-free format (``train_state.pt``) is read with ``weights_only=True``.
    """
    from safetensors.torch import load_file

    if not (folder / "train_state.json").is_file() and (folder / "train_state.pt").is_file():
        st = torch.load(folder / "train_state.pt", map_location="cpu", weights_only=True)
        return {**st, "data_rng": _rng_tuple(st["data_rng"])}
    tensors = load_file(str(folder / "train_state.safetensors"))
    meta = json.loads((folder / "train_state.json").read_text())
    state = {
        int(idx): {
            name: tensors[f"optimizer.{idx}.{name}"] if value is None else value for name, value in slots.items()
        }
        for idx, slots in meta["state"].items()
    }
    groups = [{**g, "betas": tuple(g["betas"])} if "betas" in g else g for g in meta["param_groups"]]
    return {
        "optimizer": {"state": state, "param_groups": groups},
        "data_rng": _rng_tuple(meta["data_rng"]),
        "torch_rng": tensors["torch_rng"],
        "loss_rng": tensors["loss_rng"],
    }


def _rng_tuple(data_rng) -> tuple:
    """``random.Random.setstate`` wants tuples where JSON gives lists."""
    version, internal, gauss = data_rng
    return (version, tuple(internal), gauss)


def latest_checkpoint(out: Path) -> Path | None:
    for name in ("ckpt", "ckpt.old"):
        if (out / name / "state.json").is_file():
            return out / name
    return None


# ---- training --------------------------------------------------------------------------------------------------
def train(cfg: ProxyTrainConfig) -> Path:
    """Run (or resume) training in ``cfg.out_dir``; returns the checkpoint folder."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    torch.set_num_threads(cfg.threads)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "config.json", to_dict(cfg))
    tok_dir = out / "tokenizer"
    ckpt = latest_checkpoint(out)
    init = Path(cfg.init_from) if cfg.init_from and ckpt is None else None
    if init is not None and not (init / "tokenizer.json").is_file():
        raise FileNotFoundError(f"init_from={init} is not an exported proxy folder (no tokenizer.json)")
    if not (tok_dir / "tokenizer.json").is_file():
        if init is not None:
            AutoTokenizer.from_pretrained(init).save_pretrained(tok_dir)
        else:
            tokenizer = build_proxy_tokenizer(cfg.base_vocab, cfg.key_word_tokens, cfg.uuid_chars, cfg.key_sentences)
            tokenizer.save_pretrained(tok_dir)
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)

    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    if ckpt:
        model = LlamaForCausalLM.from_pretrained(ckpt)
    elif init is not None:
        model = LlamaForCausalLM.from_pretrained(init)
        if (init / "training_log.jsonl").is_file():  # the earlier stage's curve, prepended at export
            shutil.copy(init / "training_log.jsonl", out / "init_log.jsonl")
        print(f"warm start from {init} (fresh optimizer, step 0)", flush=True)
    else:
        model = build_model(cfg.model, tokenizer)
    model.config._attn_implementation = "sdpa"
    model.to(cfg.device).train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2 or "embed" in n]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=tuple(cfg.betas),
        fused=False,
    )
    data = Generator(tokenizer, seed=cfg.data_seed, extra_questions=cfg.extra_questions)
    loss_gen = torch.Generator().manual_seed(cfg.seed + 1)
    state = {"step": 0, "phase": 0, "phase_start": 0, "tokens": 0, "train_s": 0.0, "em_window": {}}
    if ckpt:
        st = load_train_state(ckpt)
        opt.load_state_dict(st["optimizer"])
        data.rng.setstate(st["data_rng"])
        torch.set_rng_state(st["torch_rng"])
        loss_gen.set_state(st["loss_rng"])
        state = json.loads((ckpt / "state.json").read_text())
        print(f"resumed from {ckpt} at step {state['step']}", flush=True)
    windows = {k: deque(v, maxlen=cfg.em_window * 8) for k, v in state["em_window"].items()}
    probes = make_probes(tokenizer, cfg)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters, vocab {model.config.vocab_size}", flush=True)

    log = open(out / "log.jsonl", "a", encoding="utf-8")  # noqa: SIM115  # appended to for the whole run
    t_start, last_ckpt = time.time(), time.time()
    fresh = {"lm": 0.0, "ans": 0.0, **dict.fromkeys(ATTN_TARGETS, 0.0), "n": 0, "tok": 0, "t": 0.0}
    acc = {**fresh, "em": []}
    aux_heads = {}  # target -> RetrievalHead, for the auxiliary losses this run uses
    if cfg.attn_weight > 0:
        aux_heads["src"] = RetrievalHead(model, cfg.attn_layer, cfg.attn_head, "src")
    if any(p.gather_weight > 0 for p in cfg.phases):
        aux_heads["qsrc"] = RetrievalHead(model, cfg.gather_layer, cfg.gather_heads[0], "qsrc")
        aux_heads["nsrc"] = RetrievalHead(model, cfg.gather_layer, cfg.gather_heads[1], "nsrc")
    bar = tqdm(total=cfg.total_steps, initial=state["step"], desc="proxy", mininterval=5, file=sys.stdout)

    def checkpoint() -> None:
        state["em_window"] = {k: list(v) for k, v in windows.items()}
        save_checkpoint(out, model, opt, state, data.rng.getstate(), loss_gen)

    while state["step"] < cfg.total_steps:
        step = state["step"]
        phase = cfg.phases[state["phase"]]
        t0 = time.time()
        seqs = data.batch(phase.mix or FULL_MIX, phase.min_len, phase.max_len, phase.tokens_per_step)
        lr = wsd_linear(step, cfg.total_steps, cfg.lr, cfg.warmup_steps, cfg.decay_fraction, cfg.min_lr_ratio)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad(set_to_none=True)
        micro = max(cfg.micro_batch_tokens, 2 * phase.max_len)
        weights = {"src": cfg.attn_weight, "qsrc": phase.gather_weight, "nsrc": phase.gather_weight}
        heads = [(h, weights[name]) for name, h in aux_heads.items() if weights[name] > 0]
        lm_loss, ans_loss, head_losses, em = train_step_loss(
            model, seqs, tokenizer.pad_token_id, cfg, loss_gen, micro, heads
        )
        head_loss = {h.target: v for (h, _), v in zip(heads, head_losses, strict=True)}
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        dt = time.time() - t0

        n_tok = int(sum(len(s.ids) for s in seqs))
        state["step"] = step + 1
        state["tokens"] += n_tok
        state["train_s"] += dt
        for r, _q, c in em:
            windows.setdefault(seqs[r].task, deque(maxlen=cfg.em_window * 8)).append(int(c))
        acc["lm"] += lm_loss
        acc["ans"] += ans_loss
        for name in ATTN_TARGETS:
            acc[name] += head_loss.get(name, 0.0)
        acc["n"] += 1
        acc["tok"] += n_tok
        acc["t"] += dt
        acc["em"] += [int(c) for _, _, c in em]
        bar.update(1)

        # Phase advance on the running exact match of the core tasks (feasibility note: accuracy-driven).
        in_phase = state["step"] - state["phase_start"]
        adv = [sum(windows[t]) / len(windows[t]) for t in cfg.advance_tasks if t in windows and len(windows[t]) >= 8]
        run_em = sum(adv) / len(adv) if adv else 0.0
        last = state["phase"] == len(cfg.phases) - 1
        if not last and ((in_phase >= phase.min_steps and run_em >= phase.advance_em) or in_phase >= phase.max_steps):
            state["phase"] += 1
            state["phase_start"] = state["step"]
            windows.clear()
            print(f"\nstep {state['step']}: phase {state['phase']} (running EM {run_em:.2f})", flush=True)

        if state["step"] % cfg.log_every == 0:
            row = {
                "step": state["step"],
                "phase": state["phase"],
                "len": phase.max_len,
                "lm_loss": acc["lm"] / acc["n"],
                "answer_loss": acc["ans"] / acc["n"],
                "attn_loss": acc["src"] / acc["n"],
                "gather_loss": (acc["qsrc"] + acc["nsrc"]) / acc["n"],
                "train_em": sum(acc["em"]) / max(1, len(acc["em"])),
                "running_em": run_em,
                "task_em": {t: round(sum(w) / len(w), 3) for t, w in sorted(windows.items()) if w},
                "tok_per_s": acc["tok"] / acc["t"],
                "lr": lr,
                "grad_norm": float(gnorm),
                "tokens": state["tokens"],
                "train_s": state["train_s"],
                "wall_s": time.time() - t_start,
            }
            if state["step"] % cfg.probe_every == 0:
                t_probe = time.time()
                row["probe"] = probe(model, probes, cfg.bf16)
                row["probe_s"] = time.time() - t_probe
            log.write(json.dumps(row) + "\n")
            log.flush()
            bar.set_postfix(
                ph=state["phase"],
                lm=f"{row['lm_loss']:.2f}",
                ans=f"{row['answer_loss']:.2f}",
                em=f"{row['train_em']:.2f}",
                tps=f"{row['tok_per_s']:.0f}",
            )
            if "probe" in row:
                print(
                    "\nprobe", state["step"], json.dumps({k: round(v, 2) for k, v in row["probe"].items()}), flush=True
                )
            acc = {**fresh, "em": []}

        if time.time() - last_ckpt >= cfg.ckpt_every_s:
            checkpoint()
            last_ckpt = time.time()
        if cfg.max_wall_s and time.time() - t_start >= cfg.max_wall_s:
            print(f"\nwall budget reached at step {state['step']}", flush=True)
            break
    checkpoint()
    bar.close()
    for head in aux_heads.values():
        head.remove()
    log.close()
    return out / "ckpt"


# ---- export ----------------------------------------------------------------------------------------------------
def plot_loss(log_path: Path, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(
        {r["step"]: r for r in read_jsonl(log_path)}.values()
    )  # a resume re-logs the steps after its checkpoint
    rows.sort(key=lambda r: r["step"])
    step = [r["step"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(14, 4.5))
    a.plot(step, [r["lm_loss"] for r in rows], label="LM loss (nats/token)")
    a.plot(step, [r["answer_loss"] for r in rows], label="answer loss (nats/token)")
    a.set_yscale("log")
    a.set_xlabel("step")
    a.legend()
    b.plot(step, [r["train_em"] for r in rows], label="train exact match", alpha=0.5)
    probes = [r for r in rows if "probe" in r]
    for key in sorted({k for r in probes for k in r["probe"]}):  # stages may probe different cells
        pts = [(r["step"], r["probe"][key]) for r in probes if key in r["probe"]]
        b.plot(*zip(*pts, strict=True), marker="o", ms=3, label=key)
    b.set_xlabel("step")
    b.set_ylim(-0.02, 1.02)
    b.legend(fontsize=6, ncol=2, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the axes, not over the curves
    for ax in (a, b):
        for r0, r1 in zip(rows, rows[1:], strict=False):
            if r1["phase"] != r0["phase"]:
                ax.axvline(r1["step"], color="grey", lw=0.5, ls="--")
    fig.tight_layout()
    save_figure(fig, png, dpi=110)
    plt.close(fig)


def write_stage_log(out: Path, dst: Path) -> None:
    """The run's log, preceded by the warm-start parent's (``init_log.jsonl``) with this run's steps offset past it,
    so the exported curve covers every stage; each row keeps a ``stage`` number (0 = from scratch)."""
    rows: list[dict] = []
    if (out / "init_log.jsonl").is_file():
        rows = [{"stage": 0, **r} for r in read_jsonl(out / "init_log.jsonl")]
    offset = max((r["step"] for r in rows), default=0)
    stage = max((r["stage"] for r in rows), default=-1) + 1
    seen: dict[int, dict] = {}
    for r in read_jsonl(out / "log.jsonl"):  # a resume re-logs the steps after its checkpoint: keep the last
        seen[r["step"]] = {**r, "stage": stage, "step": r["step"] + offset}
    rows += sorted(seen.values(), key=lambda r: r["step"])
    dst.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def export(cfg: ProxyTrainConfig) -> Path:
    """Write the last checkpoint to ``export_dir`` as a plain Hugging Face folder (safetensors + tokenizer + the
    training log, config and loss curve), built beside it and swapped in whole.

    ``export_dtype="bfloat16"`` stores the weights in bf16 (the precision training computed in, under autocast) to
    halve the folder, and records ``dtype: float32`` in ``config.json`` so ``from_pretrained`` (default or
    ``dtype="auto"``) loads and runs the model in fp32.
    """
    from transformers import AutoTokenizer, LlamaForCausalLM

    out, dst = Path(cfg.out_dir), Path(cfg.export_dir)
    ckpt = latest_checkpoint(out)
    if ckpt is None:
        raise FileNotFoundError(f"no checkpoint in {out}")
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model = LlamaForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    model.generation_config.pad_token_id = model.config.pad_token_id
    model.to(getattr(torch, cfg.export_dtype)).save_pretrained(tmp)
    config = json.loads((tmp / "config.json").read_text())
    atomic_write_json(tmp / "config.json", {**config, "dtype": "float32"})
    AutoTokenizer.from_pretrained(out / "tokenizer").save_pretrained(tmp)
    state = json.loads((ckpt / "state.json").read_text())
    state.pop("em_window", None)
    atomic_write_json(tmp / "training_state.json", state)
    atomic_write_json(tmp / "training_config.json", to_dict(cfg))
    write_stage_log(out, tmp / "training_log.jsonl")
    plot_loss(tmp / "training_log.jsonl", tmp / "loss_curve.png")
    dropped = sorted(p.name for p in dst.iterdir() if not (tmp / p.name).exists()) if dst.is_dir() else []
    swap_in(tmp, dst)
    if (
        dropped
    ):  # e.g. the hand-written model card and the eval.proxy_ruler scores, which describe the model just replaced
        warnings.warn(
            f"export replaced {dst} whole and removed {', '.join(dropped)} (not written by export): they described "
            "the previous model; rewrite them for this one (or restore them from git if it is the same model)",
            stacklevel=2,
        )
    return dst


def main(argv: list[str] | None = None) -> None:
    cfg = load_config(ProxyTrainConfig, sys.argv[1:] if argv is None else argv, usage=__doc__)
    if cfg.mode == "train":
        train(cfg)
    else:
        print(export(cfg))


if __name__ == "__main__":
    main()
