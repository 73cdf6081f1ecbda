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

Layout: the config is :mod:`core_kv.teacher.config`, the model :func:`core_kv.models.loading.load_from_spec`, the documents
:mod:`core_kv.documents`, the
summary and text report :mod:`core_kv.teacher.report`; this module is the collection and the manifest merge.

Shapes: T document length, H query heads, Hkv KV heads, G = H/Hkv, D head dim, N candidates at an event.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm import tqdm

from core_kv.budget import budget_split, protected_mask, top_free
from core_kv.config import to_dict
from core_kv.documents import Doc, make_docs
from core_kv.features import (
    NUM_FEATURES,
    OBS_WINDOW,
    FeatureStats,
    compute_features,
    feature_names,
    moments,
    observation_attention,
    spec,
)
from core_kv.files import atomic_write, atomic_write_json, atomic_write_text, read_json
from core_kv.geometry import Geometry
from core_kv.lock import main_process_lock
from core_kv.models.attention import (
    attention_inputs,
    attention_modules,
    layer_qkv,
    model_dims,
    prerope_keys,
    window_layers,
)
from core_kv.models.fingerprint import check_fingerprint, model_fingerprint
from core_kv.models.loading import check_lengths, check_vocabulary, load_from_spec
from core_kv.nystrom import normalised_beta_b
from core_kv.teacher.config import TeacherConfig, event_times
from core_kv.teacher.dataset import FORMAT, MANIFEST, ShardWriter, TeacherRecord, config_hash
from core_kv.teacher.geometry import fit_geometry
from core_kv.teacher.metrics import free_overlap, greedy_select, residual, set_quality
from core_kv.teacher.report import format_report, summarise
from core_kv.teacher.solver import solve_allocation
from core_kv.teacher.utility import future_utility, normalise

# ---------------------------------------------------------------------------------------------------------------
# Geometry


@torch.inference_mode()
def collect_keys(model: nn.Module, docs: list[Doc], per_head: int, device) -> list[torch.Tensor]:
    """Pre-RoPE keys per layer (Hkv, ≤per_head, D) from calibration documents (an even subsample)."""
    mods = attention_modules(model)
    keys: dict[int, list[torch.Tensor]] = defaultdict(list)

    def keep(layer, module, hidden_states, kwargs):
        keys[layer].append(prerope_keys(module, hidden_states)[0].float().cpu())

    with attention_inputs(model, keep):
        for d in docs:
            model.model(input_ids=torch.tensor([d.ids], device=device), use_cache=False)
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
        qkv = layer_qkv(module, hidden_states, position_embeddings)
        q_pre, k_pre, v, q_post, k_post = qkv.q_pre, qkv.k_pre, qkv.v, qkv.q_post, qkv.k_post  # (H|Hkv, T, D)
        hkv, t_len, d = k_pre.shape
        g = qkv.groups
        z = geometry.project(layer, k_pre)  # (Hkv, T, d_z)
        phi = geometry.nystrom(layer, z)  # (Hkv, T, M)
        protos = geometry.prototypes[layer].to(z)
        scaling = qkv.scaling
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
            kv = k_post[:, : int(fpos.max()) + 1]
            u = future_utility(qf, kv, fpos, t_e, scaling, weights, pools=(cfg.utility_pool,))[cfg.utility_pool]
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
                persistence[:, :t_e], keys_post=k_post[:, :t_e], version=cfg.features,
            )  # fmt: skip
            persistence[:, :t_e] = ema
        phi_e = phi[:, :t_e].double()
        with timer("solver"):
            p_star, _ = solve_allocation(pi_u, phi_e, cfg.lam_at(layer), cfg.steps, cfg.eta_value)
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
                record_metrics(cfg, pi_u, phi_e, p_star, t_e, rec, cfg.lam_at(layer))


def record_metrics(cfg: TeacherConfig, pi_u, phi, p_star, n: int, rec: Recorder, lam: float) -> None:
    """Table 5 and Table 7 samples of one (event, layer), every KV head."""
    ref_long = 2 * cfg.ref_steps
    _, hist = solve_allocation(pi_u, phi, lam, ref_long, cfg.eta_value, record=(1, cfg.steps, cfg.ref_steps, ref_long))
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


def _layer_hook(cfg, doc, geometry, rec, writer, skip=()):
    """What runs before each attention module's forward: the layer's events (timed as ``_in_hooks``). Layers in
    ``skip`` (a hybrid model's sliding-window layers, which presses never compress) get none."""

    def fn(layer, module, hidden_states, kwargs):
        if layer in skip:
            return
        t0 = time.perf_counter()
        process_layer(cfg, module, layer, hidden_states, kwargs["position_embeddings"], doc, geometry, rec, writer)
        rec.time["_in_hooks"] += time.perf_counter() - t0

    return fn


def run_teacher(cfg: TeacherConfig) -> dict:
    """Run the teacher over ``cfg.data`` and write the dataset to ``cfg.out_dir``; returns the metrics dict.

    A finished dataset already in ``out_dir`` is never replaced unasked: one of this config and base model is kept
    (the run says so and returns its metrics), one of another config or model is refused unless ``cfg.overwrite``.
    The folder is locked while the run writes it (:mod:`core_kv.lock`): a second run into it is refused.
    """
    from accelerate import PartialState

    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    state = PartialState(cpu=not torch.cuda.is_available())
    with main_process_lock(cfg.out_dir, "teacher run", state):
        return _run_teacher(cfg, state)


def _run_teacher(cfg: TeacherConfig, state) -> dict:
    rank, world, device = state.process_index, state.num_processes, state.device
    t_start = time.perf_counter()
    out = Path(cfg.out_dir)
    finished = read_manifest(out)
    if finished is not None and not cfg.overwrite and not same_teacher_config(cfg, out, finished):
        raise ValueError(
            f"{out} holds a finished teacher dataset of another config (compare its config.yaml), which a run never "
            f"replaces unasked: pass out_dir=<another folder> to build this one beside it, or overwrite=true to "
            f"replace it"
        )
    model, tok = load_from_spec(cfg.model, device)
    if tok is not None:
        check_vocabulary(model, tok, f"model {cfg.model.path} with tokenizer {cfg.model.tokenizer or cfg.model.path}")
    check_lengths(model, {"data.max_len": cfg.data.max_len}, f"model {cfg.model.path or '(random_init)'}")
    dims = model_dims(model)
    fp = model_fingerprint(model)
    if finished is not None and not cfg.overwrite:
        check_fingerprint(finished.get("fingerprint", {}), fp, f"the finished teacher dataset in {out} (overwrite=true "
                          "replaces it)")  # fmt: skip
        if state.is_main_process:
            print(f"teacher data: {out} is finished for this config and base model: kept (overwrite=true rebuilds it)")
        return read_json(out / finished.get("metrics", "metrics.json"), "teacher metrics")
    if rank == 0 and (out / MANIFEST).exists():
        (out / MANIFEST).unlink()  # overwrite=true: the manifest marks completion; the rebuild invalidates it first
    state.wait_for_everyone()

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
            except ValueError as e:  # another model (or unreadable): refit ours; a given geometry_path is not replaced
                if cfg.geometry_path:
                    raise ValueError(f"geometry_path {geo_path} cannot be used for this model ({e}); a run never "
                                     "replaces a given geometry: pass another geometry_path, or none") from None  # fmt: skip
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
    kept = {k: v for k, v in to_dict(cfg).items() if k not in ("out_dir", "progress", "threads", "overwrite")}
    progress = Progress(out, rank, {"config": kept, "world": world, "model": fp})  # metrics options included
    done = 0 if cfg.overwrite else progress.restore(rec, writer)
    if done and state.is_local_main_process:
        print(f"teacher[{rank}]: resuming after {done} of {len(docs)} documents ({progress.json})", flush=True)
    bar = tqdm(docs, desc=f"teacher[{rank}]", initial=done, disable=not cfg.progress or not state.is_local_main_process)
    with torch.inference_mode():
        for k, doc in enumerate(docs[done:], done + 1):
            with attention_inputs(model, _layer_hook(cfg, doc, geometry, rec, writer, skip=set(window_layers(model)))):
                t0 = time.perf_counter()
                model.model(input_ids=torch.tensor([doc.ids], device=device), use_cache=False)
                rec.time["_forward_total"] += time.perf_counter() - t0
            rec.tokens += len(doc.ids)
            writer.flush()  # a shard ends with its document, so every document boundary is a resume point
            progress.save(k, rec, writer)
            bar.update(1)
            bar.set_postfix(tokens=rec.tokens, events=rec.events)
    bar.close()
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
        for r in range(world):
            Progress(out, r, {}).clear()  # the manifest (written last) marks the run finished
        print(format_report(cfg, metrics, fp["name"]))
    state.wait_for_everyone()
    if world > 1:
        state.destroy_process_group()
    return metrics


class Progress:
    """One process's progress through its documents, saved atomically after each document (``parts/rank{r}.progress
    .json``, written last, names the Recorder's tensors at that point): a relaunch of the same config, model and
    process count restores the Recorder and the shards written, and skips the finished documents. The shards it then
    writes are the uninterrupted run's (every shard ends at a document boundary)."""

    def __init__(self, out: Path, rank: int, key: dict):
        self.dir, self.rank, self.key = out / "parts", rank, config_hash(key)
        self.json = self.dir / f"rank{rank:03d}.progress.json"

    def _tensors(self, docs: int) -> Path:
        return self.dir / f"rank{self.rank:03d}.progress-{docs:06d}.safetensors"

    def save(self, docs: int, rec: Recorder, writer: ShardWriter) -> None:
        tensors = {k: v.contiguous() for k, v in rec.tensors().items()}
        self.dir.mkdir(parents=True, exist_ok=True)
        atomic_write(self._tensors(docs), lambda tmp: save_file(tensors, tmp))
        atomic_write_json(self.json, {"key": self.key, "docs": docs, "shards": writer.shards, "tokens": rec.tokens,
                                      "events": rec.events, "time": dict(rec.time)})  # fmt: skip
        for old in self.dir.glob(f"rank{self.rank:03d}.progress-*.safetensors"):
            if old != self._tensors(docs):
                old.unlink()

    def restore(self, rec: Recorder, writer: ShardWriter) -> int:
        """The documents already done (0: none, or progress of another config, model or process count)."""
        if not self.json.is_file():
            return 0
        saved = read_json(self.json, "teacher progress")
        path = self._tensors(saved.get("docs", -1)) if isinstance(saved, dict) else None
        if path is None or saved.get("key") != self.key or not path.is_file():
            return 0
        tensors = load_file(str(path))
        rec.count, rec.total, rec.total_sq = tensors.pop("count"), tensors.pop("total"), tensors.pop("total_sq")
        for k, v in tensors.items():
            rec.samples[k.removeprefix("s.")] = [v]
        rec.tokens, rec.events = saved["tokens"], saved["events"]
        rec.time.update(saved["time"])
        writer.shards = list(saved["shards"])
        return saved["docs"]

    def clear(self) -> None:
        for f in self.dir.glob(f"rank{self.rank:03d}.progress*"):
            f.unlink()


# options that do not change the data: left out of the config hash and of the "same config" test
NOT_HASHED = ("out_dir", "progress", "threads", "metrics", "metrics_docs", "overwrite")


def hashed_config(resolved: dict) -> dict:
    """The resolved config without :data:`NOT_HASHED` (the manifest's ``config_hash`` is of this)."""
    hashed = {k: v for k, v in resolved.items() if k not in NOT_HASHED}
    if hashed.get("features") == 1:  # added after datasets were built: v1 runs keep their hash
        hashed.pop("features")
    return hashed


def read_manifest(out: Path) -> dict | None:
    """The manifest of a finished dataset in ``out`` (``None``: none); an unreadable one raises naming it."""
    path = out / MANIFEST
    if not path.is_file():
        return None
    manifest = read_json(path, "teacher manifest")
    if not isinstance(manifest, dict):
        raise ValueError(f"{path}: not a teacher manifest (a JSON object); delete {out} or pass overwrite=true")
    return manifest


def same_teacher_config(cfg: TeacherConfig, out: Path, manifest: dict) -> bool:
    """Whether the finished dataset in ``out`` was built with ``cfg``'s data-relevant options: the same config hash,
    or the same ``config.yaml`` once options it predates are dropped where they hold their defaults."""
    from omegaconf import OmegaConf

    current = hashed_config(to_dict(cfg))
    if manifest.get("config_hash") == config_hash(current):
        return True
    try:
        stored = OmegaConf.to_container(OmegaConf.load(out / "config.yaml"))
    except Exception:  # absent or unreadable: not provably the same
        return False
    if not isinstance(stored, dict):
        return False
    stored, defaults = hashed_config(stored), hashed_config(to_dict(TeacherConfig(out_dir=cfg.out_dir)))
    for key in [k for k in current if k not in stored and current[k] == defaults.get(k)]:
        del current[key]
    return stored == current


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
    stats.version = cfg.features
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
    hashed = hashed_config(resolved)
    shards = sorted((s for p in parts for s in p["shards"]), key=lambda s: s["file"])
    manifest = {
        "format": FORMAT,
        "feature_spec": spec(cfg.features),
        "teacher": cfg.teacher_params(),
        "fingerprint": fp,
        "config_hash": config_hash(hashed),
        "shards": shards,
        "num_records": sum(s["records"] for s in shards),
        "docs": sorted((d for p in parts for d in p["docs"]), key=lambda d: d["index"]),
        "geometry": "geometry.safetensors",
        "feature_stats": "feature_stats.safetensors",
        "metrics": "metrics.json",
        "features": list(feature_names(cfg.features)),
        "num_processes": world,
    }
    atomic_write_json(out / MANIFEST, manifest)
    return metrics
