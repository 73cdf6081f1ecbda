"""CORE's costs (paper Tables 18–19; CORE.md "Costs"): added parameters, auxiliary state, prefill and decode time.

Measured side by side in one process: no compression, SnapKV and CORE, at 1k–8k context tokens and one
compression ratio (default 75%, the paper's Table 19 setting), for one-shot prefill and chunked prefill (512), plus
the per-token decode time on the compressed cache (32 greedy steps; CORE pays the memory readout on every step).
Every method ends with the same KV payload (chunked SnapKV runs with the equivalent absolute budget).
Time is the median CPU time over ``--repeats`` rounds with the method order rotating (five decode passes per round
and method, interleaved across the methods), after an untimed priming round on a short context (one thread; CPU time rather than wall time because
the host is shared). Reported as ratios to no compression and to SnapKV, next to each method's KV payload and
auxiliary bytes.

The model is a random-weight Llama built from config (4 layers, hidden 256, 4 query / 2 KV heads, head_dim 64,
the shapes of ``benchmarks/twinkv_cost.py``) with an untrained CORE artifact fitted to it (cost depends on shapes,
not weights); ``--model``/``--checkpoint`` measure a real model and artifact instead. ``--shape llama-3.1-8b``
builds the first ``--layers`` decoder layers of Llama-3.1-8B (hidden 4096, 32 query / 8 KV heads, head_dim 128,
MLP 14336) with a 1,024-token vocabulary: CORE's per-layer cost against a real model's per-layer cost (the
embedding and LM head are left out, which makes CORE's share pessimistic). Usage::

    .venv/bin/python benchmarks/core_cost.py --lengths 1024 2048 4096 8192 --repeats 3
    .venv/bin/python benchmarks/core_cost.py --shape llama-3.1-8b --layers 2 --lengths 1024 2048 --modes one-shot
    .venv/bin/python benchmarks/core_cost.py --model smollm2-135m --checkpoint checkpoints/core-smollm2-v2/final \
        --modes one-shot --lengths 2048 --press-option repair.head_budgets=adaptive --press-option repair.repair=true
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

from benchmarks.twinkv_cost import MODEL
from core_kv.eval.press_labels import parse_press_options

SHAPES = {
    "tiny": MODEL,  # the shapes of benchmarks/twinkv_cost.py
    "llama-3.1-8b": dict(  # meta-llama/Llama-3.1-8B config.json, vocabulary cut to 1,024, layers set by --layers
        vocab_size=1024,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        rope_theta=500000.0,
        max_position_embeddings=131072,
    ),
    "smollm2-135m": dict(  # HuggingFaceTB/SmolLM2-135M-Instruct config.json (30 layers, 9 query / 3 KV heads, D 64)
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    ),
}
DECODE_STEPS = 32


def build_model(shape: dict):
    from core_kv.models.tiny import tiny_lm

    return tiny_lm(seed=0, attn_implementation="sdpa", **shape)


def bench_shape(shape: str, layers: int | None) -> dict:
    """The config of ``--shape`` with ``--layers`` decoder layers (all of them when None)."""
    return SHAPES[shape] | ({"num_hidden_layers": layers} if layers else {})


def bench_model(model: str | None, shape: str, layers: int | None):
    """``--model`` (a folder or a packaged name such as ``smollm2-135m``, fp32), else the config-built ``--shape``."""
    if model:
        from core_kv.models.loading import load_model

        return load_model(model, dtype="float32")[0]
    return build_model(bench_shape(shape, layers))


def add_model_args(ap, default_shape: str = "smollm2-135m", feature_spec: int | None = None) -> None:
    """The model options every cost benchmark shares: ``--model``, ``--checkpoint``, ``--shape``, ``--layers`` (and
    ``--feature-spec`` of the untrained artifact, when ``feature_spec`` gives its default); read by
    :func:`bench_model` and :func:`build_artifact`."""
    ap.add_argument("--model", default=None, help="a local model folder or packaged name (default: --shape)")
    ap.add_argument("--checkpoint", default=None, help="a CORE artifact for --model (default: untrained, fitted)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default=default_shape, help="config-built model shape")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers of --shape (default: all of them)")
    if feature_spec is not None:
        ap.add_argument("--feature-spec", type=int, default=feature_spec,
                        help="feature spec of the untrained artifact (without --checkpoint)")  # fmt: skip


def build_artifact(model, folder: Path, feature_spec: int = 1) -> Path:
    """An untrained CORE artifact for ``model``: geometry fitted to its keys on random tokens, default MLPs, features
    of spec ``feature_spec`` (cost depends on the spec: v2 adds the O(N²) twin counts)."""
    from core_kv.core_model import CoreConfig, CoreModel
    from core_kv.distill.replay import capture
    from core_kv.models.fingerprint import model_fingerprint
    from core_kv.teacher.geometry import fit_geometry

    ids = torch.randint(3, model.config.vocab_size, (1, 1024), generator=torch.Generator().manual_seed(0))
    acts = capture(model, ids)
    d = acts[0].k_pre.shape[-1]
    geo = fit_geometry([a.k_pre for a in acts], model_fingerprint(model), d_z=min(64, d), num_prototypes=64)
    from core_kv.features import spec

    core = CoreModel(CoreConfig.for_model(model, geo, feature_spec=spec(feature_spec)))
    core.set_geometry(geo)
    core.save_pretrained(folder)
    return folder


def shape_artifact(model, checkpoint: Path, folder: Path) -> Path:
    """An untrained artifact fitted to ``model`` with ``checkpoint``'s feature spec, protected positions, write rule and
    inference policy (what the cost depends on; the weights do not change it)."""
    from core_kv.core_model import CoreModel

    source = CoreModel.from_pretrained(checkpoint).config
    path = build_artifact(model, folder, source.feature_spec["version"])
    core = CoreModel.from_pretrained(path)
    for name in ("protected_sinks", "protected_recent", "write_rule", "inference_policy"):
        setattr(core.config, name, getattr(source, name))
    core.save_pretrained(path)
    return path


def presses(checkpoint: Path, ratio: float, n: int, chunked: bool, memory_dtypes=(), variants=None) -> dict:
    """The three methods at context ``n``, plus CORE with each of ``memory_dtypes`` and each ``--press-option`` NAME
    (``variants``: NAME → press options, timed as ``core_NAME``).

    Chunked SnapKV gets the absolute budget ``floor(n (1 − ratio))``: with a ratio the framework re-applies it to the
    compressed cache at every chunk (170 tokens/head at 75% and chunk 512, whatever n), which would compare different
    payloads; CORE's own event budget ends at the same count."""
    from core_kv.presses import build_press

    snap = {"budget": math.floor(n * (1 - ratio) + 1e-9)} if chunked else {"compression_ratio": ratio}

    def core(**options):
        return build_press("core", checkpoint=str(checkpoint), compression_ratio=ratio, **options)

    out = {"none": None, "snapkv": build_press("snapkv", **snap), "core": core()}
    out |= {f"core_{dt}": core(memory_dtype=dt) for dt in memory_dtypes}
    return out | {f"core_{name}": core(**opts) for name, opts in (variants or {}).items()}


def cpu_seconds(fn) -> float:
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


def measure(
    model,
    methods: dict,
    n: int,
    chunk: int | None,
    repeats: int,
    prime: int = 256,
    context: torch.Tensor | None = None,
    decode_passes: int = 5,
) -> dict:
    """Median CPU seconds of prefill and of one decode step per method, plus bytes, at context ``n`` (seeded random
    tokens; ``context`` (1, N) gives the token ids instead).

    A first round on ``prime`` tokens (allocations, first-call overheads) is not timed; then ``repeats`` rounds with
    the method order rotating: every method's prefill, then ``decode_passes`` decode passes (an 8-token question and
    ``DECODE_STEPS`` greedy tokens, the cache trimmed back after each) interleaved across the methods, the order
    rotating from pass to pass, so a change of the host's load between passes hits every method alike (the round
    holds every method's cache). The KV payload and the auxiliary state (``press.aux_bytes()``: what the press holds
    beside the kept KV as decoding starts, the number eval reports and ``answer_questions`` give) are read right after
    each prefill."""
    from core_kv.models.cache import kv_bytes
    from core_kv.pipeline import greedy_answer, prefill

    ctx = context
    if ctx is None:
        ctx = torch.randint(3, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(n))
    n = ctx.shape[1]
    question = torch.randint(3, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(1))
    tokens = question.shape[1] + DECODE_STEPS - 1  # decode tokens per pass: the question's forward counts its 8
    names = list(methods)
    times = {m: {"prefill": [], "decode": []} for m in names}
    info = {}

    def rotated(k: int) -> list[str]:
        return names[k % len(names) :] + names[: k % len(names)]

    for r in range(repeats + 1):  # round 0 primes on a short context and is dropped
        context = ctx if r else ctx[:, : min(prime, n)]
        caches = {}
        for m in rotated(r):
            press, box = methods[m], {}
            t_pre = cpu_seconds(lambda: box.setdefault("cache", prefill(model, context, press, chunk)))  # noqa: B023
            caches[m] = box.pop("cache")
            if r:
                acc = kv_bytes(caches[m])
                times[m]["prefill"].append(t_pre)
                info[m] = {"kv_bytes": acc["total"], "kv_payload": acc["payload"],
                           "aux_bytes": press.aux_bytes() if press else 0}  # fmt: skip
        for k in range(decode_passes if r else 1):
            for m in rotated(r + k):
                answer = partial(greedy_answer, model, caches[m], context.shape[1], question, DECODE_STEPS)
                t_dec = cpu_seconds(partial(answer, methods[m], eos_token_ids=[]))
                if r:
                    times[m]["decode"].append(t_dec / tokens)
        caches = None  # freed before the next round's prefills
    return {m: {k: statistics.median(v) for k, v in times[m].items()} | info[m] for m in names}


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    """A markdown table: the header, its rule, then one line per row of (already formatted) cells."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def table(results: dict, lengths: list[int]) -> str:
    header = ["prefill", "context", "method", "prefill s", "decode ms/token", "prefill ÷ none", "prefill ÷ snapkv",
              "decode ÷ none", "decode ÷ snapkv", "KV bytes", "aux bytes"]  # fmt: skip
    rows = []
    for mode, per_len in results.items():
        for n in lengths:
            r = per_len[str(n)]
            for m, v in r.items():
                rows.append([
                    mode, str(n), m, f"{v['prefill']:.3f}", f"{1e3 * v['decode']:.2f}",
                    f"{v['prefill'] / r['none']['prefill']:.3f}", f"{v['prefill'] / r['snapkv']['prefill']:.3f}",
                    f"{v['decode'] / r['none']['decode']:.3f}", f"{v['decode'] / r['snapkv']['decode']:.3f}",
                    f"{v['kv_bytes']:,}", f"{v['aux_bytes']:,} ({100 * v['aux_bytes'] / v['kv_bytes']:.1f}% of KV)",
                ])  # fmt: skip
    return markdown_table(header, rows)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--ratio", type=float, default=0.75)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    add_model_args(ap, default_shape="tiny")
    ap.add_argument("--modes", nargs="+", choices=["one-shot", "chunked"], default=["one-shot", "chunked"])
    ap.add_argument("--memory-dtypes", nargs="*", default=[], help="also CORE with memory_dtype=<each> (float16, ...)")
    ap.add_argument(
        "--press-option",
        action="append",
        default=[],
        metavar="NAME.OPTION=VALUE",
        help="also CORE with these press options (JSON values), timed as core_NAME (e.g. repair.repair=true)",
    )
    ap.add_argument("--out", default=None, help="write the results JSON here")
    args = ap.parse_args(argv)
    try:
        variants = parse_press_options(args.press_option)
    except ValueError as e:
        raise SystemExit(str(e)) from None  # the syntax of needle_wording.py / answer_likelihood.py
    names = ["core"] + [f"core_{dt}" for dt in args.memory_dtypes] + [f"core_{name}" for name in variants]
    if len(set(names)) != len(names):
        ap.error(f"--press-option / --memory-dtypes: column names repeat ({names}); give each variant its own NAME")
    torch.set_num_threads(args.threads)

    from core_kv.presses.core import core_parameter_counts

    model = bench_model(args.model, args.shape, args.layers)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(args.checkpoint) if args.checkpoint else build_artifact(model, Path(tmp) / "core")
        results = {}
        modes = [("one-shot", None)] * ("one-shot" in args.modes)
        modes += [(f"chunked {args.chunk}", args.chunk)] * ("chunked" in args.modes)
        for mode, chunk in modes:
            results[mode] = {}
            for n in args.lengths:
                methods = presses(ckpt, args.ratio, n, chunk is not None, args.memory_dtypes, variants)
                results[mode][str(n)] = measure(model, methods, n, chunk, args.repeats)
                print(f"[core_cost] {mode} {n}: {json.dumps(results[mode][str(n)])}", flush=True)
        core = methods["core"].core
        params = core_parameter_counts(core)
        base_params = sum(p.numel() for p in model.parameters())
        equiv = methods["core"].token_equivalent(next(model.parameters()).element_size())
    summary = {
        "ratio": args.ratio,
        "threads": args.threads,
        "repeats": args.repeats,
        "decode_steps": DECODE_STEPS,
        "model": args.model or bench_shape(args.shape, args.layers),
        "base_parameters": base_params,
        "core_parameters": params,
        "core_parameters_share": params["total"] / base_params,
        "memory_state_bytes": core.memory.state_bytes(),
        "memory_token_equivalent_per_head": equiv,
        "results": results,
    }
    print(
        f"\nAdded parameters: {params} ({100 * summary['core_parameters_share']:.2f}% of {base_params:,}); "
        f"memory state {summary['memory_state_bytes']:,} B = {equiv} cached tokens per KV head\n"
    )
    print(table(results, args.lengths))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
