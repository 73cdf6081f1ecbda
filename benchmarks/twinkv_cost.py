"""TwinKV construction cost vs SnapKV, and blockwise vs naive nonlocal counting (paper 000 §3.5, §5.6, App. A.8).

Construction = context prefill + compression (``core_kv.pipeline.prefill`` under the press), at 1k/2k/4k/8k tokens
and 75% removal, TwinKV and SnapKV (window 64, kernel 5, the paper's baseline setting) measured in the same run;
a no-press prefill is the reference. Time: one process per length holds all methods, primes each, then runs
``--repeats`` rounds with the method order rotating, and reports the median CPU time per construction (one
thread; CPU time rather than wall time because the host is shared and heavily loaded). Peak memory: every
(method, length) runs once in its own process, and the peak is the process's peak resident set size during the
run minus its resident size just before it (CPU: PyTorch has no allocated-memory counter), so it covers
activations, compression temporaries and the cache, not the weights. Peak processes run with glibc's
``MALLOC_MMAP_THRESHOLD_=65536`` so freed tensors leave the resident set at once; without it repeated runs of one
condition differed by up to 50%, with it by under 0.1 MiB.

The model is a random-weight Llama built from config (4 layers, hidden 256, 4 query / 2 KV heads, head_dim 64):
cost depends on shapes, not weights. Usage::

    .venv/bin/python benchmarks/twinkv_cost.py --lengths 1024 2048 4096 8192 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

MODEL = dict(
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=16384,
)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def build_model():
    from core_kv.models.tiny import tiny_lm

    return tiny_lm(seed=0, attn_implementation="sdpa", **MODEL)


def make_press(spec: dict):
    from core_kv.presses import build_press

    if spec["name"] == "none":
        return None
    return build_press(spec["name"], **spec.get("options", {}))


def peak(fn, prime) -> dict:
    """``prime()`` (a small input: pages in the kernels' code), then one ``fn()``; peak RSS above the primed level."""
    prime()
    base = rss_bytes()
    fn()
    return {"peak_bytes": max(0, peak_rss_bytes() - base)}


def interleaved_cpu_seconds(fns: dict, repeats: int) -> dict:
    """Median CPU seconds of each callable over ``repeats`` rounds, the order rotating every round."""
    names = list(fns)
    times = {k: [] for k in names}
    for r in range(repeats):
        for k in names[r % len(names) :] + names[: r % len(names)]:
            t0 = time.process_time()
            fns[k]()
            times[k].append(time.process_time() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def worker(job: dict) -> dict:
    torch.set_num_threads(job["threads"])
    if job["kind"] in ("construct_time", "construct_peak"):
        from core_kv.pipeline import prefill

        model = build_model()
        ids = torch.randint(0, MODEL["vocab_size"], (1, job["n"]), generator=torch.Generator().manual_seed(job["n"]))
        presses = {name: make_press(spec) for name, spec in job["presses"].items()}
        runs = {name: (lambda p=p: prefill(model, ids, p)) for name, p in presses.items()}
        if job["kind"] == "construct_peak":
            ((name, p),) = presses.items()
            return peak(runs[name], lambda: prefill(model, ids[:, :256], p))
        for p in presses.values():  # prime: first-call costs out of the timings
            prefill(model, ids[:, :256], p)
        return interleaved_cpu_seconds(runs, job["repeats"])
    if job["kind"] in ("count_time", "count_peak"):
        from core_kv.presses.twinkv import naive_nonlocal_counts, nonlocal_counts

        keys = torch.randn(1, job["heads"], job["n"], job["head_dim"], generator=torch.Generator().manual_seed(0))
        fns = {"blockwise": nonlocal_counts, "naive": naive_nonlocal_counts}
        if job["kind"] == "count_peak":
            fn = fns[job["which"]]
            return peak(lambda: fn(keys), lambda: fn(keys[:, :, :256]))
        for fn in fns.values():
            fn(keys[:, :, :256])
        return interleaved_cpu_seconds({k: (lambda f=f: f(keys)) for k, f in fns.items()}, job["repeats"])
    raise ValueError(job["kind"])


def run_job(job: dict) -> dict:
    """Run one job in a fresh interpreter, so peak RSS belongs to that job alone."""
    env = dict(os.environ)
    if job["kind"].endswith("_peak"):  # every allocation >= 64 KiB mmapped and unmapped on free: RSS tracks tensors
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    out = subprocess.run(
        [sys.executable, __file__, "--worker", json.dumps(job)], check=True, capture_output=True, text=True, env=env
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def construction_table(lengths, repeats, threads, ratio) -> str:
    presses = {
        "none": {"name": "none"},
        "snapkv": {"name": "snapkv", "options": {"compression_ratio": ratio}},
        "twinkv": {"name": "twinkv", "options": {"compression_ratio": ratio}},
    }
    rows = [
        "| N | prefill only (CPU s) | SnapKV (CPU s) | TwinKV (CPU s) | time TwinKV/SnapKV | SnapKV peak (MiB) "
        "| TwinKV peak (MiB) | peak TwinKV/SnapKV |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n in lengths:
        job = {"n": n, "repeats": repeats, "threads": threads}
        t = run_job({"kind": "construct_time", "presses": presses} | job)
        m = {k: run_job({"kind": "construct_peak", "presses": {k: presses[k]}} | job)["peak_bytes"] for k in presses}
        rows.append(
            f"| {n} | {t['none']:.3f} | {t['snapkv']:.3f} | {t['twinkv']:.3f} | {t['twinkv'] / t['snapkv']:.2f} "
            f"| {m['snapkv'] / 2**20:.1f} | {m['twinkv'] / 2**20:.1f} | {m['twinkv'] / max(m['snapkv'], 1):.2f} |"
        )
        print(rows[-1], file=sys.stderr, flush=True)
    return "\n".join(rows)


def counting_table(lengths, repeats, threads, heads, head_dim) -> str:
    rows = [
        "| N | blockwise (CPU s) | naive N×N (CPU s) | blockwise peak (MiB) | naive peak (MiB) | peak blockwise/naive |",
        "|---|---|---|---|---|---|",
    ]
    for n in lengths:
        job = {"n": n, "heads": heads, "head_dim": head_dim, "repeats": repeats, "threads": threads}
        t = run_job({"kind": "count_time"} | job)
        m = {k: run_job({"kind": "count_peak", "which": k} | job)["peak_bytes"] for k in ("blockwise", "naive")}
        rows.append(
            f"| {n} | {t['blockwise']:.3f} | {t['naive']:.3f} | {m['blockwise'] / 2**20:.1f} "
            f"| {m['naive'] / 2**20:.1f} | {m['blockwise'] / max(m['naive'], 1):.3f} |"
        )
        print(rows[-1], file=sys.stderr, flush=True)
    return "\n".join(rows)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--ratio", type=float, default=0.75)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    print(f"### Construction (prefill + compression), r = {args.ratio}, {args.threads} CPU thread(s)\n")
    print(construction_table(args.lengths, args.repeats, args.threads, args.ratio))
    print(f"\n### Nonlocal counting, H = {MODEL['num_key_value_heads']} KV heads, d = 64, one layer\n")
    print(counting_table(args.lengths, args.repeats, args.threads, MODEL["num_key_value_heads"], 64))


if __name__ == "__main__":
    main()
