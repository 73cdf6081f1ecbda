"""Where CORE's online time goes: prefill and decode CPU time per component and per layer (issue 19).

Runs one context through no compression and through CORE (one-shot or chunked prefill, then the question and
``--steps`` greedy tokens, as ``benchmarks/core_cost.py``) and times every CORE component by wrapping it (no
instrumentation in the library, so production pays nothing):

| component   | what                                                                              |
|-------------|-----------------------------------------------------------------------------------|
| q_hook      | pre-/post-RoPE queries from ``q_proj`` and the observation window                 |
| hooks       | the attention pre/post hooks' bookkeeping (positions, persistence, budget)       |
| unrope      | pre-RoPE keys of the candidates at an event                                       |
| features    | the 14 features (observation attention, geometry, leverage, ...)                  |
| indexer     | indexer MLP scores + the calibrated distribution                                  |
| topb        | protected set + Top-B                                                             |
| write       | the memory write (φ⁺ of evicted keys, M, b, Z, ...)                               |
| evict       | the rest of the event and the cache gather                                        |
| readout_lse | log-partition of the queries over the retained cache                              |
| readout_mem | φ⁺(q), m(q), the gate and ô (``_compensate``)                                     |
| readout     | the rest of the readout hook (layouts, post-RoPE queries when lse_R is computed)  |

Times are self times (a component's children are subtracted), CPU seconds, one thread. ``overhead`` = CORE's
total minus no compression's; what the components do not explain is the cost of the smaller cache's attention
(negative) and unhooked work. Usage::

    .venv/bin/python benchmarks/core_profile.py --shape smollm2-135m --length 2048
    .venv/bin/python benchmarks/core_profile.py --model <folder> --checkpoint <artifact> --length 2048 --chunk 512
"""

from __future__ import annotations

import argparse
import inspect
import json
import tempfile
import time
from collections import defaultdict
from functools import wraps
from pathlib import Path

import torch

from benchmarks.core_cost import SHAPES, bench_model, build_artifact

COMPONENTS = (
    "q_hook", "hooks", "unrope", "features", "indexer", "topb", "write", "evict", "readout_lse", "readout_mem", "readout",
)  # fmt: skip


class Profiler:
    """Self CPU time per (phase, component, layer) of wrapped callables."""

    def __init__(self):
        self.phase = "prefill"
        self.layer = -1
        self.totals = defaultdict(float)  # (phase, component, layer) -> seconds
        self.calls = defaultdict(int)
        self._stack: list[list[float]] = []  # [start, child time]
        self._undo = []

    def wrap(self, owner, attr: str, component: str, layer_of=None) -> None:
        """Time ``owner.attr`` as ``component``; ``layer_of(args)`` names the layer (else the enclosing one)."""
        if not hasattr(owner, attr):
            return
        fn = getattr(owner, attr)
        prof = self

        @wraps(fn)
        def timed(*args, **kwargs):
            outer = prof.layer
            if layer_of is not None:
                prof.layer = layer_of(args)
            frame = [time.process_time(), 0.0]
            prof._stack.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.process_time() - frame[0]
                prof._stack.pop()
                if prof._stack:
                    prof._stack[-1][1] += spent
                key = (prof.phase, component, prof.layer)
                prof.totals[key] += spent - frame[1]
                prof.calls[key] += 1
                prof.layer = outer

        static = isinstance(inspect.getattr_static(owner, attr), staticmethod)
        setattr(owner, attr, staticmethod(timed) if static else timed)
        self._undo.append((owner, attr, staticmethod(fn) if static else fn))

    def unwrap(self) -> None:
        for owner, attr, fn in reversed(self._undo):
            setattr(owner, attr, fn)
        self._undo.clear()

    def by_component(self, phase: str) -> dict:
        out = defaultdict(float)
        for (ph, comp, _), t in self.totals.items():
            if ph == phase:
                out[comp] += t
        return dict(out)

    def by_layer(self, phase: str) -> dict:
        out = defaultdict(lambda: defaultdict(float))
        for (ph, comp, layer), t in self.totals.items():
            if ph == phase:
                out[layer][comp] += t
        return {k: dict(v) for k, v in sorted(out.items())}


def instrument(prof: Profiler, press) -> None:
    """Wrap the press's components (whichever of them this version of the press has)."""
    import core_kv.memory as memory
    import core_kv.presses.core as core_mod

    cls = type(press)
    mod_layer = lambda a: a[1].layer_idx  # noqa: E731  (bound method on the class: args = (self, module, ...))
    prof.wrap(cls, "_q_hook", "q_hook", mod_layer)
    prof.wrap(cls, "_pre_hook", "hooks", mod_layer)
    prof.wrap(cls, "_post_hook", "hooks", mod_layer)
    prof.wrap(cls, "_event", "evict")
    prof.wrap(cls, "_apply", "evict")
    prof.wrap(cls, "unrope", "unrope")
    prof.wrap(cls, "_features", "features")
    prof.wrap(cls, "_scores", "indexer")
    prof.wrap(press.core.indexer, "scores", "indexer")
    prof.wrap(press.core.indexer, "distribution", "indexer")
    prof.wrap(core_mod, "top_free", "topb")
    prof.wrap(core_mod, "protected_mask", "topb")
    prof.wrap(press.core.memory, "write", "write")
    prof.wrap(cls, "_write", "write")
    prof.wrap(cls, "_compensate", "readout_mem")
    prof.wrap(core_mod, "memory_write", "write")
    prof.wrap(cls, "readout", "readout", mod_layer)
    prof.wrap(cls, "_retained_lse", "readout_lse")
    del memory


def run(model, press, ctx, question, steps: int, chunk: int | None, prof: Profiler | None) -> dict:
    from core_kv.pipeline import greedy_answer, prefill

    n = ctx.shape[1]
    if prof:
        prof.phase = "prefill"
    t0 = time.process_time()
    cache = prefill(model, ctx, press, chunk)
    t_pre = time.process_time() - t0
    if prof:
        prof.phase = "decode"
    t0 = time.process_time()
    greedy_answer(model, cache, n, question, steps, press, eos_token_ids=[])
    t_dec = time.process_time() - t0
    return {"prefill": t_pre, "decode": t_dec, "decode_forwards": question.shape[1] + steps - 1}


def report(prof: Profiler, base: dict, core: dict, layers: int) -> str:
    lines = []
    for phase in ("prefill", "decode"):
        comp = prof.by_component(phase)
        over = core[phase] - base[phase]
        per = 1e3 / (core["decode_forwards"] if phase == "decode" else 1)
        unit = "ms/token" if phase == "decode" else "ms"
        lines.append(
            f"\n{phase}: none {base[phase] * per:.1f} {unit}, CORE {core[phase] * per:.1f} {unit} "
            f"(×{core[phase] / base[phase]:.3f}; overhead {over * per:+.1f} {unit})"
        )
        lines.append(f"| component | {unit} | share of CORE time | per layer (mean) |")
        lines.append("|---|---|---|---|")
        for name in sorted(comp, key=comp.get, reverse=True):
            lines.append(
                f"| {name} | {comp[name] * per:.2f} | {100 * comp[name] / core[phase]:.1f}% | "
                f"{comp[name] * per / layers:.3f} |"
            )
        lines.append(f"| all components | {sum(comp.values()) * per:.2f} | "
                     f"{100 * sum(comp.values()) / core[phase]:.1f}% | |")  # fmt: skip
        per_layer = prof.by_layer(phase)
        names = [c for c in COMPONENTS if c in comp]
        lines.append(f"\n{phase} per layer ({unit}): | layer | " + " | ".join(names) + " | total |")
        for layer, row in per_layer.items():
            if layer < 0:
                continue
            cells = " | ".join(f"{row.get(c, 0.0) * per:.3f}" for c in names)
            lines.append(f"| {layer} | {cells} | {sum(row.values()) * per:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--ratio", type=float, default=0.75)
    ap.add_argument("--chunk", type=int, default=None, help="chunked prefill (default: one-shot)")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", default=None)
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--out", default=None, help="write the raw totals (JSON) here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from core_kv.presses import build_press

    model = bench_model(args.model, args.shape, args.layers)
    n = args.length
    ctx = torch.randint(3, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(n))
    question = torch.randint(3, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(1))
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(args.checkpoint) if args.checkpoint else build_artifact(model, Path(tmp) / "core")
        press = build_press("core", checkpoint=str(ckpt), compression_ratio=args.ratio)
        run(model, press, ctx[:, :256], question, 2, args.chunk and min(args.chunk, 128), None)  # prime
        base = run(model, None, ctx, question, args.steps, args.chunk, None)
        prof = Profiler()
        instrument(prof, press)
        try:
            core = run(model, press, ctx, question, args.steps, args.chunk, prof)
        finally:
            prof.unwrap()
    layers = model.config.num_hidden_layers
    print(f"[core_profile] {args.model or args.shape}, {n} tokens, ratio {args.ratio}, "
          f"{'chunk ' + str(args.chunk) if args.chunk else 'one-shot'}, {args.threads} thread(s)")  # fmt: skip
    print(report(prof, base, core, layers))
    if args.out:
        raw = {f"{ph}|{c}|{la}": t for (ph, c, la), t in prof.totals.items()}
        Path(args.out).write_text(json.dumps({"none": base, "core": core, "totals": raw}, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
