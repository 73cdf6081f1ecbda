"""Does a model (and a press) retrieve a needle beyond RULER's exact wording? Full cache vs presses, own prompts.

The prompts are :mod:`core_kv.eval.needles`' (its docstring tabulates the four wordings: RULER's own and three
rewordings that share none of its template words): one needle at a random depth of a haystack of RULER's noise lines
or of essay text, keys and values drawn with ``--seed`` (never 42, disjoint from RULER's evaluation draws), then a
question on top of the (compressed) context and a greedy answer; a prompt counts as answered when the value's digits
appear in the answer. Every method sees identical token ids.

Usage::

    .venv/bin/python benchmarks/needle_wording.py --model smollm2-135m --lengths 2048 --n 10
    .venv/bin/python benchmarks/needle_wording.py --model smollm2-135m --methods full keydiff core \\
        --ratios 0.5 0.75 0.9 --press-option core.checkpoint=checkpoints/core-smollm2/final --n 20 --json out.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from core_kv.eval.needles import HAYSTACKS, WORDINGS, build_prompts
from core_kv.eval.press_labels import build_labelled_presses, parse_press_options


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="model name or folder (core_kv.models.loading)")
    ap.add_argument("--methods", nargs="+", default=["full"],
                    help="press names or labels with a kind (--press-option label.kind=<press>); full = no press")  # fmt: skip
    ap.add_argument("--ratios", nargs="+", type=float, default=[0.75], help="compression ratios for the presses")
    ap.add_argument("--press-option", action="append", default=[], help="method.option=value (JSON values)")
    ap.add_argument("--wordings", nargs="+", default=list(WORDINGS), choices=list(WORDINGS))
    ap.add_argument("--haystacks", nargs="+", default=list(HAYSTACKS), choices=list(HAYSTACKS))
    ap.add_argument("--lengths", nargs="+", type=int, default=[2048])
    ap.add_argument("--n", type=int, default=10, help="prompts per (wording, haystack, length)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--no-chat-template", action="store_true", help="feed raw text (default: the tokenizer's)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default="", help="write results (and every answer) here")
    args = ap.parse_args(argv)
    if args.n < 1 or any(x < 64 for x in args.lengths) or any(not 0 < r < 1 for r in args.ratios):
        raise SystemExit("--n must be >= 1, --lengths >= 64, --ratios in (0, 1)")
    if args.seed == 42:
        raise SystemExit("--seed 42 is RULER's evaluation seed; use another")

    import core_kv.presses  # noqa: F401
    from core_kv.models.loading import load_model
    from core_kv.pipeline import answer_questions

    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model, dtype="float32")
    try:
        presses = {
            r: build_labelled_presses(args.methods, parse_press_options(args.press_option), r) for r in args.ratios
        }
    except ValueError as e:
        raise SystemExit(str(e)) from None
    cells = [("full", 0.0)] if "full" in args.methods else []
    cells += [(m, r) for m in args.methods if m != "full" for r in args.ratios]
    results, rows = [], []
    for length in args.lengths:
        prompts = {(w, h): build_prompts(tok, w, h, length, args.n, args.seed) for w in args.wordings
                   for h in args.haystacks}  # fmt: skip
        for method, ratio in cells:
            press = None if method == "full" else presses[ratio][method]
            t0 = time.time()
            for (w, h), ps in prompts.items():
                hits = 0
                for p in ps:
                    out = answer_questions(
                        model, tok, context=p["context"], questions=[p["question"]], press=press,
                        answer_prefixes=[p["prefix"]], max_new_tokens=args.max_new_tokens,
                        use_chat_template=False if args.no_chat_template else None,
                    )  # fmt: skip
                    ans = out["answers"][0]
                    ok = p["value"] in ans.replace(",", "").replace(" ", "")
                    hits += ok
                    rows.append({"length": length, "method": method, "ratio": ratio, "wording": w, "haystack": h,
                                 "value": p["value"], "depth": round(p["depth"], 3), "answer": ans, "ok": ok})  # fmt: skip
                results.append({"length": length, "method": method, "ratio": ratio, "wording": w, "haystack": h,
                                "answered": hits, "n": len(ps)})  # fmt: skip
            got = ", ".join(
                f"{r['wording']}/{r['haystack']} {r['answered']}/{r['n']}" for r in results[-len(prompts) :]
            )
            print(f"[needle_wording] {method} @ {ratio:.2f}, {length} tokens: {got} ({time.time() - t0:.0f} s)",
                  file=sys.stderr, flush=True)  # fmt: skip
            if args.json:  # the cells so far, so a long run's finished cells are on disk before it ends
                _write(args, results, rows, finished=False)
    print(
        f"\nmodel: {args.model} | chat template: {not args.no_chat_template} | n = {args.n} per cell | seed {args.seed}"
    )
    cols = [(w, h) for w in args.wordings for h in args.haystacks]
    print("| length | method | ratio | " + " | ".join(f"{w}/{h}" for w, h in cols) + " |")
    print("|---" * (3 + len(cols)) + "|")
    for length in args.lengths:
        for method, ratio in cells:
            got = {(r["wording"], r["haystack"]): r for r in results
                   if r["length"] == length and r["method"] == method and r["ratio"] == ratio}  # fmt: skip
            cells_txt = " | ".join(f"{got[c]['answered']}/{got[c]['n']}" for c in cols)
            print(f"| {length} | {method} | {ratio:.2f} | {cells_txt} |")
    return _write(args, results, rows, finished=True)


def _write(args, results: list[dict], rows: list[dict], finished: bool) -> dict:
    """The payload (``finished``: False while cells remain), written atomically to ``--json`` when given."""
    payload = {"args": vars(args), "finished": finished, "results": results, "answers": rows}
    if args.json:
        from core_kv.files import atomic_write_json

        atomic_write_json(Path(args.json), payload)
    return payload


if __name__ == "__main__":
    main()
