"""Press overhead: prefill time, decode ms/token and peak memory of every registered press relative to no press.

All presses are measured side by side in one run: for each context length and repeat, the no-press baseline and
every press run back to back (round robin), so machine-load drift hits them alike. Times are the best of the
repeats (load from other processes only ever adds time), memory the median; each is divided by the baseline's.
The ``full`` press (keeps everything) is an A/A control: its distance from 1.00 is the noise floor.

- **prefill**: ``core_kv.pipeline.prefill`` of the context under the press (compression included).
- **decode**: ``greedy_answer`` of ``--new-tokens`` tokens after a 1-token question on the compressed cache,
  per token (the press stays installed: ragged attention, readout).
- **memory**: peak process RSS above the RSS just before the call, sampled every 2 ms from ``/proc/self/statm``
  over prefill + decode (torch's CPU allocator is invisible to ``tracemalloc``). The script re-executes itself with
  ``MALLOC_MMAP_THRESHOLD_=65536`` so glibc returns freed tensors to the OS and RSS tracks live tensors instead of
  a cached heap. Still approximate (2 ms sampling); the exact KV payload ratio (``kv_bytes``) is printed beside it.

Timings use ``--threads`` torch threads (default 1: on a shared 2-core machine two OpenMP threads contending with
other jobs ran 10-30x slower and far noisier than one).

Model: ``checkpoints/proxy-lm`` if it exists, else a config-built Llama of env.md §7's size (vocab 1024, hidden 256,
4 layers, 4 query / 2 KV heads, fp32). Presses that need attention weights (``needs_attentions``) run on an eager
copy (same weights) and only up to ``--eager-max-len`` tokens; their ratios are against the sdpa baseline, so they
include the price of eager attention.

    python benchmarks/press_overhead.py --lengths 1024 2048 4096 8192 --repeats 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
import transformers

from core_kv.models.cache import kv_bytes
from core_kv.models.tiny import tiny_lm
from core_kv.pipeline import greedy_answer, prefill
from core_kv.presses import PRESSES, build_press

ROOT = Path(__file__).resolve().parents[1]
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class PeakRSS:
    """Peak RSS above the starting RSS while the block runs (background sampling thread)."""

    def __enter__(self):
        self.base = self.peak = rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def _poll(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())
        self.delta = self.peak - self.base


def load_model(eager: bool) -> tuple[torch.nn.Module, str]:
    impl = "eager" if eager else "sdpa"
    ckpt = ROOT / "checkpoints" / "proxy-lm"
    if (ckpt / "config.json").exists():
        model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, attn_implementation=impl)
        return model.eval(), str(ckpt.relative_to(ROOT))
    model = tiny_lm(
        seed=0,
        attn_implementation=impl,
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16384,
    )
    return model, "config-built Llama (env.md §7, 4.5M params)"


def make_press(name: str, ratio: float):
    if name == "full":  # the A/A control keeps everything
        return build_press(name)
    return build_press(name, compression_ratio=ratio)


def run_once(model, press, context: torch.Tensor, question: torch.Tensor, new_tokens: int) -> dict:
    n = context.shape[1]
    with PeakRSS() as mem:
        t0 = time.perf_counter()
        cache = prefill(model, context, press)
        t1 = time.perf_counter()
        greedy_answer(model, cache, n, question, new_tokens, press, eos_token_ids=[])
        t2 = time.perf_counter()
    return {"prefill": t1 - t0, "decode": (t2 - t1) / new_tokens, "mem": mem.delta, "kv": kv_bytes(cache)["total"]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--presses", nargs="+", default=None, help="registered names (default: all)")
    ap.add_argument("--ratio", type=float, default=0.5, help="compression_ratio for every press")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--eager-max-len", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = ap.parse_args(argv)
    if argv is None and os.environ.get("MALLOC_MMAP_THRESHOLD_") is None:  # see the module docstring
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"})
    torch.set_num_threads(args.threads)

    names = args.presses or sorted(PRESSES)
    unknown = set(names) - set(PRESSES)
    if unknown:
        raise SystemExit(f"unknown press(es) {sorted(unknown)}; registered: {sorted(PRESSES)}")
    model, model_desc = load_model(eager=False)
    eager_model = None
    presses = {}
    for name in names:
        try:
            presses[name] = make_press(name, args.ratio)
        except Exception as e:  # a press that cannot be built here (e.g. needs a checkpoint) is reported, not fatal
            presses[name] = e
            print(f"not built: {name}: {type(e).__name__}: {e}")
    if any(not isinstance(p, Exception) and p.needs_attentions for p in presses.values()):
        eager_model, _ = load_model(eager=True)
        eager_model.load_state_dict(model.state_dict())
    vocab = model.config.vocab_size
    print(f"model: {model_desc}; torch threads {torch.get_num_threads()}; ratio {args.ratio}; repeats {args.repeats}")

    results: dict = {}  # (name, length) -> list of measurements, or an error string
    for length in args.lengths:
        gen = torch.Generator().manual_seed(length)
        context = torch.randint(0, vocab, (1, length), generator=gen)
        question = torch.randint(0, vocab, (1, 1), generator=gen)
        run_once(model, None, context[:, :256], question, 2)  # warm-up
        for rep in range(args.repeats):
            for name in ["none", *names]:
                press = None if name == "none" else presses[name]
                key = (name, length)
                if isinstance(results.get(key), str):
                    continue
                if isinstance(press, Exception):
                    results[key] = f"not built ({type(press).__name__})"
                    continue
                m = model
                if press is not None and press.needs_attentions:
                    if length > args.eager_max_len:
                        results[key] = "skipped (eager)"
                        continue
                    m = eager_model
                try:
                    out = run_once(m, press, context, question, args.new_tokens)
                except Exception as e:
                    results[key] = f"error: {type(e).__name__}: {str(e)[:60]}"
                    continue
                results.setdefault(key, []).append(out)
            print(f"  length {length}: repeat {rep + 1}/{args.repeats} done", flush=True)

    def med(name, length, metric):
        agg = min if metric in ("prefill", "decode") else statistics.median
        return agg(r[metric] for r in results[name, length])

    base = {(length, k): med("none", length, k) for length in args.lengths for k in ("prefill", "decode", "mem", "kv")}
    header = "| press | " + " | ".join(f"{n // 1024}k" if n % 1024 == 0 else str(n) for n in args.lengths) + " |"
    rule = "|---|" + "---|" * len(args.lengths)
    titles = {
        "prefill": "Prefill time (press / no press)",
        "decode": "Decode ms/token (press / no press)",
        "mem": "Peak RSS delta over prefill + decode (press / no press)",
        "kv": "KV payload kept (press / no press, exact)",
    }
    lines = [
        f"Model: {model_desc}, fp32, CPU ({torch.get_num_threads()} thread(s)); compression_ratio {args.ratio}; "
        f"times best of {args.repeats} repeats, memory median; {args.new_tokens} decoded tokens after a 1-token question."
    ]
    for metric, title in titles.items():
        lines += ["", f"**{title}**", "", header, rule]
        absolute = []
        for length in args.lengths:
            b = base[length, metric]
            absolute.append(
                f"{b:.3f} s"
                if metric == "prefill"
                else f"{b * 1e3:.2f} ms"
                if metric == "decode"
                else f"{b / 2**20:.1f} MiB"
            )
        lines.append("| *no press (absolute)* | " + " | ".join(absolute) + " |")
        for name in names:
            cells = []
            for length in args.lengths:
                r = results.get((name, length))
                if isinstance(r, str) or r is None:
                    cells.append(r or "—")
                else:
                    b = base[length, metric]
                    cells.append(f"{med(name, length, metric) / b:.2f}" if b > 0 else "n/a")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
