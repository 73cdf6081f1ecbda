"""Why the SmolLM2 recipe does not win on Gemma-3-270M (issue 57, item 1): retention, teacher accuracy, features.

On the policy stage's validation prompts (:mod:`core_kv.eval.validation`: archive-record needles in filler noise or
in Python-documentation prose, seeds >= 2000 here, never an evaluation context), per prompt:

1. one full-cache forward over context + question + answer captures every layer's Q/K/V
   (:func:`core_kv.distill.replay.capture`); at the one-shot prefill's single event (``t_e`` = the context length)
   :func:`core_kv.distill.replay.replay_layer` computes, in every compressed layer, the artifact's 14 features, the
   student's logits and the teacher's targets with the teacher's own functions: ``π_U`` from the question/answer
   tail (the teacher run's future queries at the context end) and ``p* = solve_allocation(π_U, Φ, λ)`` with the
   artifact's λ;
2. each selector compresses the context in one-shot prefill and answers greedily on that cache (the harness's
   protocol, :func:`core_kv.pipeline.answer_questions`' two steps): ``teacher`` (Top-B of p*, :class:`TargetPress`),
   ``utility`` (Top-B of π_U, the λ = 0 teacher), ``no_<feature>`` (the artifact's indexer with that standardised
   feature at its training mean, 0, in every compressed layer), each alone or ``+repair`` (wrapped in TwinKV's repair
   pass as the ``core`` press wraps its scorer), and any press (``core``: the artifact with no options; ``bare``:
   its scorer alone, ``core_scorer``; ``twinkv``, ``keydiff``, ``valuediff``); the retained positions of each layer
   are read off the cache (:func:`research.retention_audit.kept_positions`) and the answer's value tokens located in
   the context (``answer kept``: the share of them kept, per compressed layer);
3. ``features``: per compressed layer, the Spearman correlation of each raw feature with p* over the free
   candidates, and the indexer's leave-one-out: the standardised feature set to its training mean (0), the Top-B
   overlap with the teacher's set and the answer tokens kept, against the intact indexer.

``run`` appends one JSON line per prompt (resumable: finished prompts are skipped); ``table`` prints the tables.

    OMP_NUM_THREADS=1 .venv/bin/python -m research.gemma_diagnosis run --tasks single_prose --per-task 12 \\
        --seed 2000 --out runs/diag/gemma_diag.jsonl
    .venv/bin/python -m research.gemma_diagnosis table runs/diag/gemma_diag.jsonl --tasks single_prose
    OMP_NUM_THREADS=1 .venv/bin/python -m research.gemma_diagnosis run --model smollm2-135m \\
        --artifact checkpoints/core-smollm2/final --methods --score-methods --tasks single_prose single_noise \\
        --per-task 4 --seed 2000 --out runs/diag/smollm2_features.jsonl      # features only (no presses)
    .venv/bin/python -m research.gemma_diagnosis table runs/diag/smollm2_features.jsonl --layers 18-21

The commands of every table, and what they showed: ``docs/method.md``, "CORE on Gemma-3-270M: where the SmolLM2
recipe breaks".
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from core_kv.presses.base import ScorerPress

RATIOS = (0.75, 0.9)
SELECTORS = ("teacher", "utility")  # built here from the teacher's targets; every other method is a press name
ABLATED = "no_"  # no_<feature>: the artifact's indexer with that standardised feature at its training mean (0)


REPAIRED = "+repair"  # <selector>+repair: the selector wrapped in TwinKV's repair pass as the `core` press wraps it


def is_selector(method: str) -> bool:
    base = method.removesuffix(REPAIRED)
    return base in SELECTORS or base.startswith(ABLATED)


@dataclass
class TargetPress(ScorerPress):
    """Keeps the Top-B of a given per-layer distribution (the teacher's p* or π_U over the context), with the
    artifact's protected sinks and recent window: the teacher's allocation served as a press."""

    targets: dict = field(default_factory=dict)  # {layer: (Hkv, N)}

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        t = self.targets[module.layer_idx]
        if t.shape[-1] != keys.shape[2]:
            raise ValueError(f"TargetPress: layer {module.layer_idx} has {keys.shape[2]} cached entries, targets "
                             f"cover {t.shape[-1]}")  # fmt: skip
        return t[None].to(keys.device, torch.float32)


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Rank correlation of two 1-D tensors (average ranks not needed: ties are rare in continuous features)."""
    ra, rb = a.double().argsort().argsort().double(), b.double().argsort().argsort().double()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    den = float(ra.norm() * rb.norm())
    return float((ra * rb).sum()) / den if den > 0 else 0.0


def make_press(method: str, ratio: float, press_options: dict):
    """The press ``method`` names (a label with ``kind`` in its options, or a press name) at ``ratio``."""
    from core_kv.presses import build_press

    opts = dict(press_options.get(method, {}))
    return build_press(opts.pop("kind", method), compression_ratio=ratio, **opts)


def analyse_prompt(
    model, tok, core, prompt, methods, score_methods, ratios, press_options, max_new_tokens, skip_full=False
) -> dict:
    """Every measurement of one validation prompt (module docstring)."""
    from transformers import DynamicCache

    from core_kv.budget import budget_split, kept_tokens, protected_mask, top_free
    from core_kv.distill.replay import ReplaySpec, capture, replay_layer
    from core_kv.models.attention import window_layers
    from core_kv.pipeline import encode, greedy_answer, prefill
    from core_kv.presses.twin_repair import TwinRepairPress
    from research.retention_audit import context_ids_and_spans, kept_positions

    enc = encode(tok, prompt.context, [prompt.question], [prompt.prefix])
    ctx = enc.context_ids[0].tolist()
    n = len(ctx)
    q_ids = enc.question_ids[0]
    answer = tok.encode(prompt.answer, add_special_tokens=False)
    values = [v for v in prompt.answer.replace(".", " ").split() if v.isdigit()]
    vpos = set()
    for v in values:  # the value's token positions, located as the retention audit locates a needle's
        ids_v, _, span = context_ids_and_spans(tok, {"context": prompt.context, "needle": v, "value": v})
        if ids_v != ctx:
            raise RuntimeError("the diagnosis's context ids differ from the pipeline's")
        vpos |= span
    ids = torch.tensor([ctx + q_ids[0].tolist() + answer])
    t0 = time.perf_counter()
    inputs: dict = {}
    acts = capture(model, ids, inputs=inputs)
    spec = ReplaySpec.from_teacher(core.config.teacher, policy="full", features=core.config.feature_spec["version"])
    geometry = core.geometry()
    windows = window_layers(model)
    layers = [i for i in range(len(acts)) if i not in windows]
    targets = {m: {} for m in [*SELECTORS, *(m.removesuffix(REPAIRED) for m in methods if m.startswith(ABLATED))]}
    names = list(core.config.feature_spec["names"])
    feat_rows = {}
    with torch.no_grad():
        for layer in layers:
            (ev,) = replay_layer(acts[layer], layer, [n], n, geometry, spec, core.indexer.scores)
            targets["teacher"][layer] = ev.p_star.float()
            targets["utility"][layer] = ev.pi_u.float()
            for m in [m for m in targets if m.startswith(ABLATED)]:
                x = core.indexer.standardize(layer, ev.features)
                x[..., names.index(m.removeprefix(ABLATED))] = 0.0
                targets[m][layer] = core.indexer.layers[layer](x).squeeze(-1)
            prot = ev.protected
            free = ~prot
            x = core.indexer.standardize(layer, ev.features)
            heads = range(ev.p_star.shape[0])
            rows = {"spearman_student": mean(spearman(ev.scores[h][free], ev.p_star[h][free]) for h in heads),
                    "spearman_pstar": [mean(spearman(ev.features[h, free, f], ev.p_star[h][free]) for h in heads)
                                       for f in range(ev.features.shape[-1])]}  # fmt: skip
            loo = {}
            for r in ratios:
                b, s, w = budget_split(n, r, spec.protected_sinks, spec.protected_recent)
                prot_r = protected_mask(n, s, w)
                teach = top_free(ev.p_star.float(), prot_r, b - int(prot_r.sum()))  # (Hkv, N)
                util = top_free(ev.pi_u.float(), prot_r, b - int(prot_r.sum()))
                vp = sorted(vpos)
                rows.setdefault("kept", {})[str(r)] = {"teacher": float(teach[:, vp].float().mean()),
                                                       "utility": float(util[:, vp].float().mean())}  # fmt: skip
                per = []
                for f in [-1, *range(x.shape[-1])]:
                    xf = x.clone()
                    if f >= 0:
                        xf[..., f] = 0.0
                    s_f = core.indexer.layers[layer](xf).squeeze(-1)
                    kept = top_free(s_f, prot_r, b - int(prot_r.sum()))
                    per.append({"overlap": float((kept & teach & ~prot_r).sum() / max(1, int((teach & ~prot_r).sum()))),
                                "answer": float(kept[:, vp].float().mean())})  # fmt: skip
                loo[str(r)] = per
                rows["kept"][str(r)]["bare"] = per[0]["answer"]
            rows["loo"] = loo
            feat_rows[layer] = rows
        # scorer presses' retained sets at the same event, from their own compress() on the captured cache
        score_kept = {}
        for m in score_methods:
            for r in ratios:
                press = make_press(m, r, press_options)
                kept = {}
                for layer in layers:
                    module, hs, (cos, sin) = inputs[layer]
                    a = acts[layer]
                    idx = press.compress(
                        module,
                        hs[:, :n],
                        a.k_post[None, :, :n].to(hs.dtype),
                        a.v[None, :, :n].to(hs.dtype),
                        None,
                        {"position_embeddings": (cos[:, :n], sin[:, :n])},
                        kept_tokens(n, r),
                    )[0]
                    kept[str(layer)] = float(torch.isin(idx, torch.tensor(sorted(vpos))).sum(-1).float().mean()
                                             / len(vpos))  # fmt: skip
                score_kept[f"{m}@{r}"] = kept
    t_teacher = time.perf_counter() - t0
    out = {"task": prompt.task, "depth": prompt.depth, "context_tokens": n, "answer_tokens": len(vpos),
           "layers": layers, "features": feat_rows, "score_kept": score_kept, "teacher_seconds": t_teacher,
           "cells": []}  # fmt: skip
    if not methods:
        return out
    with torch.no_grad():
        full = DynamicCache()
        model.model(input_ids=enc.context_ids, past_key_values=full)
        full_keys = [lay.keys for lay in full.layers]
    sinks, recent = spec.protected_sinks, spec.protected_recent
    repair_threshold = core.policy().for_ratio(None).repair_threshold
    cells = [("full", 0.0)] * (not skip_full) + [(m, r) for m in methods for r in ratios]
    for method, ratio in cells:
        t1 = time.perf_counter()
        if method == "full":
            press = None
        elif is_selector(method):
            press = TargetPress(compression_ratio=ratio, protected_sinks=sinks, protected_recent=recent,
                                targets=targets[method.removesuffix(REPAIRED)])  # fmt: skip
            if method.endswith(REPAIRED):  # as core_kv.presses.core.compose wraps the scorer
                press = TwinRepairPress(press=press, protected_sinks=sinks, protected_recent=recent,
                                        threshold=repair_threshold)  # fmt: skip
        else:
            press = make_press(method, ratio, press_options)
        with torch.inference_mode():
            cache = prefill(model, enc.context_ids, press)
            kept = kept_positions(cache, full_keys) if press is not None else None
            tokens = greedy_answer(model, cache, n, q_ids, max_new_tokens or len(answer) + 2, press)
        text = tok.decode(tokens, skip_special_tokens=True)
        ok = all(v in text.replace(",", "").replace(" ", "") for v in values)
        cell = {"method": method, "ratio": ratio, "answer": text, "ok": ok, "seconds": time.perf_counter() - t1}
        if kept is not None:
            cell["answer_kept"] = {str(l): sum(len(s & vpos) for s in kept[l]) / (len(kept[l]) * len(vpos))
                                   for l in layers}  # fmt: skip
        out["cells"].append(cell)
    return out


def run(args) -> None:
    import core_kv.presses  # noqa: F401
    from core_kv.core_model import CoreModel
    from core_kv.eval.press_labels import parse_press_options
    from core_kv.eval.validation import build
    from core_kv.models.loading import load_model

    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model, dtype="float32")
    core = CoreModel.from_pretrained(args.artifact, base_model=model).eval()
    names = core.config.feature_spec["names"]
    bad = [
        m for m in args.methods if m.startswith(ABLATED) and m.removeprefix(ABLATED).removesuffix(REPAIRED) not in names
    ]
    if bad:
        raise SystemExit(f"--methods {' '.join(bad)}: not a feature of {args.artifact} ({', '.join(names)})")
    options = parse_press_options(args.press_option)
    for m in [*args.methods, *args.score_methods]:
        if not is_selector(m):
            options.setdefault(m, {})
    for m in ("core", "bare"):
        if m in options:
            options[m].setdefault("checkpoint", args.artifact)
    options.get("bare", {}).setdefault("kind", "core_scorer")
    out = Path(args.out)
    done = set()
    if out.is_file():
        done = {(r["task"], r["index"]) for r in map(json.loads, out.read_text().splitlines())}
    out.parent.mkdir(parents=True, exist_ok=True)
    for task in args.tasks:
        for i, p in enumerate(build(tok, task, args.length, args.per_task, args.seed)):
            if (task, i) in done:
                continue
            t0 = time.perf_counter()
            row = analyse_prompt(model, tok, core, p, args.methods, args.score_methods, args.ratios, options,
                                 args.max_new_tokens, args.skip_full)  # fmt: skip
            row.update({"index": i, "seed": args.seed, "model": args.model, "artifact": args.artifact,
                        "seconds": time.perf_counter() - t0})  # fmt: skip
            with out.open("a") as f:  # one line per finished prompt: a restart resumes after it
                f.write(json.dumps(row) + "\n")
            print(f"[gemma_diagnosis] {task} #{i}: {row['seconds']:.0f} s", flush=True)


def mean(xs) -> float:
    """The mean of the values that are not ``None`` (NaN when none)."""
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else float("nan")


def layer_groups(spec: str, layers: list[int]) -> dict[str, list[int]]:
    """``--layers``: ``""`` (each compressed layer; all pooled past 6), ``all``, or comma-separated ranges ``a-b``."""
    if not spec:
        return {f"L{l}": [l] for l in layers} if len(layers) <= 6 else {"all": layers}
    if spec == "all":
        return {"all": layers}
    out = {}
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out[f"L{part}"] = [l for l in layers if int(lo) <= l <= int(hi or lo)]
    return out


def table(args) -> None:
    rows = [json.loads(line) for path in args.files for line in Path(path).read_text().splitlines()]
    rows = [r for r in rows if not args.tasks or r["task"] in args.tasks]
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    groups = layer_groups(args.layers, rows[0]["layers"])
    counts = ", ".join(f"{t} x{len({r['index'] for r in rows if r['task'] == t})}" for t in tasks)
    seeds = sorted({r["seed"] for r in rows})
    print(f"prompts: {counts} (core_kv.eval.validation, seed {seeds}, {rows[0]['model']}, {rows[0]['artifact']})\n")
    ratios = list(rows[0]["features"][str(rows[0]["layers"][0])]["kept"])

    def per_group(fn) -> list[float]:  # fn(row, layer) -> value: mean over prompts and the group's layers
        return [mean(fn(row, l) for row in rows for l in g) for g in groups.values()]

    print(
        "Answer (value) tokens kept, mean over prompts: teacher = Top-B of p*, utility = Top-B of π_U (λ = 0), "
        "bare = the artifact's indexer alone, at the one-shot event; other rows: the press's own retained sets\n"
    )
    print("| selector | " + " | ".join(f"{g} @{float(r):.2f}" for r in ratios for g in groups) + " |")
    print("|---|" + "---|" * (len(groups) * len(ratios)))
    for sel in ("teacher", "utility", "bare"):
        vals = [
            v for r in ratios for v in per_group(lambda row, l, r=r, sel=sel: row["features"][str(l)]["kept"][r][sel])
        ]
        print(f"| {sel} | " + " | ".join(f"{v:.2f}" for v in vals) + " |")
    presses = list(dict.fromkeys(c["method"] for row in rows for c in row["cells"] if "answer_kept" in c))
    for m in [p for p in presses if not is_selector(p)]:

        def kept(row, l, r, m=m):
            cells = (c for c in row["cells"] if c["method"] == m and c["ratio"] == float(r))
            return next((c["answer_kept"][str(l)] for c in cells), None)  # None: not run on this prompt

        vals = [v for r in ratios for v in per_group(lambda row, l, r=r: kept(row, l, r))]
        print(f"| {m} (press) | " + " | ".join(f"{v:.2f}" for v in vals) + " |")
    for m in dict.fromkeys(k.split("@")[0] for row in rows for k in row.get("score_kept", {})):
        vals = [v for r in ratios
                for v in per_group(lambda row, l, r=r, m=m: row["score_kept"][f"{m}@{float(r)}"][str(l)])]  # fmt: skip
        print(f"| {m} | " + " | ".join(f"{v:.2f}" for v in vals) + " |")
    cells = list(dict.fromkeys((c["method"], c["ratio"]) for r in rows for c in r["cells"]))
    if cells:
        print("\nGreedy accuracy (the value's digits in the answer) per task\n")
        print("| method | ratio | " + " | ".join(tasks) + " | all |")
        print("|---|---|" + "---|" * (len(tasks) + 1))
        for m, ratio in cells:
            acc = []
            for t in [*tasks, None]:
                ok = [c["ok"] for r in rows if t in (None, r["task"]) for c in r["cells"]
                      if c["method"] == m and c["ratio"] == ratio]  # fmt: skip
                acc.append(f"{sum(ok)}/{len(ok)}")
            print(f"| {m} | {ratio:.2f} | " + " | ".join(acc) + " |")
        print("\nPaired comparisons (per-prompt correctness, the tasks above pooled): prompts only A / only B answers, "
              "the SE of the accuracy difference, and the prompts needed to separate a 10-point difference with this "
              "paired variance (two-sided 5%, power 80%)\n")  # fmt: skip
        print("| ratio | A | B | acc A | acc B | A only | B only | SE of the difference | prompts for 10 points |")
        print("|---|---|---|---|---|---|---|---|---|")
        methods = list(dict.fromkeys(m for m, _ in cells if m != "full"))
        for ratio in sorted({r for _, r in cells if r > 0}):
            for a, b in [(x, y) for i, x in enumerate(methods) for y in methods[i + 1 :]]:
                pa = [
                    next((c["ok"] for c in r["cells"] if c["method"] == a and c["ratio"] == ratio), None) for r in rows
                ]
                pb = [
                    next((c["ok"] for c in r["cells"] if c["method"] == b and c["ratio"] == ratio), None) for r in rows
                ]
                pairs = [(x, y) for x, y in zip(pa, pb, strict=True) if x is not None and y is not None]
                if not pairs:
                    continue
                k = len(pairs)
                var = statistics.pvariance([float(x) - float(y) for x, y in pairs]) if k > 1 else 0.0
                need = math.ceil((1.96 + 0.84) ** 2 * var / 0.1**2) if var > 0 else "–"
                print(f"| {ratio:.2f} | {a} | {b} | {mean(x for x, _ in pairs):.2f} | {mean(y for _, y in pairs):.2f} | "
                      f"{sum(x and not y for x, y in pairs)} | {sum(y and not x for x, y in pairs)} | "
                      f"{math.sqrt(var / k):.3f} | {need} |")  # fmt: skip
    first = rows[0]["features"][str(rows[0]["layers"][0])]
    spec_names = json.loads((Path(rows[0]["artifact"]) / "config.json").read_text())["feature_spec"]["names"]
    print("\nSpearman correlation with the teacher's p* over the free candidates (mean over prompts and KV heads), and "
          "the indexer's leave-one-out (one standardised feature set to its training mean, 0): answer tokens kept and "
          "Top-B overlap with the teacher's free picks, layers pooled; first row: the intact indexer\n")  # fmt: skip
    print("| feature | " + " | ".join(f"ρ(f, p*) {g}" for g in groups) + " | "
          + " | ".join(f"answer kept @{float(r):.2f} | overlap @{float(r):.2f}" for r in ratios) + " |")  # fmt: skip
    print("|---|" + "---|" * (len(groups) + 2 * len(ratios)))
    everything = [l for g in groups.values() for l in g]

    def loo(f: int, r: str, key: str) -> float:
        return mean(row["features"][str(l)]["loo"][r][f + 1][key] for row in rows for l in everything)

    rho = per_group(lambda row, l: row["features"][str(l)]["spearman_student"])
    print("| (student logits) | " + " | ".join(f"{x:+.2f}" for x in rho) + " | "
          + " | ".join(f"{loo(-1, r, 'answer'):.2f} | {loo(-1, r, 'overlap'):.2f}" for r in ratios) + " |")  # fmt: skip
    for f in range(len(first["spearman_pstar"])):
        rho = per_group(lambda row, l, f=f: row["features"][str(l)]["spearman_pstar"][f])
        print(f"| {spec_names[f]} | " + " | ".join(f"{x:+.2f}" for x in rho) + " | "
              + " | ".join(f"{loo(f, r, 'answer'):.2f} | {loo(f, r, 'overlap'):.2f}" for r in ratios) + " |")  # fmt: skip
    print(f"\nrun time: {mean(r['seconds'] for r in rows):.0f} s per prompt ({mean(r['teacher_seconds'] for r in rows):.0f}"
          " s of it the capture, the teacher and the scorer presses' sets)")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="measure prompts, appending to --out")
    r.add_argument("--model", default="gemma3-270m")
    r.add_argument("--artifact", default="checkpoints/core-gemma3-270m/final")
    r.add_argument("--methods", nargs="*", default=["teacher", "utility", "core", "twinkv"],
                   help=f"{', '.join(SELECTORS)}, {ABLATED}<feature> (the indexer with that feature at its mean, "
                        "served as a press) or press names / labels (--press-option label.kind=<press>); "
                        "core and bare (core_scorer) get --artifact; none: features only")  # fmt: skip
    r.add_argument("--score-methods", nargs="*", default=["keydiff", "valuediff"],
                   help="scorer presses whose retained sets are read from their compress() on the captured cache "
                        "(no prefill, no answer)")  # fmt: skip
    r.add_argument("--skip-full", action="store_true", help="no full-cache answer (measured in another file)")
    r.add_argument("--press-option", action="append", default=[], help="method.option=value (JSON values)")
    r.add_argument("--tasks", nargs="+", default=["single_noise", "single_prose"])
    r.add_argument("--per-task", type=int, default=8)
    r.add_argument("--seed", type=int, default=2000, help="validation seed (>= 2000 here; the stage used 1000)")
    r.add_argument("--length", type=int, default=2048)
    r.add_argument("--ratios", nargs="+", type=float, default=list(RATIOS))
    r.add_argument("--max-new-tokens", type=int, default=0, help="0: the answer's tokens + 2")
    r.add_argument("--threads", type=int, default=1)
    r.add_argument("--out", required=True, help="JSON lines, one per prompt (appended; finished prompts skipped)")
    t = sub.add_parser("table", help="print the tables of one or more --out files")
    t.add_argument("files", nargs="+")
    t.add_argument("--tasks", nargs="*", default=[], help="only these tasks' prompts (default: all)")
    t.add_argument("--layers", default="", help="layer groups: all, or ranges a-b,c (default: each, all past 6)")
    args = ap.parse_args(argv)
    if args.cmd == "run":
        if args.seed < 2000:
            raise SystemExit("--seed must be >= 2000 (lower seeds are the policy stage's and the evaluation's)")
        if args.per_task < 1 or any(not 0 < x < 1 for x in args.ratios):
            raise SystemExit("--per-task must be >= 1 and --ratios in (0, 1)")
        run(args)
    else:
        table(args)


if __name__ == "__main__":
    main()
