"""Full-cache RULER scores of the proxy LM: greedy decoding on ``input + answer_prefix`` with the plain HF model.

Usage::

    python -m core_kv.eval.proxy_ruler checkpoints/proxy-lm --lengths 1024 2048 4096 --n 20 --out runs/proxy/eval.json

Samples are RULER's seed-42 sets from :mod:`core_kv.eval.ruler`, sized with the proxy tokenizer
(``len(tok.tokenize(text))``). The score is RULER's ``string_match_all`` (x100). To fit a CPU budget, generation
stops after ``min(tokens_to_generate, cap, ANSWER_TOKENS[task])`` new tokens instead of RULER's 128 for NIAH: the
limits are at least the length of a correct answer (one number = 9 proxy tokens, a UUID = 37, 4 numbers = 36; VT
keeps its 30), so only a model that would bury the answer after a long preamble scores lower than with 128. CWE is
cut at ``cap`` (48) of its 120 tokens, enough for about 10 of its answer words.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import time
from pathlib import Path

import torch

from core_kv.eval.ruler import RULER_11
from core_kv.files import atomic_write_json

ANSWER_TOKENS = {  # proxy tokens of the longest correct answer (+ a margin): one number = 9, a UUID = 37, 4 numbers = 36
    "niah_single_1": 12,
    "niah_single_2": 12,
    "niah_multikey_1": 12,
    "niah_multikey_2": 12,
    "niah_single_3": 40,
    "niah_multikey_3": 40,
    "niah_multivalue": 40,
    "niah_multiquery": 40,
}


def token_counter(tokenizer):
    """RULER's counter for the proxy tokenizer, fingerprinted by content (not by folder) for the sample cache."""
    from core_kv.eval.ruler import TokenCounter

    digest = hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode("utf-8")).hexdigest()[:16]
    return TokenCounter(f"proxy-lm:{digest}", lambda text: len(tokenizer.tokenize(text)))


def string_match_all(pred: str, refs: list[str]) -> float:
    """RULER's per-sample metric: the share of references found case-insensitively in the post-processed prediction."""
    pred = re.sub(r"[\x00-\x1f]", "\n", pred.strip()).strip().lower()
    return sum(r.lower() in pred for r in refs) / len(refs)


@torch.no_grad()
def evaluate(
    model_dir: str,
    lengths: list[int],
    n: int,
    tasks: list[str],
    cap: int = 48,
    threads: int = 2,
    out: str | None = None,
) -> dict:
    """Score every (task, length) cell on the first ``n`` seed-42 samples (``out`` is rewritten after each cell).

    Returns:
        ``{"scores": {task: {length: score or None if RULER cannot build the cell}}, "seconds": {...}, "predictions": [...]}``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from core_kv.eval.ruler import generate_cached

    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    counter = token_counter(tok)
    scores: dict[str, dict[int, float]] = {}
    seconds: dict[str, dict[int, float]] = {}
    preds = []
    res = {"model": str(model_dir), "n": n, "cap": cap, "scores": scores, "seconds": seconds, "predictions": preds}
    for length in lengths:
        for task in tasks:
            t0 = time.time()
            try:
                records = generate_cached(task, length, n, counter, seed=42)
            except ValueError as e:  # e.g. an essay task whose 500-word haystack step does not fit at this length
                print(f"{task:18s} L={length:5d} skipped: {e}", flush=True)
                scores.setdefault(task, {})[length] = None
            else:
                total = 0.0
                for rec in records:
                    ids = tok(rec["input"] + rec["answer_prefix"], return_tensors="pt")["input_ids"]
                    gen = model.generate(
                        ids,
                        do_sample=False,
                        max_new_tokens=min(rec["max_new_tokens"], cap, ANSWER_TOKENS.get(task, cap)),
                        pad_token_id=tok.pad_token_id,
                    )
                    pred = tok.decode(gen[0, ids.shape[1] :], skip_special_tokens=True)
                    s = string_match_all(pred, rec["outputs"])
                    total += s
                    preds.append({"task": task, "length": length, "tokens": ids.shape[1], "pred": pred,
                                  "outputs": rec["outputs"], "score": s})  # fmt: skip
                scores.setdefault(task, {})[length] = round(100 * total / len(records), 2)
                seconds.setdefault(task, {})[length] = round(time.time() - t0, 1)
                print(f"{task:18s} L={length:5d} n={len(records)} score={scores[task][length]:6.2f} "
                      f"({seconds[task][length]:.0f}s)", flush=True)  # fmt: skip
            if out:
                atomic_write_json(Path(out), res)
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model_dir")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--tasks", nargs="+", default=list(RULER_11))  # in RULER's order
    p.add_argument("--n", type=int, default=20)
    p.add_argument("--cap", type=int, default=48)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    evaluate(a.model_dir, a.lengths, a.n, a.tasks, a.cap, a.threads, a.out)


if __name__ == "__main__":
    main()
