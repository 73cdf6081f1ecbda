"""End-to-end retrieval signal: the needle's likelihood under each press's compressed cache.

Issue 20's open question is why the learned allocation, better than KeyDiff's by every single-layer measure, answers
fewer needles. Answered / not answered is a coarse, noisy count (12 prompts per row move in steps of 8%); this
benchmark measures the same prompts continuously. For each held-out needle prompt (``needle_wording.py``'s builder:
seed 7, never RULER's 42; chat template on) and each method, the context is compressed in one-shot prefill exactly as
the pipeline does (``core_kv.pipeline.prefill``), then the question + answer prefix + the true answer ``" <value>."``
are teacher-forced on the compressed cache with the press still installed, as the pipeline answers (ragged attention,
the memory's readout; ``core_kv.eval.fidelity.continuation_logprobs``). Reported per method
and haystack:

- ``nll``: mean negative log-likelihood (nats) of the answer's tokens (the value's digits and the final period);
- ``Δnll``: the same minus the full cache's on the same prompt (0 = lossless);
- ``top1``: share of prompts whose every answer token is the compressed model's argmax under teacher forcing (a
  greedy copy of the value, given the answer's format);
- ``first miss``: mean index of the first answer token that is not the argmax (the answer's length if none):
  where a garbled copy goes wrong.

Methods are press names, ``full``, or labels with a ``kind`` (as in the evaluation configs), so variants of one
press compare side by side::

    .venv/bin/python -m research.answer_likelihood --methods full keydiff core nomem \\
        --press-option core.checkpoint=checkpoints/core-smollm2/final \\
        --press-option nomem.kind=core --press-option nomem.checkpoint=checkpoints/core-smollm2/final \\
        --press-option nomem.memory=false --ratio 0.75 --haystacks noise essay --n 12

``core_mix`` (``benchmarks/allocation_mix.py``: another press's scores in some layers of the ``core`` press) is
registered too.

**Memory audit.** A label of kind ``core_certified`` (``--press-option <label>.kind=core_certified``: the ``core`` press
whose memory logs the certificate, :mod:`research.certificate`; refused without a memory) is fed in two
forwards — the question, then the queries that predict the answer's tokens (the question's last token and the
answer's) — and its certificate rows of each are summarised per prompt (issue 18's memory target: where the
memory helps and where it costs retrieval). For queries ``q`` and query heads, with ``o*`` the attention output over
retained + evicted entries, ``o_R`` over retained ones and ``ô`` the memory-compensated one:

- ``gain_answer`` / ``gain_question``: ``G = 1 − Σ‖o* − ô‖ / Σ‖o* − o_R‖`` (paper Table 8's compensation gain; < 0:
  the memory moves the output away from the full attention output) on the answer-predicting / question queries;
- ``gate_answer`` / ``alpha_answer``: the mean gate ``g(q)`` and the mean true evicted mass ``α_E(q)`` on them;
- ``gain_answer_layers``: ``G`` per layer on the answer-predicting queries.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from core_kv.eval.needles import HAYSTACKS, WORDINGS, build_prompts
from core_kv.eval.press_labels import build_labelled_presses, parse_press_options
from research.core_audit import query_heads, weighted_sum


def answer_scores(logprobs: torch.Tensor, answer: list[int]) -> dict:
    """Scores of the answer tokens from the log-probs ``(T, V)`` of the fed sequence whose last ``len(answer)`` rows
    predict them (row i predicts fed token i + 1)."""
    rows = logprobs[-len(answer) :]
    target = torch.tensor(answer, device=rows.device)
    nll = -rows.gather(-1, target[:, None])[:, 0]
    hit = rows.argmax(-1) == target
    misses = (~hit).nonzero().flatten()
    return {
        "nll": float(nll.mean()),
        "top1": bool(hit.all()),
        "first_miss": int(misses[0]) if len(misses) else len(answer),
    }


def _gain(rows: list[dict]) -> float:
    """``1 − Σ comp_err / Σ ret_err`` over certificate rows (query-weighted, every head; NaN without error)."""
    ret = weighted_sum(rows, "ret_err")
    return 1 - weighted_sum(rows, "comp_err") / ret if ret > 0 else float("nan")


def _mean_of(rows: list[dict], key: str) -> float:
    n = query_heads(rows)
    return weighted_sum(rows, key) / n if n else float("nan")


def memory_audit(question_rows: list[dict], answer_rows: list[dict]) -> dict:
    """Compensation gain, gate and true evicted mass of CorePress certificate rows, split by forward (module doc)."""
    layers = sorted({r["layer"] for r in answer_rows})
    return {
        "gain_answer": _gain(answer_rows),
        "gain_question": _gain(question_rows),
        "gate_answer": _mean_of(answer_rows, "gate"),
        "alpha_answer": _mean_of(answer_rows, "alpha"),
        "gain_answer_layers": {str(ly): _gain([r for r in answer_rows if r["layer"] == ly]) for ly in layers},
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="model name or folder (core_kv.models.loading)")
    ap.add_argument("--methods", nargs="+", default=["full", "keydiff"],
                    help="press names or labels with a kind (--press-option label.kind=<press>); full = no press")  # fmt: skip
    ap.add_argument("--ratio", type=float, default=0.75, help="compression ratio of every press")
    ap.add_argument("--press-option", action="append", default=[], help="method.option=value (JSON values)")
    ap.add_argument("--wording", default="ruler", choices=list(WORDINGS))
    ap.add_argument("--haystacks", nargs="+", default=list(HAYSTACKS), choices=list(HAYSTACKS))
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--n", type=int, default=12, help="prompts per haystack")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default="", help="write the per-prompt rows and the summary here")
    args = ap.parse_args(argv)
    if args.n < 1 or args.length < 64 or not 0 < args.ratio < 1:
        raise SystemExit("--n must be >= 1, --length >= 64, --ratio in (0, 1)")
    if args.seed == 42:
        raise SystemExit("--seed 42 is RULER's evaluation seed; use another")

    import core_kv.presses  # noqa: F401
    from core_kv.eval.fidelity import continuation_logprobs
    from core_kv.models.loading import load_model
    from core_kv.pipeline import encode, prefill
    from research.certificate import CertifiedCorePress

    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model, dtype="float32")
    try:
        presses = build_labelled_presses(args.methods, parse_press_options(args.press_option), args.ratio)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    rows = []
    for hay in args.haystacks:
        for i, p in enumerate(build_prompts(tok, args.wording, hay, args.length, args.n, args.seed)):
            enc = encode(tok, p["context"], [p["question"]], [p["prefix"]])
            answer = tok.encode(f" {p['value']}.", add_special_tokens=False)
            fed = torch.cat([enc.question_ids[0], torch.tensor([answer])], 1)
            ctx = enc.context_ids
            for m, press in presses.items():
                t0 = time.time()
                cache = prefill(model, ctx, press)
                audit = {}
                with torch.inference_mode():
                    if isinstance(press, CertifiedCorePress):  # two forwards: question, answer-predicting queries
                        cut = fed.shape[1] - len(answer) - 1
                        lp_q = continuation_logprobs(model, cache, ctx.shape[1], fed[:, :cut], press)
                        q_rows = list(press.certificates)
                        lp_a = continuation_logprobs(model, cache, ctx.shape[1] + cut, fed[:, cut:-1], press)
                        lp = torch.cat([lp_q, lp_a])
                        audit = memory_audit(q_rows, press.certificates[len(q_rows) :])
                    else:
                        lp = continuation_logprobs(model, cache, ctx.shape[1], fed[:, :-1], press)
                rows.append({"haystack": hay, "prompt": i, "method": m, "value": p["value"],
                             "depth": round(p["depth"], 3), "seconds": round(time.time() - t0, 2),
                             **answer_scores(lp, answer), **audit})  # fmt: skip
            print(f"[answer_likelihood] {hay} prompt {i + 1}/{args.n}", file=sys.stderr, flush=True)
    full_nll = {(r["haystack"], r["prompt"]): r["nll"] for r in rows if r["method"] == "full"}
    summary = []
    print(f"\nmodel {args.model} | ratio {args.ratio} | {args.n} prompts per haystack, {args.length} tokens, "
          f"{args.wording} wording, seed {args.seed}")  # fmt: skip
    print("| method | haystack | nll | Δnll vs full | top1 | first miss |")
    print("|---|---|---|---|---|---|")
    for m in args.methods:
        for hay in args.haystacks:
            sel = [r for r in rows if r["method"] == m and r["haystack"] == hay]
            s = {"method": m, "haystack": hay, "nll": statistics.mean(r["nll"] for r in sel),
                 "top1": sum(r["top1"] for r in sel) / len(sel),
                 "first_miss": statistics.mean(r["first_miss"] for r in sel)}  # fmt: skip
            if full_nll:
                s["dnll"] = statistics.mean(r["nll"] - full_nll[(hay, r["prompt"])] for r in sel)
            summary.append(s)
            dn = f"{s['dnll']:+.3f}" if "dnll" in s else "–"
            print(f"| {m} | {hay} | {s['nll']:.3f} | {dn} | {s['top1']:.2f} | {s['first_miss']:.2f} |")
    audited = [m for m in args.methods if any("gain_answer" in r for r in rows if r["method"] == m)]
    if audited:
        print(
            "\n| method | haystack | G answer-predicting queries | G question queries | gate g (answer) | α_E (answer) |"
        )
        print("|---|---|---|---|---|---|")
    for m in audited:
        for hay in args.haystacks:
            sel = [r for r in rows if r["method"] == m and r["haystack"] == hay]
            s = next(x for x in summary if x["method"] == m and x["haystack"] == hay)
            for key in ("gain_answer", "gain_question", "gate_answer", "alpha_answer"):
                s[key] = statistics.mean(r[key] for r in sel)
            print(
                f"| {m} | {hay} | {s['gain_answer']:+.3f} | {s['gain_question']:+.3f} | {s['gate_answer']:.3f} | "
                f"{s['alpha_answer']:.3f} |"
            )
    payload = {"args": vars(args), "summary": summary, "rows": rows}
    if args.json:
        from core_kv.files import atomic_write_json

        atomic_write_json(Path(args.json), payload)
    return payload


if __name__ == "__main__":
    main()
