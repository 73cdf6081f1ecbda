"""Oracle retention on RULER needles: can the model answer from a compressed cache that keeps the right entries?

For each RULER sample the answer's tokens are located in the context; a press keeps, at the given ratio, a chosen
set of positions in every compressed layer and fills the rest of the budget at random (seeded):

- ``needle``: the needle sentence (``--before`` tokens before the value to ``--after`` tokens after it);
- ``needle+edges``: the same plus the first ``--sinks`` and the last ``--recent`` positions;
- ``random``: nothing forced (the floor).

It separates "the model cannot answer from a 25% cache" from "the press did not keep what the answer needs"
(``docs/results.md``, Gemma-3-270M). The harness's protocol (question-agnostic, greedy, ``answer_questions``); a
sample counts as answered when the reference value appears in the answer. Usage::

    .venv/bin/python benchmarks/needle_oracle.py --model gemma3-270m --ratio 0.75 --n 5 \\
        --tasks niah_single_2 niah_multikey_1 --json results/needle_oracle_gemma3.json
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import torch

from core_kv.presses.base import ScorerPress


@dataclass
class ForcedPress(ScorerPress):
    """Keeps ``forced`` positions (clipped to the cache) and fills the budget with seeded random ones."""

    forced: list[int] = field(default_factory=list)
    seed: int = 0

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        s = torch.rand(keys.shape[:3], generator=torch.Generator().manual_seed(self.seed)).to(keys.device)
        idx = torch.tensor([p for p in self.forced if 0 <= p < keys.shape[2]], dtype=torch.long)
        s[..., idx] = 2.0
        return s


def answer_span(tok, ids: list[int], answer: str) -> tuple[int, int] | None:
    """``(start, end)`` of the answer's tokens in ``ids`` (with or without a leading space), else ``None``."""
    for text in (answer, " " + answer):
        a = tok.encode(text, add_special_tokens=False)
        for i in range(len(ids) - len(a) + 1):
            if ids[i : i + len(a)] == a:
                return i, i + len(a)
    return None


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--tasks", nargs="+", default=["niah_single_2", "niah_multikey_1"])
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--n", type=int, default=5, help="samples per task")
    ap.add_argument("--seed", type=int, default=42, help="RULER data seed (42: the grid's contexts)")
    ap.add_argument("--ratio", type=float, default=0.75)
    ap.add_argument("--before", type=int, default=24)
    ap.add_argument("--after", type=int, default=8)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--recent", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=12)
    ap.add_argument("--attn", default="eager")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)

    from core_kv.eval.benchmarks import BenchmarkConfig, get_benchmark
    from core_kv.models.loading import load_model
    from core_kv.pipeline import answer_questions, encode

    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model, dtype="float32", attn_implementation=args.attn)
    cfg = BenchmarkConfig(kind="ruler", tasks=args.tasks, lengths=[args.length], num_samples=args.n)
    samples = get_benchmark("ruler").load(cfg, tok, args.seed)
    labels = ("needle", "needle+edges", "random")
    rows, counts = [], {(t, k): [0, 0] for t in args.tasks for k in labels}
    for s in samples:
        ids = encode(tok, s.context, [s.question], [s.answer_prefix]).context_ids[0].tolist()
        span = answer_span(tok, ids, s.answers[0])
        if span is None:
            continue
        needle = list(range(span[0] - args.before, span[1] + args.after))
        edges = list(range(args.sinks)) + list(range(len(ids) - args.recent, len(ids)))
        for label, forced in zip(labels, (needle, needle + edges, []), strict=True):
            press = ForcedPress(compression_ratio=args.ratio, forced=forced)
            out = answer_questions(model, tok, s.context, [s.question], press=press, answer_prefixes=[s.answer_prefix],
                                   max_new_tokens=args.max_new_tokens)  # fmt: skip
            ok = any(a in out["answers"][0] for a in s.answers[:1])
            counts[s.task, label][0] += ok
            counts[s.task, label][1] += 1
            rows.append({"task": s.task, "keep": label, "answer": out["answers"][0], "reference": s.answers[0],
                         "answered": ok, "context_tokens": len(ids), "value_at": span[0]})  # fmt: skip
    print(f"model {args.model} | ratio {args.ratio} | RULER {args.length}, seed {args.seed}, n = {args.n} per task")
    print("| task | " + " | ".join(labels) + " |\n|---|" + "---|" * len(labels))
    for t in args.tasks:
        print(f"| {t} | " + " | ".join(f"{counts[t, k][0]}/{counts[t, k][1]}" for k in labels) + " |")
    result = {"args": vars(args), "counts": {f"{t}/{k}": v for (t, k), v in counts.items()}, "rows": rows}
    if args.json:
        from core_kv.files import atomic_write_json

        atomic_write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
