"""Table 7 for training-free presses: J_B of SnapKV's, KeyDiff's and ExpectedAttention's retained sets beside the
CORE student's, the teacher's and utility-only Top-B, on the same held-out events (issue 20, item 3).

The held-out report of ``train.py`` (``distill/evaluate.py``) scores the student, the teacher and utility-only Top-B
on the full-cache events of its held-out documents (the teacher's protocol, paper Table 7). This script replays the
same documents (indices ``EVAL_OFFSET + i`` of the run's teacher data spec, from the run's resolved
``config.yaml``) and adds each press's selection at the same events: the press's own ``score`` on the cached prefix
``[0, t_e)`` (post-RoPE keys, values, the prefix's hidden states for the presses that recompute window queries),
then the same Top-B over the free (unprotected) candidates, the same budget and the same U_B / C_B / J_B
(``teacher.metrics.set_quality``) as the report.

    .venv/bin/python -m research.selector_quality --run checkpoints/core-smollm2 --docs 4
    .venv/bin/python -m research.selector_quality --run checkpoints/core-proxy --docs 6

Prints one table per ratio; ``--json`` writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

PRESSES = ("snapkv", "keydiff", "expected_attention")


def press_scores(press, module, hidden_states, position_embeddings, acts, t_e: int) -> torch.Tensor:
    """``press.score`` at an event after ``t_e`` cached tokens (Hkv, t_e), on the cache as the press sees it."""
    cos, sin = position_embeddings
    keys = acts.k_post[None, :, :t_e].to(hidden_states.dtype)
    values = acts.v[None, :, :t_e].to(hidden_states.dtype)
    kwargs = {"position_embeddings": (cos[:, :t_e], sin[:, :t_e])}
    return press.score(module, hidden_states[:, :t_e], keys, values, None, kwargs)[0].float()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--run", required=True, help="a train.py run folder: config.yaml + final/ (e.g. checkpoints/core-smollm2)"
    )
    ap.add_argument("--docs", type=int, default=0, help="held-out documents (0: the run's eval_docs)")
    ap.add_argument("--presses", nargs="+", default=list(PRESSES))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)

    import core_kv.presses  # noqa: F401
    from core_kv.budget import budget_split, protected_mask, top_free
    from core_kv.config import load_config
    from core_kv.core_model import CoreModel
    from core_kv.distill.config import TrainConfig
    from core_kv.distill.evaluate import EVAL_OFFSET
    from core_kv.distill.replay import ReplaySpec, capture, replay_layer
    from core_kv.documents import make_docs
    from core_kv.models.loading import load_from_spec
    from core_kv.nystrom import normalised_beta_b
    from core_kv.presses import build_press
    from core_kv.teacher.config import event_times
    from core_kv.teacher.metrics import set_quality

    torch.set_num_threads(args.threads)
    run = Path(args.run)
    if not (run / "config.yaml").is_file() or not (run / "final").is_dir():
        raise SystemExit(f"--run {run}: expected a train.py run folder with config.yaml and final/")
    cfg = load_config(TrainConfig, [str(run / "config.yaml")])
    model, tok = load_from_spec(cfg.teacher.model, torch.device("cpu"))
    core = CoreModel.from_pretrained(run / "final", base_model=model)
    geometry, idx = core.geometry(), core.indexer
    spec = ReplaySpec.from_teacher(
        core.config.teacher, policy="full", targets=True, features=core.config.feature_spec["version"]
    )
    presses = {name: build_press(name, compression_ratio=0.75) for name in args.presses}
    for press in presses.values():
        press.on_enter(model)  # per-model setup (ExpectedAttention's RoPE table); no hooks: scores are called directly
    n_docs = args.docs or cfg.eval_docs
    docs = make_docs(cfg.teacher.data, [EVAL_OFFSET + i for i in range(n_docs)], tok)
    names = ["utility", "teacher", "student", *args.presses]
    sums = {r: {n: {"U": [], "C": []} for n in names} for r in cfg.eval_ratios}
    t0 = time.perf_counter()
    for d_i, doc in enumerate(docs):
        ids = torch.tensor([doc.ids])
        inputs: dict = {}
        acts = capture(model, ids, inputs=inputs)
        times = event_times(len(doc.ids), doc.qa_start, spec.chunk_size)
        for layer, a in enumerate(acts):
            module, hs, pe = inputs[layer]
            events = replay_layer(a, layer, times, doc.qa_start, geometry, spec, idx.scores)
            phi_all = geometry.nystrom(layer, geometry.project(layer, a.k_pre))
            for ev in events:
                if ev.p_star is None:
                    continue
                n = ev.cand.shape[1]
                heads = torch.arange(ev.cand.shape[0])[:, None]
                phi = phi_all[heads, ev.cand].double()
                beta_b = normalised_beta_b(phi)
                ps = {name: press_scores(p, module, hs, pe, a, ev.t_e) for name, p in presses.items()}
                for ratio in cfg.eval_ratios:
                    b, s, w = budget_split(n, ratio, spec.protected_sinks, spec.protected_recent)
                    b_free = b - s - w
                    if not 0 < b_free < n - s - w:
                        continue
                    prot = protected_mask(n, s, w)
                    scores = {"utility": ev.pi_u, "teacher": ev.p_star, "student": ev.scores.float(), **ps}
                    for name, sc in scores.items():
                        u, c = set_quality(top_free(sc, prot, b_free), ev.pi_u, phi, beta_b)
                        sums[ratio][name]["U"] += u.tolist()
                        sums[ratio][name]["C"] += c.tolist()
        print(f"doc {d_i + 1}/{len(docs)} ({len(doc.ids)} tokens) {time.perf_counter() - t0:.0f} s", flush=True)
    out = {}
    for ratio in cfg.eval_ratios:
        rows = {}
        for name in names:
            u, c = sums[ratio][name]["U"], sums[ratio][name]["C"]
            if u:
                mu, mc = sum(u) / len(u), sum(c) / len(c)
                rows[name] = {"U_B": mu, "C_B": mc, "J_B": mu + mc, "n": len(u)}
        out[f"r{round(100 * ratio)}"] = rows
        tj = rows["teacher"]["J_B"]
        print(f"\n{ratio:.0%} removal ({rows['teacher']['n']} event x layer x head problems, {n_docs} held-out docs)")
        print("| selector | U_B | C_B | J_B | J_B / teacher |\n|---|---|---|---|---|")
        for name, r in sorted(rows.items(), key=lambda kv: -kv[1]["J_B"]):
            print(f"| {name} | {r['U_B']:.4f} | {r['C_B']:.4f} | {r['J_B']:.4f} | {100 * r['J_B'] / tj:.2f}% |")
    if args.json:
        Path(args.json).write_text(json.dumps({"run": str(run), "docs": n_docs, "table7": out}, indent=1))
    return out


if __name__ == "__main__":
    main()
