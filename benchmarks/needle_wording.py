"""Does a model (and a press) retrieve a needle beyond RULER's exact wording? Full cache vs presses, own prompts.

One needle sentence in a haystack of RULER's noise lines or of essay text, placed at a random depth, then a question
on top of the (compressed) context, greedy decoding; a prompt counts as answered when the value's digits appear in
the answer. Four wordings: RULER's own (``ruler``) and three rewordings that share none of its template words:

| wording  | needle                                                      | question                                   |
|----------|-------------------------------------------------------------|--------------------------------------------|
| ruler    | One of the special magic numbers for {key} is: {value}.     | What is the special magic number for {key} mentioned in the provided text? |
| secret   | Remember this: the secret code of {key} is {value}.         | What is the secret code of {key}?          |
| password | The password for the {key} vault is {value}.                | What is the password for the {key} vault?  |
| locker   | Note: the locker number assigned to {key} is {value}.       | Which locker number was assigned to {key}? |

Keys are adjective-noun pairs (``amber-falcon``), values 7-digit numbers, both drawn with ``--seed`` (never 42, so the
prompts are disjoint from RULER's evaluation draws). The question carries no answer prefix, except for ``ruler``
(RULER's own). Prompts are built with the model's tokenizer as counter so every method sees identical token ids.
Usage::

    .venv/bin/python benchmarks/needle_wording.py --model smollm2-135m --lengths 2048 --n 10
    .venv/bin/python benchmarks/needle_wording.py --model smollm2-135m --methods full keydiff core \\
        --ratios 0.5 0.75 0.9 --press-option core.checkpoint=checkpoints/core-smollm2/final --n 20 --json out.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

WORDINGS = {
    "ruler": (
        "One of the special magic numbers for {key} is: {value}.",
        "What is the special magic number for {key} mentioned in the provided text?",
        "The special magic number for {key} mentioned in the provided text is",
    ),
    "secret": ("Remember this: the secret code of {key} is {value}.", "What is the secret code of {key}?", ""),
    "password": ("The password for the {key} vault is {value}.", "What is the password for the {key} vault?", ""),
    "locker": ("Note: the locker number assigned to {key} is {value}.", "Which locker number was assigned to {key}?",
               ""),
}  # fmt: skip
HAYSTACKS = ("noise", "essay")
ADJ = ("amber", "silent", "crimson", "brave", "lucky", "frozen", "golden", "hidden", "quiet", "rapid", "wild", "pale")
NOUN = ("falcon", "river", "lantern", "meadow", "harbor", "compass", "orchid", "glacier", "violin", "beacon", "otter")


def build_prompts(tokenizer, wording: str, haystack: str, length: int, n: int, seed: int) -> list[dict]:
    """``n`` prompts of about ``length`` context tokens (the tokenizer counts), needle at a uniform random depth."""
    from core_kv.corpus import essays_text
    from core_kv.eval.ruler import NOISE

    needle_t, question_t, prefix_t = WORDINGS[wording]
    rng = random.Random(f"{seed}-{wording}-{haystack}-{length}")
    if haystack == "noise":
        unit = NOISE + " "
        per = len(tokenizer.encode(unit, add_special_tokens=False))
        filler_units = [unit] * (length // per + 1)
    else:
        words = essays_text().split()
        filler_units = None
    out = []
    for _ in range(n):
        key = f"{rng.choice(ADJ)}-{rng.choice(NOUN)}"
        value = str(rng.randint(1_000_000, 9_999_999))
        needle = needle_t.format(key=key, value=value)
        budget = length - len(tokenizer.encode(needle, add_special_tokens=False)) - 8
        if filler_units is not None:
            pieces = filler_units[: max(1, budget // per)]
        else:
            start = rng.randrange(0, len(words) - 4 * length)
            pieces, used = [], 0
            for w in words[start:]:
                used += 1
                pieces.append(w + " ")
                if used >= int(budget * 0.72):  # ~0.72 words per token for English BPE; refined below
                    break
            while len(tokenizer.encode("".join(pieces), add_special_tokens=False)) > budget:
                pieces = pieces[: int(len(pieces) * 0.95)]
        cut = rng.randint(0, len(pieces))
        context = "".join(pieces[:cut]) + needle + " " + "".join(pieces[cut:])
        out.append(
            {"context": context.strip(), "question": question_t.format(key=key), "prefix": prefix_t.format(key=key),
             "value": value, "needle": needle, "depth": cut / max(1, len(pieces))}
        )  # fmt: skip
    return out


def parse_press_options(items: list[str]) -> dict[str, dict]:
    opts: dict[str, dict] = {}
    for item in items:
        if "=" not in item or "." not in item.split("=", 1)[0]:
            raise SystemExit(f"--press-option expects method.option=value, got {item!r}")
        lhs, value = item.split("=", 1)
        method, key = lhs.split(".", 1)
        if not method or not key:
            raise SystemExit(f"--press-option expects method.option=value, got {item!r}")
        try:
            value = json.loads(value)
        except ValueError:
            pass
        opts.setdefault(method, {})[key] = value
    return opts


def build_labelled_presses(methods: list[str], options: dict[str, dict], ratio: float) -> dict:
    """One press per label at ``ratio``: a press name, ``full`` (None: no press), or a label whose options name its
    press with ``kind`` (as in the evaluation configs), so variants of one press sit side by side."""
    from core_kv.presses import build_press

    unknown = set(options) - set(methods)
    if unknown:
        raise SystemExit(f"--press-option for methods not in --methods: {sorted(unknown)}")
    presses = {}
    for m in methods:
        opts = dict(options.get(m, {}))
        presses[m] = None if m == "full" else build_press(opts.pop("kind", m), compression_ratio=ratio, **opts)
    return presses


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
    presses = {r: build_labelled_presses(args.methods, parse_press_options(args.press_option), r) for r in args.ratios}
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
            print(
                f"[needle_wording] {method} @ {ratio:.2f}, {length} tokens: {time.time() - t0:.0f} s", file=sys.stderr
            )
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
    payload = {"args": vars(args), "results": results, "answers": rows}
    if args.json:
        from core_kv.files import atomic_write_json

        atomic_write_json(Path(args.json), payload)
    return payload


if __name__ == "__main__":
    main()
