"""core_kv against kvpress 0.5.5 on a real model: same token ids, same press and ratio — answers, kept positions, time.

Issue 18's parity check, as a script (kept out of CI, like ``scripts/kvpress_fidelity.py``: kvpress pins
transformers < 5.3, so it runs in a throwaway venv of its own). Three steps::

    # 1. prompts (core_kv venv): RULER seed-42 samples built and tokenized exactly as ``eval.py`` does
    .venv/bin/python scripts/kvpress_compare.py prompts --out results/kvp/prompts.json
    # 2. one run per library, alternated or in turn, one thread each (the same loop, the same model folder)
    .venv/bin/python scripts/kvpress_compare.py run --library core_kv --prompts results/kvp/prompts.json \\
        --out results/kvp/core_kv.json
    python3 -m venv /tmp/kvp && /tmp/kvp/bin/pip install torch==2.13.0 transformers==5.2.0 kvpress==0.5.5
    /tmp/kvp/bin/python scripts/kvpress_compare.py run --library kvpress --prompts results/kvp/prompts.json \\
        --out results/kvp/kvpress.json
    # 3. the table (core_kv venv: scores with core_kv's RULER scorer)
    .venv/bin/python scripts/kvpress_compare.py compare results/kvp/core_kv.json results/kvp/kvpress.json

``run`` imports only torch, transformers and the chosen library. Per sample and method it prefills the context
under the press (``with press(model)``), recovers every layer-head's kept positions by matching the compressed
cache's key rows against the full cache's (one-shot prefill computes every layer's keys from uncompressed hidden
states, so a kept row is bit-identical), then feeds the question ids at positions ``N…`` and decodes greedily up
to ``--max-new-tokens``, stopping at an eos token after the first token, which is never eos (eos is excluded from its
argmax: core_kv's protocol, ``docs/evaluation.md``; kvpress's own pipeline never checks the first token and decodes
on past it, which this loop does not imitate, so both libraries are compared under one protocol). core_kv's press stays installed while decoding (its pipeline does so; these
uniform presses leave a plain cache, so it changes nothing); kvpress's press covers the prefill only, as in its
pipeline. Times: prefill + compression of the context (s), and decode ms per generated token after the first.

``compare`` prints, per method: each library's RULER score, answers identical, layer-heads with identical kept
positions, and the median time ratios core_kv / kvpress (prefill, decode), each library measured in its own run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

METHODS = ("full", "snapkv", "keydiff", "streaming_llm", "expected_attention")
KVPRESS_CLASSES = {
    "snapkv": "SnapKVPress",
    "keydiff": "KeyDiffPress",
    "streaming_llm": "StreamingLLMPress",
    "expected_attention": "ExpectedAttentionPress",
}


def _write_json(path: Path, obj) -> None:
    """Atomic write (``core_kv.files.atomic_write_json``'s job; ``run`` must not import core_kv in kvpress's venv)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def build_prompts(args) -> None:
    """RULER samples of ``--tasks`` at ``--length`` (seed 42), encoded as core_kv's pipeline encodes them."""
    from core_kv.eval.ruler import load_ruler
    from core_kv.models.loading import load_model
    from core_kv.models.packaged import resolve_model_path
    from core_kv.pipeline import encode

    folder = resolve_model_path(args.model)
    _, tok = load_model(folder, dtype="float32")
    samples = load_ruler(args.tasks, [args.length], args.n, tok, seed=42)
    rows = []
    for s in samples:
        enc = encode(tok, s.context, [s.question], [s.answer_prefix])
        rows.append({"task": s.task, "answers": s.answers, "metric": s.metric,
                     "context_ids": enc.context_ids[0].tolist(), "question_ids": enc.question_ids[0][0].tolist()})  # fmt: skip
    _write_json(Path(args.out), {"model": str(folder), "length": args.length, "tasks": args.tasks, "samples": rows})
    print(f"{len(rows)} prompts -> {args.out} (model folder {folder})")


def _press(library: str, method: str, ratio: float):
    if method == "full":
        return None
    if library == "core_kv":
        from core_kv.presses import build_press

        return build_press(method, compression_ratio=ratio)
    import kvpress

    return getattr(kvpress, KVPRESS_CLASSES[method])(compression_ratio=ratio)


def _kept_digests(cache, full_keys) -> list[str]:
    """One digest of the sorted kept positions per (layer, KV head)."""
    out = []
    for layer, fk in zip(cache.layers, full_keys, strict=True):
        keys, _, valid = layer.padded() if hasattr(layer, "padded") else (layer.keys, None, None)
        for h in range(fk.shape[1]):
            rows = {fk[0, h, i].numpy().tobytes(): i for i in range(fk.shape[2])}
            k = keys[0, h] if valid is None else keys[0, h][valid[h]]
            kept = sorted(rows[r.numpy().tobytes()] for r in k if r.numpy().tobytes() in rows)
            out.append(hashlib.sha1(json.dumps(kept).encode()).hexdigest()[:16])
    return out


def run(args) -> None:
    """Every method on every prompt with one library; resumable per (method, sample)."""
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    if args.library == "core_kv":
        import core_kv.presses  # noqa: F401  (registers the presses)
    torch.set_num_threads(args.threads)
    data = json.loads(Path(args.prompts).read_text())
    model = AutoModelForCausalLM.from_pretrained(data["model"], dtype=torch.float32, attn_implementation="sdpa").eval()
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    out_path = Path(args.out)
    done = json.loads(out_path.read_text()) if out_path.exists() else {}
    if done and (done.get("library") != args.library or done.get("ratio") != args.ratio):
        raise SystemExit(f"{out_path} holds another run ({done.get('library')}, ratio {done.get('ratio')}): "
                         "pass another --out")  # fmt: skip
    done.setdefault("library", args.library)
    done.setdefault("ratio", args.ratio)
    from importlib.metadata import version

    lib = version("kvpress") if args.library == "kvpress" else "working tree"
    done.setdefault(
        "versions", {"torch": torch.__version__, "transformers": version("transformers"), args.library: lib}
    )
    results = done.setdefault("results", {})
    n_samples = len(data["samples"]) if args.limit is None else min(args.limit, len(data["samples"]))
    todo = [(i, m) for i in range(n_samples) for m in args.methods if str(i) not in results.get(m, {})]
    full_keys, keys_of = None, None  # the full cache's keys of one sample, shared by its methods
    for n, (i, method) in enumerate(todo):
        s = data["samples"][i]
        ctx = torch.tensor([s["context_ids"]])
        press = _press(args.library, method, args.ratio)
        with torch.no_grad():
            if press is not None and keys_of != i:
                full = DynamicCache()
                model.model(input_ids=ctx, past_key_values=full)
                full_keys, keys_of = [layer.keys for layer in full.layers], i
            cache = DynamicCache()
            t0 = time.perf_counter()
            if press is None:
                model.model(input_ids=ctx, past_key_values=cache)
            else:
                with press(model):
                    model.model(input_ids=ctx, past_key_values=cache)
            prefill_s = time.perf_counter() - t0
            digests = _kept_digests(cache, full_keys) if press is not None else []
            n_ctx = ctx.shape[1]
            ids, pos, tokens, steps = torch.tensor([s["question_ids"]]), n_ctx, [], []
            installed = press(model) if (press is not None and args.library == "core_kv") else nullcontext()
            with installed:
                for _ in range(args.max_new_tokens):
                    t1 = time.perf_counter()
                    position_ids = torch.arange(pos, pos + ids.shape[1])[None]
                    logits = model(input_ids=ids, position_ids=position_ids, past_key_values=cache, use_cache=True,
                                   logits_to_keep=1).logits  # fmt: skip
                    steps.append(time.perf_counter() - t1)
                    pos += ids.shape[1]
                    last = logits[0, -1].clone()
                    if not tokens and eos:  # the first token is never eos (core_kv's protocol)
                        last[[t for t in sorted(eos) if t < last.shape[-1]]] = float("-inf")
                    token = int(last.argmax())
                    if token in eos:
                        break
                    tokens.append(token)
                    ids = torch.tensor([[token]])
        results.setdefault(method, {})[str(i)] = {
            "tokens": tokens, "kept": digests, "prefill_s": prefill_s,
            "decode_ms": 1000 * statistics.mean(steps[1:]) if len(steps) > 1 else None,
        }  # fmt: skip
        _write_json(out_path, done)
        print(f"[{args.library}] {n + 1}/{len(todo)} {method} sample {i}: prefill {prefill_s:.2f} s, "
              f"{len(tokens)} tokens", flush=True)  # fmt: skip


def compare(args) -> None:
    """The parity table of two ``run`` outputs (scored with core_kv's RULER scorer)."""
    from transformers import AutoTokenizer

    from core_kv.eval.scorers import score

    a, b = (json.loads(Path(p).read_text()) for p in (args.a, args.b))
    data = json.loads(Path(args.prompts).read_text())
    tok = AutoTokenizer.from_pretrained(data["model"])
    print(f"{a['library']} ({a['versions']}) vs {b['library']} ({b['versions']}); ratio {a['ratio']}; "
          f"{len(data['samples'])} prompts of {data['length']} tokens ({', '.join(data['tasks'])})\n")  # fmt: skip
    print(f"| method | {a['library']} score | {b['library']} score | answers identical | kept positions identical "
          f"(layer-heads) | prefill {a['library']}/{b['library']} | decode {a['library']}/{b['library']} |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for m in [m for m in METHODS if m in a["results"] and m in b["results"]]:
        common = sorted(set(a["results"][m]) & set(b["results"][m]), key=int)
        ra, rb = ([r["results"][m][i] for i in common] for r in (a, b))

        def mean_score(rows, common=common):
            vals = [score(data["samples"][int(i)]["metric"], tok.decode(r["tokens"], skip_special_tokens=True),
                          data["samples"][int(i)]["answers"]) for i, r in zip(common, rows, strict=True)]  # fmt: skip
            return sum(vals) / len(vals)  # scorers return 0-100

        same = sum(x["tokens"] == y["tokens"] for x, y in zip(ra, rb, strict=True))
        kept = [(p == q) for x, y in zip(ra, rb, strict=True) for p, q in zip(x["kept"], y["kept"], strict=True)]
        kept_s = f"{sum(kept)}/{len(kept)}" if kept else "–"
        pre = statistics.median(x["prefill_s"] for x in ra) / statistics.median(y["prefill_s"] for y in rb)
        da = [x["decode_ms"] for x in ra if x["decode_ms"] is not None]
        db = [y["decode_ms"] for y in rb if y["decode_ms"] is not None]
        dec = f"{statistics.median(da) / statistics.median(db):.2f}" if da and db else "–"
        print(f"| {m} | {mean_score(ra):.2f} | {mean_score(rb):.2f} | {same}/{len(common)} | {kept_s} | {pre:.2f} | "
              f"{dec} |")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prompts", help="build the prompts (core_kv venv)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument(
        "--tasks", nargs="+", default=["niah_single_1", "niah_single_2", "niah_multikey_1", "niah_multivalue"]
    )
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--n", type=int, default=5, help="samples per task")
    p.add_argument("--out", required=True)
    r = sub.add_parser("run", help="run one library on the prompts")
    r.add_argument("--library", required=True, choices=["core_kv", "kvpress"])
    r.add_argument("--prompts", required=True)
    r.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    r.add_argument("--ratio", type=float, default=0.75)
    r.add_argument("--max-new-tokens", type=int, default=32)
    r.add_argument("--threads", type=int, default=1)
    r.add_argument("--limit", type=int, default=None, help="only the first LIMIT prompts (a smoke run)")
    r.add_argument("--out", required=True)
    c = sub.add_parser("compare", help="print the parity table")
    c.add_argument("a")
    c.add_argument("b")
    c.add_argument("--prompts", required=True)
    args = ap.parse_args(argv)
    if args.cmd == "run" and not 0 < args.ratio < 1:
        raise SystemExit(f"--ratio must be in (0, 1), got {args.ratio}")
    {"prompts": build_prompts, "run": run, "compare": compare}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
