"""Why is the proxy student below its teacher? Warm-up-only distillation on cached teacher records, measured on the
training records and on the held-out report's events (issue 20 item 3; research/notebook.md, "Proxy student gap").

``cache`` replays the teacher dataset's documents (for the coverage features Φ of every record) and the held-out report
documents (indices 2,100,000+, full-cache candidates, teacher targets online) once and stores them; ``eval`` scores an
indexer (a run's ``stages/indexer*.safetensors``) on both; ``train`` reruns the warm-up stage of
``core_kv.distill.stages.train_indexer`` (same loss, AdamW, lr schedule, clipping, record order) with options, and
reports train-set and held-out KL / Top-B overlap / Table 7 J_B (student / teacher / utility-only, the numbers of
``distill/evaluate.py``'s full-cache rows: the harness reproduces a run's held-out Table 7 exactly). ``--pool held``
trains on the held-out events themselves: the ceiling of the indexer on these features.

Two information tests (research/notebook.md, "Proxy student gap"): ``--obs-window W`` builds (``teacher``) and caches
(``cache``) records whose observation-window features use the last ``W`` queries instead of the spec's 32 (the
window is a module constant of :mod:`core_kv.features`; this script overrides it in the modules that read it, for
the experiment only: the records' manifest carries the window, and the teacher-dataset reader refuses them wherever
the spec's 32 is computed, so no artifact can be trained on them), and ``train --opt content=1`` appends each
candidate's key content, its Nyström coverage features Φ_i (M = 64, scaled to unit RMS), to the 14 standardised
inputs of a wider first layer.

Usage (one thread; needs the proxy teacher data, built by the first ``make train``)::

    OMP_NUM_THREADS=1 .venv/bin/python -m research.distill_gap cache
    OMP_NUM_THREADS=1 .venv/bin/python -m research.distill_gap eval runs/core-proxy/stages/indexer.safetensors
    OMP_NUM_THREADS=1 .venv/bin/python -m research.distill_gap train --opt rank=0 --opt steps=300
    OMP_NUM_THREADS=1 .venv/bin/python -m research.distill_gap teacher --obs-window 128 --teacher-dir runs/teacher/w128
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from core_kv.budget import budget_split, protected_mask, top_free
from core_kv.distill.losses import kl_to_teacher, topb_boundary_bce, topb_overlap
from core_kv.features import NUM_FEATURES
from core_kv.indexer import HIDDEN, CoreIndexer
from core_kv.nystrom import normalised_beta_b
from core_kv.schedules import warmup_cosine
from core_kv.teacher.dataset import MANIFEST
from core_kv.teacher.metrics import set_quality

RATIOS = (0.75, 0.9)
CACHE = Path("runs/diag/distill_gap_cache.pt")
DEFAULT_TEACHER = "runs/teacher/proxy"  # make train's proxy records
EVAL_OFFSET = 2_100_000


def trainer(teacher_dir="runs/teacher/proxy", num_docs=32):
    from core_kv.distill.config import TrainConfig
    from core_kv.distill.trainer import Trainer

    cfg = TrainConfig(out_dir="runs/diag/distill_gap", threads=1, progress=False)
    cfg.teacher.out_dir = teacher_dir
    cfg.teacher.data.num_docs = num_docs
    manifest = Path(teacher_dir) / MANIFEST
    if manifest.exists():  # the records' feature spec (a run with teacher.features=2 built v2 records)
        cfg.teacher.features = int(json.loads(manifest.read_text())["feature_spec"]["version"])
    cfg.teacher.progress = False
    cfg.build_teacher = False
    tr = Trainer(cfg)
    tr.load_base()
    tr.setup()
    return tr


def _item(layer, feats, p_star, pi_u, phi, sinks, recent, doc, cand=None):
    n = p_star.shape[-1]
    beta = normalised_beta_b(phi.double())
    it = {
        "layer": layer,
        "doc": doc,
        "features": feats.float(),
        "p_star": p_star.float(),
        "pi_u": pi_u.float(),
        "phi": phi.float(),
        "beta": beta,
        "rat": {},
    }
    for r in RATIOS:
        b, s, w = budget_split(n, r, sinks, recent)
        bf = b - s - w
        if not 0 < bf < n - s - w:
            continue
        prot = protected_mask(n, s, w)
        d = {"prot": prot, "bf": bf}
        for name, sel in (("teacher", p_star), ("utility", pi_u)):
            u, c = set_quality(top_free(sel.double(), prot, bf), pi_u, phi.double(), beta)
            d[name] = (u.tolist(), c.tolist())
        it["rat"][r] = d
    return it


@torch.no_grad()
def build_cache(teacher_dir="runs/teacher/proxy", num_docs=32, out=CACHE, eval_docs=6):
    from core_kv.distill.replay import capture, replay_layer

    tr = trainer(teacher_dir, num_docs)
    sinks, recent = tr.spec.protected_sinks, tr.spec.protected_recent
    geo = tr.geometry
    recs = tr.ds.records()
    train = []
    by_doc = {}
    for r in recs:
        by_doc.setdefault(r.doc, []).append(r)
    for d in sorted(by_doc):
        doc = tr.docs([d])[0]
        acts = capture(tr.model, torch.tensor([doc.ids]))
        for r in by_doc[d]:
            a = acts[r.layer]
            phi = geo.nystrom(r.layer, geo.project(r.layer, a.k_pre))[:, r.positions]
            train.append(_item(r.layer, r.features, r.p_star, r.pi_u, phi, sinks, recent, d))
    held = []
    for doc in tr.docs([EVAL_OFFSET + i for i in range(eval_docs)]):
        acts = capture(tr.model, torch.tensor([doc.ids]))
        spec = replace(tr.spec, policy="full", targets=True)
        times = tr.context("x").times(doc)
        for layer, a in enumerate(acts):
            phi_all = geo.nystrom(layer, geo.project(layer, a.k_pre))
            for ev in replay_layer(a, layer, times, doc.qa_start, geo, spec, None):
                if ev.p_star is None:
                    continue
                heads = torch.arange(ev.cand.shape[0])[:, None]
                held.append(
                    _item(layer, ev.features, ev.p_star, ev.pi_u, phi_all[heads, ev.cand], sinks, recent, doc.index)
                )
    torch.save(
        {
            "train": train,
            "held": held,
            "stats": tr.core.indexer.feature_stats(),
            "num_layers": tr.core_config.num_layers,
            "num_kv_heads": tr.core.indexer.head_bias.shape[1],
        },
        out,
    )
    print(f"cache: {len(train)} train records, {len(held)} held-out events -> {out}")


def metrics(idx, items, j_items=None):
    """KL (all items), per ratio overlap and U/C/J of student/teacher/utility on ``j_items`` (default all)."""
    j_items = items if j_items is None else j_items
    out = {}
    with torch.no_grad():
        kls = [float(kl_to_teacher(it["p_star"], idx.scores(it["layer"], it["features"])).mean()) for it in items]
        out["kl"] = sum(kls) / len(kls)
        for r in RATIOS:
            acc = {k: [] for k in ("ov", "Us", "Cs", "Ut", "Ct", "Uu", "Cu")}
            for it in j_items:
                d = it["rat"].get(r)
                if d is None:
                    continue
                s = idx.scores(it["layer"], it["features"])
                acc["ov"].append(float(topb_overlap(s, it["p_star"], d["prot"], d["bf"]).mean()))
                u, c = set_quality(
                    top_free(s.float(), d["prot"], d["bf"]), it["pi_u"].double(), it["phi"].double(), it["beta"]
                )
                acc["Us"] += u.tolist()
                acc["Cs"] += c.tolist()
                acc["Ut"] += d["teacher"][0]
                acc["Ct"] += d["teacher"][1]
                acc["Uu"] += d["utility"][0]
                acc["Cu"] += d["utility"][1]
            m = {k: sum(v) / len(v) for k, v in acc.items()}
            tag = f"r{round(100 * r)}"
            out[tag] = {
                "overlap": m["ov"],
                "U_s": m["Us"],
                "J_s": m["Us"] + m["Cs"],
                "J_t": m["Ut"] + m["Ct"],
                "J_u": m["Uu"] + m["Cu"],
                "U_t": m["Ut"],
            }
            out[tag]["pct"] = out[tag]["J_s"] / out[tag]["J_t"]
    return out


def fmt(m):
    s = f"KL {m['kl']:.4f}"
    for tag in ("r75", "r90"):
        x = m[tag]
        s += (
            f" | {tag} J {x['J_s']:.4f}/{x['J_t']:.4f}/{x['J_u']:.4f} ({100 * x['pct']:.2f}%) U {x['U_s']:.3f}"
            f" ov {100 * x['overlap']:.1f}"
        )
    return s


def set_obs_window(w: int) -> None:
    """Override the spec's observation window (32 queries) wherever it is read, for ``--obs-window``."""
    import core_kv.distill.replay
    import core_kv.features
    import core_kv.teacher.config
    import core_kv.teacher.run

    for m in (
        core_kv.features,
        core_kv.teacher.run,
        core_kv.distill.replay,
        core_kv.teacher.config,
    ):
        m.OBS_WINDOW = w


def build_teacher(teacher_dir: str, features: int = 2):
    """The proxy teacher records (configs/teacher/default.yaml, spec ``features``) into ``teacher_dir``."""
    from core_kv.config import load_config
    from core_kv.teacher.config import TeacherConfig
    from core_kv.teacher.run import run_teacher

    argv = ["--config", "configs/teacher/default.yaml", f"features={features}", f"out_dir={teacher_dir}"]
    run_teacher(load_config(TeacherConfig, argv + ["threads=1", "progress=false"]))


def new_indexer(cache, seed=0, content=False):
    """The paper-size indexer; ``content`` widens each layer's input by the M coverage features (``--opt content=1``)."""
    torch.manual_seed(seed)
    if content:
        m = cache["train"][0]["phi"].shape[-1]
        idx = ContentIndexer(cache["num_layers"], cache["num_kv_heads"], m)
    else:
        idx = CoreIndexer(cache["num_layers"], cache["num_kv_heads"])
    idx.set_feature_stats(cache["stats"])
    return idx


def with_content(items):
    """Items whose features carry Φ_i after the 14 columns (for :class:`ContentIndexer`)."""
    return [{**it, "features": torch.cat([it["features"].float(), it["phi"].float()], -1)} for it in items]


def mlp(n_in: int, width: int, hidden_layers: int) -> nn.Sequential:
    """``n_in → width (→ width)* → 1`` with GELU, ``hidden_layers`` hidden layers."""
    dims = [n_in] + [width] * hidden_layers
    mods = [m for a, b in zip(dims[:-1], dims[1:], strict=True) for m in (nn.Linear(a, b), nn.GELU())]
    return nn.Sequential(*mods, nn.Linear(width, 1))


class ContentIndexer(CoreIndexer):
    """14 standardised features + Φ_i at unit RMS → 128 → 128 → 1 (an information test, not the paper's shape)."""

    def __init__(self, num_layers, num_kv_heads, m):
        super().__init__(num_layers, num_kv_heads)
        self.layers = nn.ModuleList(mlp(NUM_FEATURES + m, HIDDEN, 2) for _ in range(num_layers))

    def standardize(self, layer, features, heads=None):
        base = super().standardize(layer, features[..., :NUM_FEATURES], heads)
        phi = features[..., NUM_FEATURES:].float()
        phi = phi / (phi.norm(dim=-1, keepdim=True) + 1e-6) * phi.shape[-1] ** 0.5
        return torch.cat([base, phi], -1)


def load_weights(idx, path):
    from safetensors.torch import load_file

    t = load_file(path)
    sd = {k.removeprefix("indexer."): v for k, v in t.items() if k.startswith("indexer.") or "layers." in k}
    missing = idx.load_state_dict({k: v for k, v in sd.items() if k in idx.state_dict()}, strict=False)
    return missing


def train(
    cache,
    steps=300,
    per_micro=16,
    lr=1e-3,
    wd=0.01,
    warm=8,
    clip=1.0,
    rank=0.1,
    seed=0,
    every=50,
    shuffle=0,
    val_docs=0,
    ratios="0.75,0.9",
    hidden=None,
    j_train=120,
    log=None,
    pool_name="train",
    content=0,
):
    """Warm-up stage as stages.train_indexer (records cycled in (doc, event, layer) order unless shuffle)."""
    if content and hidden:
        raise ValueError("--opt content=1 and --opt hidden=... are separate tests; give one")
    idx = new_indexer(cache, seed, content=bool(content))
    if content:
        cache = {**cache, "train": with_content(cache["train"]), "held": with_content(cache["held"])}
    if hidden:
        idx.layers = nn.ModuleList(mlp(NUM_FEATURES, hidden, 3) for _ in range(cache["num_layers"]))
    pool = cache[pool_name]
    if val_docs:
        docs = sorted({it["doc"] for it in pool})
        vd = set(docs[-val_docs:])
        val = [it for it in pool if it["doc"] in vd]
        pool = [it for it in pool if it["doc"] not in vd]
    else:
        val = None
    order = list(range(len(pool)))
    n = steps * per_micro
    seq = []
    g = torch.Generator().manual_seed(seed)
    while len(seq) < n:
        seq += torch.randperm(len(pool), generator=g).tolist() if shuffle else order
    seq = seq[:n]
    ratios_l = [float(x) for x in str(ratios).split(",")]
    opt = torch.optim.AdamW(idx.parameters(), lr=lr, weight_decay=wd)
    jt = pool[:: max(1, len(pool) // j_train)]
    hist = []
    t0 = time.time()

    def report(step):
        rec = {"step": step, "train": metrics(idx, pool, jt), "held": metrics(idx, cache["held"])}
        if val is not None:
            rec["val"] = metrics(idx, val)
        hist.append(rec)
        line = f"step {step:4d} ({time.time() - t0:.0f}s) train KL {rec['train']['kl']:.4f} "
        line += f"J75 {100 * rec['train']['r75']['pct']:.2f}% | "
        if val is not None:
            line += f"val KL {rec['val']['kl']:.4f} J75 {100 * rec['val']['r75']['pct']:.2f}% | "
        print(line + "held " + fmt(rec["held"]), flush=True)

    for step in range(steps):
        for gr in opt.param_groups:
            gr["lr"] = warmup_cosine(step, steps, lr, warm)
        batch = [pool[i] for i in seq[step * per_micro : (step + 1) * per_micro]]
        losses = []
        for j, it in enumerate(batch):
            s = idx.scores(it["layer"], it["features"])
            p = it["p_star"]
            l_ = kl_to_teacher(p, s).mean()
            n_ = p.shape[-1]
            r = ratios_l[j % len(ratios_l)]
            b, sk, w = budget_split(n_, r, 4, 32)  # the proxy teacher's 4 sinks + 32 recent
            bf = b - sk - w
            if rank > 0 and 0 < bf < n_ - sk - w:
                l_ = l_ + rank * topb_boundary_bce(p, s, protected_mask(n_, sk, w), bf).mean()
            losses.append(l_)
        lossv = torch.stack(losses).mean()
        opt.zero_grad()
        lossv.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(idx.parameters(), clip)
        opt.step()
        if every and ((step + 1) % every == 0) and step + 1 < steps:
            report(step + 1)
    report(steps)
    if log:
        Path(log).write_text(json.dumps(hist))
    return idx, hist


def parse(pairs):
    kw = {}
    for a in pairs:
        k, v = a.split("=", 1)
        for conv in (int, float):
            try:
                v = conv(v)
                break
            except ValueError:
                pass
        kw[k] = v
    return kw


def main(argv=None):
    import argparse

    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("command", choices=("teacher", "cache", "eval", "train"))
    ap.add_argument("weights", nargs="?", help="eval: an indexer's safetensors (a run's stages/indexer.safetensors)")
    ap.add_argument("--cache", default=str(CACHE), help="the cached records (default %(default)s)")
    ap.add_argument("--teacher-dir", default=DEFAULT_TEACHER)
    ap.add_argument("--pool", default="train", choices=("train", "held"), help="train: the records to fit")
    ap.add_argument(
        "--opt",
        action="append",
        default=[],
        help="train option k=v: steps, per_micro, lr, wd, warm, clip, rank, seed, every, shuffle, "
        "val_docs, ratios ('0.75,0.9'), hidden, content (1: append the key content Φ), log",
    )
    ap.add_argument(
        "--obs-window", type=int, default=None, help="teacher / cache: window queries of the features (spec: 32)"
    )
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    if a.obs_window is not None and (a.command not in ("teacher", "cache") or a.obs_window < 1):
        ap.error("--obs-window takes a positive count and goes with `teacher` or `cache`")
    if a.command == "teacher" and (
        a.obs_window is None or Path(a.teacher_dir).resolve() == Path(DEFAULT_TEACHER).resolve()
    ):
        ap.error(f"`teacher` is for --obs-window tests: give one and a --teacher-dir other than {DEFAULT_TEACHER}")
    if a.obs_window is not None:  # checked before anything is overridden: a refused call changes nothing
        set_obs_window(a.obs_window)
    if a.command == "teacher":
        build_teacher(a.teacher_dir)
        return
    if a.command == "cache":
        Path(a.cache).parent.mkdir(parents=True, exist_ok=True)
        build_cache(a.teacher_dir, out=Path(a.cache))
        return
    cache = torch.load(a.cache, weights_only=False)
    if a.command == "eval":
        idx = new_indexer(cache)
        load_weights(idx, a.weights)
        jt = cache["train"][:: max(1, len(cache["train"]) // 120)]
        print("train", fmt(metrics(idx, cache["train"], jt)))
        print("held ", fmt(metrics(idx, cache["held"])))
    else:
        train(cache, pool_name=a.pool, **parse(a.opt))


if __name__ == "__main__":
    main()
