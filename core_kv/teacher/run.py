"""The teacher run: documents → chunked-prefill events → (π_U, features, p*) shards + Table 5/7 + throughput.

``python -m core_kv.teacher --config configs/teacher/default.yaml [a.b=v ...]``, also under ``accelerate launch``
(documents are split round-robin across processes; rank 0 merges the manifest).

Events [choice]. With full-cache candidates (stage 1) a chunked prefill of a document is, layer by layer, the same
computation as one causal forward, so the run does one forward per document and reads every event from it: events
sit at multiples of ``chunk_size`` inside the context, plus one at the end of the context when the document has a
question. At an event at time t_e the candidates are all tokens ``< t_e``; the future queries are the next chunk
(inside the context) and the question/answer tail ``[qa_start, T)``, mixed with weights ``1 − qa_weight`` and
``qa_weight``. The student's own retained sets (DAgger-style) are stage 2's business.

Capture. A forward pre-hook on each attention module receives the layer input and RoPE tables; the layer's events
are processed inside the hook with the family helpers of :mod:`core_kv.models.attention`, then dropped, so memory
stays at one layer's Q/K/V. Hook time is timed apart from the forward.

Import note: ``core_kv.teacher.{coverage,solver,utility,geometry,metrics}`` are the base stage and import nothing
above them; this runner and :mod:`core_kv.teacher.dataset` compose them with :mod:`core_kv.features` (the one
feature definition shared with training and the press).

Shapes: T document length, H query heads, Hkv KV heads, G = H/Hkv, D head dim, N candidates at an event.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm import tqdm

from core_kv.budget import budget_split
from core_kv.config import to_dict
from core_kv.features import (
    FEATURE_NAMES,
    NUM_FEATURES,
    OBS_WINDOW,
    FeatureStats,
    compute_features,
    moments,
    observation_attention,
    spec,
)
from core_kv.io import atomic_write, atomic_write_json, atomic_write_text
from core_kv.kernels import normalised_beta_b
from core_kv.models.attention import (
    _split_qkv,
    apply_rope,
    attention_modules,
    model_dims,
    prerope_keys,
    prerope_queries,
)
from core_kv.teacher.dataset import FORMAT, MANIFEST, ShardWriter, TeacherRecord, config_hash
from core_kv.teacher.geometry import Geometry, fit_geometry, model_fingerprint
from core_kv.teacher.metrics import (
    free_overlap,
    greedy_select,
    protected_mask,
    residual,
    set_quality,
    top_free,
)
from core_kv.teacher.solver import solve_allocation
from core_kv.teacher.utility import future_utility, normalise

PROXY_MIX = {
    "niah_single_1": 0.1,
    "niah_single_2": 0.15,
    "niah_multikey_1": 0.15,
    "niah_multikey_2": 0.1,
    "niah_multivalue": 0.1,
    "niah_multiquery": 0.1,
    "mk_noise": 0.05,
    "vt": 0.05,
    "lm": 0.2,
}


# ---------------------------------------------------------------------------------------------------------------
# Config


@dataclass
class ModelSpec:
    """The frozen base model: a Hugging Face folder/hub id, or (``random_init``) a config-built Llama."""

    path: str = "checkpoints/proxy-lm"
    revision: str = ""
    tokenizer: str = ""  # "" = path; "build" = build the proxy tokenizer in code
    random_init: bool = False
    seed: int = 0
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    vocab_size: int = 512
    dtype: str = "float32"
    attn_implementation: str = "sdpa"


@dataclass
class DataSpec:
    """Teacher documents. ``proxy``: the proxy LM's RULER-style generator + essays; ``random``: random tokens
    (tests); ``hf``: a Hugging Face dataset (``context_field`` + ``answer_field``, e.g. LongAlpaca-12k)."""

    source: str = "proxy"
    num_docs: int = 16
    calib_docs: int = 8
    calib_keys: int = 16384  # pre-RoPE keys per head kept for the geometry fit
    min_len: int = 1536
    max_len: int = 2048
    seed: int = 20261130  # never 42 (RULER's evaluation seed)
    mix: dict[str, float] = field(default_factory=lambda: dict(PROXY_MIX))
    question_tokens: int = 48  # tokens before the first answer token counted as the question
    hf_dataset: str = "Yukang/LongAlpaca-12k"
    hf_split: str = "train"
    hf_context_field: str = "instruction"
    hf_answer_field: str = "output"


@dataclass
class TeacherConfig:
    """Everything a teacher run depends on; YAML files in ``configs/teacher/`` override these defaults."""

    out_dir: str = "runs/teacher/default"
    model: ModelSpec = field(default_factory=ModelSpec)
    data: DataSpec = field(default_factory=DataSpec)
    chunk_size: int = 512
    qa_weight: float = 0.5
    lam: float = 2.0
    steps: int = 8  # R0 [paper Table 5]
    ref_steps: int = 16  # Table 5 reference
    eta: str = "auto"  # "auto" or a number in (0, 1]
    ratios: list[float] = field(default_factory=lambda: [0.75, 0.9])
    protected_sinks: int = 4
    protected_recent: int = 32
    d_z: int = 64
    num_prototypes: int = 64
    geometry_path: str = ""  # "" = <out_dir>/geometry.safetensors (fitted if absent)
    metrics: bool = True
    metrics_docs: int = -1  # Table 5/7 on documents with index < this only (-1: all); the greedy is O(B·N·M)
    records_per_shard: int = 256
    feature_dtype: str = "float16"
    threads: int = 1  # >0: torch.set_num_threads (1 is fastest on shared CPUs; 0 = leave it)
    progress: bool = True

    def __post_init__(self) -> None:
        if self.data.seed == 42:
            raise ValueError("data.seed 42 is RULER's evaluation seed; teacher documents must use another one")
        if self.eta != "auto":
            e = float(self.eta)
            if not 0 < e <= 1:
                raise ValueError(f"eta must be 'auto' or in (0, 1], got {self.eta}")
        if self.lam < 0:
            raise ValueError(f"lam must be >= 0, got {self.lam}")
        if not 0 <= self.qa_weight <= 1:
            raise ValueError(f"qa_weight must be in [0, 1], got {self.qa_weight}")
        if not self.ratios or any(not 0 <= r < 1 for r in self.ratios):
            raise ValueError(f"ratios must be compression ratios in [0, 1), got {self.ratios}")
        if self.steps < 1 or self.ref_steps < self.steps:
            raise ValueError("need 1 <= steps <= ref_steps")
        if self.data.source not in ("proxy", "random", "hf"):
            raise ValueError(f"data.source must be proxy, random or hf, got {self.data.source!r}")
        if self.chunk_size <= OBS_WINDOW:
            raise ValueError(f"chunk_size must exceed the observation window ({OBS_WINDOW})")
        if self.feature_dtype not in ("float16", "float32"):
            raise ValueError("feature_dtype must be float16 or float32")
        counts = [(f"data.{k}", getattr(self.data, k), 1) for k in ("num_docs", "calib_docs", "calib_keys", "min_len")]
        counts += [(k, getattr(self, k), 1) for k in ("records_per_shard", "d_z", "num_prototypes")]
        counts += [(k, getattr(self, k), 0) for k in ("protected_sinks", "protected_recent", "threads")]
        counts += [("data.question_tokens", self.data.question_tokens, 0)]
        for name, v, low in counts:
            if isinstance(v, bool) or v < low:
                raise ValueError(f"{name} must be >= {low}, got {v!r}")
        if self.data.source != "hf" and self.data.max_len < self.data.min_len:  # hf rows have natural lengths
            raise ValueError(f"data.max_len ({self.data.max_len}) must be >= data.min_len ({self.data.min_len})")
        if self.metrics_docs < -1 or self.metrics_docs == 0:
            raise ValueError(f"metrics_docs must be -1 (all documents) or >= 1, got {self.metrics_docs}")

    @property
    def eta_value(self) -> float | str:
        return "auto" if self.eta == "auto" else float(self.eta)

    def teacher_params(self) -> dict:
        """What the allocations depend on besides the model and the documents (recorded in the manifest)."""
        return {
            "lam": self.lam,
            "steps": self.steps,
            "eta": self.eta,
            "beta": "normalised: beta*B = 1/mean|Phi|^2",
            "chunk_size": self.chunk_size,
            "qa_weight": self.qa_weight,
            "question_tokens": self.data.question_tokens,
            "ratios": list(self.ratios),
            "protected_sinks": self.protected_sinks,
            "protected_recent": self.protected_recent,
            "d_z": self.d_z,
            "num_prototypes": self.num_prototypes,
            "candidates": "full cache (all tokens before the event)",
        }


# ---------------------------------------------------------------------------------------------------------------
# Model and documents


@dataclass
class Doc:
    index: int
    ids: list[int]
    qa_start: int | None  # first token of the question/answer tail, None for plain text
    kind: str


def load_model(spec_: ModelSpec, device) -> tuple[nn.Module, object | None]:
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from core_kv.models.packaged import resolve_model_path

    dtype = getattr(torch, spec_.dtype)
    if not spec_.random_init:
        spec_ = replace(spec_, path=resolve_model_path(spec_.path), tokenizer=resolve_model_path(spec_.tokenizer))
    local = spec_.path.startswith(("checkpoints/", "runs/", "./", "/"))
    if not spec_.random_init and local and not Path(spec_.path).is_dir():
        raise FileNotFoundError(
            f"model.path {spec_.path} does not exist: train/export the proxy LM first (python -m "
            "core_kv.proxy.train ...), or pass model.path=<HF folder or hub id>"
        )
    tok = None
    tok_path = spec_.tokenizer or ("" if spec_.random_init else spec_.path)
    if tok_path == "build":
        from core_kv.proxy.train import build_proxy_tokenizer

        tok = build_proxy_tokenizer()
    elif tok_path:
        tok = AutoTokenizer.from_pretrained(tok_path, revision=spec_.revision or None)
    if spec_.random_init:
        vocab = max(spec_.vocab_size, 64 * math.ceil(len(tok) / 64) if tok is not None else 0)
        cfg = LlamaConfig(
            vocab_size=vocab,
            hidden_size=spec_.hidden_size,
            num_hidden_layers=spec_.num_layers,
            num_attention_heads=spec_.num_heads,
            num_key_value_heads=spec_.num_kv_heads,
            intermediate_size=spec_.intermediate_size,
            max_position_embeddings=8192,
        )
        cfg._attn_implementation = spec_.attn_implementation
        torch.manual_seed(spec_.seed)
        model = LlamaForCausalLM(cfg).to(dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            spec_.path, revision=spec_.revision or None, dtype=dtype, attn_implementation=spec_.attn_implementation
        )
    return model.to(device).eval(), tok


def make_docs(data: DataSpec, indices: list[int], tokenizer) -> list[Doc]:
    """Deterministic documents by global index: the same index gives the same document in any process split."""
    if data.source == "random":
        out = []
        for i in indices:
            g = torch.Generator().manual_seed(data.seed * 1000 + i)
            n = int(torch.randint(data.min_len, data.max_len + 1, (1,), generator=g))
            ids = torch.randint(3, 500, (n,), generator=g).tolist()
            qa = n - 24 if i % 2 else None
            out.append(Doc(i, ids, qa, "random_qa" if qa else "random"))
        return out
    if data.source == "hf":
        import datasets

        ds = datasets.load_dataset(data.hf_dataset, split=data.hf_split)
        out = []
        for i in indices:
            row = ds[i % len(ds)]
            ctx = tokenizer(row[data.hf_context_field], add_special_tokens=True)["input_ids"]
            ans = tokenizer(row[data.hf_answer_field], add_special_tokens=False)["input_ids"]
            ans = ans[:512]
            room = max(data.max_len - len(ans), 2 * data.question_tokens)
            if len(ctx) > room:  # middle truncation (as LongBench does): keep the head and the question at the end
                ctx = ctx[: room // 2] + ctx[len(ctx) - (room - room // 2) :]
            qa = max(len(ctx) - data.question_tokens, 1)
            out.append(Doc(i, ctx + ans, qa, "hf"))
        return out
    from core_kv.proxy.data import Generator

    gen = Generator(tokenizer, seed=data.seed)
    names, weights = zip(*sorted(data.mix.items()), strict=True)
    out = []
    for i in indices:
        rng = random.Random(data.seed * 1000 + i)
        task, length = rng.choices(names, weights)[0], rng.randint(data.min_len, data.max_len)
        gen.rng = random.Random(data.seed * 1000 + i + 1)
        seq = gen.sample(task, length)
        first = next((j for j, a in enumerate(seq.ans) if a > 0), None)
        qa = None if first is None else max(first - data.question_tokens, 1)
        out.append(Doc(i, seq.ids, qa, task))
    return out


def event_times(n: int, qa_start: int | None, chunk: int) -> list[int]:
    """Event times t_e (number of cached tokens): chunk boundaries inside the context, plus the context end."""
    end = n if qa_start is None else qa_start
    times = list(range(chunk, end, chunk))
    if qa_start is not None and end > OBS_WINDOW and (not times or times[-1] != end):
        times.append(end)
    return times


# ---------------------------------------------------------------------------------------------------------------
# Geometry


@torch.inference_mode()
def collect_keys(model: nn.Module, docs: list[Doc], per_head: int, device) -> list[torch.Tensor]:
    """Pre-RoPE keys per layer (Hkv, ≤per_head, D) from calibration documents (an even subsample)."""
    mods = attention_modules(model)
    keys: dict[int, list[torch.Tensor]] = defaultdict(list)

    def hook(idx):
        def fn(module, args, kwargs):
            hs = kwargs.get("hidden_states", args[0] if args else None)
            keys[idx].append(prerope_keys(module, hs)[0].float().cpu())

        return fn

    handles = [m.register_forward_pre_hook(hook(i), with_kwargs=True) for i, m in enumerate(mods)]
    try:
        for d in docs:
            model.model(input_ids=torch.tensor([d.ids], device=device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    out = []
    for i in range(len(mods)):
        k = torch.cat(keys[i], dim=1)
        stride = max(1, k.shape[1] // per_head)
        out.append(k[:, ::stride][:, :per_head])
    return out


# ---------------------------------------------------------------------------------------------------------------
# Per-layer processing


class Recorder:
    """Accumulates feature moments, metric samples and timings of one process."""

    def __init__(self, layers: int, kv_heads: int, ratios: list[float]):
        self.count = torch.zeros(layers, kv_heads, dtype=torch.float64)
        self.total = torch.zeros(layers, kv_heads, NUM_FEATURES, dtype=torch.float64)
        self.total_sq = torch.zeros_like(self.total)
        self.samples: dict[str, list[torch.Tensor]] = defaultdict(list)
        self.time: dict[str, float] = defaultdict(float)
        self.tokens = 0
        self.events = 0
        self.ratios = ratios

    def add(self, name: str, value: torch.Tensor) -> None:
        self.samples[name].append(value.detach().double().cpu().reshape(-1))

    def tensors(self) -> dict[str, torch.Tensor]:
        t = {"count": self.count, "total": self.total, "total_sq": self.total_sq}
        for k, v in self.samples.items():
            t[f"s.{k}"] = torch.cat(v)
        return t


class _Timer:
    def __init__(self, rec: Recorder, name: str, device):
        self.rec, self.name, self.device = rec, name, device

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.t = time.perf_counter()

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.rec.time[self.name] += time.perf_counter() - self.t


def process_layer(
    cfg: TeacherConfig,
    module: nn.Module,
    layer: int,
    hidden_states: torch.Tensor,
    position_embeddings,
    doc: Doc,
    geometry: Geometry,
    rec: Recorder,
    writer: ShardWriter,
) -> None:
    """All events of one document at one layer: utility, features, allocation, metrics, records."""
    device = hidden_states.device
    timer = lambda name: _Timer(rec, name, device)  # noqa: E731
    with timer("capture"):
        q_pre = prerope_queries(module, hidden_states)  # (1, H, T, D)
        k_pre = prerope_keys(module, hidden_states)  # (1, Hkv, T, D)
        t_len, hkv, d = k_pre.shape[2], k_pre.shape[1], k_pre.shape[3]
        v = _split_qkv(module, hidden_states)[2].view(1, t_len, hkv, d).transpose(1, 2)[0]  # (Hkv, T, D)
        q_post = apply_rope(module, q_pre, position_embeddings)[0].float()  # (H, T, D)
        k_post = apply_rope(module, k_pre, position_embeddings)[0].float()  # (Hkv, T, D)
        q_pre, k_pre = q_pre[0].float(), k_pre[0].float()
        g = q_pre.shape[0] // hkv
        z = geometry.project(layer, k_pre)  # (Hkv, T, d_z)
        phi = geometry.nystrom(layer, z)  # (Hkv, T, M)
        protos = geometry.prototypes[layer].to(z)
        scaling = float(getattr(module, "scaling", d**-0.5))
    persistence = torch.full((hkv, t_len), float("nan"), device=device)
    times = event_times(t_len, doc.qa_start, cfg.chunk_size)
    for e, t_e in enumerate(times):
        with timer("utility"):
            nxt = torch.arange(t_e, min(t_e + cfg.chunk_size, doc.qa_start or t_len), device=device)
            qa = torch.arange(doc.qa_start, t_len, device=device) if doc.qa_start is not None else nxt[:0]
            w_qa = cfg.qa_weight if len(nxt) else 1.0
            w_qa = w_qa if len(qa) else 0.0
            fpos = torch.cat([nxt, qa])
            weights = torch.cat([torch.full((len(nxt),), (1 - w_qa) / max(len(nxt), 1)),
                                 torch.full((len(qa),), w_qa / max(len(qa), 1))])  # fmt: skip
            qf = q_post[:, fpos].view(hkv, g, len(fpos), d)
            u = future_utility(qf, k_post[:, : int(fpos.max()) + 1], fpos, t_e, scaling, weights)
            pi_u = normalise(u.double())  # (Hkv, N)
        with timer("features"):
            wpos = torch.arange(max(0, t_e - OBS_WINDOW), t_e, device=device)
            cand = torch.arange(t_e, device=device)
            obs = observation_attention(
                q_post[:, wpos].view(hkv, g, len(wpos), d), k_post[:, :t_e], wpos, cand, scaling
            )
            q_obs = q_pre[:, wpos].view(hkv, g * len(wpos), d)
            feats, ema = compute_features(
                obs, q_obs, k_pre[:, :t_e], v[:, :t_e].float(), cand, t_e - 1, z[:, :t_e], phi[:, :t_e], protos,
                persistence[:, :t_e],
            )  # fmt: skip
            persistence[:, :t_e] = ema
        phi_e = phi[:, :t_e].double()
        with timer("solver"):
            p_star, _ = solve_allocation(pi_u, phi_e, cfg.lam, cfg.steps, cfg.eta_value)
        budgets = torch.tensor([budget_split(t_e, r, cfg.protected_sinks, cfg.protected_recent)[0] for r in cfg.ratios])
        with timer("write"):
            c, s1, s2 = moments(feats.cpu())
            rec.count[layer] += c
            rec.total[layer] += s1
            rec.total_sq[layer] += s2
            writer.add(TeacherRecord(doc.index, e, layer, cand.cpu(), feats.cpu(), pi_u.float().cpu(),
                                     p_star.float().cpu(), budgets))  # fmt: skip
        rec.events += 1
        if cfg.metrics and (cfg.metrics_docs < 0 or doc.index < cfg.metrics_docs):
            with timer("metrics"):
                record_metrics(cfg, pi_u, phi_e, p_star, t_e, rec)


def record_metrics(cfg: TeacherConfig, pi_u, phi, p_star, n: int, rec: Recorder) -> None:
    """Table 5 and Table 7 samples of one (event, layer), every KV head."""
    ref_long = 2 * cfg.ref_steps
    _, hist = solve_allocation(
        pi_u, phi, cfg.lam, ref_long, cfg.eta_value, record=(1, cfg.steps, cfg.ref_steps, ref_long)
    )
    p_ref = hist[cfg.ref_steps]
    rec.add("e_1", residual(hist[1], p_ref))
    rec.add(f"e_{cfg.steps}", residual(hist[cfg.steps], p_ref))
    rec.add(f"e_{cfg.ref_steps}_vs_{ref_long}", residual(p_ref, hist[ref_long]))
    rec.add("tv_pstar_piu", residual(p_star, pi_u))
    beta_b = normalised_beta_b(phi)
    for r in cfg.ratios:
        b, s, w = budget_split(n, r, cfg.protected_sinks, cfg.protected_recent)
        b_free = b - s - w
        if b_free <= 0 or b_free >= n - s - w:
            continue
        prot = protected_mask(n, s, w, device=pi_u.device)
        tag = f"r{round(100 * r)}"
        rec.add(f"overlap_1.{tag}", free_overlap(hist[1], p_ref, prot, b_free))
        rec.add(f"overlap_{cfg.steps}.{tag}", free_overlap(hist[cfg.steps], p_ref, prot, b_free))
        sets = {
            "utility": top_free(pi_u, prot, b_free),
            "teacher": top_free(p_star, prot, b_free),
            "greedy": greedy_select(pi_u, phi, beta_b, prot, b_free),
        }
        for name, mask in sets.items():
            u, c = set_quality(mask, pi_u, phi, beta_b)
            rec.add(f"U.{tag}.{name}", u)
            rec.add(f"C.{tag}.{name}", c)


# ---------------------------------------------------------------------------------------------------------------
# Run


def _hooks(cfg, model, doc, geometry, rec, writer):
    def make(idx):
        def fn(module, args, kwargs):
            hs = kwargs.get("hidden_states", args[0] if args else None)
            t0 = time.perf_counter()
            process_layer(cfg, module, idx, hs, kwargs["position_embeddings"], doc, geometry, rec, writer)
            rec.time["_in_hooks"] += time.perf_counter() - t0

        return fn

    return [m.register_forward_pre_hook(make(i), with_kwargs=True) for i, m in enumerate(attention_modules(model))]


def summarise(cfg: TeacherConfig, t: dict[str, torch.Tensor], times: dict, tokens: int, events: int, dims) -> dict:
    """Table 5, Table 7 and throughput from merged samples."""

    def stats(x):
        return {"median": float(x.median()), "p90": float(x.quantile(0.9)), "mean": float(x.mean()), "n": x.numel()}

    s = {k[2:]: v for k, v in t.items() if k.startswith("s.")}
    out: dict = {"model_layers": dims["layers"], "kv_heads": dims["kv_heads"]}
    if s:
        r0, rr = cfg.steps, cfg.ref_steps
        t5 = {
            "1": {"e_R": stats(s["e_1"])},
            str(r0): {"e_R": stats(s[f"e_{r0}"])},
            str(rr): {f"e_R_vs_{2 * rr}": stats(s[f"e_{rr}_vs_{2 * rr}"])},
        }
        for r in cfg.ratios:
            tag = f"r{round(100 * r)}"
            if f"overlap_1.{tag}" in s:
                t5["1"][f"overlap.{tag}"] = float(s[f"overlap_1.{tag}"].mean())
                t5[str(r0)][f"overlap.{tag}"] = float(s[f"overlap_{r0}.{tag}"].mean())
        out["table5"] = t5
        out["tv_pstar_piu"] = stats(s["tv_pstar_piu"])
        t7 = {}
        for r in cfg.ratios:
            tag = f"r{round(100 * r)}"
            rows = {}
            for name in ("utility", "teacher", "greedy"):
                if f"U.{tag}.{name}" in s:
                    u, c = s[f"U.{tag}.{name}"], s[f"C.{tag}.{name}"]
                    rows[name] = {"U_B": float(u.mean()), "C_B": float(c.mean()), "J_B": float((u + c).mean())}
            t7[tag] = rows
        out["table7"] = t7
    wall = times.get("_wall", 0.0)
    hooks = times.get("_in_hooks", 0.0)
    forward = times.get("_forward_total", 0.0) - hooks
    parts = {k: v for k, v in times.items() if not k.startswith("_")}
    production = forward + sum(v for k, v in parts.items() if k != "metrics")
    out["throughput"] = {
        "tokens": tokens,
        "events_x_layers": events,
        "wall_s": wall,
        "tokens_per_s": tokens / wall if wall else float("nan"),
        "tokens_per_s_per_layer": tokens * dims["layers"] / wall if wall else float("nan"),
        "tokens_per_s_without_metrics": tokens / production if production else float("nan"),
        "seconds": {"forward": forward, **parts},
        "share_without_metrics": {k: v / production for k, v in {"forward": forward, **parts}.items() if k != "metrics"}
        if production
        else {},
    }
    return out


def format_report(cfg: TeacherConfig, m: dict, model_name: str) -> str:
    lines = [f"CORE teacher (stage 1) — model {model_name}, lambda={cfg.lam}, eta={cfg.eta}, R0={cfg.steps}"]
    if "table5" in m:
        t5 = m["table5"]
        lines.append("Table 5 (residual e_R = 1/2|p^(R) - p^(16)|_1; Top-B agreement with R=16 on the free picks)")
        tags = [f"r{round(100 * r)}" for r in cfg.ratios]
        lines.append(
            f"  {'R':>4} {'median e_R':>12} {'P90 e_R':>12} " + " ".join(f"{'overlap@' + t:>12}" for t in tags)
        )
        for r in ("1", str(cfg.steps)):
            e = t5[r]["e_R"]
            ov = " ".join(f"{100 * t5[r].get('overlap.' + t, float('nan')):11.2f}%" for t in tags)
            lines.append(f"  {r:>4} {e['median']:12.3e} {e['p90']:12.3e} {ov}")
        e = t5[str(cfg.ref_steps)][f"e_R_vs_{2 * cfg.ref_steps}"]
        lines.append(f"  {cfg.ref_steps:>4} {e['median']:12.3e} {e['p90']:12.3e}   (vs R={2 * cfg.ref_steps}; ref.)")
        lines.append("Table 7 (U_B = kept utility mass, C_B = logdet coverage of the kept set, J_B = U_B + C_B)")
        for tag, rows in m["table7"].items():
            for name, v in sorted(rows.items(), key=lambda kv: ("utility", "teacher", "greedy").index(kv[0])):
                lines.append(f"  {tag:>4} {name:>8}  U_B {v['U_B']:.4f}  C_B {v['C_B']:.4f}  J_B {v['J_B']:.4f}")
        lines.append(f"TV(p*, pi_U): median {m['tv_pstar_piu']['median']:.4f}")
    th = m["throughput"]
    lines.append(
        f"Throughput: {th['tokens']} tokens, {th['tokens_per_s']:.1f} tok/s, {th['tokens_per_s_per_layer']:.1f} "
        f"tok/s per layer (x layers), {th['tokens_per_s_without_metrics']:.1f} tok/s without the Table 5/7 metrics"
    )
    lines.append(
        "  time share without metrics: "
        + ", ".join(f"{k} {100 * v:.1f}%" for k, v in th["share_without_metrics"].items())
    )
    return "\n".join(lines)


def run_teacher(cfg: TeacherConfig) -> dict:
    """Run the teacher over ``cfg.data`` and write the dataset to ``cfg.out_dir``; returns the metrics dict."""
    from accelerate import PartialState

    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    state = PartialState(cpu=not torch.cuda.is_available())
    rank, world, device = state.process_index, state.num_processes, state.device
    t_start = time.perf_counter()
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if rank == 0 and (out / MANIFEST).exists():
        (out / MANIFEST).unlink()  # the manifest marks completion; a rerun invalidates it first
    model, tok = load_model(cfg.model, device)
    dims = model_dims(model)
    fp = model_fingerprint(model)

    geo_path = Path(cfg.geometry_path) if cfg.geometry_path else out / "geometry.safetensors"
    calibration = {
        "source": cfg.data.source, "calib_docs": cfg.data.calib_docs, "calib_keys": cfg.data.calib_keys,
        "seed": cfg.data.seed, "min_len": cfg.data.min_len, "max_len": cfg.data.max_len, "d_z": cfg.d_z,
        "num_prototypes": cfg.num_prototypes,
    }  # fmt: skip
    if rank == 0:
        geometry = None
        if geo_path.is_file():
            try:
                geometry = Geometry.load(geo_path, fp)
            except ValueError:  # another model: refit
                geometry = None
            if geometry is not None and not cfg.geometry_path and geometry.calibration != calibration:
                geometry = None  # fitted under other calibration settings: refit
        if geometry is None:
            calib = make_docs(cfg.data, [1_000_000 + i for i in range(cfg.data.calib_docs)], tok)
            keys = collect_keys(model, calib, cfg.data.calib_keys, device)
            geometry = fit_geometry(keys, fp, cfg.d_z, cfg.num_prototypes, calibration=calibration)
            geometry.save(geo_path)
        if geo_path != out / "geometry.safetensors":
            geometry.save(out / "geometry.safetensors")
    state.wait_for_everyone()
    geometry = Geometry.load(out / "geometry.safetensors", fp)
    geometry = Geometry(*(getattr(geometry, k).to(device) for k in ("mean", "proj", "prototypes", "gamma", "kmm_inv_sqrt")),
                        fingerprint=geometry.fingerprint, calibration=geometry.calibration)  # fmt: skip

    mine = [i for i in range(cfg.data.num_docs) if i % world == rank]
    docs = make_docs(cfg.data, mine, tok)
    rec = Recorder(dims["layers"], dims["kv_heads"], list(cfg.ratios))
    writer = ShardWriter(out, rank, cfg.records_per_shard, getattr(torch, cfg.feature_dtype))
    bar = tqdm(docs, desc=f"teacher[{rank}]", disable=not cfg.progress or not state.is_local_main_process)
    with torch.inference_mode():
        for doc in bar:
            handles = _hooks(cfg, model, doc, geometry, rec, writer)
            try:
                t0 = time.perf_counter()
                model.model(input_ids=torch.tensor([doc.ids], device=device), use_cache=False)
                rec.time["_forward_total"] += time.perf_counter() - t0
            finally:
                for h in handles:
                    h.remove()
            rec.tokens += len(doc.ids)
            bar.set_postfix(tokens=rec.tokens, events=rec.events)
    shards = writer.close()
    rec.time["_wall"] = time.perf_counter() - t_start
    part = {"rank": rank, "shards": shards, "tokens": rec.tokens, "events": rec.events, "time": dict(rec.time),
            "docs": [{"index": d.index, "kind": d.kind, "tokens": len(d.ids), "qa_start": d.qa_start} for d in docs]}  # fmt: skip
    atomic_write_json(out / "parts" / f"rank{rank:03d}.json", part)
    tensors = {k: v.contiguous() for k, v in rec.tensors().items()}
    atomic_write(out / "parts" / f"rank{rank:03d}.safetensors", lambda tmp: save_file(tensors, tmp))
    state.wait_for_everyone()
    metrics = {}
    if rank == 0:
        metrics = merge(cfg, out, world, dims, fp, t_start)
        print(format_report(cfg, metrics, fp["name"]))
    state.wait_for_everyone()
    if world > 1:
        state.destroy_process_group()
    return metrics


def merge(cfg: TeacherConfig, out: Path, world: int, dims: dict, fp: dict, t_start: float) -> dict:
    """Rank 0: combine the per-process parts into feature stats, metrics and the manifest (written last)."""
    parts = [json.loads((out / "parts" / f"rank{r:03d}.json").read_text()) for r in range(world)]
    tens = [load_file(str(out / "parts" / f"rank{r:03d}.safetensors")) for r in range(world)]
    merged = {}
    for k in tens[0]:
        if k.startswith("s."):
            vals = [t[k] for t in tens if k in t]
            merged[k] = torch.cat(vals)
        else:
            merged[k] = sum(t[k] for t in tens)
    stats = FeatureStats.from_moments(merged["count"], merged["total"], merged["total_sq"])
    stats.save(out / "feature_stats.safetensors")
    times: dict[str, float] = defaultdict(float)
    for p in parts:
        for k, v in p["time"].items():
            times[k] += v
    times["_wall"] = time.perf_counter() - t_start if world == 1 else max(p["time"]["_wall"] for p in parts)
    tokens, events = sum(p["tokens"] for p in parts), sum(p["events"] for p in parts)
    metrics = summarise(cfg, merged, dict(times), tokens, events, dims)
    metrics["num_processes"] = world
    metrics["model"] = fp
    atomic_write_json(out / "metrics.json", metrics)
    from omegaconf import OmegaConf

    resolved = to_dict(cfg)
    atomic_write_text(out / "config.yaml", OmegaConf.to_yaml(resolved))
    hashed = {
        k: v for k, v in resolved.items() if k not in ("out_dir", "progress", "threads", "metrics", "metrics_docs")
    }
    shards = sorted((s for p in parts for s in p["shards"]), key=lambda s: s["file"])
    manifest = {
        "format": FORMAT,
        "feature_spec": spec(),
        "teacher": cfg.teacher_params(),
        "fingerprint": fp,
        "config_hash": config_hash(hashed),
        "shards": shards,
        "num_records": sum(s["records"] for s in shards),
        "docs": sorted((d for p in parts for d in p["docs"]), key=lambda d: d["index"]),
        "geometry": "geometry.safetensors",
        "feature_stats": "feature_stats.safetensors",
        "metrics": "metrics.json",
        "features": list(FEATURE_NAMES),
        "num_processes": world,
    }
    atomic_write_json(out / MANIFEST, manifest)
    return metrics
