"""Perplexity of a model on the held-out essays (full cache): the model cards' language-modelling sanity number.

Documents are the essays held out from proxy training (``core_kv.eval.fidelity``'s ``essays`` source, whitespace
collapsed), cut into non-overlapping windows of ``--length`` tokens after the tokenizer's bos (if any); perplexity is
``exp(mean NLL)`` over every predicted token of every window. The LM head runs on 256 positions at a time (a
262k-token vocabulary's logits for 2k positions would take 2 GB). Usage::

    .venv/bin/python benchmarks/perplexity.py --model smollm2-135m --length 2048 --windows 8
"""

from __future__ import annotations

import argparse
import math
import re

import torch

BLOCK = 256  # positions whose logits are materialised at once


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    if args.length < 16 or args.windows < 1:
        raise SystemExit("--length must be >= 16 and --windows >= 1")
    from core_kv.corpus import held_out_texts
    from core_kv.models.loading import load_model

    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model, dtype="float32")
    text = " ".join(re.sub(r"\s+", " ", t) for _, t in held_out_texts())
    ids = tok.encode(text, add_special_tokens=False)
    bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
    step = args.length - len(bos)
    cap = getattr(model.config, "final_logit_softcapping", None)
    nll, count = 0.0, 0
    with torch.no_grad():
        for w in range(args.windows):
            chunk = ids[w * step : (w + 1) * step]
            if len(chunk) < step:
                break
            x = torch.tensor([bos + chunk])
            hidden = model.model(input_ids=x).last_hidden_state[0, :-1]
            for b in range(0, hidden.shape[0], BLOCK):  # BLOCK positions of logits at a time (Gemma: 262k vocab)
                logits = model.lm_head(hidden[b : b + BLOCK]).float()
                if cap:  # the model's final-logit softcap (Gemma 2), as its forward applies it
                    logits = torch.tanh(logits / cap) * cap
                nll += float(torch.nn.functional.cross_entropy(logits, x[0, b + 1 : b + 1 + BLOCK], reduction="sum"))
            count += x.shape[1] - 1
    ppl = math.exp(nll / count)
    print(
        f"{args.model}: perplexity {ppl:.3f} over {count} tokens ({count // (args.length - 1)} windows of "
        f"{args.length}) on the held-out essays"
    )
    return {"perplexity": ppl, "tokens": count}


if __name__ == "__main__":
    main()
