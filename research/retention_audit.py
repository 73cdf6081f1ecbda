"""Which tokens does a press keep? Per layer: the needle sentence, the prompt head, overlap with a reference press.

For RULER-worded needle prompts (``core_kv.eval.needles``'s builder, noise or essay haystack, the model's
chat template) or the NIAH benchmark's contexts (``--haystack niah``: the San Francisco needle at ``--n`` depths),
each method compresses the context in one-shot prefill; the retained positions of every (layer, KV head) are
recovered by matching the cached keys against the full cache's keys (one-shot prefill computes every
layer's K/V from uncompressed hidden states, so a kept entry is bit-identical to its full-cache row). Reported per
layer, averaged over prompts and KV heads:

- ``needle``: fraction of the needle sentence's tokens kept;
- ``value``: fraction of the value's digit tokens kept;
- ``head``: fraction of the first ``--head-tokens`` tokens kept (chat-template system turn + task instruction);
- ``whole value``: fraction of KV heads that keep every token of the value (copying a multi-token number needs
  all of its tokens in the heads that copy it; a mean ``value`` can hide heads that each miss one digit);
- ``overlap``: |kept ∩ kept_ref| / |kept| against ``--reference`` (default KeyDiff) at the same ratio;
- ``qmass``: share of the question's attention kept: the full-cache attention that the question + answer-prefix
  tokens (appended as the pipeline does) put on the context, summed over the kept entries, divided by the total on the
  context (mean over those queries and the query heads of each KV head) — the question-aware utility ``U_B`` of the
  kept set, which a question-agnostic cache must anticipate (``--answer-rows``: from the answer's own tokens, the
  queries that copy the value, which the teacher's question/answer tail also counts);
- ``q1``..``q4`` (printed after the table): the share of each quarter of the context kept (where a method keeps);
- ``output error``: for those same queries, ``||o* - o_R|| / ||o*||`` of each query head's attention output (before
  ``W_O``, this layer's inputs held at the full cache's) with only the kept context entries vs the full cache.

Usage::

    .venv/bin/python -m research.retention_audit --model smollm2-135m --methods core keydiff snapkv \\
        --press-option core.checkpoint=checkpoints/core-smollm2/final --ratio 0.75 --n 4
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from core_kv.eval.needles import build_prompts
from core_kv.eval.press_labels import parse_press_options


def context_ids_and_spans(tok, prompt: dict) -> tuple[list[int], set[int], set[int]]:
    """Context token ids as the pipeline builds them (the chat template, or BOS + raw text for a tokenizer without
    one), and the needle / value token positions."""
    head: list[int] = []
    if getattr(tok, "chat_template", None) is not None:
        sep = "#" * (len(prompt["context"]) + 10)
        text = tok.apply_chat_template([{"role": "user", "content": prompt["context"] + sep}],
                                       add_generation_prompt=True, tokenize=False).split(sep)[0]  # fmt: skip
    else:  # the pipeline's raw-text encoding: BOS (if any) + the context
        text, head = prompt["context"], [tok.bos_token_id] if tok.bos_token_id is not None else []
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    start = text.index(prompt["needle"])
    end = start + len(prompt["needle"])
    v0 = text.index(prompt["value"], start)
    v1 = v0 + len(prompt["value"])
    needle = {len(head) + i for i, (a, b) in enumerate(enc["offset_mapping"]) if a < end and b > start}
    value = {len(head) + i for i, (a, b) in enumerate(enc["offset_mapping"]) if a < v1 and b > v0}
    return head + enc["input_ids"], needle, value


def niah_prompts(tok, length: int, n: int) -> list[dict]:
    """The NIAH benchmark's contexts (:func:`core_kv.eval.niah.load_niah`: the San Francisco needle in the essays) at
    ``length`` tokens and ``n`` evenly spaced depths, as audit prompts; the ``value`` is the answer-bearing span
    (``"sandwich and sit in Dolores Park"``: both strings the benchmark's match needs)."""
    from core_kv.eval.niah import depth_grid, load_niah

    rows = load_niah(tok, lengths=[length], depths=depth_grid(n))
    return [{"context": r.context, "needle": r.extra["needle"], "value": "sandwich and sit in Dolores Park",
             "question": r.question, "prefix": r.answer_prefix, "depth": r.extra["depth"]} for r in rows]  # fmt: skip


def kept_positions(cache, full_keys: list[torch.Tensor]) -> list[list[set[int]]]:
    """Per layer, per KV head: positions whose full-cache key row is in the compressed cache."""
    from core_kv.models.cache import RaggedLayer

    out = []
    for layer, fk in zip(cache.layers, full_keys, strict=True):
        heads = []
        if isinstance(layer, RaggedLayer):
            keys, _, valid = layer.padded()
        else:
            keys, valid = layer.keys, None
        for h in range(fk.shape[1]):
            k = keys[0, h] if valid is None else keys[0, h][valid[h]]
            # exact row matching through a hash of each row's bytes
            full_rows = {fk[0, h, i].numpy().tobytes(): i for i in range(fk.shape[2])}
            heads.append({full_rows[r.numpy().tobytes()] for r in k if r.numpy().tobytes() in full_rows})
        out.append(heads)
    return out


def question_attention(model, ctx_ids: list[int], q_ids: list[int], first_row: int = 0) -> list[dict]:
    """Per layer: ``mass`` (Hkv, N), the mean full-cache attention of the question tokens ``q_ids[first_row:]`` on
    each of the N context tokens; ``rows`` (H, T, N + T_q), those tokens' attention rows; ``values`` (Hkv, N + T_q, D)."""
    from transformers import DynamicCache

    n, hooks, out = len(ctx_ids), [], []
    body = getattr(model, "model", model)
    g = model.config.num_attention_heads // model.config.num_key_value_heads

    def grab(module, args, output):
        rows = output[1][0, :, n + first_row :].float()  # (H, T, N + T_q)
        out.append({"mass": rows[..., :n].mean(1).view(-1, g, n).mean(1), "rows": rows})

    impl = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        for layer in body.layers:
            hooks.append(layer.self_attn.register_forward_hook(grab))
        cache = DynamicCache()
        with torch.no_grad():
            body(input_ids=torch.tensor([ctx_ids + q_ids]), past_key_values=cache, output_attentions=True)
    finally:
        for h in hooks:
            h.remove()
        model.set_attn_implementation(impl)
    for layer, rec in zip(cache.layers, out, strict=True):
        rec["values"] = layer.values[0].float()
    return out


def retention_error(rec: dict, kept: list[set[int]], n: int) -> float:
    """Mean over the question rows and query heads of ``||o* - o_R|| / ||o*||``: the attention output (before W_O)
    with the full cache vs with the kept context entries (+ the question's own tokens)."""
    rows, values = rec["rows"], rec["values"]
    hkv = values.shape[0]
    g = rows.shape[0] // hkv
    errs = []
    for h, s in enumerate(kept):
        mask = torch.zeros(values.shape[1])
        mask[sorted(s)] = 1.0
        mask[n:] = 1.0
        a = rows[h * g : (h + 1) * g]  # (G, T, L)
        o_full = a @ values[h]
        ar = a * mask
        o_r = (ar / ar.sum(-1, keepdim=True)) @ values[h]
        errs.append(((o_full - o_r).norm(dim=-1) / o_full.norm(dim=-1).clamp_min(1e-12)).mean())
    return float(torch.stack(errs).mean())


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--methods", nargs="+", default=["keydiff", "snapkv"])
    ap.add_argument("--reference", default="keydiff", help="press the overlap is measured against")
    ap.add_argument("--ratio", type=float, default=0.75)
    ap.add_argument("--press-option", action="append", default=[], help="method.option=value (JSON values)")
    ap.add_argument("--haystack", default="noise", choices=["noise", "essay", "niah"],
                    help="niah: the NIAH benchmark's contexts (San Francisco needle, essays) at --n depths")  # fmt: skip
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--head-tokens", type=int, default=30)
    ap.add_argument("--layers", default="", help="comma-separated layers to print (default: all)")
    ap.add_argument(
        "--answer-rows",
        action="store_true",
        help="question mass from the answer's tokens (' <value>.' after the prefix) instead of the question's",
    )
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    if not 0 < args.ratio < 1 or args.n < 1:
        raise SystemExit("--ratio must be in (0, 1) and --n >= 1")

    from transformers import DynamicCache

    import core_kv.presses  # noqa: F401
    from core_kv.models.loading import load_model
    from core_kv.pipeline import encode
    from core_kv.presses import build_press

    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model, dtype="float32")
    options = parse_press_options(args.press_option)
    if args.haystack == "niah":
        prompts = niah_prompts(tok, args.length, args.n)
    else:
        prompts = build_prompts(tok, "ruler", args.haystack, args.length, args.n, args.seed)
    methods = list(dict.fromkeys([*args.methods, args.reference]))
    stats: dict[str, list[dict]] = {m: [] for m in methods}
    for p in prompts:
        ids, needle, value = context_ids_and_spans(tok, p)
        enc = encode(tok, p["context"], [p["question"]], [p["prefix"]])
        if enc.context_ids[0].tolist() != ids:
            raise RuntimeError("the audit's context ids differ from the pipeline's")
        q_ids = enc.question_ids[0][0].tolist()
        if args.answer_rows:  # the answer's tokens after the prefix, as greedy decoding would produce them
            answer = tok.encode(f" {p['value']}.", add_special_tokens=False)
            qatt = question_attention(model, ids, q_ids + answer, first_row=len(q_ids))
        else:
            qatt = question_attention(model, ids, q_ids)
        x = torch.tensor([ids])
        with torch.no_grad():
            full = DynamicCache()
            model.model(input_ids=x, past_key_values=full)
            full_keys = [layer.keys for layer in full.layers]
            kept = {}
            for m in methods:
                press = build_press(m, compression_ratio=args.ratio, **options.get(m, {}))
                cache = DynamicCache()
                with press(model):
                    model.model(input_ids=x, past_key_values=cache)
                kept[m] = kept_positions(cache, full_keys)
        head = set(range(min(args.head_tokens, len(ids))))
        quarters = [set(range(len(ids) * i // 4, len(ids) * (i + 1) // 4)) for i in range(4)]
        for m in methods:
            rows = []
            for layer, heads in enumerate(kept[m]):
                ref = kept[args.reference][layer]
                rows.append({
                    "layer": layer,
                    "needle": sum(len(s & needle) for s in heads) / (len(heads) * len(needle)),
                    "value": sum(len(s & value) for s in heads) / (len(heads) * len(value)),
                    "whole": sum(value <= s for s in heads) / len(heads),
                    "head": sum(len(s & head) for s in heads) / (len(heads) * len(head)),
                    "overlap": sum(len(s & r) / max(1, len(s)) for s, r in zip(heads, ref, strict=True)) / len(heads),
                    "kept": sum(len(s) for s in heads) / len(heads),
                    **{f"q{i + 1}": sum(len(s & quarter) for s in heads) / (len(heads) * max(1, len(quarter)))
                       for i, quarter in enumerate(quarters)},  # fmt: skip
                    "qmass": sum(float(qatt[layer]["mass"][h, sorted(s)].sum() / qatt[layer]["mass"][h].sum())
                                 for h, s in enumerate(heads)) / len(heads),
                    "relerr": retention_error(qatt[layer], heads, len(ids)),
                })  # fmt: skip
            stats[m].append(rows)
    layers = [int(v) for v in args.layers.split(",")] if args.layers else list(range(len(stats[methods[0]][0])))
    print(f"\nmodel {args.model} | ratio {args.ratio} | {args.n} prompts, {args.haystack} haystack, {args.length} tokens"
          f" | overlap vs {args.reference}")  # fmt: skip
    print(
        "| method | layer | needle kept | value kept | whole value | first tokens kept | overlap | question mass kept "
        "| output error | tokens kept |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    summary = {}
    for m in methods:
        mean = {k: [sum(r[l][k] for r in stats[m]) / len(stats[m]) for l in range(len(stats[m][0]))]
                for k in ("needle", "value", "whole", "head", "overlap", "qmass", "relerr", "kept")}  # fmt: skip
        summary[m] = mean
        for l in layers:
            print(f"| {m} | {l} | {mean['needle'][l]:.2f} | {mean['value'][l]:.2f} | {mean['whole'][l]:.2f} | "
                  f"{mean['head'][l]:.2f} | "
                  f"{mean['overlap'][l]:.2f} | {mean['qmass'][l]:.2f} | {mean['relerr'][l]:.3f} | {mean['kept'][l]:.0f} |")  # fmt: skip
        print(f"| {m} | mean | " + " | ".join(f"{sum(mean[k]) / len(mean[k]):.2f}" for k in
                                             ("needle", "value", "whole", "head", "overlap", "qmass", "relerr")) + f" | {sum(mean['kept']) / len(mean['kept']):.0f} |")  # fmt: skip
    per_prompt = {m: [{k: sum(r[k] for r in rows) / len(rows) for k in ("needle", "value", "whole", "qmass")}
                      for rows in stats[m]] for m in methods}  # fmt: skip
    print("\n| method | share kept of the context's 1st quarter | 2nd | 3rd | 4th |\n|---|---|---|---|---|")
    for m in methods:  # where in the context a method keeps (all layers and prompts)
        shares = [sum(r[f"q{i}"] for rows in stats[m] for r in rows) / sum(len(rows) for rows in stats[m])
                  for i in range(1, 5)]  # fmt: skip
        print(f"| {m} | " + " | ".join(f"{x:.2f}" for x in shares) + " |")
    if "depth" in prompts[0]:  # NIAH: where the needle sits decides what is kept
        print("\n| method | " + " | ".join(f"depth {p['depth']}%" for p in prompts) + " |")
        print("|---|" + "---|" * len(prompts))
        for m in methods:
            print(f"| {m} (value kept, mean over layers) | " + " | ".join(f"{r['value']:.2f}" for r in per_prompt[m])
                  + " |")  # fmt: skip
    if args.json:
        from core_kv.files import atomic_write_json

        depths = [p.get("depth") for p in prompts]
        atomic_write_json(Path(args.json), {"args": vars(args), "per_layer": summary, "depths": depths,
                                            "per_prompt": per_prompt})  # fmt: skip
    return summary


if __name__ == "__main__":
    main()
