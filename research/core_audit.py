"""CORE's certificate audit and write-rule compensation gain (paper Tables 6 and 8; CORE.md "Certificate").

For each document (held-out essays, cut to ``--length`` tokens), the context is prefilled in chunks under
the ``core_certified`` press (:mod:`research.certificate`) and a teacher-forced continuation is fed on top; every later query (next chunks,
continuation) logs, per query head, the true retention error ``‖o* − o_R‖`` (o* from a shadow copy of the evicted
K/V), the four-term bound, the true and predicted evicted mass and the compensated error ``‖o* − ô‖``.

- Table 6 (per ratio, mass-weighted writes): µ_E = mean true evicted mass α_E, p̄(E) = mean predicted mass ε̂,
  Bound and RetErr normalised by ‖o*‖, tightness = RetErr / Bound, and the share of queries the online bound
  (δ = ``--delta``, the state's running radius) covers.
- Table 8 (per write rule, at ``--ratio``): compensation gain ``G = 1 − Σ‖o* − ô‖ / Σ‖o* − o_R‖`` of the queries
  after the 4th eviction event, without (G⁽⁰⁾) and with (G⁽δ⁾) a ±δ per-event perturbation of the write mass.

Usage (proxy model and its trained artifact)::

    .venv/bin/python -m research.core_audit --model checkpoints/proxy-lm --checkpoint checkpoints/core-proxy/final
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch


def documents(tokenizer, length: int, count: int) -> list[torch.Tensor]:
    from core_kv.corpus import held_out_texts

    docs = []
    for _, text in held_out_texts():
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) >= length:
            docs.append(torch.tensor([ids[:length]]))
        if len(docs) == count:
            break
    if not docs:
        raise ValueError(f"no held-out essay has {length} tokens")
    return docs


def run(model, ckpt: Path, docs, ratio: float, chunk: int, tail: int, **options) -> list[dict]:
    """Certificate rows of every readout, all documents."""
    from core_kv.models.cache import cache_kwarg
    from core_kv.pipeline import prefill
    from research.certificate import CertifiedCorePress

    rows = []
    for ids in docs:
        press = CertifiedCorePress(checkpoint=str(ckpt), compression_ratio=ratio, policy="paper", **options)
        ctx, cont = ids[:, :-tail], ids[:, -tail:]
        cache = prefill(model, ctx, press, chunk)
        pos = torch.arange(ctx.shape[1], ids.shape[1])[None]
        with torch.inference_mode(), press(model):
            model(input_ids=cont, position_ids=pos, use_cache=True, **{cache_kwarg(model): cache})
        rows += press.certificates
    return rows


def weighted_sum(rows, key) -> float:
    """``Σ_rows Σ_heads queries · row[key][head]`` over certificate rows (each row holds per-head means)."""
    return sum(sum(r[key][h] * r["queries"] for h in range(len(r[key]))) for r in rows)


def query_heads(rows) -> int:
    """The number of (query, head) pairs the rows average over."""
    return sum(r["queries"] * len(r["ret_err"]) for r in rows)


def table6(rows) -> dict:
    n = query_heads(rows)
    ret, bound = weighted_sum(rows, "ret_err_rel") / n, weighted_sum(rows, "bound_rel") / n
    return {
        "mu_E": weighted_sum(rows, "alpha") / n,
        "p_E": weighted_sum(rows, "eps_hat") / n,
        "bound": bound,
        "ret_err": ret,
        "tightness": ret / bound,
        "online_bound_holds": weighted_sum(rows, "holds") / n,
        "exact_bound_holds": weighted_sum(rows, "holds_exact") / n,
        "queries_x_heads": n,
    }


def gain(rows, event: int) -> float | None:
    sel = [r for r in rows if r["events"] == event]
    if not sel:
        return None
    return 1 - weighted_sum(sel, "comp_err") / weighted_sum(sel, "ret_err")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny", help="local model folder, or tiny (config-built, untrained artifact)")
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("--ratios", type=float, nargs="+", default=[0.25, 0.5, 0.75, 0.9])
    ap.add_argument("--ratio", type=float, default=0.75, help="ratio of the write-rule table (paper: 75%%)")
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--tail", type=int, default=64, help="teacher-forced continuation tokens after the context")
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("--delta", type=float, default=0.05)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from core_kv.models.loading import load_model

    model, tokenizer = load_model(args.model, dtype="float32")
    with tempfile.TemporaryDirectory() as tmp:
        if args.checkpoint:
            ckpt = Path(args.checkpoint)
        else:
            from benchmarks.core_cost import build_artifact

            ckpt = build_artifact(model, Path(tmp) / "core")
        docs = documents(tokenizer, args.length, args.docs)
        t6 = {}
        for r in args.ratios:
            t6[r] = table6(run(model, ckpt, docs, r, args.chunk, args.tail, certificate_delta=args.delta))
            print(f"[core_audit] table6 {r}: {json.dumps(t6[r])}", flush=True)
        t8 = {}
        for rule in ("mass", "equal_event", "uniform_token"):
            clean = run(model, ckpt, docs, args.ratio, args.chunk, args.tail, write_rule=rule)
            noisy = run(model, ckpt, docs, args.ratio, args.chunk, args.tail, write_rule=rule, write_noise=args.delta)
            g0, gd = gain(clean, 4), gain(noisy, 4)
            t8[rule] = {"G0": g0, "Gdelta": gd, "dG": None if g0 is None or gd is None else g0 - gd,
                        "G_all_events": gain_all(clean)}  # fmt: skip
            print(f"[core_audit] table8 {rule}: {json.dumps(t8[rule])}", flush=True)
    print(
        "\n| removal | µ_E (true mass) | p̄(E) (predicted) | Bound / ‖o*‖ | RetErr / ‖o*‖ | tightness | online bound holds |"
    )
    print("|---|---|---|---|---|---|---|")
    for r, v in t6.items():
        print(
            f"| {r:.0%} | {v['mu_E']:.3f} | {v['p_E']:.3f} | {v['bound']:.3f} | {v['ret_err']:.3f} | "
            f"{v['tightness']:.3f} | {v['online_bound_holds']:.1%} |"
        )
    fmt = lambda x: "n/a" if x is None else f"{100 * x:.2f}"  # noqa: E731
    print(f"\n| write rule ({args.ratio:.0%}) | G⁽⁰⁾ % (4th event) | G⁽δ⁾ % | ΔG (pp) | G % (all events) |")
    print("|---|---|---|---|---|")
    for rule, v in t8.items():
        print(f"| {rule} | {fmt(v['G0'])} | {fmt(v['Gdelta'])} | {fmt(v['dG'])} | {fmt(v['G_all_events'])} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "table6": t6, "table8": t8}, indent=1))


def gain_all(rows) -> float:
    return 1 - weighted_sum(rows, "comp_err") / weighted_sum(rows, "ret_err")


if __name__ == "__main__":
    main()
