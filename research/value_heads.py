"""Where does each press keep a needle's value: in the heads that read it, and in the others?

A companion of ``retention_audit.py`` (issue 20's question: the learned allocation keeps more of the needle than the
presses that answer, yet answers less). For held-out RULER-worded needle prompts (``needle_wording.py``'s builder), the
answer tokens' full-cache attention on the value's digit tokens ranks the (layer, KV head) pairs; per method:

- ``retrieval heads``: over the ``--top`` pairs that read the value most, the share that keep every digit (``whole``)
  and the share of their attention on the value that the kept set holds (``value mass``);
- ``other heads``: the value's renormalised share of the kept attention divided by its full-cache share
  (``inflation``: 1 = the value weighs in the head's compressed readout as it did with the full cache, 0 = evicted);
- ``repeated / first digits``: the share of a value's digits kept (per layer and head) for digits that repeat an
  earlier digit of the same value vs first occurrences (does a redundancy-penalising score drop repeated digits?).

Methods and options as in ``answer_likelihood.py`` (labels with ``--press-option label.kind=<press>``)::

    .venv/bin/python -m research.value_heads --methods adakv_expected_attention keydiff twinkv core \\
        --press-option core.checkpoint=runs/core-smollm2-v2/final --press-option core.memory=false \\
        --haystack essay --n 6 --ratio 0.75
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from core_kv.eval.needles import HAYSTACKS, build_prompts
from core_kv.eval.press_labels import build_labelled_presses, parse_press_options
from research.retention_audit import context_ids_and_spans, kept_positions, question_attention


def head_stats(mass: torch.Tensor, kept: set[int], value: list[int]) -> tuple[bool, float, float]:
    """For one (layer, KV head) with full-cache attention ``mass`` (N,) on the context: whether ``kept`` holds the
    whole value, the share of the value's mass kept, and the value's renormalised share of the kept mass divided by
    its full-cache share."""
    kept_idx = torch.tensor(sorted(kept), dtype=torch.long)
    in_value = torch.zeros_like(mass, dtype=torch.bool)
    in_value[value] = True
    k_mask = torch.zeros_like(in_value)
    k_mask[kept_idx] = True
    v_full, v_kept = float(mass[in_value].sum()), float(mass[in_value & k_mask].sum())
    total, total_kept = float(mass.sum()), float(mass[k_mask].sum())
    inflation = (v_kept / max(total_kept, 1e-12)) / max(v_full / max(total, 1e-12), 1e-12)
    return set(value) <= kept, v_kept / max(v_full, 1e-12), inflation


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--methods", nargs="+", default=["keydiff", "twinkv"])
    ap.add_argument("--press-option", action="append", default=[], help="method.option=value (JSON values)")
    ap.add_argument("--ratio", type=float, default=0.75)
    ap.add_argument("--haystack", default="essay", choices=list(HAYSTACKS))
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--n", type=int, default=6)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--top", type=int, default=10, help="(layer, KV head) pairs counted as retrieval heads")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    if args.n < 1 or args.top < 1 or not 0 < args.ratio < 1:
        raise SystemExit("--n and --top must be >= 1, --ratio in (0, 1)")
    if "full" in args.methods:
        raise SystemExit("--methods: value_heads compares presses; 'full' keeps every entry (nothing to measure)")
    if args.seed == 42:
        raise SystemExit("--seed 42 is RULER's evaluation seed; use another")

    from transformers import DynamicCache

    import core_kv.presses  # noqa: F401
    from core_kv.models.loading import load_model
    from core_kv.pipeline import encode

    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model, dtype="float32")
    presses = build_labelled_presses(args.methods, parse_press_options(args.press_option), args.ratio)
    acc = {m: {"whole": [], "vmass": [], "other_infl": [], "rep": [0, 0], "first": [0, 0]}
           for m in presses}  # fmt: skip
    for p in build_prompts(tok, "ruler", args.haystack, args.length, args.n, args.seed):
        ids, _, value_set = context_ids_and_spans(tok, p)
        value = sorted(value_set)
        seen, repeated = set(), set()
        for i in value:
            if ids[i] in seen:
                repeated.add(i)
            seen.add(ids[i])
        enc = encode(tok, p["context"], [p["question"]], [p["prefix"]])
        if enc.context_ids[0].tolist() != ids:
            raise RuntimeError("the diagnostic's context ids differ from the pipeline's")
        q_ids = enc.question_ids[0][0].tolist()
        answer = tok.encode(f" {p['value']}.", add_special_tokens=False)
        qatt = question_attention(model, ids, q_ids + answer, first_row=len(q_ids))
        reads = torch.stack([rec["mass"][:, value].sum(-1) for rec in qatt])  # (L, Hkv)
        n_heads = reads.shape[1]
        top = set(reads.flatten().topk(min(args.top, reads.numel())).indices.tolist())
        x = torch.tensor([ids])
        with torch.no_grad():
            full = DynamicCache()
            model.model(input_ids=x, past_key_values=full)
            full_keys = [layer.keys for layer in full.layers]
            for m, press in presses.items():
                cache = DynamicCache()
                with press(model):
                    model.model(input_ids=x, past_key_values=cache)
                a = acc[m]
                for layer, heads in enumerate(kept_positions(cache, full_keys)):
                    for h, kept in enumerate(heads):
                        whole, vmass, infl = head_stats(qatt[layer]["mass"][h], kept, value)
                        if layer * n_heads + h in top:
                            a["whole"].append(whole)
                            a["vmass"].append(vmass)
                        else:
                            a["other_infl"].append(infl)
                        for i in value:
                            key = "rep" if i in repeated else "first"
                            a[key][0] += i in kept
                            a[key][1] += 1
        print(f"[value_heads] prompt {p['value']}: retrieval heads {sorted(divmod(i, n_heads) for i in top)}",
              file=sys.stderr, flush=True)  # fmt: skip
    print(
        f"\nmodel {args.model} | ratio {args.ratio} | {args.n} prompts, {args.haystack} haystack | top {args.top} heads"
    )
    print(
        "| method | retrieval heads: whole value | value mass kept | other heads: inflation median / mean "
        "| repeated digits kept | first digits kept |"
    )
    print("|---|---|---|---|---|---|")
    summary = {}
    for m, a in acc.items():
        s = {"whole": sum(a["whole"]) / len(a["whole"]), "value_mass": statistics.mean(a["vmass"]),
             "other_inflation_median": statistics.median(a["other_infl"]),
             "other_inflation_mean": statistics.mean(a["other_infl"]),
             "repeated_kept": a["rep"][0] / max(1, a["rep"][1]), "first_kept": a["first"][0] / max(1, a["first"][1])}  # fmt: skip
        summary[m] = s
        print(f"| {m} | {s['whole']:.2f} | {s['value_mass']:.2f} | {s['other_inflation_median']:.2f} / "
              f"{s['other_inflation_mean']:.2f} | {s['repeated_kept']:.2f} | {s['first_kept']:.2f} |")  # fmt: skip
    return summary


if __name__ == "__main__":
    main()
